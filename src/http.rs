//! The HTTP listeners (ingress, metrics): HTTP/1.1 whose every request must finish its headers and its body within deadlines, on sockets capped per peer and in total that shed the slowest first.
//!
//! The ingress listener faces webhook senders, often the internet. A client that opens
//! sockets and never sends (or never finishes) a request, drips a byte every few seconds
//! (which an idle timer alone never closes), or leaves keep-alive connections idle, must not
//! hold file descriptors and memory for ever, nor keep real senders out: headers have
//! `header_timeout` from the first byte a request may start with, the body `body_timeout`
//! from the end of the headers, a socket that moves no byte for `idle` is closed, and at a
//! socket cap the socket not serving a request that has waited longest is shed
//! (crate::sockets).
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};

use crate::lifecycle::{Lifecycle, Signal};
use crate::metrics::Metrics;
use crate::sockets::{Admission, Busy, Caps, Slot, Sockets};

/// Most sockets open at once on one HTTP listener.
pub const MAX_CONNECTIONS: usize = 1024;

/// Most bytes of a request's head (request line and headers); a larger one is answered 431.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// The limits of one HTTP listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub caps: Caps,
    /// A socket that moves no byte for this long is closed.
    pub idle: Duration,
    /// A request's headers must have arrived this long after the socket was ready for them.
    pub header_timeout: Duration,
    /// A request's body must have arrived this long after its headers.
    pub body_timeout: Duration,
    /// A larger body is answered 413.
    pub max_body_bytes: usize,
}

/// Serves `routes` on `listener` until stopping begins; then each connection finishes the
/// request it is serving and closes. Each connection is a task of `life`, so shutdown waits
/// for its answer.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    routes: axum::Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    life: Lifecycle,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let stop = life.stopping();
    let sockets = Sockets::new(limits.caps);
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait() => return,
        };
        let (stream, remote) = match accepted {
            Ok(a) => {
                backoff = Duration::from_millis(5);
                a
            }
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::warn!(error = %e, "HTTP accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let held = loop {
            match sockets.admit(remote.ip()) {
                Admission::In { held, shed } => {
                    if let Some((peer, cap)) = shed {
                        tracing::debug!(listener = name, %peer, cap = cap.as_str(), "HTTP socket shed to make room");
                        metrics.socket_shed(name, cap.as_str());
                    }
                    break Some(held);
                }
                Admission::PeerBusy => {
                    metrics.socket_shed(name, "peer_busy");
                    break None;
                }
                // Every socket is serving a request: the next to close makes room.
                Admission::Full => {
                    let closed = sockets.closed.notified();
                    tokio::select! {
                        _ = closed => {}
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                        _ = stop.wait() => return,
                    }
                }
            }
        };
        let Some(held) = held else {
            tracing::debug!(%remote, "HTTP socket refused: every socket of its peer is serving a request");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let routes = routes.clone();
        let stop = stop.clone();
        // The ingress listener counts what it refuses before any route sees the request.
        let refusals = (name == "ingress").then(|| metrics.clone());
        let tls = tls.clone();
        life.spawn(async move {
            let slot = held.slot.clone();
            match tls {
                None => connection(stream, remote, slot, routes, limits, refusals, stop).await,
                // The handshake has the head's deadline: a socket that never finishes it is
                // closed like one that never finishes its head.
                Some(tls) => {
                    match tokio::time::timeout(limits.header_timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            connection(stream, remote, slot, routes, limits, refusals, stop).await
                        }
                        Ok(Err(e)) => tracing::debug!(%remote, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%remote, "TLS handshake not finished in time"),
                    }
                }
            }
            drop(held);
        });
    }
}

