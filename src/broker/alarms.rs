//! Resource alarms: memory, free disk space and file descriptors (RabbitMQ's memory and
//! disk alarms and its file-descriptor limit), watched by one plain thread and read by every
//! core.
//!
//! # What each alarm does
//! - **Memory** (`--memory-high-watermark`, default 0.4 of the memory available: RAM, or the
//!   cgroup's limit when lower; RabbitMQ's `vm_memory_high_watermark`): raised while the
//!   process's resident memory (`/proc/self/statm`, checked every [`MEMORY_CHECK_INTERVAL`]),
//!   less the bodies of messages still being received ([`BodyAssembly`]), is above the
//!   threshold. It blocks publishers as the disk alarm does (below), with RabbitMQ's reason
//!   "low on memory"; what they had sent is stored meanwhile and the memory it held returns
//!   (each core has its allocator give freed pages back every 50 ms while the alarm lasts,
//!   `core::memory`), consumers keep draining.
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

/// Bytes of message bodies being received (reserved for a basic.publish whose content is not
/// complete), process-wide. The memory alarm leaves them out: a client blocked in the middle of
/// a message may stop sending (lapin does), so blocking cannot free them, and counting them
/// kept the alarm raised for good (six 24 MiB messages half-sent against a watermark 128 MiB
/// above the idle broker). They are bounded by connections × `--max-message-size`.
static BODIES_IN_ASSEMBLY: AtomicU64 = AtomicU64::new(0);

/// One message body's assembly buffer, counted in [`BODIES_IN_ASSEMBLY`] until dropped.
#[derive(Debug)]
pub struct BodyAssembly(u64);

impl BodyAssembly {
    /// Counts `bytes` (the buffer's capacity) until the value is dropped.
    pub fn new(bytes: usize) -> BodyAssembly {
        BODIES_IN_ASSEMBLY.fetch_add(bytes as u64, Ordering::Relaxed);
        BodyAssembly(bytes as u64)
    }
}

impl Drop for BodyAssembly {
    fn drop(&mut self) {
        BODIES_IN_ASSEMBLY.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// How often the monitor reads the resident memory (one small read of `/proc`; a publisher
/// at 1 GB/s gets 10 MB past the watermark in this time).
pub const MEMORY_CHECK_INTERVAL: Duration = Duration::from_millis(10);
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
    /// The disk alarm threshold, free bytes (0 = never raised; set at run time by
    /// `ringmqctl set_disk_free_limit`).
    pub disk_free_limit: AtomicU64,
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
    /// The memory alarm threshold, resident bytes (0 = never raised).
    pub memory_limit: AtomicU64,
    /// Resident memory of the process at the last check, bytes.
    pub memory_used: AtomicU64,
    /// The memory alarm is raised.
    pub memory_alarm: AtomicBool,
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
        Alarms { disk_free_limit: AtomicU64::new(disk_free_limit), disk_free_bytes: AtomicU64::new(u64::MAX), ..Default::default() }
    }

    /// True while the disk alarm is raised.
    pub fn disk_alarm(&self) -> bool {
        self.disk_alarm.load(Ordering::Relaxed)
    }

    /// True while the memory alarm is raised.
    pub fn memory_alarm(&self) -> bool {
        self.memory_alarm.load(Ordering::Relaxed)
    }

    /// True while an alarm blocks publishing connections (memory or disk).
    pub fn publishers_blocked(&self) -> bool {
        self.memory_alarm() || self.disk_alarm()
    }

