//! Client connections: a capped accept loop that backs off on errors, and sockets that close when they carry no call for too long.
//!
//! A TCP connection costs a file descriptor and some memory whether or not it is used, so one
//! that never sends a request, that sends half a handshake, or that sits idle between calls is
//! closed on a timer; calls in flight keep it open. HTTP/2 keepalive (set on the server) finds
//! peers that vanished while a call was open.
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::futures::OwnedNotified;
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::metrics::Metrics;
use crate::sockets::{Admission, Busy, Caps, Held, Slot, Sockets, Streaming};

/// Limits on client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Most connections open at once; past it the one with no call in flight that has waited longest is closed.
    pub max_connections: usize,
    /// Most connections one peer may hold; past it its one with no call in flight that has waited longest is closed.
    pub max_per_peer: usize,
    /// A connection must start its first call (after TLS and the HTTP/2 preface) within this.
    pub first_request_timeout: Duration,
    /// A connection with no call in flight for this long is closed.
    pub idle_timeout: Duration,
    /// A connection is not shed within this of being accepted or of its last call's end.
    pub shed_grace: Duration,
}

/// What is known of one connection, shared between the socket and the calls it carries.
#[derive(Debug)]
pub struct ConnState {
    opened: Instant,
    /// The connection's place among the listener's: calls in flight, and whether one started.
    slot: Arc<Slot>,
    /// Milliseconds after `opened` when the last call finished.
    last_done_ms: AtomicU64,
    /// Open health Watch streams on this connection.
    pub(crate) watches: AtomicUsize,
}

impl ConnState {
    fn new(slot: Arc<Slot>) -> ConnState {
        ConnState {
            opened: Instant::now(),
            slot,
            last_done_ms: AtomicU64::new(0),
            watches: AtomicUsize::new(0),
        }
    }

    /// Who the connection counts against.
    pub fn peer(&self) -> crate::sockets::Peer {
        self.slot.peer()
    }

    /// A call starts; the connection is busy until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        InFlight {
            state: self.clone(),
            _busy: Work::Call(self.slot.begin()),
        }
    }

    /// An unauthenticated long-lived stream starts: the connection stays open while it lasts,
    /// but is not busy (it may be shed; see crate::sockets).
    pub fn begin_stream(self: &Arc<Self>) -> InFlight {
        InFlight {
            state: self.clone(),
            _busy: Work::Stream(self.slot.begin_stream()),
        }
    }

    fn started(&self) -> bool {
        self.slot.served.load(Ordering::Relaxed)
    }

    /// When the connection may be closed, if nothing starts meanwhile.
    fn close_at(&self, limits: &ConnLimits) -> Option<Instant> {
        if self.slot.in_flight() > 0 || self.slot.streams() > 0 {
            return None;
        }
        if !self.started() {
            return Some(self.opened + limits.first_request_timeout);
        }
        let done = Duration::from_millis(self.last_done_ms.load(Ordering::Relaxed));
        Some(self.opened + done + limits.idle_timeout)
    }
}

/// A call in flight on a connection.
#[derive(Debug)]
pub struct InFlight {
    state: Arc<ConnState>,
    _busy: Work,
}

