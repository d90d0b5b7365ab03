//! Errors that end a bench run before it can report figures.

/// Why a run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Contradictory or invalid flags.
    #[error("usage: {0}")]
    Usage(String),
    /// The broker could not be reached or refused the connection (within the timeout).
    #[error("cannot connect to {uri}: {reason}")]
    Connect {
        /// URI, password redacted.
        uri: String,
        /// Client library error or "timeout".
        reason: String,
    },
    /// Declaring or binding the topology failed.
    #[error("setup failed: {0}")]
    Setup(String),
    /// Local resource error (timerfd, file descriptors, files of `report`).
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