    /// The reason `connection.blocked` carries (RabbitMQ's texts).
    pub fn block_reason(&self) -> &'static str {
        match (self.memory_alarm(), self.disk_alarm()) {
            (true, true) => "low on memory and disk space",
            (true, false) => "low on memory",
            _ => "low on disk space",
        }
    }

    /// Sets the disk alarm threshold (free bytes, 0 = never) and has the monitor check
    /// within [`MEMORY_CHECK_INTERVAL`] (RabbitMQ's `rabbitmqctl set_disk_free_limit`).
    pub fn set_disk_free_limit(&self, bytes: u64) {
        self.disk_free_limit.store(bytes, Ordering::Relaxed);
        self.disk_full_seen();
    }

    /// Sets the memory alarm threshold (resident bytes, 0 = never); the monitor applies it
    /// within [`MEMORY_CHECK_INTERVAL`] (RabbitMQ's `rabbitmqctl set_vm_memory_high_watermark`).
    pub fn set_memory_limit(&self, bytes: u64) {
        self.memory_limit.store(bytes, Ordering::Relaxed);
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

/// Starts the monitor thread. `on_block(blocked)` runs on that thread each time an alarm is
/// raised or cleared, with [`Alarms::publishers_blocked`] (the broker tells its cores, which tell their
/// connections).
///
/// # Errors
/// When the thread cannot be started.
pub fn start_monitor(alarms: Arc<Alarms>, data_dir: PathBuf, on_block: impl Fn(bool) + Send + 'static) -> std::io::Result<()> {
    check_fds(&alarms);
    // Either alarm changing is news (a memory alarm raised during a disk alarm starts the
    // cores' memory collection); connections ignore a state they are already in.
    let mut seen = (false, false);
    let mut changed = move |alarms: &Alarms| {
        let now = (alarms.memory_alarm(), alarms.disk_alarm());
        if now != seen {
            seen = now;
            on_block(alarms.publishers_blocked());
        }
    };
    check_memory(&alarms);
    check_disk(&alarms, &data_dir);
    changed(&alarms);
    std::thread::Builder::new().name("ringmq-alarms".into()).spawn(move || {
        let mut last_fds = std::time::Instant::now();
        let mut last_disk = std::time::Instant::now();
        loop {
            std::thread::sleep(MEMORY_CHECK_INTERVAL);
            check_memory(&alarms);
            // A store's ENOSPC (disk_full_seen) is looked at within one memory interval.
            if alarms.disk_full_seen.swap(false, Ordering::Relaxed) || last_disk.elapsed() >= DISK_CHECK_INTERVAL {
                check_disk(&alarms, &data_dir);
                last_disk = std::time::Instant::now();
            }
            changed(&alarms);
            if last_fds.elapsed() >= CHECK_INTERVAL {
                check_fds(&alarms);
                last_fds = std::time::Instant::now();
            }
        }
    })?;
    Ok(())
}

/// Memory this process may use, bytes: `MemTotal` of `/proc/meminfo`, or its cgroup's limit
/// (v2 `memory.max`, v1 `memory.limit_in_bytes`) when that is lower. `None` when unknown.
pub fn available_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    let cgroup = cgroup_memory_limit();
    match (total, cgroup) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    }
}

/// The memory limit of this process's cgroup, if one is set (`max` and v1's huge
/// "unlimited" value are none).
fn cgroup_memory_limit() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroup.lines() {
        // v2: "0::/path"; v1: "N:memory:/path".
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        let limit = std::fs::read_to_string(&file).ok().and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(l) = limit.filter(|l| *l < 1 << 60) {
            return Some(l);
        }
    }
    None
}

/// Resident memory of this process, bytes (`/proc/self/statm`'s second field × page size).
pub fn resident_memory() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).unwrap_or(4096))
}

fn check_memory(alarms: &Alarms) {
    let limit = alarms.memory_limit.load(Ordering::Relaxed);
    let Some(used) = resident_memory() else { return };
    alarms.memory_used.store(used, Ordering::Relaxed);
    let counted = used.saturating_sub(BODIES_IN_ASSEMBLY.load(Ordering::Relaxed));
    let raised = limit > 0 && counted > limit;
    if alarms.memory_alarm.swap(raised, Ordering::Relaxed) != raised {
        if raised {
            tracing::warn!(resident_bytes = used, limit_bytes = limit, "memory alarm raised: publishing connections are blocked");
        } else {
            tracing::info!(resident_bytes = used, limit_bytes = limit, "memory alarm cleared: publishers unblocked");
        }
    }
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

fn check_disk(alarms: &Alarms, data_dir: &std::path::Path) {
    let free = match ringmq_shards::free_disk_bytes(data_dir) {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!(error = %e, "statvfs of the data directory failed");
            return;
        }
    };
    alarms.disk_free_bytes.store(free, Ordering::Relaxed);
    let limit = alarms.disk_free_limit.load(Ordering::Relaxed);
    let raised = limit > 0 && free < limit;
    if alarms.disk_alarm.swap(raised, Ordering::Relaxed) != raised {
        if raised {
            tracing::warn!(free_bytes = free, limit_bytes = limit, "disk alarm raised: publishing connections are blocked");
        } else {
            tracing::info!(free_bytes = free, limit_bytes = limit, "disk alarm cleared: publishers unblocked");
        }
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

    #[test]
    fn the_memory_alarm_follows_the_resident_memory() {
        let a = Alarms::new(0);
        let rss = resident_memory().expect("statm");
        assert!(rss > 1 << 20, "{rss}");
        assert!(available_memory().is_some_and(|m| m > rss));
        a.memory_limit.store(rss / 2, Ordering::Relaxed);
        check_memory(&a);
        assert!(a.memory_alarm() && a.publishers_blocked());
        assert_eq!(a.block_reason(), "low on memory");
        a.memory_limit.store(u64::MAX / 2, Ordering::Relaxed);
        check_memory(&a);
        assert!(!a.publishers_blocked());
        a.memory_limit.store(0, Ordering::Relaxed);
        check_memory(&a);
        assert!(!a.memory_alarm(), "0 is off");
    }
}
