//! Resource alarms: free disk space and file descriptors (RabbitMQ's disk alarm and its
//! file-descriptor limit), watched by one plain thread and read by every core.
//!
//! # What each alarm does
//! - **Disk** (`--disk-free-limit BYTES`, default 50 MB, RabbitMQ's `disk_free_limit`):
//!   raised while the data directory's filesystem has fewer free bytes (statvfs
//!   `f_bavail * f_frsize`) than the limit, checked every [`DISK_CHECK_INTERVAL`] and at
//!   once when a store reports a full disk ([`Alarms::disk_full_seen`]). While it is raised,
//!   every connection that has published is sent `connection.blocked` and is not read
//!   until it clears (`amqp/connection.rs`); consumers keep draining, and acks free space
//!   as segments empty.
//! - **File descriptors**: at start the soft RLIMIT_NOFILE is raised to the hard limit
//!   ([`raise_fd_limit`]); the open count (`/proc/self/fd`) is refreshed on the same
//!   timer and raised by [`Alarms::reserve_fds`] in between. Within [`fd_headroom`] of the
//!   limit, new connections are closed at accept and new queues refused (506
//!   RESOURCE_ERROR), so descriptors are left for the queues and connections there are.
//!
//! # Assumptions
//! The monitor thread is the only writer of the refreshed values; cores only read them
//! (relaxed atomics: an alarm seen one tick late is fine, a store failure is handled where
//! it happens).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the monitor checks open descriptors.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(500);
/// How often it checks free disk space (statvfs is cheap; a fast publisher writes tens of
/// MB in the 500 ms of [`CHECK_INTERVAL`]).
pub const DISK_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// Shared alarm state (one per process).
#[derive(Debug, Default)]
pub struct Alarms {
    /// Free bytes on the data directory's filesystem at the last check.
    pub disk_free_bytes: AtomicU64,
    /// The disk alarm threshold, bytes (0 = never raised).
    pub disk_free_limit: u64,
    /// The disk alarm is raised.
    pub disk_alarm: AtomicBool,
    /// Open file descriptors of the process at the last check (plus reservations since).
    pub open_fds: AtomicU64,
    /// The soft RLIMIT_NOFILE in force.
    pub max_fds: AtomicU64,
    /// Descriptors are within [`fd_headroom`] of the limit.
    pub fd_alarm: AtomicBool,
    /// Connections closed at accept because descriptors ran low.
    pub connections_refused: AtomicU64,
    /// A store saw ENOSPC since the last check: check now.
    disk_full_seen: AtomicBool,
    /// When a refused connection was last logged, ms since the Unix epoch (0 = never).
    refusal_warned_ms: AtomicU64,
}

/// Descriptors kept free below the limit before new connections and queues are refused:
/// a twentieth of the limit, at least 32 (256 → 32, 1,024 → 51, 65,536 → 3,276).
pub fn fd_headroom(max_fds: u64) -> u64 {
    (max_fds / 20).max(32)
}

/// True when `open` descriptors leave less than [`fd_headroom`] below a known `max`.
fn in_headroom(open: u64, max: u64) -> bool {
    max > 0 && open + fd_headroom(max) > max
}

impl Alarms {
    /// Alarm state for a data directory with this disk threshold; nothing is raised yet.
    pub fn new(disk_free_limit: u64) -> Alarms {
        Alarms { disk_free_limit, disk_free_bytes: AtomicU64::new(u64::MAX), ..Default::default() }
    }

    /// True while the disk alarm is raised.
    pub fn disk_alarm(&self) -> bool {
        self.disk_alarm.load(Ordering::Relaxed)
    }

    /// A store reported a full disk: the monitor checks at its next wake-up (≤ 10 ms).
    pub fn disk_full_seen(&self) {
        self.disk_full_seen.store(true, Ordering::Relaxed);
    }

    /// Takes `n` descriptors for something about to open files (a queue's shards) if that
    /// leaves [`fd_headroom`] free; the monitor's next count replaces the estimate.
    ///
    /// # Errors
    /// `(open, max)` when the descriptors are too close to the limit.
    pub fn reserve_fds(&self, n: u64) -> Result<(), (u64, u64)> {
        let max = self.max_fds.load(Ordering::Relaxed);
        if max == 0 {
            return Ok(());
        }
        let open = self.open_fds.fetch_add(n, Ordering::Relaxed) + n;
        if in_headroom(open, max) {
            self.open_fds.fetch_sub(n, Ordering::Relaxed);
            return Err((open - n, max));
        }
        Ok(())
    }

    /// True when a new connection must be refused (descriptors within the headroom).
    pub fn refuse_connections(&self) -> bool {
        let max = self.max_fds.load(Ordering::Relaxed);
        max > 0 && self.open_fds.load(Ordering::Relaxed) + fd_headroom(max) / 2 > max
    }