/// What a call holds on its connection's place.
#[derive(Debug)]
enum Work {
    Call(#[allow(dead_code)] Busy),
    Stream(#[allow(dead_code)] Streaming),
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let ms = u64::try_from(self.state.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.state.last_done_ms.fetch_max(ms, Ordering::Relaxed);
    }
}

/// The connection's facts, in every request's extensions (under TLS, inside `TlsConnectInfo`).
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote: Option<SocketAddr>,
    /// `peer:<address>`, the rate-limit key of callers not known by credentials; made once
    /// per connection, not per call.
    pub peer: Arc<str>,
    pub state: Arc<ConnState>,
}

impl ConnInfo {
    /// The connection a request came on, with or without TLS.
    pub fn of(extensions: &http::Extensions) -> Option<ConnInfo> {
        extensions.get::<ConnInfo>().cloned().or_else(|| {
            extensions
                .get::<tonic::transport::server::TlsConnectInfo<ConnInfo>>()
                .map(|t| t.get_ref().clone())
        })
    }
}

/// An accepted TCP connection that fails its reads once it has outlived its timers.
#[derive(Debug)]
pub struct Conn {
    io: TcpStream,
    info: ConnInfo,
    limits: ConnLimits,
    timer: Pin<Box<Sleep>>,
    /// Ready once the connection is shed to make room for another.
    shed: Pin<Box<OwnedNotified>>,
    _held: Held,
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl Conn {
    /// Polls the timer: `Ready(Err)` once the connection should close.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.shed.as_mut().poll(cx).is_ready() {
            return Poll::Ready(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "shed to make room for another connection",
            ));
        }
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = Instant::now();
            match self.info.state.close_at(&self.limits) {
                Some(at) if at <= now => {
                    let why = if self.info.state.started() {
                        "idle connection closed"
                    } else {
                        "no request within the first-request timeout"
                    };
                    tracing::debug!(remote = ?self.info.remote, why, "closing connection");
                    return Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, why));
                }
                Some(at) => self.timer.as_mut().reset(at.into()),
                // Busy: look again after a full idle period.
                None => self
                    .timer
                    .as_mut()
                    .reset((now + self.limits.idle_timeout).into()),
            }
        }
    }
}

use std::future::Future as _;

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending => match this.poll_expired(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
            ready => ready,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The process's soft limit on open files, from /proc (Linux); `None` elsewhere.
fn open_files_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The connection cap in force: the configured one, lowered so that client connections
/// leave file descriptors for the store's connections, files and the metrics listener.
pub fn effective_max_connections(configured: usize) -> usize {
    match open_files_limit() {
        Some(files) => {
            let reserve = 64.min(files / 2);
            configured.min(files.saturating_sub(reserve)).max(1)
        }
        None => configured.max(1),
    }
}

/// How often a connection waiting for room looks again (as well as whenever one closes).
const ROOM_POLL: Duration = Duration::from_millis(50);

fn note_shed(metrics: &Metrics, shed: Option<(crate::sockets::Peer, crate::sockets::Cap)>) {
    if let Some((peer, cap)) = shed {
        tracing::debug!(%peer, cap = cap.as_str(), "connection shed to make room");
        metrics.socket_shed("grpc", cap.as_str());
    }
}

/// An admitted socket, ready to serve.
fn conn_of(io: TcpStream, remote: SocketAddr, held: Held, limits: ConnLimits) -> Conn {
    // Without TCP_NODELAY a multi-frame answer waits for a delayed ACK (~40 ms).
    let _ = io.set_nodelay(true);
    let state = Arc::new(ConnState::new(held.slot.clone()));
    let first = Instant::now() + limits.first_request_timeout;
    Conn {
        io,
        info: ConnInfo {
            remote: Some(remote),
            peer: format!("peer:{}", remote.ip()).into(),
            state,
        },
        limits,
        timer: Box::pin(tokio::time::sleep_until(first.into())),
        shed: Box::pin(held.slot.shed.clone().notified_owned()),
        _held: held,
    }
}

/// A socket whose peer had no room: admitted once a connection of the peer closes or may be
/// shed, or closed after the first-request timeout.
async fn wait_for_room(
    io: TcpStream,
    remote: SocketAddr,
    turn: crate::sockets::Waiting,
    sockets: Arc<Sockets>,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Result<Conn, io::Error>>,
) {
    let deadline = tokio::time::Instant::now() + limits.first_request_timeout;
    // Room goes only to a socket that has sent its whole opening (the HTTP/2 preface, or a TLS
    // ClientHello record): silent and half-open sockets never take a real caller's turn, and
    // a caller admitted after waiting has its request read at once.
    let opened = tokio::select! {
        _ = tx.closed() => return,
        _ = turn.gone.notified() => {
            tracing::debug!(%remote, "connection closed: newer ones of its peer wait for room");
            return;
        }
        o = tokio::time::timeout_at(deadline, opening_sent(&io)) => o,
    };
    match opened {
        Ok(true) => {}
        Ok(false) => {
            tracing::debug!(%remote, "connection closed: it sent no HTTP/2 or TLS opening");
            return;
        }
        Err(_) => {
            metrics.socket_shed("grpc", "peer_busy");
            tracing::debug!(%remote, "connection closed: no opening within the first-request timeout");
            return;
        }
    }
    loop {
        let closed = sockets.closed.notified();
        match sockets.admit(remote.ip()) {
            Admission::In { held, shed } => {
                drop(turn);
                note_shed(&metrics, shed);
                let _ = tx.send(Ok(conn_of(io, remote, held, limits))).await;
                return;
            }
            Admission::PeerBusy | Admission::Full => {}
        }
        tokio::select! {
            _ = tx.closed() => return,
            _ = closed => {}
            _ = tokio::time::sleep(ROOM_POLL) => {}
            _ = turn.gone.notified() => {
                tracing::debug!(%remote, "connection closed: newer ones of its peer wait for room");
                return;
            }
            _ = tokio::time::sleep_until(deadline) => {
                metrics.socket_shed("grpc", "peer_busy");
                tracing::debug!(%remote, "connection closed: no room for it within the first-request timeout");
                return;
            }
        }
    }
}

/// How often a waiting socket with part of its opening buffered looks again (a peek does not
/// consume, so the socket stays readable and cannot be awaited).
const OPENING_POLL: Duration = Duration::from_millis(20);

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How much of a client's opening the bytes it has sent so far are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// All of it: the whole HTTP/2 preface, or a whole TLS handshake record.
    Sent,
    /// A prefix of one; `want` bytes in all make it whole (when known).
    Partial { want: usize },
    /// Neither an HTTP/2 preface nor a TLS handshake.
    Foreign,
}

