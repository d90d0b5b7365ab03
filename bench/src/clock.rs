//! Time for the bench: one monotonic clock in nanoseconds, shared by every process on the
//! host, and a precise pacer for fixed-rate publishing.
//!
//! # Why a timerfd
//! tokio's timer wheel rounds every sleep up to the next millisecond. A producer paced by
//! it would send up to 1 ms late, and since latency is measured from the *intended* send
//! time (no coordinated omission), that lateness would show up as broker latency. A
//! `timerfd` armed with an absolute CLOCK_MONOTONIC deadline wakes the runtime through
//! epoll with microsecond precision instead.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::task::{Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Nanoseconds on CLOCK_MONOTONIC (`clock_gettime(2)`), comparable across processes on
/// one host. Message bodies carry this value as their send timestamp.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One producer's fixed-rate schedule (no coordinated omission): its message `k` (from 0) is
/// due at `start + k / rate` and carries that intended time. The producers of a run share
/// one `schedule_start` and are spread evenly over one interval, so 1,000 producers at
/// 10 msgs/s make a steady 10,000 msgs/s rather than a burst of 1,000 every 100 ms. Both
/// engines publish by it (`run.rs`, `raw/conn.rs`).
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    /// When message 0 is due, CLOCK_MONOTONIC ns (phase included).
    start: u64,
    /// Messages per second; 0 = unlimited (no schedule: nothing here is called then).
    rate: f64,
}

impl Schedule {
    /// The schedule of producer `index` of `producers`, `rate` msgs/s each, from
    /// `schedule_start` (ns).
    pub fn new(schedule_start: u64, index: u16, producers: u32, rate: f64) -> Self {
        let phase = if rate > 0.0 { (f64::from(index) / f64::from(producers.max(1)) * 1e9 / rate) as u64 } else { 0 };
        Schedule { start: schedule_start + phase, rate }
    }

    /// When message `k` is due (ns).
    pub fn intended_at(&self, k: u64) -> u64 {
        self.start + (k as f64 * 1e9 / self.rate) as u64
    }

    /// How many messages are due at `now` (ns), the one due exactly then included.
    pub fn due_by(&self, now: u64) -> u64 {
        (now.saturating_sub(self.start) as f64 * self.rate / 1e9) as u64 + 1
    }

    /// Messages due but never sent when publishing stops at `now` (ns) after `sent` of at
    /// most `limit`: those due 1 ms before the stop or earlier (one due at the very instant
    /// publishing stopped is not "behind"). Reported, not dropped from the latency picture.
    pub fn behind_at_stop(&self, now: u64, sent: u64, limit: u64) -> u64 {
        let due = match now.checked_sub(self.start + 1_000_000) {
            Some(d) => (d as f64 * self.rate / 1e9) as u64 + 1,
            None => 0,
        };
        due.min(limit).saturating_sub(sent)
    }
}

/// Wakes a task at an absolute CLOCK_MONOTONIC instant (ns) with a timerfd.
///
/// One pacer per producer; each holds one file descriptor.
pub struct Pacer {
    fd: AsyncFd<OwnedFd>,
    /// The deadline (ns) the timer is armed for, 0 when disarmed.
    armed_for: u64,
}

impl Pacer {
    /// Creates a disarmed pacer.
    ///
    /// # Errors
    /// `timerfd_create(2)` failures (e.g. EMFILE) and epoll registration errors.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the returned fd is checked before use.
        let raw = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `owned` is a valid open fd owned by the AsyncFd for its whole life, and
        // OwnedFd::as_raw_fd always returns that same fd.
        let fd = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE) }.map_err(|e| e.into_parts().1)?;
        Ok(Self { fd, armed_for: 0 })
    }

    fn arm(&mut self, deadline_ns: u64) {
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec {
                tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: valid fd and itimerspec; old value not requested.
        unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), libc::TFD_TIMER_ABSTIME, &spec, std::ptr::null_mut()) };
        self.armed_for = deadline_ns;
    }

    /// Ready once `now_ns() >= deadline_ns`; otherwise arms the timer and registers the
    /// task's waker. A failing fd degrades to "ready" (the producer then just sends late
    /// rather than hangs).
    pub fn poll_until(&mut self, cx: &mut Context<'_>, deadline_ns: u64) -> Poll<()> {
        for _ in 0..4 {
            if now_ns() >= deadline_ns {
                return Poll::Ready(());
            }
            if self.armed_for != deadline_ns {
                self.arm(deadline_ns);
            }
            match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(mut guard)) => {
                    let mut expirations = [0u8; 8];
                    // SAFETY: reading 8 bytes into an 8-byte buffer from our own timerfd.
                    let n = unsafe { libc::read(self.fd.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
                    if n < 0 {
                        guard.clear_ready();
                    } else {
                        self.armed_for = 0;
                    }
                }
            }
        }
        // Spurious wake-ups four times in a row: let the caller re-poll soon.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    #[test]
    fn producers_share_one_interval_and_report_what_a_stop_left_unsent() {
        // 4 producers at 10 msgs/s from t = 1 s: offsets 0, 25, 50, 75 ms.
        let s: Vec<Schedule> = (0..4).map(|i| Schedule::new(1_000_000_000, i, 4, 10.0)).collect();
        assert_eq!(s.iter().map(|s| s.intended_at(0)).collect::<Vec<_>>(), [1_000_000_000, 1_025_000_000, 1_050_000_000, 1_075_000_000]);
        assert_eq!(s[1].intended_at(3), 1_325_000_000);
        assert_eq!(s[0].due_by(1_000_000_000), 1, "the first is due at the start");
        assert_eq!(s[0].due_by(1_299_999_999), 3);
        // Stopped at 1.3 s after 1 sent: 2 were due by 1.299 s (1 ms grace), at most 2 sent in all.
        assert_eq!(s[0].behind_at_stop(1_300_000_000, 1, 10), 2);
        assert_eq!(s[0].behind_at_stop(1_300_000_000, 1, 2), 1, "never more than the limit");
        assert_eq!(s[0].behind_at_stop(1_000_500_000, 0, 10), 0, "nothing is behind in the first ms");
    }
}
