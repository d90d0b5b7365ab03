//! The log's way out: every log line goes through a bounded queue to one writer thread
//! (`ringmq-log`), which writes it to standard error. A core never writes to stderr itself.
//!
//! # Invariants
//! 1. The broker outlives its log sink. A write that fails (a closed pipe: EPIPE, a full
//!    disk, EIO) drops that line and counts it; nothing panics and nothing exits. Rust
//!    ignores SIGPIPE, so a closed pipe is an error here, not a signal.
//! 2. A core never waits on the sink: a line is handed over with `try_send`; when the queue
//!    is full (a reader that stopped reading, so the writer thread is blocked in `write`),
//!    the line is dropped and counted.
//! 3. When a write succeeds again after lines were dropped, the sink is told once, before
//!    that line, how many were lost and why.
//! 4. Lines reach the sink in the order they were logged by one thread; [`flush`] waits (a
//!    bounded time) until what was queued is written, so the last lines before an exit are
//!    not lost.
//!
//! The count is exported as `ringmq_log_lines_dropped_total` ([`dropped`]).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lines the queue holds before it drops: about 16 MiB of typical 250-byte lines.
const QUEUE_LINES: usize = 65_536;

/// Lines dropped since the start: not written (the sink failed) or not queued (full).
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Lines handed to the writer thread, and lines it has finished with (written or dropped);
/// [`flush`] waits for the second to reach the first.
static QUEUED: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);

static QUEUE: OnceLock<flume::Sender<Vec<u8>>> = OnceLock::new();

/// Log lines dropped since the process started (a failed write to stderr, or the queue full).
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Starts the writer thread and returns the writer factory for `tracing_subscriber::fmt`
/// (`.with_writer(..)`). Later calls return a factory for the same queue.
///
/// # Errors
/// When the thread cannot be spawned: the caller then logs to stderr directly.
pub fn stderr_sink() -> std::io::Result<LogSink> {
    if QUEUE.get().is_none() {
        let (tx, rx) = flume::bounded::<Vec<u8>>(QUEUE_LINES);
        std::thread::Builder::new().name("ringmq-log".into()).spawn(move || write_lines(rx, std::io::stderr()))?;
        let _ = QUEUE.set(tx);
    }
    Ok(LogSink)
}

/// The writer thread: writes each line to `out`; counts what it cannot write (invariant 3).
fn write_lines(rx: flume::Receiver<Vec<u8>>, mut out: impl Write) {
    let mut told = DROPPED.load(Ordering::Relaxed);
    let mut last_error: Option<std::io::Error> = None;
    while let Ok(line) = rx.recv() {
        let lost = DROPPED.load(Ordering::Relaxed) - told;
        let notice = (lost > 0).then(|| {
            let why = last_error.as_ref().map_or_else(|| "the log queue was full".to_string(), |e| e.to_string());
            format!("ringmq: {lost} log lines were dropped ({why}); logging again\n")
        });
        // The notice goes first; while even it cannot be written, the line is dropped too.
        let written = match notice {
            Some(n) => out.write_all(n.as_bytes()).inspect(|_| told += lost).and_then(|_| out.write_all(&line)),
            None => out.write_all(&line),
        };
        match written {
            Ok(()) => last_error = None,
            Err(e) => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
                last_error = Some(e);
            }
        }
        DONE.fetch_add(1, Ordering::Release);
    }
}

/// Waits until every line queued so far has been written or dropped, for at most `limit`.
/// For the last lines before the process exits.
pub fn flush(limit: Duration) {
    let target = QUEUED.load(Ordering::Acquire);
    let deadline = Instant::now() + limit;
    while DONE.load(Ordering::Acquire) < target && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes `text` to stderr after the queued log lines ([`flush`], up to 1 s), ignoring a
/// failed write: for the few messages written outside the log (a fatal error's last words),
/// where `eprintln!` would panic on a closed pipe.
pub fn stderr_line(text: &str) {
    flush(Duration::from_secs(1));
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// The writer factory handed to `tracing_subscriber::fmt`: each event is formatted into a
/// [`LogLine`] and queued when it is dropped.
#[derive(Clone, Copy, Debug)]
pub struct LogSink;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::with_capacity(256))
    }
}

/// One event's formatted bytes, queued for the writer thread when dropped.
#[derive(Debug)]
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let Some(tx) = QUEUE.get() else {
            let _ = std::io::stderr().write_all(&self.0);
            return;
        };
        QUEUED.fetch_add(1, Ordering::AcqRel);
        if tx.try_send(std::mem::take(&mut self.0)).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            DONE.fetch_add(1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that fails its first `fail` writes, then takes everything.
    struct Flaky {
        fail: usize,
        got: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl Write for Flaky {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.fail > 0 {
                self.fail -= 1;
                return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
            }
            self.got.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failing_sink_drops_and_counts_lines_then_says_so_once_when_it_is_back() {
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = flume::unbounded();
        for i in 0..5 {
            tx.send(format!("line {i}\n").into_bytes()).unwrap();
        }
        drop(tx);
        let before = dropped();
        write_lines(rx, Flaky { fail: 2, got: got.clone() });
        let text = String::from_utf8(got.lock().unwrap().clone()).unwrap();
        assert!(dropped() >= before + 2, "two lines counted as dropped");
        // The notice comes once, before the first line written after the failures.
        assert!(text.starts_with("ringmq: 2 log lines were dropped ("), "{text}");
        assert_eq!(text.matches("were dropped").count(), 1, "{text}");
        assert!(text.ends_with("line 2\nline 3\nline 4\n"), "{text}");
    }
}
