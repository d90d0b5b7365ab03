//! The management API's HTTP/1.1 transport: hyper on one tokio thread (`ringmq-mgmt`),
//! which accepts, reads and writes every connection; each request's work runs on tokio's
//! blocking pool (threads `ringmq-mgmt-work`, at most [`MAX_HANDLERS`]), since handlers
//! wait for the cores' answers.
//!
//! Why not a thread per connection: a browser, a Prometheus agent or `curl --parallel` keeps
//! several keep-alive connections open, and a server that ties a thread to each can leave a
//! new connection unserved while its threads sit on idle ones (the server crate used before
//! did: 4 of 1,000 parallel declares waited 11 minutes). Here an idle connection costs a
//! socket and a small task, not a thread.
//!
//! Listeners: the plain `--management-listen` and the HTTPS `--management-tls-listen`, both
//! on this one thread; an HTTPS socket's task runs the TLS handshake first ([`super::tls`]),
//! then the same HTTP service.
//!
//! Limits: request headers must arrive within [`HEADER_TIMEOUT`]; bodies over
//! [`super::MAX_BODY`] bytes are answered 413.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};

use futures_rustls::TlsAcceptor;

use super::{Answer, Api, Bound};
use crate::config::ManagementTls;

/// Most requests worked on at once (tokio's blocking pool); more wait their turn.
pub const MAX_HANDLERS: usize = 32;

/// How long a client may take to send a request's headers, from the connection's start or
/// the previous answer (idle keep-alive connections are closed after it too).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(60);

/// The listeners to bind: the plain HTTP address and the HTTPS one with its rustls config.
pub(super) struct Listeners<'a> {
    /// `--management-listen`.
    pub http: Option<SocketAddr>,
    /// `--management-tls-listen` and its files.
    pub https: Option<&'a ManagementTls>,
}

/// Binds each of `listeners` and starts the server thread for `api` (both listeners on it).
/// Returns each listener's bound address or bind error (the port is taken, the address is
/// not this host's): a listener that cannot bind leaves the other serving.
///
/// # Errors
/// The thread's or runtime's when they cannot start.
pub(super) fn start(listeners: Listeners<'_>, api: Arc<Api>) -> std::io::Result<Bound> {
    let bind = |addr: SocketAddr| -> std::io::Result<(std::net::TcpListener, SocketAddr)> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    };
    let mut bound = Vec::new();
    let http = listeners.http.map(|addr| {
        bind(addr).map(|(l, local)| {
            bound.push((l, None));
            local
        })
    });
    let https = listeners.https.map(|tls| {
        bind(tls.listen).map(|(l, local)| {
            tracing::info!(%local, certificate = tls.cert_from, verify_peer = tls.verify_peer, "management API over TLS");
            bound.push((l, Some(TlsAcceptor::from(tls.server.clone()))));
            local
        })
    });
    let answer = Bound { http, https };
    if bound.is_empty() {
        return Ok(answer);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .max_blocking_threads(MAX_HANDLERS)
        .thread_name("ringmq-mgmt-work")
        .build()?;
    std::thread::Builder::new().name("ringmq-mgmt".into()).spawn(move || {
        runtime.block_on(async move {
            for (listener, tls) in bound {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => drop(tokio::spawn(accept_loop(l, tls, api.clone()))),
                    Err(e) => tracing::error!(error = %e, "management API: cannot register a listening socket; that listener is off"),
                }
            }
            std::future::pending::<()>().await
        });
    })?;
    Ok(answer)
}

/// Accepts on `listener` for ever; each socket's task shakes hands first when `tls` is given.
async fn accept_loop(listener: tokio::net::TcpListener, tls: Option<TlsAcceptor>, api: Arc<Api>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::warn!(error = %e, "management API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (api, tls) = (api.clone(), tls.clone());
        tokio::spawn(async move {
            match tls {
                None => serve_connection(TokioIo::new(stream), peer, api).await,
                Some(acceptor) => {
                    if let Some(stream) = super::tls::accept(&acceptor, stream, peer).await {
                        serve_connection(TokioIo::new(stream), peer, api).await;
                    }
                }
            }
        });
    }
}

/// Serves HTTP/1.1 on one connection (plain or TLS) until it closes.
async fn serve_connection<I>(io: I, peer: SocketAddr, api: Arc<Api>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = service_fn(move |rq| serve_one(api.clone(), rq, peer));
    let conn = http1::Builder::new().timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).serve_connection(io, service);
    if let Err(e) = conn.await {
        tracing::debug!(%peer, error = %e, "management API connection ended");
    }
}

/// Reads one request's body (up to `MAX_BODY`), answers it on the blocking pool.
async fn serve_one(api: Arc<Api>, rq: hyper::Request<Incoming>, peer: SocketAddr) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let (parts, body) = rq.into_parts();
    let body = match Limited::new(body, super::MAX_BODY as usize).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err((e.is::<http_body_util::LengthLimitError>(), e.to_string())),
    };
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let incoming = RequestHead {
        method: parts.method.as_str().to_owned(),
        url: parts.uri.path_and_query().map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
        authorization: header("authorization"),
        reason: header("x-reason"),
        script: parts.headers.contains_key("x-requested-with"),
        loopback: peer.ip().is_loopback(),
    };
    let answer = tokio::task::spawn_blocking(move || match body {
        Ok(bytes) => api.answer(&incoming, &bytes),
        Err((true, _)) => Answer::error(413, "bad_request", format!("the body exceeds {} bytes", super::MAX_BODY), incoming.script),
        Err((false, e)) => Answer::error(400, "bad_request", format!("cannot read the body: {e}"), incoming.script),
    })
    .await
    .unwrap_or_else(|e| Answer::error(500, "internal_error", format!("the handler failed: {e}"), true));
    Ok(answer.into_response())
}

/// What the handlers need of a request besides its body.
pub(crate) struct RequestHead {
    /// `GET`, `PUT`, …
    pub(super) method: String,
    /// Path and query as sent (still percent-encoded).
    pub(super) url: String,
    /// The `Authorization` header.
    pub(super) authorization: Option<String>,
    /// The `X-Reason` header (a connection close's text).
    pub(super) reason: Option<String>,
    /// Sent by a script (`X-Requested-With`): a 401 carries no Basic challenge.
    pub(super) script: bool,
    /// The client connected from a loopback address.
    pub(super) loopback: bool,
}

impl Answer {
    fn into_response(self) -> hyper::Response<Full<Bytes>> {
        let mut r = hyper::Response::new(Full::new(self.body));
        *r.status_mut() = hyper::StatusCode::from_u16(self.status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
        for (name, value) in self.headers {
            if let Ok(v) = hyper::header::HeaderValue::from_str(&value) {
                r.headers_mut().append(name, v);
            }
        }
        r
    }
}