/// One socket's HTTP/1.1 connection, closed when it is shed. Requests refused before routing
/// (a head too large or malformed, a body too large, too slow or unreadable) are counted in
/// `refusals` as HTTP ingress refusals, when given.
async fn connection<S>(
    stream: S,
    remote: std::net::SocketAddr,
    slot: Arc<Slot>,
    routes: axum::Router,
    limits: HttpLimits,
    refusals: Option<Arc<Metrics>>,
    stop: Signal,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(IdleIo::new(stream, limits.idle));
    let request_slot = slot.clone();
    let request_refusals = refusals.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        // Routes read the peer as axum's extractor does.
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(remote));
        request(
            req,
            routes.clone(),
            request_slot.clone(),
            limits,
            request_refusals.clone(),
        )
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // The head's own bound (431); the buffer's alone is not one when a head arrives in a
        // single read.
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let shed = slot.shed.notified();
    let stopping = stop.wait();
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                // hyper answers these itself (431, 400). A head that never completes is
                // not counted: hyper's timer cannot tell it from a keep-alive left idle.
                if e.is_parse() || e.is_parse_too_large() {
                    if let Some(m) = &refusals {
                        m.ingress_refused("http");
                    }
                }
                tracing::debug!(error = %e, "HTTP connection ended");
            }
            return;
        }
        // Dropping the connection closes the socket.
        _ = shed => return,
        _ = stopping => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// One request: its body read within `body_timeout` and `max_body_bytes`, then routed.
async fn request(
    req: Request<Incoming>,
    mut routes: axum::Router,
    slot: Arc<Slot>,
    limits: HttpLimits,
    refusals: Option<Arc<Metrics>>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    // A declared length over the limit is refused before any of the body is read, and before
    // hyper would answer an `Expect: 100-continue` inviting it.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        if let Some(m) = &refusals {
            m.ingress_refused("http");
        }
        return Ok(refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the body is larger than {} bytes", limits.max_body_bytes),
        ));
    }
    let read = Limited::new(body, limits.max_body_bytes).collect();
    let refused = |status, message: &str| {
        if let Some(m) = &refusals {
            m.ingress_refused("http");
        }
        Ok(refusal(status, message))
    };
    let body = match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("the body is larger than {} bytes", limits.max_body_bytes),
            )
        }
        Ok(Err(_)) => return refused(StatusCode::BAD_REQUEST, "the body could not be read"),
        Err(_) => {
            return refused(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "the body did not arrive within {} s of the headers",
                    limits.body_timeout.as_secs_f64()
                ),
            )
        }
    };
    // Only now is the socket serving a request: a slow body could still be shed. It serves
    // it until the answer is written, so an answer to a recorded trigger is never cut off.
    let busy = slot.begin();
    let req = Request::from_parts(parts, Body::from(body));
    let answer = tower::Service::call(&mut routes, req).await?;
    Ok(answer.map(|inner| Body::new(Answering { inner, _busy: busy })))
}

/// An answer's body, keeping its socket busy until it has been written (or dropped).
struct Answering {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Answering {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An answer before routing, with `Connection: close`: the socket has misbehaved. Its body
/// reads both as the ingress's `{"error"}` and as a google.rpc.Status (the JSON door's
/// refusals): the gRPC code a too-large message (RESOURCE_EXHAUSTED), a late body
/// (DEADLINE_EXCEEDED) or an unreadable one (INVALID_ARGUMENT) gets.
fn refusal(status: StatusCode, why: &str) -> Response<Body> {
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => tonic::Code::ResourceExhausted,
        StatusCode::REQUEST_TIMEOUT => tonic::Code::DeadlineExceeded,
        _ => tonic::Code::InvalidArgument,
    };
    let body =
        serde_json::json!({ "error": why, "code": code as i32, "message": why, "details": [] });
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A socket that fails (and so is closed) after `idle` without a byte read or written.
pub struct IdleIo<S> {
    stream: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> IdleIo<S> {
    fn new(stream: S, idle: Duration) -> IdleIo<S> {
        IdleIo {
            stream,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn progressed(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.deadline.as_mut().poll(cx).is_ready()
    }
}

fn idle_error() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "connection idle")
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.progressed();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.progressed();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A TLS acceptor for an HTTP listener, from the gRPC listener's PEM certificate chain and key
/// (`--tls-cert-file`, `--tls-key-file`): HTTP/1.1 over TLS 1.2 or 1.3, no client certificate
/// asked for (callers name themselves with a bearer token).
pub fn tls_acceptor(
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", cert_file.display()))?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", key_file.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