/// TLS record header: content type (22, handshake), a 3.x version, and a 16-bit length.
const TLS_HEADER: usize = 5;
/// Largest TLS plaintext record (RFC 8446 §5.1).
const TLS_MAX_RECORD: usize = 1 << 14;

fn opening(bytes: &[u8]) -> Opening {
    match bytes.first() {
        None => Opening::Partial {
            want: PREFACE.len(),
        },
        Some(0x16) => {
            if bytes.len() > 1 && bytes[1] != 0x03 {
                return Opening::Foreign;
            }
            if bytes.len() < TLS_HEADER {
                return Opening::Partial { want: TLS_HEADER };
            }
            let len = usize::from(u16::from_be_bytes([bytes[3], bytes[4]]));
            if len == 0 || len > TLS_MAX_RECORD {
                return Opening::Foreign;
            }
            if bytes.len() >= TLS_HEADER + len {
                Opening::Sent
            } else {
                Opening::Partial {
                    want: TLS_HEADER + len,
                }
            }
        }
        Some(_) => {
            let n = bytes.len().min(PREFACE.len());
            if bytes[..n] != PREFACE[..n] {
                Opening::Foreign
            } else if n == PREFACE.len() {
                Opening::Sent
            } else {
                Opening::Partial {
                    want: PREFACE.len(),
                }
            }
        }
    }
}

