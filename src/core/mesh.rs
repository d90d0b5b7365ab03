//! Typed per-core inboxes: how cores talk (DESIGN.md, "Threads and cores": message passing
//! only). One unbounded flume channel per core; the message type is the caller's.
//!
//! # Invariants
//! - Messages from one sender to one core arrive in the order sent.
//! - [`drain`] handles at most [`crate::core::BATCH`] + 1 messages per wake-up before it
//!   yields: that is the batching of cross-core messages per tick.

use std::ops::ControlFlow;

use crate::core::BATCH;

/// The sending side of every core's inbox, by core index (Send + Sync, cheap to clone).
#[derive(Debug)]
pub struct Inboxes<M> {
    senders: Vec<flume::Sender<M>>,
}

impl<M> Clone for Inboxes<M> {
    fn clone(&self) -> Self {
        Inboxes { senders: self.senders.clone() }
    }
}

impl<M> Inboxes<M> {
    /// Creates `cores` inboxes; returns the senders and each core's receiver, by index.
    pub fn new(cores: u32) -> (Inboxes<M>, Vec<flume::Receiver<M>>) {
        let (senders, receivers) = (0..cores.max(1)).map(|_| flume::unbounded()).unzip();
        (Inboxes { senders }, receivers)
    }

    /// Number of cores.
    pub fn len(&self) -> usize {
        self.senders.len()
    }

    /// Always false: there is at least one core.
    pub fn is_empty(&self) -> bool {
        self.senders.is_empty()
    }

    /// Sends `msg` to core `core` (an index below [`Inboxes::len`]).
    ///
    /// # Errors
    /// Gives the message back when that core's inbox is closed (the core has stopped).
    pub fn send(&self, core: usize, msg: M) -> Result<(), M> {
        self.senders[core].send(msg).map_err(|e| e.into_inner())
    }

    /// Sends `make()` to every core; cores that have stopped are skipped.
    pub fn send_all(&self, mut make: impl FnMut() -> M) {
        for s in &self.senders {
            let _ = s.send(make());
        }
    }
}

/// Runs a core's inbox: waits for a message, then handles it and up to [`BATCH`] more that
/// are already there before yielding to the core's other tasks. Ends when `handle` returns
/// `Break` (with its value) or every sender is gone (`None`).
pub async fn drain<M, R>(rx: flume::Receiver<M>, mut handle: impl FnMut(M) -> ControlFlow<R>) -> Option<R> {
    while let Ok(msg) = rx.recv_async().await {
        if let ControlFlow::Break(r) = handle(msg) {
            return Some(r);
        }
        for _ in 0..BATCH {
            match rx.try_recv() {
                Ok(m) => {
                    if let ControlFlow::Break(r) = handle(m) {
                        return Some(r);
                    }
                }
                Err(_) => break,
            }
        }
        glommio::yield_if_needed().await;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_keeps_order_and_reports_a_stopped_core() {
        let (inboxes, mut rx) = Inboxes::<u32>::new(2);
        assert_eq!(inboxes.len(), 2);
        for i in 0..5 {
            inboxes.send(1, i).unwrap();
        }
        assert_eq!(rx[1].drain().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert!(rx[0].is_empty());
        drop(rx.remove(0));
        assert_eq!(inboxes.send(0, 7), Err(7));
    }

    #[test]
    fn drain_stops_at_break_and_at_the_last_sender() {
        let ex = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound).make().unwrap();
        ex.run(async {
            let (inboxes, mut rx) = Inboxes::<u32>::new(1);
            for i in 0..3000 {
                inboxes.send(0, i).unwrap();
            }
            let mut seen = 0;
            let r = drain(rx.remove(0), |m| {
                seen += 1;
                if m == 2500 {
                    ControlFlow::Break(m)
                } else {
                    ControlFlow::Continue(())
                }
            })
            .await;
            assert_eq!((r, seen), (Some(2500), 2501));
            let (inboxes, mut rx) = Inboxes::<u32>::new(1);
            inboxes.send(0, 1).unwrap();
            drop(inboxes);
            assert_eq!(drain(rx.remove(0), |_| ControlFlow::<()>::Continue(())).await, None);
        });
    }
}
