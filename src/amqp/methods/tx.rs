//! Class `tx` (spec 1.9): not implemented yet; every method gets 540 NOT_IMPLEMENTED
//! (a connection error, as the spec assigns to "not-implemented").

use std::rc::Rc;

use amq_protocol::protocol::tx;

use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;

/// Refuses every tx method with 540.
pub fn handle(_s: &Rc<Session>, _channel: u16, _m: tx::AMQPMethod) -> Result<(), AmqpError> {
    Err(AmqpError::not_implemented("transactions (tx.select) are not supported by ringmq; use publisher confirms"))
}