/// Waits, without consuming a byte, until `io` has sent its whole opening: `false` when it
/// closed or sent something else.
async fn opening_sent(io: &TcpStream) -> bool {
    let mut buf = vec![0u8; PREFACE.len()];
    loop {
        let n = match io.peek(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        match opening(&buf[..n]) {
            Opening::Sent => return true,
            Opening::Foreign => return false,
            Opening::Partial { want } => {
                if want > buf.len() {
                    buf.resize(want, 0);
                } else {
                    tokio::time::sleep(OPENING_POLL).await;
                }
            }
        }
    }
}

/// Longest pause after an accept error (out of file descriptors, for one).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Accepts connections until the returned stream is dropped. At a cap it sheds (crate::sockets):
/// the connection with no call in flight that has waited longest is closed to make room; with every one busy it
/// waits for one to close; a peer whose every connection is busy (or within the shed grace) has its
/// new one wait for room off the loop (see crate::sockets). After an
/// accept error it pauses, doubling up to a second, instead of retrying at once.
pub fn incoming(
    listener: TcpListener,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
) -> ReceiverStream<Result<Conn, io::Error>> {
    let (tx, rx) = mpsc::channel(1);
    let sockets = Sockets::new(Caps {
        total: limits.max_connections,
        per_peer: limits.max_per_peer,
        grace: limits.shed_grace,
    });
    // The server's own accept loop, not a lifecycle task: tonic owns the stream it feeds,
    // and dropping it when the server stops ends this loop (`tx.closed`).
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(5);
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (io, remote) = match accepted {
                Ok(a) => {
                    backoff = Duration::from_millis(5);
                    a
                }
                Err(e) => {
                    tracing::warn!(error = %e, pause_ms = backoff.as_millis() as u64, "accepting a connection failed; pausing");
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                    continue;
                }
            };
            let held = loop {
                match sockets.admit(remote.ip()) {
                    Admission::In { held, shed } => {
                        note_shed(&metrics, shed);
                        break Some(held);
                    }
                    Admission::PeerBusy => break None,
                    Admission::Full => {
                        let closed = sockets.closed.notified();
                        tokio::select! {
                            _ = tx.closed() => return,
                            _ = closed => {}
                            _ = tokio::time::sleep(ROOM_POLL) => {}
                        }
                    }
                }
            };
            let Some(held) = held else {
                // Every connection of the peer is busy or within its grace: wait for room
                // off the accept loop, so other peers are not held up.
                let Some((turn, dropped)) = sockets.wait_turn(remote.ip()) else {
                    metrics.socket_shed("grpc", "peer_busy");
                    tracing::debug!(%remote, "connection refused: as many connections as the cap wait for room");
                    continue;
                };
                if dropped {
                    metrics.socket_shed("grpc", "peer_busy");
                }
                // A connection's own wait for room, ended by its deadline or when the server
                // stops taking (`tx.closed`): tonic's, like the accept loop.
                tokio::spawn(wait_for_room(
                    io,
                    remote,
                    turn,
                    sockets.clone(),
                    limits,
                    metrics.clone(),
                    tx.clone(),
                ));
                continue;
            };
            if tx
                .send(Ok(conn_of(io, remote, held, limits)))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_opening_is_sent_only_whole() {
        assert_eq!(opening(PREFACE), Opening::Sent);
        assert_eq!(opening(&[PREFACE, b"\0\0\x12\x04"].concat()), Opening::Sent);
        assert_eq!(
            opening(b"PRI * HTTP/2.0\r\n"),
            Opening::Partial { want: 24 }
        );
        assert_eq!(opening(&PREFACE[..23]), Opening::Partial { want: 24 });
        assert_eq!(opening(b"GET / HTTP/1.1\r\n"), Opening::Foreign);
        assert_eq!(
            opening(b"PRI * HTTP/1.1\r\n\r\nSM\r\n\r\n"),
            Opening::Foreign
        );
        // A TLS handshake record of 512 bytes: whole at 517, a prefix before.
        let mut hello = vec![0x16, 0x03, 0x01, 0x02, 0x00];
        assert_eq!(opening(&hello[..4]), Opening::Partial { want: 5 });
        assert_eq!(opening(&hello), Opening::Partial { want: 517 });
        hello.resize(516, 1);
        assert_eq!(opening(&hello), Opening::Partial { want: 517 });
        hello.push(1);
        assert_eq!(opening(&hello), Opening::Sent);
        assert_eq!(opening(&[0x16, 0x02]), Opening::Foreign);
        assert_eq!(opening(&[0x16, 0x03, 0x01, 0x00, 0x00]), Opening::Foreign);
        assert_eq!(opening(&[0x16, 0x03, 0x01, 0x40, 0x01]), Opening::Foreign);
    }
}
