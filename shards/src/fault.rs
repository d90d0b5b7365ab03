//! Fault injection at named points, for crash tests (`Shard::open_with_faults`).
//!
//! A [`Faults`] handle is shared between the test and the shard. Each time the
//! shard reaches a [`FaultPoint`] it counts a hit; an armed point fires on the
//! chosen hit with a [`FaultAction`]. After a `Crash` (or a `Tear`, which
//! crashes right after its partial write) every later I/O of that shard is
//! suppressed, as if the machine lost power at that instant: the test then
//! drops the shard (`Shard::abandon`) and reopens the directory.

use std::{cell::RefCell, collections::HashMap, rc::Rc};

/// Where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// A background write of a full 1 MiB chunk of appended records.
    Append,
    /// The write of the partial chunk that `sync` cuts (group commit).
    Sync,
    /// The fdatasync of segment data inside `sync`.
    Fdatasync,
    /// The fdatasync of deletion bitmaps inside `sync` (deletes made durable).
    Delete,
    /// A segment roll: after the new segment's `.idx`/`.del` exist, before its
    /// `.seg` is written. `Tear` tears the last write of the old segment instead.
    SegmentRoll,
    /// Removal of a fully deleted segment: after its `.seg` is unlinked, before
    /// its `.idx`/`.del` are.
    SegmentRemove,
    /// Opening or creating a file: a segment's `.seg`, `.idx` or `.del` at a roll
    /// or at open, the `.seg` the writer opens for direct I/O, a `.del` or `.idx`
    /// opened for fdatasync. `FailWith { errno: libc::EMFILE }` is the
    /// open-files limit.
    Open,
    /// Taking disk blocks (fallocate) for a `.seg` file or for side-file pages,
    /// ahead of their use. `FailWith { errno: libc::ENOSPC }` is a full disk.
    Allocate,
}

/// What happens when an armed point fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// The operation fails with EIO; nothing is written. The shard turns read-only
    /// (for writes/syncs), a roll failure only fails that `append`.
    Fail,
    /// Only the first `keep_bytes` (rounded down to 512) of the write reach the
    /// file, then the shard crashes.
    Tear {
        /// Bytes of the write that are kept.
        keep_bytes: usize,
    },
    /// The shard crashes before the operation: it and all later I/O are lost.
    Crash,
    /// The operation fails with this OS error (`libc::ENOSPC`, `libc::EMFILE`,
    /// `libc::EDQUOT`…); nothing is written. Where the shard can refuse the
    /// operation without losing track of its state (an open, an allocation), it
    /// stays writable; a failed write or fdatasync turns it read-only, as `Fail`.
    FailWith {
        /// The OS error number.
        errno: i32,
    },
}

impl FaultAction {
    /// The `io::Error` a failing action stands for (`Fail`: EIO).
    pub fn error(self) -> std::io::Error {
        match self {
            FaultAction::FailWith { errno } => std::io::Error::from_raw_os_error(errno),
            _ => std::io::Error::from_raw_os_error(libc::EIO),
        }
    }

    /// True for the actions that fail an operation without crashing (`Fail`, `FailWith`).
    pub fn is_failure(self) -> bool {
        matches!(self, FaultAction::Fail | FaultAction::FailWith { .. })
    }
}

#[derive(Default, Debug)]
struct Inner {
    armed: Vec<(FaultPoint, u32, FaultAction)>,
    hits: HashMap<FaultPoint, u32>,
    fired: Vec<(FaultPoint, FaultAction)>,
    crashed: bool,
}

/// Shared fault plan; cheap to clone (`Rc`).
#[derive(Clone, Default, Debug)]
pub struct Faults(Rc<RefCell<Inner>>);

impl Faults {
    /// An empty plan: nothing fires.
    pub fn new() -> Faults {
        Faults::default()
    }

    /// Arms `point` to fire `action` on its hit number `after_hits + 1`
    /// (counting from now-on hits, including earlier ones: hit numbers are absolute).
    pub fn arm(&self, point: FaultPoint, after_hits: u32, action: FaultAction) {
        self.0.borrow_mut().armed.push((point, after_hits, action));
    }

    /// True once a `Crash` or `Tear` fired.
    pub fn crashed(&self) -> bool {
        self.0.borrow().crashed
    }

    /// Faults that fired so far, in order.
    pub fn fired(&self) -> Vec<(FaultPoint, FaultAction)> {
        self.0.borrow().fired.clone()
    }

    /// How many times `point` was reached.
    pub fn hits(&self, point: FaultPoint) -> u32 {
        self.0.borrow().hits.get(&point).copied().unwrap_or(0)
    }

    /// Counts a hit; returns the action to take (`Some(Crash)` for any point
    /// once crashed).
    pub(crate) fn hit(&self, point: FaultPoint) -> Option<FaultAction> {
        let mut s = self.0.borrow_mut();
        if s.crashed {
            return Some(FaultAction::Crash);
        }
        let n = s.hits.entry(point).or_insert(0);
        let this = *n;
        *n += 1;
        let pos = s.armed.iter().position(|&(p, after, _)| p == point && after == this)?;
        let (_, _, action) = s.armed.remove(pos);
        s.fired.push((point, action));
        if !action.is_failure() {
            s.crashed = true;
        }
        Some(action)
    }
}
