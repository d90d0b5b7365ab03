//! A one-shot broadcast flag for tasks of one single-threaded runtime ("stop producing",
//! "drain finished"). Each waiting task owns one waker slot, so polling it on every
//! message costs no allocation.

use std::cell::{Cell, RefCell};
use std::task::{Context, Poll, Waker};

/// One-shot flag; `fire` wakes every registered task.
#[derive(Default)]
pub struct Signal {
    fired: Cell<bool>,
    slots: RefCell<Vec<Option<Waker>>>,
}

impl Signal {
    /// Reserves a waker slot for one task; pass the id to [`Signal::poll_fired`].
    pub fn register(&self) -> usize {
        let mut slots = self.slots.borrow_mut();
        slots.push(None);
        slots.len() - 1
    }

    /// True once fired.
    pub fn is_fired(&self) -> bool {
        self.fired.get()
    }

    /// Fires the flag and wakes all registered tasks. Idempotent.
    pub fn fire(&self) {
        if self.fired.replace(true) {
            return;
        }
        for w in self.slots.borrow_mut().iter_mut() {
            if let Some(w) = w.take() {
                w.wake();
            }
        }
    }

    /// Ready once fired; otherwise stores the task's waker in slot `id`.
    pub fn poll_fired(&self, id: usize, cx: &mut Context<'_>) -> Poll<()> {
        if self.fired.get() {
            return Poll::Ready(());
        }
        let mut slots = self.slots.borrow_mut();
        match &mut slots[id] {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Waits until fired, using slot `id`.
    pub async fn fired(&self, id: usize) {
        std::future::poll_fn(|cx| self.poll_fired(id, cx)).await
    }
}
