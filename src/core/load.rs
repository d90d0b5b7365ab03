//! How busy this core is: the share of the last window its executor spent running tasks or
//! polling I/O (glommio's `ExecutorStats::total_runtime`, which leaves out parked and spinning
//! time), measured lazily by whoever asks, so an idle core is never woken to measure itself.
//!
//! A core that is busy for nearly all of a window has no time to spare: work that arrives
//! faster than it leaves (a publisher outrunning a consumer on the same core) then takes the
//! time the leaving work needed. `broker::queue` asks [`saturated`] before it slows a
//! publisher for its consumers' sake (`dispatch.rs`, egress before ingress).

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Shortest window a figure covers; a call within it returns the last figure.
pub const WINDOW: Duration = Duration::from_millis(2);

/// Busy share, in permille, from which a core counts as saturated (90 %).
pub const SATURATED_PERMILLE: u32 = 900;

thread_local! {
    /// (start of the current window, last figure in permille).
    static METER: Cell<(Option<Instant>, u32)> = const { Cell::new((None, 0)) };
}

/// Permille (0..=1000) of the time since the previous measurement that this core's executor
/// was busy; the previous figure when that was less than [`WINDOW`] ago. The first call on a
/// core returns 0 (it starts the first window).
///
/// Takes (and so resets) the executor's `executor_stats()`: nothing else in ringmq reads them.
///
/// # Panics
/// Outside a glommio executor (glommio's `executor_stats` does).
pub fn busy_permille() -> u32 {
    METER.with(|m| {
        let (since, last) = m.get();
        let now = Instant::now();
        let Some(since) = since else {
            // What the stats held so far is dropped.
            let _ = glommio::executor().executor_stats();
            m.set((Some(now), 0));
            return 0;
        };
        let elapsed = now.saturating_duration_since(since);
        if elapsed < WINDOW {
            return last;
        }
        let busy = glommio::executor().executor_stats().total_runtime();
        let permille = u32::try_from(busy.as_micros().saturating_mul(1000) / elapsed.as_micros().max(1)).unwrap_or(u32::MAX).min(1000);
        m.set((Some(now), permille));
        permille
    })
}

/// Whether this core was busy for at least [`SATURATED_PERMILLE`] of the last window.
pub fn saturated() -> bool {
    busy_permille() >= SATURATED_PERMILLE
}
