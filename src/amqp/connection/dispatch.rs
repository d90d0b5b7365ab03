//! Frame dispatch on the reader side: each frame to its handler.
//!
//! Channel 0 carries connection methods only (spec 4.2.3); any other channel is
//! routed by its state: not open (only channel.open, or a stray close-ok), closing (only
//! close-ok or close, spec 1.5.2.5), assembling content (a method frame there is 505
//! UNEXPECTED_FRAME, spec 4.2.6), or open (the class's handler in `methods`).
//!
//! Content assembly (spec 4.2.6): basic.publish, then one content header of class 60,
//! then body frames until the declared size; a body larger than declared is 501
//! FRAME_ERROR, a declared size above `--max-message-size` is 406 on the channel.
//!
//! Invariant: an error carries the class and method it answers (filled in here when the
//! handler left it empty) and goes to the scope the spec gives it: a channel error
//! closes the channel, a connection error the connection.

use std::rc::Rc;

use amq_protocol::protocol::{basic, channel as chan, connection as conn, AMQPClass};

use super::Session;
use crate::amqp::channel::ChannelState;
use crate::amqp::codec::Frame;
use crate::amqp::error::{AmqpError, Scope};
use crate::amqp::methods;

impl Session {
    /// connection.update-secret (class 10, method 70; RabbitMQ's extension, used to rotate
    /// credentials that expire, such as OAuth 2 tokens): answered update-secret-ok, and the
    /// connection goes on as the user it logged in as. The users here are configured ones
    /// whose login does not expire, so, as RabbitMQ does for its internal users (their
    /// backend's state cannot expire, so `rabbit_access_control:update_state` keeps it
    /// unchanged), the new secret is not checked: amqplib's and pika's suites rotate to an
    /// arbitrary secret and expect update-secret-ok. `reason` is logged; the secret is not.
    fn update_secret(&self, new_secret: &[u8], reason: &str) {
        let user = self.st.borrow().user.clone();
        tracing::info!(conn = %self.id, %user, reason, secret_bytes = new_secret.len(), "user updated secret");
        self.send_method(0, &AMQPClass::Connection(conn::AMQPMethod::UpdateSecretOk(conn::UpdateSecretOk {})));
    }

