//! The management API over HTTPS (`--management-tls-listen`, RabbitMQ's
//! `management.ssl.port`): the TLS handshake of each socket the HTTPS listener accepts, after
//! which [`super::http`] serves it exactly as a plain one (same routes, same auth, same UI).
//!
//! # Invariants
//! 1. Everything between accept and the end of the TLS handshake is bounded by
//!    [`HANDSHAKE_TIMEOUT`], the amqps listener's deadline: a client that sends nothing, or
//!    stalls in the middle, is closed at the deadline with an info line naming it.
//! 2. A client whose first byte is not a TLS handshake record but an ASCII capital (an HTTP
//!    method: `http://` to the HTTPS port) is answered `400` in plain text pointing to
//!    `https://`, and closed, with a warn line. Any other failure of the handshake (not TLS, a
//!    certificate that does not verify, none where one is required) is closed with a warn
//!    line (rustls's error) or, for an early EOF, an info line.
//! 3. The config ([`crate::config::ManagementTls`]) was built at load: nothing here reads a
//!    file.
//!
//! # Why adapters, not tokio-rustls
//! The amqps listener already runs futures-rustls (futures-io traits, which glommio
//! implements); tokio's traits differ only in their read buffer. [`AsFutures`] shows
//! tokio's `TcpStream` to futures-rustls, [`AsTokio`] shows the TLS stream back to tokio's
//! traits for hyper-util's `TokioIo`: no new crate, and one rustls in the build.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_rustls::server::TlsStream;
use futures_rustls::TlsAcceptor;
use tokio::io::ReadBuf;
use tokio::net::TcpStream;

/// Longest time from accept to the end of the TLS handshake: the amqps listener's
/// (`amqp::connection::HANDSHAKE_TIMEOUT`), 10 s.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS record of content type handshake starts with this byte (RFC 8446 §5.1): every TLS
/// client's first byte.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Bytes of a plain HTTP request read (and dropped) before it is answered, so that the close
/// after the answer is a FIN, not a reset that could discard the answer.
const PLAIN_REQUEST_DRAIN: usize = 64 << 10;

/// An established HTTPS connection, as hyper-util's `TokioIo` takes it.
pub(super) type HttpsStream = AsTokio<TlsStream<AsFutures<TcpStream>>>;

/// How a handshake ended without a TLS stream.
enum Refused {
    /// Plain HTTP on the HTTPS port (answered 400).
    PlainHttp,
    /// The socket's or rustls's error; `InvalidData` is rustls refusing the peer.
    Io(io::Error),
}

impl From<io::Error> for Refused {
    fn from(e: io::Error) -> Self {
        Refused::Io(e)
    }
}

/// Runs the TLS handshake on `stream`, accepted from `peer`, within [`HANDSHAKE_TIMEOUT`]
/// (the module's invariants 1 and 2). `None` when it failed: the failure is logged and the
/// socket is closed by the drop.
pub(super) async fn accept(acceptor: &TlsAcceptor, stream: TcpStream, peer: SocketAddr) -> Option<HttpsStream> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(acceptor, stream)).await {
        Ok(Ok(tls)) => return Some(tls),
        Ok(Err(Refused::PlainHttp)) => {
            tracing::warn!(%peer, "management API: plain HTTP on the HTTPS port; answered 400 and closed")
        }
        Ok(Err(Refused::Io(e))) if e.kind() == io::ErrorKind::InvalidData => {
            tracing::warn!(%peer, error = %e, "management API: TLS handshake failed")
        }
        Ok(Err(Refused::Io(e))) => tracing::info!(%peer, error = %e, "management API: TLS handshake ended"),
        Err(_) => {
            tracing::info!(%peer, timeout_s = HANDSHAKE_TIMEOUT.as_secs(), "management API: TLS handshake not completed in time; closed")
        }
    }
    None
}

/// Peeks at the first byte (plain HTTP is answered and refused), then lets rustls shake hands.
async fn handshake(acceptor: &TlsAcceptor, stream: TcpStream) -> Result<HttpsStream, Refused> {
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before the TLS handshake").into());
    }
    if first[0] != TLS_HANDSHAKE_RECORD && first[0].is_ascii_uppercase() {
        answer_plain_http(&stream).await;
        return Err(Refused::PlainHttp);
    }
    Ok(AsTokio(acceptor.accept(AsFutures(stream)).await?))
}

/// Reads what the plain HTTP client sent (up to [`PLAIN_REQUEST_DRAIN`] bytes), then writes
/// a 400 telling it to use `https://`. Errors end it quietly: the caller logs and closes.
async fn answer_plain_http(stream: &TcpStream) {
    let body = "This is the HTTPS port of the management API: use https://\n";
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut buf = vec![0u8; 8 << 10];
    let mut drained = 0;
    while drained < PLAIN_REQUEST_DRAIN {
        match stream.try_read(&mut buf) {
            Ok(0) => break,
            Ok(n) => drained += n,
            Err(_) => break,
        }
    }
    let mut rest = answer.as_bytes();
    while !rest.is_empty() {
        if stream.writable().await.is_err() {
            return;
        }
        match stream.try_write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// A tokio stream seen through futures-io's traits (what futures-rustls takes); a close is
/// tokio's shutdown of the write half.
pub(super) struct AsFutures<T>(T);

impl<T: tokio::io::AsyncRead + Unpin> futures_lite::AsyncRead for AsFutures<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut read = ReadBuf::new(buf);
        ready!(Pin::new(&mut self.0).poll_read(cx, &mut read))?;
        Poll::Ready(Ok(read.filled().len()))
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> futures_lite::AsyncWrite for AsFutures<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A futures-io stream seen through tokio's traits (what hyper-util's `TokioIo` takes); a
/// shutdown is futures-io's close (rustls sends close_notify, then the TCP write half shuts).
pub(super) struct AsTokio<T>(T);

impl<T: futures_lite::AsyncRead + Unpin> tokio::io::AsyncRead for AsTokio<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let n = ready!(Pin::new(&mut self.0).poll_read(cx, buf.initialize_unfilled()))?;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: futures_lite::AsyncWrite + Unpin> tokio::io::AsyncWrite for AsTokio<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_close(cx)
    }
}
