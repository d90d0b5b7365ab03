//! Class `tx` (spec 1.9): select, commit, rollback, with RabbitMQ's semantics; the rules
//! are numbered in [`crate::amqp::transaction`].

use std::rc::Rc;

use amq_protocol::protocol::{tx, AMQPClass};

use super::basic::{apply_settle, deliver};
use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;
use crate::amqp::transaction::Tx;

/// The 406 RabbitMQ answers when a commit's publish could not be stored (rule 3).
pub fn partial_completion() -> AmqpError {
    AmqpError::precondition_failed("partial tx completion").on_method(90, 20)
}

/// tx.select, tx.commit, tx.rollback.
///
/// # Errors
/// 406 PRECONDITION_FAILED: tx.select on a channel in confirm mode ("cannot switch from
/// confirm to tx mode"), tx.commit or tx.rollback without tx.select ("channel is not
/// transactional"); 503 COMMAND_INVALID for the server's own methods.
pub fn handle(s: &Rc<Session>, channel: u16, m: tx::AMQPMethod) -> Result<(), AmqpError> {
    match m {
        tx::AMQPMethod::Select(_) => {
            if let Some(c) = s.st.borrow_mut().channels.get_mut(&channel) {
                if c.confirms.enabled {
                    return Err(AmqpError::precondition_failed("cannot switch from confirm to tx mode"));
                }
                if c.tx.is_none() {
                    c.tx = Some(Box::default());
                    c.confirms.next_seq = 1;
                }
            }
            s.send_method(channel, &AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
            Ok(())
        }
        tx::AMQPMethod::Commit(_) => commit(s, channel),
        tx::AMQPMethod::Rollback(_) => {
            {
                let mut st = s.st.borrow_mut();
                let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
                let tx = c.tx.as_mut().ok_or_else(not_transactional)?;
                tx.publishes.clear();
                let held = std::mem::take(&mut tx.settles);
                c.ledger.restore(held.into_iter().flat_map(|(_, items)| items));
            }
            s.send_method(channel, &AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})));
            Ok(())
        }
        tx::AMQPMethod::SelectOk(_) | tx::AMQPMethod::CommitOk(_) | tx::AMQPMethod::RollbackOk(_) => {
            Err(AmqpError::command_invalid("this tx method is sent by the server"))
        }
    }
}

fn not_transactional() -> AmqpError {
    AmqpError::precondition_failed("channel is not transactional")
}

/// tx.commit (rule 3): the held publishes to their queues, then the held settlements in
/// order; commit-ok at once when nothing is left to store, else from the writer as the
/// queues answer (`Tx::stored`).
fn commit(s: &Rc<Session>, channel: u16) -> Result<(), AmqpError> {
    let (publishes, settles) = {
        let mut st = s.st.borrow_mut();
        let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        let tx: &mut Tx = c.tx.as_mut().ok_or_else(not_transactional)?;
        (std::mem::take(&mut tx.publishes), std::mem::take(&mut tx.settles))
    };
    for routed in publishes {
        let seq = match s.st.borrow_mut().channels.get_mut(&channel) {
            Some(c) => c.confirms.take_seq(routed.queues.len()),
            None => return Ok(()),
        };
        deliver(s, channel, routed.committed(), Some(seq));
    }
    for (kind, held) in settles {
        apply_settle(s, channel, kind, held.into_iter().map(|(_, u)| u).collect());
    }
    let done = {
        let mut st = s.st.borrow_mut();
        let Some(c) = st.channels.get_mut(&channel) else { return Ok(()) };
        let (last, low) = (c.confirms.next_seq - 1, c.confirms.lowest_pending());
        c.tx.as_mut().map(|tx| tx.committed(last, low)).unwrap_or_default()
    };
    for ok in done {
        if !ok {
            return Err(partial_completion());
        }
        s.send_method(channel, &AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
    }
    Ok(())
}