    /// Carries out one frame read from the socket.
    pub(super) async fn on_frame(self: &Rc<Self>, frame: Frame) -> Result<(), AmqpError> {
        let closing = self.st.borrow().closing.is_some();
        match frame {
            Frame::Heartbeat { channel: 0 } => Ok(()),
            Frame::Heartbeat { channel } => Err(AmqpError::frame_error(format!("heartbeat frame on channel {channel}"))),
            Frame::Method { channel: 0, method } => {
                let m = *method;
                match m {
                    AMQPClass::Connection(conn::AMQPMethod::Close(c)) => {
                        tracing::debug!(conn = %self.id, code = c.reply_code, text = %c.reply_text, "client closed connection");
                        // As RabbitMQ: by close-ok, the channels are closed (their deliveries
                        // requeued) and the exclusive queues are gone.
                        self.release().await;
                        self.send_method(0, &AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})));
                        self.st.borrow_mut().linger = true;
                        self.finish();
                        Ok(())
                    }
                    AMQPClass::Connection(conn::AMQPMethod::CloseOk(_)) => {
                        self.finish();
                        Ok(())
                    }
                    _ if closing => Ok(()),
                    AMQPClass::Connection(conn::AMQPMethod::Blocked(_) | conn::AMQPMethod::Unblocked(_)) => Ok(()),
                    AMQPClass::Connection(conn::AMQPMethod::UpdateSecret(u)) => {
                        self.update_secret(u.new_secret.as_bytes(), u.reason.as_str());
                        Ok(())
                    }
                    AMQPClass::Connection(m) => {
                        let id = AMQPClass::Connection(m.clone()).get_amqp_method_id();
                        Err(AmqpError::command_invalid("connection method not valid after the handshake").on_method(10, id))
                    }
                    other => {
                        let (c, mth) = (other.get_amqp_class_id(), other.get_amqp_method_id());
                        Err(AmqpError::channel_error("non-connection method on channel 0").on_method(c, mth))
                    }
                }
            }
            _ if closing => Ok(()),
            Frame::Method { channel, method } => self.on_method(channel, *method).await,
            Frame::Header { .. } | Frame::Body { .. } => self.on_frame_now(frame).map(|_| ()),
        }
    }

    /// Carries out a frame that needs no `await` (content frames, basic.publish, basic.ack):
    /// most of a publisher's and an acking consumer's frames, without building the general
    /// path's future (moving the frame into it and out was 5 % of a core at 1 M msgs/s).
    /// Returns the frame untouched when it needs [`Session::on_frame`].
    pub(super) fn on_frame_now(self: &Rc<Self>, frame: Frame) -> Result<Option<Frame>, AmqpError> {
        if self.st.borrow().closing.is_some() {
            return Ok(Some(frame));
        }
        match frame {
            Frame::Method { channel, method } if channel != 0 => {
                let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
                let r = match *method {
                    AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => match self.channel_gate(channel, class_id, method_id) {
                        Some(r) => return r.map(|_| None),
                        None => methods::basic::publish_started(self, channel, p),
                    },
                    AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => match self.channel_gate(channel, class_id, method_id) {
                        Some(r) => return r.map(|_| None),
                        None => methods::basic::ack(self, channel, a),
                    },
                    _ => return Ok(Some(Frame::Method { channel, method })),
                };
                self.method_done(channel, class_id, method_id, r).map(|_| None)
            }
            Frame::Header { channel, class_id, body_size, properties, raw_properties } => {
                let mut st = self.st.borrow_mut();
                let Some(c) = st.channels.get_mut(&channel) else {
                    return Err(AmqpError::channel_error(format!("content header on channel {channel}, which is not open")));
                };
                if c.state == ChannelState::Closing {
                    return Ok(None);
                }
                let Some(p) = c.publish.as_mut().filter(|p| p.body_size.is_none()) else {
                    return Err(AmqpError::unexpected_frame(format!("content header on channel {channel} without basic.publish")));
                };
                if class_id != 60 {
                    return Err(AmqpError::unexpected_frame(format!("content header of class {class_id}, expected 60")));
                }
                p.body_size = Some(body_size);
                p.properties = properties;
                p.raw_properties = raw_properties;
                let max = self.core.shared.config.max_message_size;
                if body_size > max {
                    c.publish = None;
                    drop(st);
                    // Later body frames of this message land on a closing channel and are dropped.
                    // RabbitMQ's words (rabbit_channel's check_msg_size).
                    self.fail_channel(
                        channel,
                        AmqpError::precondition_failed(format!("message size {body_size} is larger than configured max size {max}"))
                            .on_method(60, 40),
                        None,
                    );
                    return Ok(None);
                }
                if body_size == 0 {
                    drop(st);
                    return self.publish_complete(channel).map(|_| None);
                }
                Ok(None)
            }
            Frame::Body { channel, payload } => {
                let mut st = self.st.borrow_mut();
                let Some(c) = st.channels.get_mut(&channel) else {
                    return Err(AmqpError::channel_error(format!("content body on channel {channel}, which is not open")));
                };
                if c.state == ChannelState::Closing {
                    return Ok(None);
                }
                let Some(p) = c.publish.as_mut().filter(|p| p.body_size.is_some()) else {
                    return Err(AmqpError::unexpected_frame(format!("content body on channel {channel} without a content header")));
                };
                let size = p.body_size.unwrap_or(0);
                if p.received + payload.len() as u64 > size {
                    return Err(AmqpError::frame_error(format!("content body larger than the declared {size} bytes")));
                }
                p.push_body(payload);
                if p.received == size {
                    drop(st);
                    return self.publish_complete(channel).map(|_| None);
                }
                Ok(None)
            }
            other => Ok(Some(other)),
        }
    }

    fn publish_complete(self: &Rc<Self>, channel: u16) -> Result<(), AmqpError> {
        let p = {
            let mut st = self.st.borrow_mut();
            st.channels.get_mut(&channel).and_then(|c| c.publish.take())
        };
        let Some(p) = p else { return Ok(()) };
        let first = !std::mem::replace(&mut self.st.borrow_mut().published, true);
        if first && self.core.shared.alarms.publishers_blocked() {
            self.set_blocked(true, None);
        }
        if let Err(e) = methods::basic::publish(self, channel, p) {
            return self.on_error(channel, e.on_method(60, 40));
        }
        Ok(())
    }

    fn on_error(&self, channel: u16, e: AmqpError) -> Result<(), AmqpError> {
        match e.scope {
            Scope::Connection => Err(e),
            Scope::Channel => {
                self.fail_channel(channel, e, None);
                Ok(())
            }
        }
    }

    async fn on_method(self: &Rc<Self>, channel: u16, method: AMQPClass) -> Result<(), AmqpError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        if let Some(r) = self.channel_gate(channel, class_id, method_id) {
            return r;
        }
        let r = match method {
            AMQPClass::Channel(m) => methods::channel::handle(self, channel, m).await,
            AMQPClass::Exchange(m) => methods::exchange::handle(self, channel, m).await,
            AMQPClass::Queue(m) => methods::queue::handle(self, channel, m).await,
            AMQPClass::Basic(m) => methods::basic::handle(self, channel, m).await,
            AMQPClass::Confirm(m) => methods::confirm::handle(self, channel, m),
            AMQPClass::Tx(m) => methods::tx::handle(self, channel, m),
            AMQPClass::Access(_) => {
                self.send_method(
                    channel,
                    &AMQPClass::Access(amq_protocol::protocol::access::AMQPMethod::RequestOk(amq_protocol::protocol::access::RequestOk {})),
                );
                Ok(())
            }
            AMQPClass::Connection(_) => Err(AmqpError::command_invalid("connection method on a non-zero channel")),
        };
        self.method_done(channel, class_id, method_id, r)
    }

    /// What the state of `channel` makes of method `class_id`.`method_id` before its class's
    /// handler sees it: `None` when the channel is open and takes it. A channel not open
    /// takes only channel.open (and a stray close-ok); a closing one only close-ok or close
    /// (spec 1.5.2.5; the rest is dropped); one assembling content no method at all (505
    /// UNEXPECTED_FRAME, spec 4.2.6).
    fn channel_gate(self: &Rc<Self>, channel: u16, class_id: u16, method_id: u16) -> Option<Result<(), AmqpError>> {
        const OPEN: (u16, u16) = (20, 10);
        const CLOSE: (u16, u16) = (20, 40);
        const CLOSE_OK: (u16, u16) = (20, 41);
        let st = self.st.borrow();
        match st.channels.get(&channel) {
            None => {
                drop(st);
                Some(match (class_id, method_id) {
                    OPEN => methods::channel::open(self, channel),
                    // A close-ok for a channel we already forgot is harmless.
                    CLOSE_OK => Ok(()),
                    _ => {
                        Err(AmqpError::channel_error(format!("expecting 'channel.open' for channel {channel}"))
                            .on_method(class_id, method_id))
                    }
                })
            }
            Some(c) if c.state == ChannelState::Closing => {
                drop(st);
                match (class_id, method_id) {
                    CLOSE_OK => {
                        self.st.borrow_mut().channels.remove(&channel);
                    }
                    CLOSE => {
                        self.st.borrow_mut().channels.remove(&channel);
                        self.send_method(channel, &AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})));
                    }
                    _ => {}
                }
                Some(Ok(()))
            }
            Some(c) if c.publish.is_some() => Some(Err(AmqpError::unexpected_frame(format!(
                "method frame on channel {channel} while content of basic.publish was expected"
            ))
            .on_method(class_id, method_id))),
            Some(_) => None,
        }
    }

    /// A handler's outcome: an error gets the method it answers (unless the handler named
    /// one) and goes to its scope.
    fn method_done(&self, channel: u16, class_id: u16, method_id: u16, r: Result<(), AmqpError>) -> Result<(), AmqpError> {
        match r {
            Ok(()) => Ok(()),
            Err(mut e) => {
                if e.class_id == 0 {
                    e = e.on_method(class_id, method_id);
                }
                self.on_error(channel, e)
            }
        }
    }
}
