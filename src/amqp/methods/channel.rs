//! Class `channel` (spec 1.5): open, close, close-ok, flow.

use std::rc::Rc;

use amq_protocol::protocol::{channel as chan, AMQPClass};

use crate::amqp::channel::Channel;
use crate::amqp::connection::{close_effects, Session};
use crate::amqp::error::AmqpError;

/// channel.open on a channel number not in use.
///
/// # Errors
/// 504 CHANNEL_ERROR (hard) when the number is 0 or above the negotiated channel_max
/// (spec 1.5.2.1, rule "channel-max").
pub fn open(s: &Rc<Session>, channel: u16) -> Result<(), AmqpError> {
    let mut st = s.st.borrow_mut();
    if channel == 0 || channel > st.channel_max {
        return Err(AmqpError::channel_error(format!("channel {channel} is above channel_max {}", st.channel_max)).on_method(20, 10));
    }
    let uid = s.core.shared.next_id();
    let mut opened = Channel::new(channel, uid);
    opened.live = Some(s.core.shared.live.channels.enter());
    st.channels.insert(channel, opened);
    drop(st);
    s.send_method(channel, &AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {})));
    Ok(())
}

/// Every other channel method on an open channel.
///
/// # Errors
/// 504 CHANNEL_ERROR for channel.open on an open channel (spec 1.5.2.1).
pub async fn handle(s: &Rc<Session>, channel: u16, m: chan::AMQPMethod) -> Result<(), AmqpError> {
    match m {
        chan::AMQPMethod::Open(_) => Err(AmqpError::channel_error(format!("channel {channel} is already open")).on_method(20, 10)),
        chan::AMQPMethod::Close(_) => {
            let effects = {
                let mut st = s.st.borrow_mut();
                st.channels.remove(&channel).map(|mut c| close_effects(&mut c))
            };
            if let Some(e) = effects {
                s.apply_close_effects_and_wait(e).await;
            }
            s.send_method(channel, &AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})));
            Ok(())
        }
        chan::AMQPMethod::CloseOk(_) => {
            // Only meaningful while closing, handled by the connection; otherwise ignore.
            Ok(())
        }
        chan::AMQPMethod::Flow(f) => {
            if !f.active {
                // As RabbitMQ: a client cannot pause the server's deliveries this way
                // (use basic.qos); a hard 540.
                return Err(AmqpError::not_implemented("active=false").on_method(20, 20));
            }
            if let Some(c) = s.st.borrow_mut().channels.get_mut(&channel) {
                c.flow_active = f.active;
            }
            s.send_method(channel, &AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk { active: f.active })));
            Ok(())
        }
        chan::AMQPMethod::FlowOk(_) => Ok(()),
        chan::AMQPMethod::OpenOk(_) => Err(AmqpError::command_invalid("channel.open-ok is sent by the server").on_method(20, 11)),
    }
}
