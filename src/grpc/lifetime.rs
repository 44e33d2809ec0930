//! A long-lived response stream that can be ended from outside its body: at its credential's expiry (a JWT's `exp` plus the leeway, a client certificate's notAfter) with UNAUTHENTICATED, or when it is shed to make room.
//!
//! Every new call is authenticated afresh, but a stream is authenticated once, when it opens.
//! Without a bound a caller whose token has expired (or been left to expire) would keep what
//! that token gave it for as long as the connection lasts. The end is not a check made when
//! the body is next polled: HTTP/2 polls a body only while the client's window has room, so a
//! client that never reads would never be ended. A timer task (or the stream registry, when it
//! sheds) ends it instead: the inner stream — and what it holds, a watch's slot and its task,
//! a producer's tasks — is dropped at once, and the client is sent, when it next reads, what
//! HTTP/2 had already taken before the end and then the end's status. Nothing the inner stream
//! makes after the end is sent.
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body::{Frame, SizeHint};
use tokio::sync::oneshot;
use tonic::codegen::Bytes;
use tonic::Status;

use crate::error::Error;

/// What the caller of a stream that outlived its credential is told.
pub const EXPIRED: &str =
    "credentials expired: open a new stream with fresh ones (a watch resumes from the last resume_token)";

/// What a stream holds besides its body, given back when the stream ends (a registry slot).
pub type Held = Box<dyn Send>;

struct State {
    inner: Option<tonic::body::Body>,
    /// The end's status, once ended from outside, until it is sent.
    end: Option<Status>,
    /// The inner body has sent its end, or the end's status is sent.
    over: bool,
    waker: Option<Waker>,
    held: Option<Held>,
}

/// One side of a long-lived stream that ends it from outside.
#[derive(Clone)]
pub struct Ender(Weak<Mutex<State>>);

impl std::fmt::Debug for Ender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ender")
    }
}

fn lock(s: &Mutex<State>) -> MutexGuard<'_, State> {
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ender {
    /// Ends the stream with `status` (unless it has ended): its inner stream and what it holds
    /// are dropped now; the status goes out when the client reads. False if it had ended.
    pub fn end(&self, status: Status) -> bool {
        let Some(state) = self.0.upgrade() else {
            return false;
        };
        let mut s = lock(&state);
        if s.over || s.end.is_some() {
            return false;
        }
        s.end = Some(status);
        let inner = s.inner.take();
        let held = s.held.take();
        let waker = s.waker.take();
        drop(s);
        // Dropped outside the lock: what they hold may take other locks.
        drop(inner);
        drop(held);
        if let Some(w) = waker {
            w.wake();
        }
        true
    }
}

/// A response body that can be ended by its [`Ender`] (and by its credential's expiry).
pub struct Endable {
    state: Arc<Mutex<State>>,
    /// Dropped with the body: the expiry task, if any, stops.
    _stop: Option<oneshot::Sender<()>>,
}

impl Endable {
    /// `inner`, ended at `expires` (Unix seconds) at the latest when given (this spawns a
    /// timer task, so it must run on a Tokio runtime).
    pub fn new(inner: tonic::body::Body, expires: Option<i64>) -> (Endable, Ender) {
        let state = Arc::new(Mutex::new(State {
            inner: Some(inner),
            end: None,
            over: false,
            waker: None,
            held: None,
        }));
        let ender = Ender(Arc::downgrade(&state));
        let stop = expires.map(|at| {
            let (stop, stopped) = oneshot::channel::<()>();
            let ender = ender.clone();
            let wait = until(at);
            // The call's own timer, ended with the call (`stop`), not a lifecycle task.
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {
                        ender.end(Status::from(Error::Unauthenticated(EXPIRED.into())));
                    }
                    _ = stopped => {}
                }
            });
            stop
        });
        (Endable { state, _stop: stop }, ender)
    }
}

impl Endable {
    /// Holds `held` until the stream ends (at once if it has).
    pub fn hold(&self, held: Held) {
        let mut s = lock(&self.state);
        if s.over || s.end.is_some() || s.inner.is_none() {
            drop(s);
            drop(held);
            return;
        }
        s.held = Some(held);
    }
}

/// From now until `expires` (Unix seconds); zero if it has passed.
fn until(expires: i64) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Duration::from_secs(u64::try_from(expires).unwrap_or(0)).saturating_sub(now)
}

impl http_body::Body for Endable {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut s = lock(&self.state);
        if s.over {
            return Poll::Ready(None);
        }
        if let Some(status) = s.end.take() {
            s.over = true;
            let mut trailers = http::HeaderMap::new();
            return Poll::Ready(Some(match status.add_header(&mut trailers) {
                Ok(()) => Ok(Frame::trailers(trailers)),
                Err(e) => Err(e),
            }));
        }
        s.waker = Some(cx.waker().clone());
        let Some(inner) = s.inner.as_mut() else {
            s.over = true;
            return Poll::Ready(None);
        };
        let frame = std::task::ready!(Pin::new(inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) if f.is_data() => {}
            // Trailers, an error or the end: the inner stream is over, and what it held goes.
            _ => {
                s.over = true;
                let inner = s.inner.take();
                let held = s.held.take();
                drop(s);
                drop(inner);
                drop(held);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        let s = lock(&self.state);
        s.over || (s.end.is_none() && s.inner.as_ref().is_some_and(|b| b.is_end_stream()))
    }

    fn size_hint(&self) -> SizeHint {
        let s = lock(&self.state);
        match (&s.inner, s.over || s.end.is_some()) {
            (Some(b), false) => b.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    struct Flag(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn an_expired_stream_drops_what_it_holds_without_being_polled_then_says_unauthenticated()
    {
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        // A body that never ends by itself, expiring in about a second.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(1);
        let inner = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        let (mut body, _ender) =
            Endable::new(inner, Some(i64::try_from(now + 1).unwrap_or(i64::MAX)));
        body.hold(Box::new(Flag(released.clone())));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !released.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(tokio::time::Instant::now() < deadline, "never released");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(tx.is_closed(), "the inner stream is dropped at expiry");
        let frame = body.frame().await.expect("a frame").expect("trailers");
        let trailers = frame.into_trailers().expect("trailers");
        assert_eq!(
            trailers.get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"16"[..])
        );
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn an_ender_ends_once_and_not_after_the_inner_end() {
        let (body, ender) = Endable::new(tonic::body::Body::empty(), None);
        drop(body);
        assert!(
            !ender.end(Status::from(Error::Unavailable("x".into()))),
            "nothing left to end"
        );
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(1);
        let inner = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        let (mut body, ender) = Endable::new(inner, None);
        assert!(ender.end(Status::from(Error::Unavailable("shed".into()))));
        assert!(!ender.end(Status::from(Error::Unavailable("again".into()))));
        assert!(tx.is_closed());
        let trailers = body
            .frame()
            .await
            .expect("a frame")
            .expect("trailers")
            .into_trailers()
            .expect("trailers");
        assert_eq!(
            trailers.get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"14"[..])
        );
    }
}
