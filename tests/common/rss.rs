//! A process's resident memory as the kernel reports it (VmRSS): once, or its peak sampled
//! every 5 ms while something runs (the flow-control and memory tests).

use std::time::Duration;

/// Samples a process's resident memory (VmRSS, bytes) every 5 ms until dropped; the peak.
pub struct PeakRss {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The resident memory of process `pid`, bytes (0 when it is gone).
pub fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

impl PeakRss {
    /// Starts sampling process `pid`.
    pub fn start(pid: u32) -> PeakRss {
        use std::sync::atomic::Ordering::Relaxed;
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            // Bounded: ten minutes of samples at most.
            for _ in 0..120_000 {
                if s.load(Relaxed) {
                    break;
                }
                p.fetch_max(rss_of(pid), Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        PeakRss { peak, stop, thread: Some(thread) }
    }

    /// Stops sampling; the peak seen, bytes.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }
}
