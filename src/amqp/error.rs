//! `AmqpError`: a protocol error with its reply code and scope.
//!
//! Reply codes and their scope (soft = channel.close, hard = connection.close) follow
//! the AMQP 0-9-1 spec, section 1.2 "Constants" of amqp0-9-1.xml.

use std::fmt;

/// AMQP 0-9-1 reply codes used by ringmq (spec, "Constants").
pub mod code {
    /// connection.close by the server on shutdown (hard).
    pub const CONNECTION_FORCED: u16 = 320;
    /// basic.return: mandatory message with no route.
    pub const NO_ROUTE: u16 = 312;
    /// Access refused (soft on a channel, hard during login).
    pub const ACCESS_REFUSED: u16 = 403;
    /// Object not found (soft).
    pub const NOT_FOUND: u16 = 404;
    /// Exclusive object owned by another connection (soft).
    pub const RESOURCE_LOCKED: u16 = 405;
    /// Precondition failed: unknown delivery tag, inequivalent redeclare (soft).
    pub const PRECONDITION_FAILED: u16 = 406;
    /// Malformed frame (hard).
    pub const FRAME_ERROR: u16 = 501;
    /// Field values illegal or malformed (hard).
    pub const SYNTAX_ERROR: u16 = 502;
    /// Method not valid in this state (hard).
    pub const COMMAND_INVALID: u16 = 503;
    /// Channel id misuse (hard).
    pub const CHANNEL_ERROR: u16 = 504;
    /// Frame that was not expected here (hard).
    pub const UNEXPECTED_FRAME: u16 = 505;
    /// Resource error, e.g. too many channels (hard).
    pub const RESOURCE_ERROR: u16 = 506;
    /// Forbidden by server policy, e.g. unknown vhost (hard).
    pub const NOT_ALLOWED: u16 = 530;
    /// Method not implemented by the server (hard).
    pub const NOT_IMPLEMENTED: u16 = 540;
    /// Internal server error (hard).
    pub const INTERNAL_ERROR: u16 = 541;
}

/// Whether an error closes the channel (soft) or the whole connection (hard).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Reported with channel.close; the connection survives.
    Channel,
    /// Reported with connection.close on channel 0.
    Connection,
}

/// A protocol error: reply code, text, the method that caused it (class id, method id;
/// 0,0 when none) and its scope. Only the connection code turns it into frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmqpError {
    /// Reply code from [`code`].
    pub code: u16,
    /// Reply text, "NAME - detail" as RabbitMQ writes it. At most 255 bytes on the wire.
    pub text: String,
    /// Class id of the offending method (0 if none).
    pub class_id: u16,
    /// Method id of the offending method (0 if none).
    pub method_id: u16,
    /// Channel or connection scope.
    pub scope: Scope,
}

