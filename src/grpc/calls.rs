//! Per-call rules at the edge: a call keeps its connection busy until its answer ends (an unauthenticated long-lived stream keeps it open but not busy), health Watch streams are bounded, and every call is answered before its deadline.
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;

use super::conn::{ConnInfo, InFlight};
use crate::error::Error;

/// Bounds on health Watch streams, which any caller may open without credentials.
#[derive(Debug, Clone, Copy)]
pub struct HealthWatchLimits {
    pub per_connection: usize,
    pub total: usize,
}

#[derive(Clone, Debug)]
pub struct CallLayer {
    watch: HealthWatchLimits,
    watches: Arc<AtomicUsize>,
    /// The server's own bound on a call; a caller's `grpc-timeout` may shorten it.
    request_timeout: Duration,
}

impl CallLayer {
    pub fn new(watch: HealthWatchLimits, request_timeout: Duration) -> CallLayer {
        CallLayer {
            watch,
            watches: Arc::new(AtomicUsize::new(0)),
            request_timeout,
        }
    }
}

impl<S> tower::Layer<S> for CallLayer {
    type Service = Calls<S>;
    fn layer(&self, inner: S) -> Calls<S> {
        Calls {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Calls<S> {
    inner: S,
    layer: CallLayer,
}

const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

/// Reads a `grpc-timeout` header: up to eight digits and a unit (H, M, S, m, u, n).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// When to give up on a call that has `budget` in all: early enough that the answer
/// (UNAVAILABLE, which producers retry) reaches the caller before its own deadline does.
pub fn answer_within(budget: Duration) -> Duration {
    budget.saturating_sub((budget / 10).min(Duration::from_millis(500)))
}

/// Holds a connection busy, and a Watch slot, until the answer's body is finished or dropped.
struct Tracked {
    inner: tonic::body::Body,
    _in_flight: Option<InFlight>,
    _watch: Option<WatchSlot>,
}

impl http_body::Body for Tracked {
    type Data = tonic::codegen::Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// One open Watch stream, counted on its connection and in the process.
struct WatchSlot {
    total: Arc<AtomicUsize>,
    conn: Option<ConnInfo>,
    /// Whether `total` counts this slot.
    counted: bool,
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        if self.counted {
            self.total.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(c) = &self.conn {
            c.state.watches.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl WatchSlot {
    /// A slot for one more Watch stream on this connection, within both bounds.
    fn take(layer: &CallLayer, conn: Option<ConnInfo>) -> Result<WatchSlot, Error> {
        let limits = layer.watch;
        if let Some(c) = &conn {
            if !take(&c.state.watches, limits.per_connection) {
                return Err(Error::ResourceExhausted(format!(
                    "at most {} health Watch streams per connection",
                    limits.per_connection
                )));
            }
        }
        // From here the slot exists: dropping it gives back what it holds.
        let mut slot = WatchSlot {
            total: layer.watches.clone(),
            conn,
            counted: false,
        };
        if !take(&layer.watches, limits.total) {
            return Err(Error::ResourceExhausted(format!(
                "at most {} health Watch streams in all; retry later",
                limits.total
            )));
        }
        slot.counted = true;
        Ok(slot)
    }
}

fn take(counter: &AtomicUsize, max: usize) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

pub(super) type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Answers a call with an error at once, without reaching the service.
pub(super) fn answer<E>(e: Error) -> BoxFuture<http::Response<tonic::body::Body>, E> {
    let status = Status::from(e);
    Box::pin(async move { Ok(status.into_http()) })
}

impl<S, B> tower::Service<http::Request<B>> for Calls<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let conn = ConnInfo::of(req.extensions());
        // An unauthenticated long-lived stream keeps its connection open but not busy: a
        // connection whose only work is one may be shed (crate::sockets).
        let open_stream = super::streams::Kind::of(req.uri().path()).is_some();
        let in_flight = conn.as_ref().map(|c| {
            if open_stream {
                c.state.begin_stream()
            } else {
                c.state.begin()
            }
        });
        let watch = if req.uri().path() == HEALTH_WATCH {
            match WatchSlot::take(&self.layer, conn) {
                Ok(slot) => Some(slot),
                Err(e) => return answer(e),
            }
        } else {
            None
        };
        let budget = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map_or(self.layer.request_timeout, |t| {
                t.min(self.layer.request_timeout)
            });
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            // The answer's head must come before the deadline; a stream's body may go on.
            let head = match tokio::time::timeout(answer_within(budget), inner.call(req)).await {
                Ok(r) => r?,
                Err(_) => Status::from(Error::Unavailable(format!(
                    "no answer within {} ms: the request was not received whole in that time, or the store is busy or unreachable; retry",
                    answer_within(budget).as_millis()
                )))
                .into_http(),
            };
            Ok(head.map(|inner| {
                if in_flight.is_none() && watch.is_none() {
                    return inner;
                }
                tonic::body::Body::new(Tracked {
                    inner,
                    _in_flight: in_flight,
                    _watch: watch,
                })
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_is_read_by_its_unit_and_bounded() {
        assert_eq!(parse_grpc_timeout("8S"), Some(Duration::from_secs(8)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "123456789S", "1x", "-1S", "1.5S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
        assert_eq!(
            answer_within(Duration::from_secs(8)),
            Duration::from_millis(7500)
        );
        assert_eq!(
            answer_within(Duration::from_secs(1)),
            Duration::from_millis(900)
        );
    }
}