    /// The accept threads' check (`core::accept::Admit`): false, with a warning at most once
    /// a second and a count in `connections_refused`, when descriptors are nearly gone — they
    /// are kept for the connections and queues there are (RabbitMQ's file-descriptor limit).
    /// The client sees the socket closed before the protocol header.
    pub fn admit(&self, peer: std::net::SocketAddr) -> bool {
        if !self.refuse_connections() {
            return true;
        }
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64);
        let last = self.refusal_warned_ms.load(Ordering::Relaxed);
        if (last == 0 || now_ms >= last + 1000)
            && self.refusal_warned_ms.compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let (open, max) = (self.open_fds.load(Ordering::Relaxed), self.max_fds.load(Ordering::Relaxed));
            tracing::warn!(%peer, open_fds = open, max_fds = max, "connection refused: file descriptors nearly exhausted");
        }
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
        false
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit and returns `(soft before, soft now,
/// hard)`. A failure to raise leaves the soft limit as it was (returned as both).
pub fn raise_fd_limit() -> (u64, u64, u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return (0, 0, 0);
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    (before, lim.rlim_cur, lim.rlim_max)
}

/// Open descriptors of this process (entries of `/proc/self/fd`, less the one reading it).
pub fn count_open_fds() -> Option<u64> {
    let n = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Some(n.saturating_sub(1))
}

/// Starts the monitor thread. `on_disk_alarm(raised)` runs on that thread each time the
/// disk alarm changes (the broker tells its cores, which tell their connections).
///
/// # Errors
/// When the thread cannot be started.
pub fn start_monitor(alarms: Arc<Alarms>, data_dir: PathBuf, on_disk_alarm: impl Fn(bool) + Send + 'static) -> std::io::Result<()> {
    check_fds(&alarms);
    check_disk(&alarms, &data_dir, &on_disk_alarm);
    std::thread::Builder::new().name("ringmq-alarms".into()).spawn(move || {
        let mut last_fds = std::time::Instant::now();
        loop {
            // A store's ENOSPC (disk_full_seen) is looked at within 10 ms.
            for _ in 0..(DISK_CHECK_INTERVAL.as_millis() / 10).max(1) {
                std::thread::sleep(Duration::from_millis(10));
                if alarms.disk_full_seen.swap(false, Ordering::Relaxed) {
                    break;
                }
            }
            check_disk(&alarms, &data_dir, &on_disk_alarm);
            if last_fds.elapsed() >= CHECK_INTERVAL {
                check_fds(&alarms);
                last_fds = std::time::Instant::now();
            }
        }
    })?;
    Ok(())
}

fn check_fds(alarms: &Alarms) {
    if let Some(n) = count_open_fds() {
        alarms.open_fds.store(n, Ordering::Relaxed);
        let max = alarms.max_fds.load(Ordering::Relaxed);
        let low = in_headroom(n, max);
        if alarms.fd_alarm.swap(low, Ordering::Relaxed) != low {
            if low {
                tracing::warn!(open = n, limit = max, "file descriptor alarm raised: new connections and queues are refused");
            } else {
                tracing::info!(open = n, limit = max, "file descriptor alarm cleared");
            }
        }
    }
}

fn check_disk(alarms: &Alarms, data_dir: &std::path::Path, on_disk_alarm: &impl Fn(bool)) {
    let free = match ringmq_shards::free_disk_bytes(data_dir) {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!(error = %e, "statvfs of the data directory failed");
            return;
        }
    };
    alarms.disk_free_bytes.store(free, Ordering::Relaxed);
    let limit = alarms.disk_free_limit;
    let raised = limit > 0 && free < limit;
    if alarms.disk_alarm.swap(raised, Ordering::Relaxed) != raised {
        if raised {
            tracing::warn!(free_bytes = free, limit_bytes = limit, "disk alarm raised: publishing connections are blocked");
        } else {
            tracing::info!(free_bytes = free, limit_bytes = limit, "disk alarm cleared: publishers unblocked");
        }
        on_disk_alarm(raised);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_reservations_stop_at_the_headroom() {
        let a = Alarms::new(0);
        a.max_fds.store(256, Ordering::Relaxed);
        a.open_fds.store(200, Ordering::Relaxed);
        assert!(a.reserve_fds(4).is_ok());
        assert!(a.reserve_fds(20).is_ok());
        assert_eq!(a.open_fds.load(Ordering::Relaxed), 224);
        assert_eq!(a.reserve_fds(4), Err((224, 256)), "224 + 4 + 32 > 256");
        assert_eq!(a.open_fds.load(Ordering::Relaxed), 224, "a refused reservation takes nothing");
        assert!(!a.refuse_connections(), "connections have half the headroom");
        a.open_fds.store(241, Ordering::Relaxed);
        assert!(a.refuse_connections());
    }

    #[test]
    fn headroom_scales_with_the_limit() {
        assert_eq!(fd_headroom(256), 32);
        assert_eq!(fd_headroom(1024), 51);
        assert_eq!(fd_headroom(65536), 3276);
    }

    #[test]
    fn raising_the_limit_reports_soft_and_hard() {
        let (before, now, hard) = raise_fd_limit();
        assert!(before <= now && now <= hard, "{before} {now} {hard}");
        assert!(count_open_fds().is_some_and(|n| n >= 3));
    }
}