impl AmqpError {
    fn new(code: u16, name: &str, detail: impl fmt::Display, scope: Scope) -> Self {
        let mut text = format!("{name} - {detail}");
        if text.len() > 255 {
            let mut cut = 255;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        AmqpError { code, text, class_id: 0, method_id: 0, scope }
    }

    /// Attach the offending method's class and method ids.
    pub fn on_method(mut self, class_id: u16, method_id: u16) -> Self {
        self.class_id = class_id;
        self.method_id = method_id;
        self
    }

    /// 403 on a channel.
    pub fn access_refused(detail: impl fmt::Display) -> Self {
        Self::new(code::ACCESS_REFUSED, "ACCESS_REFUSED", detail, Scope::Channel)
    }
    /// 403 on the connection (login refused).
    pub fn login_refused(detail: impl fmt::Display) -> Self {
        Self::new(code::ACCESS_REFUSED, "ACCESS_REFUSED", detail, Scope::Connection)
    }
    /// 404, soft.
    pub fn not_found(detail: impl fmt::Display) -> Self {
        Self::new(code::NOT_FOUND, "NOT_FOUND", detail, Scope::Channel)
    }
    /// 405, soft.
    pub fn resource_locked(detail: impl fmt::Display) -> Self {
        Self::new(code::RESOURCE_LOCKED, "RESOURCE_LOCKED", detail, Scope::Channel)
    }
    /// 406, soft.
    pub fn precondition_failed(detail: impl fmt::Display) -> Self {
        Self::new(code::PRECONDITION_FAILED, "PRECONDITION_FAILED", detail, Scope::Channel)
    }
    /// 501, hard.
    pub fn frame_error(detail: impl fmt::Display) -> Self {
        Self::new(code::FRAME_ERROR, "FRAME_ERROR", detail, Scope::Connection)
    }
    /// 502, hard.
    pub fn syntax_error(detail: impl fmt::Display) -> Self {
        Self::new(code::SYNTAX_ERROR, "SYNTAX_ERROR", detail, Scope::Connection)
    }
    /// 503, hard.
    pub fn command_invalid(detail: impl fmt::Display) -> Self {
        Self::new(code::COMMAND_INVALID, "COMMAND_INVALID", detail, Scope::Connection)
    }
    /// 504, hard.
    pub fn channel_error(detail: impl fmt::Display) -> Self {
        Self::new(code::CHANNEL_ERROR, "CHANNEL_ERROR", detail, Scope::Connection)
    }
    /// 505, hard.
    pub fn unexpected_frame(detail: impl fmt::Display) -> Self {
        Self::new(code::UNEXPECTED_FRAME, "UNEXPECTED_FRAME", detail, Scope::Connection)
    }
    /// 506, hard.
    pub fn resource_error(detail: impl fmt::Display) -> Self {
        Self::new(code::RESOURCE_ERROR, "RESOURCE_ERROR", detail, Scope::Connection)
    }
    /// 530, hard.
    pub fn not_allowed(detail: impl fmt::Display) -> Self {
        Self::new(code::NOT_ALLOWED, "NOT_ALLOWED", detail, Scope::Connection)
    }
    /// 540, hard.
    pub fn not_implemented(detail: impl fmt::Display) -> Self {
        Self::new(code::NOT_IMPLEMENTED, "NOT_IMPLEMENTED", detail, Scope::Connection)
    }
    /// 541, hard.
    pub fn internal_error(detail: impl fmt::Display) -> Self {
        Self::new(code::INTERNAL_ERROR, "INTERNAL_ERROR", detail, Scope::Connection)
    }
    /// 320, hard: the server is shutting down.
    pub fn connection_forced(detail: impl fmt::Display) -> Self {
        Self::new(code::CONNECTION_FORCED, "CONNECTION_FORCED", detail, Scope::Connection)
    }
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.code, self.text)
    }
}

impl std::error::Error for AmqpError {}

impl From<crate::broker::topology::TopologyError> for AmqpError {
    /// A queue refusal's code as above; 405 RESOURCE_LOCKED (channel scope) and 503
    /// COMMAND_INVALID (connection scope) for the two only topology methods give.
    fn from(e: crate::broker::topology::TopologyError) -> Self {
        use crate::broker::topology::TopologyError as T;
        match e {
            T::Queue(q) => q.into(),
            T::ResourceLocked(d) => AmqpError::resource_locked(d),
            T::CommandInvalid(d) => AmqpError::command_invalid(d),
        }
    }
}

impl From<crate::broker::QueueError> for AmqpError {
    /// The reply code and scope of each refusal (spec 1.2 "Constants"): 404, 403 and 406
    /// close the channel; 506 and 541 the connection.
    fn from(e: crate::broker::QueueError) -> Self {
        use crate::broker::QueueError as Q;
        match e {
            Q::NotFound(d) => AmqpError::not_found(d),
            Q::AccessRefused(d) => AmqpError::access_refused(d),
            Q::PreconditionFailed(d) => AmqpError::precondition_failed(d),
            Q::ResourceError(d) => AmqpError::resource_error(d),
            Q::InternalError(d) => AmqpError::internal_error(d),
        }
    }
}
