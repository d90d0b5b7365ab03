//! The byte stream a connection runs on: a plain glommio [`TcpStream`] (amqp) or rustls over
//! one ([`TlsStream`], amqps). The connection code is generic over [`Transport`], so the
//! plain path compiles to the same code as before TLS existed: no boxing, no dynamic calls.
//!
//! # Invariants
//! - Socket options (read deadline for the handshake and heartbeats) are set on the TCP
//!   stream underneath ([`Transport::tcp`]): under TLS a missed deadline fails the read of
//!   the ciphertext, which fails the TLS read, as on a plain stream.
//! - A writer that has handed bytes to a buffering transport ([`Transport::BUFFERED`])
//!   flushes them before it waits for anything else: rustls may keep ciphertext that the
//!   socket did not take at once.

use futures_lite::{AsyncRead, AsyncWrite};
use futures_rustls::server::TlsStream;
use glommio::net::TcpStream;

/// A stream one AMQP connection is served on.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + 'static {
    /// Whether writes may stay buffered until a flush (rustls); false for a plain socket,
    /// whose writes go straight to the kernel (its flush does nothing).
    const BUFFERED: bool;

    /// Whether a connection on it can move to another core (`handoff`): a plain socket is
    /// its descriptor alone; a TLS session's state stays where it is.
    const MOVABLE: bool;

    /// The TCP stream underneath, for socket options and addresses.
    fn tcp(&self) -> &TcpStream;
}

impl Transport for TcpStream {
    const BUFFERED: bool = false;
    const MOVABLE: bool = true;

    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl Transport for TlsStream<TcpStream> {
    const BUFFERED: bool = true;
    const MOVABLE: bool = false;

    fn tcp(&self) -> &TcpStream {
        self.get_ref().0
    }
}
