//! A single-threaded wake-all event: tasks wait until the generation changes.

use std::{
    cell::{Cell, RefCell},
    future::Future,
    pin::Pin,
    task::{Context, Poll, Waker},
};

/// Wake-all notification for tasks on one executor.
#[derive(Default)]
pub(crate) struct Event {
    gen: Cell<u64>,
    wakers: RefCell<Vec<Waker>>,
}

impl Event {
    /// Current generation; pass it to [`Event::wait`] after checking a condition.
    pub(crate) fn gen(&self) -> u64 {
        self.gen.get()
    }

    /// Bumps the generation and wakes every waiter.
    pub(crate) fn notify(&self) {
        self.gen.set(self.gen.get() + 1);
        let ws = std::mem::take(&mut *self.wakers.borrow_mut());
        for w in ws {
            w.wake();
        }
    }

    /// Resolves once the generation differs from `seen`.
    pub(crate) fn wait(&self, seen: u64) -> Wait<'_> {
        Wait { ev: self, seen }
    }
}

pub(crate) struct Wait<'a> {
    ev: &'a Event,
    seen: u64,
}

impl Future for Wait<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.ev.gen.get() != self.seen {
            return Poll::Ready(());
        }
        self.ev.wakers.borrow_mut().push(cx.waker().clone());
        Poll::Pending
    }
}
