//! A response stream lives no longer than the credential that opened it: at a JWT's `exp` plus the leeway, or a client certificate's notAfter, it ends UNAUTHENTICATED.
//!
//! Every new call is authenticated afresh, but a stream is authenticated once, when it opens.
//! Without a bound a caller whose token has expired (or been left to expire) would keep what
//! that token gave it for as long as the connection lasts. The bound is a timer, not a check
//! on the next message, so a stream with nothing to send ends on time too, and what it holds
//! (a watch, a producer's tasks) is released then.
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body::{Frame, SizeHint};
use tokio::time::Sleep;
use tonic::codegen::Bytes;
use tonic::Status;

use crate::error::Error;

/// What the caller of a stream that outlived its credential is told.
pub const EXPIRED: &str =
    "credentials expired: open a new stream with fresh ones (a watch resumes from the last resume_token)";

/// A response body that ends with UNAUTHENTICATED at `expires`, unless it ended before.
pub struct UntilExpiry {
    inner: tonic::body::Body,
    timer: Pin<Box<Sleep>>,
    /// The inner body has sent its end (trailers or none), or the expiry's status is sent.
    ended: bool,
}

impl UntilExpiry {
    /// `inner`, ended at `expires` (Unix seconds) at the latest.
    pub fn new(inner: tonic::body::Body, expires: i64) -> UntilExpiry {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let at = Duration::from_secs(u64::try_from(expires).unwrap_or(0));
        UntilExpiry {
            inner,
            timer: Box::pin(tokio::time::sleep(at.saturating_sub(now))),
            ended: false,
        }
    }
}

impl http_body::Body for UntilExpiry {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        // The timer first: once the credential has expired, nothing more of the inner
        // stream goes out, even a message that is ready.
        if this.timer.as_mut().poll(cx).is_ready() {
            this.ended = true;
            // Dropping the inner body now releases what the stream holds.
            this.inner = tonic::body::Body::empty();
            let mut trailers = http::HeaderMap::new();
            return Poll::Ready(Some(
                match Status::from(Error::Unauthenticated(EXPIRED.into())).add_header(&mut trailers)
                {
                    Ok(()) => Ok(Frame::trailers(trailers)),
                    Err(e) => Err(e),
                },
            ));
        }
        let frame = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) if f.is_data() => {}
            // Trailers, an error or the end: the inner stream is over, and so is the timer.
            _ => this.ended = true,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.ended {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}
