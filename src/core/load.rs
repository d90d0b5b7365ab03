//! How busy this core is: the share of the last window its thread spent on a CPU
//! (`CLOCK_THREAD_CPUTIME_ID`: running tasks, polling and submitting I/O, not parked), measured
//! lazily by whoever asks, so an idle core is never woken to measure itself.
//!
//! A core that is busy for nearly all of a window has no time to spare: work that arrives
//! faster than it leaves (a publisher outrunning a consumer on the same core) then takes the
//! time the leaving work needed. `broker::queue` asks [`saturated`] before it slows a
//! publisher for its consumers' sake (`egress.rs`, egress before ingress).
//!
//! glommio's `executor_stats().total_runtime()` was the first measure: it grows only when a
//! task queue's run ends, and a saturated core's run rarely ends, so it read 0-300 permille
//! on a core at 100 % (measured with one publisher and its consumer on one core). The
//! thread's CPU clock costs a system call (no vDSO for it), once per [`WINDOW`] at most.
//! With `--spin-before-park-us`, spinning counts as busy.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Shortest window a figure covers; a call within it returns the last figure.
pub const WINDOW: Duration = Duration::from_millis(2);

/// Busy share, in permille, from which a core counts as saturated (90 %).
pub const SATURATED_PERMILLE: u32 = 900;

thread_local! {
    /// (start of the current window, this thread's CPU time then, last figure in permille).
    static METER: Cell<(Option<Instant>, Duration, u32)> = const { Cell::new((None, Duration::ZERO, 0)) };
}

/// CPU time this thread has used (user and system), or zero where the clock fails.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(u64::try_from(ts.tv_sec).unwrap_or(0), u32::try_from(ts.tv_nsec).unwrap_or(0))
}

/// Permille (0..=1000) of the wall time since the previous measurement that this thread
/// was on a CPU; the previous figure when that was less than [`WINDOW`] ago. The first call
/// on a thread returns 0 (it starts the first window).
pub fn busy_permille() -> u32 {
    METER.with(|m| {
        let (since, cpu_then, last) = m.get();
        let now = Instant::now();
        let Some(since) = since else {
            m.set((Some(now), thread_cpu_time(), 0));
            return 0;
        };
        let elapsed = now.saturating_duration_since(since);
        if elapsed < WINDOW {
            return last;
        }
        let cpu = thread_cpu_time();
        let busy = cpu.saturating_sub(cpu_then);
        let permille = u32::try_from(busy.as_micros().saturating_mul(1000) / elapsed.as_micros().max(1)).unwrap_or(u32::MAX).min(1000);
        m.set((Some(now), cpu, permille));
        permille
    })
}

/// Whether this core was busy for at least [`SATURATED_PERMILLE`] of the last window.
pub fn saturated() -> bool {
    busy_permille() >= SATURATED_PERMILLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_spins_is_saturated_and_one_that_sleeps_is_not() {
        assert_eq!(busy_permille(), 0, "the first call starts the window");
        // Other tests share the machine's cores: a spin counts once it kept its CPU.
        let spun = (0..50).any(|_| {
            let t = Instant::now();
            while t.elapsed() < 4 * WINDOW {
                std::hint::black_box(0u64);
            }
            saturated()
        });
        assert!(spun, "spinning for four windows never measured as saturated");
        std::thread::sleep(4 * WINDOW);
        assert!(busy_permille() < SATURATED_PERMILLE, "asleep for the whole window");
    }
}
