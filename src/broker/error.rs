//! [`QueueError`]: why a queue operation was refused, in the domain's words. The protocol
//! layer maps each variant to its AMQP 0-9-1 reply code and scope (`amqp::error`); the
//! broker never builds protocol errors itself.

/// A refused queue operation. The text is the detail a client reads after the reply code's
/// name ("NOT_FOUND - no queue 'q' in vhost '/'").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// The queue does not exist (any more): 404 NOT_FOUND, channel scope.
    #[error("{0}")]
    NotFound(String),
    /// Exclusive use by another consumer: 403 ACCESS_REFUSED, channel scope.
    #[error("{0}")]
    AccessRefused(String),
    /// A condition of the request does not hold (queue.delete if-unused/if-empty): 406
    /// PRECONDITION_FAILED, channel scope.
    #[error("{0}")]
    PreconditionFailed(String),
    /// The queue's store could not open for want of a resource (disk space, file
    /// descriptors): 506 RESOURCE_ERROR, connection scope.
    #[error("{0}")]
    ResourceError(String),
    /// The queue's store failed otherwise (an I/O error): 541 INTERNAL_ERROR, connection scope.
    #[error("{0}")]
    InternalError(String),
}
