//! Class `confirm` (RabbitMQ's publisher confirms extension): select.

use std::rc::Rc;

use amq_protocol::protocol::{confirm, AMQPClass};

use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;

/// confirm.select: from now on every publish on the channel is confirmed with basic.ack
/// (or basic.nack), numbered from 1.
///
/// # Errors
/// 406 PRECONDITION_FAILED on a transactional channel ("cannot switch from tx to confirm
/// mode", as RabbitMQ).
pub fn handle(s: &Rc<Session>, channel: u16, m: confirm::AMQPMethod) -> Result<(), AmqpError> {
    match m {
        confirm::AMQPMethod::Select(sel) => {
            if let Some(c) = s.st.borrow_mut().channels.get_mut(&channel) {
                if c.tx.is_some() {
                    return Err(AmqpError::precondition_failed("cannot switch from tx to confirm mode"));
                }
                if !c.confirms.enabled {
                    c.confirms.enabled = true;
                    c.confirms.next_seq = 1;
                }
            }
            if !sel.nowait {
                s.send_method(channel, &AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})));
            }
            Ok(())
        }
        confirm::AMQPMethod::SelectOk(_) => Err(AmqpError::command_invalid("confirm.select-ok is sent by the server")),
    }
}
