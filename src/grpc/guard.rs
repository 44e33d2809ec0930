//! The authentication and authorization layer: every call is authenticated (failed signatures bounded per address, never valid ones), checked against its method's roles, rate limited per caller, and its answer stream bounded by the caller's credential.
use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use governor::Quota;

use tokio::sync::Semaphore;
use tonic::transport::server::TlsConnectInfo;
use tonic::Status;

use super::calls::BoxFuture;
use super::conn::ConnInfo;
use super::lifetime::Endable;
use super::streams::{Kind, StreamSlot, Streams};
use crate::auth::{allowed, is_open, Authenticator, CalledMethod, Caller, Precheck, Unverified};
use crate::error::Error;
use crate::metrics::Metrics;

/// What a caller past its rate limit is told.
pub const RATE_LIMITED: &str = "rate limit for this caller exceeded; retry later";

/// The refusal of a call past its caller's rate limit: RESOURCE_EXHAUSTED with RetryInfo
/// (when the bucket has a token again, at least a millisecond) and ErrorInfo `RATE_LIMITED`,
/// so a client backs off by what it is told rather than at once.
pub fn rate_limited(wait: std::time::Duration) -> Error {
    Error::Throttled {
        message: RATE_LIMITED.into(),
        retry_after: wait.max(std::time::Duration::from_millis(1)),
        reason: "RATE_LIMITED",
    }
}

/// Signature checks running at once, in all, for callers whose address is past its budget of
/// failed authentications: whatever such addresses send, their signatures cost at most this
/// many cores.
pub const OVER_BUDGET_CHECKS: usize = 1;

/// Marks a call the server's own MCP door made in process (crate::mcp): it crossed no
/// socket, so nothing a client sends can set it. Its stream counts in the total alone.
#[derive(Clone, Copy, Debug)]
pub struct OwnCall;

/// The address an in-process call's own client came from (the JSON door's HTTP peer,
/// `peer:<ip>`): its failed authentications are budgeted as that address's, not as one
/// shared door's. Set only in process, like OwnCall.
#[derive(Clone, Debug)]
pub struct DoorPeer {
    pub key: Arc<str>,
    pub ip: std::net::IpAddr,
}

#[derive(Clone, Debug)]
pub struct GuardLayer {
    auth: Arc<Authenticator>,
    limiter: Arc<RateLimiter>,
    /// Failed authentications per peer address: an address past it has its signatures
    /// checked one at a time with every other such address, never refused unheard.
    failures: Arc<RateLimiter>,
    /// OVER_BUDGET_CHECKS permits, waited for in turn.
    over_budget: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    /// Methods that answer with a stream: it ends when the caller's credential does.
    streaming: Arc<HashSet<String>>,
    /// Long-lived streams, capped per peer and in all.
    streams: Arc<Streams>,
}

impl GuardLayer {
    /// `rate_per_sec` 0 means no rate limit; `failures_per_sec` 0 means failed
    /// authentications never slow an address down.
    pub fn new(
        auth: Arc<Authenticator>,
        rate_per_sec: f64,
        failures_per_sec: f64,
        metrics: Arc<Metrics>,
        streams: Arc<Streams>,
    ) -> GuardLayer {
        GuardLayer {
            auth,
            limiter: Arc::new(RateLimiter::new(rate_per_sec)),
            failures: Arc::new(RateLimiter::peekable(failures_per_sec)),
            over_budget: Arc::new(Semaphore::new(OVER_BUDGET_CHECKS)),
            metrics,
            streaming: Arc::new(super::layer::streaming_methods()),
            streams,
        }
    }

    /// Checks a JWT's signature. An address within its budget of failed authentications has
    /// it checked at once; past it, the check waits its turn for one of OVER_BUDGET_CHECKS
    /// permits (first come, first served) — so guesses from an address shared by many callers
    /// (a load balancer, a NAT, a sidecar) cost bounded CPU, and a valid credential from the
    /// same address is still accepted, within the call's deadline.
    async fn verify(&self, jwt: Unverified, peer: &str) -> Caller {
        let (budget, _permit) = if self.failures.has_token(peer) {
            ("within", None)
        } else {
            ("over", self.over_budget.acquire().await.ok())
        };
        let started = Instant::now();
        let caller = self.auth.verify(jwt);
        self.metrics.signature_checked(budget, started.elapsed());
        caller
    }
}

impl<S> tower::Layer<S> for GuardLayer {
    type Service = Guard<S>;
    fn layer(&self, inner: S) -> Guard<S> {
        Guard {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Guard<S> {
    inner: S,
    layer: GuardLayer,
}

/// A caller's rate-limit bucket, handed to a call that carries many items (DeliverTriggers)
/// so each item after the first takes a token of its own, as a call would.
#[derive(Clone, Debug)]
pub struct CallerBucket {
    limiter: Arc<RateLimiter>,
    bucket: String,
}

impl CallerBucket {
    /// Takes a token; when none is left, the refusal to answer with (its retry delay).
    pub fn take(&self) -> Result<(), Error> {
        self.limiter.take(&self.bucket).map_err(rate_limited)
    }
}

/// Token buckets per key (a caller, an address): `rate` a second, bursts of twice that, on
/// `governor`'s keyed limiter. It answers "take one"; the failure budget also asks "is one
/// left" without taking it, which `governor` does not answer, so each take also notes when a
/// key is left with none and until when.
#[derive(Debug)]
struct RateLimiter {
    /// None when the rate is 0 (no limit).
    buckets: Option<Buckets>,
}

#[derive(Debug)]
struct Buckets {
    limiter: governor::RateLimiter<
        String,
        governor::state::keyed::DefaultKeyedStateStore<String>,
        governor::clock::DefaultClock,
        governor::middleware::StateInformationMiddleware,
    >,
    /// How long one token takes to come back.
    per_token: Duration,
    /// Takes so far: the key count is looked at every FORGET_EVERY of them, not on each
    /// call (counting walks every shard of the limiter's map).
    takes: AtomicU64,
    /// For a limiter asked "is one left": keys whose last take left their bucket empty, and
    /// when the next token is due.
    empty: Option<Mutex<HashMap<String, Instant>>>,
}

/// Keys the limiter keeps before it forgets those whose buckets are full again.
const MAX_KEYS: usize = 100_000;
/// Takes between two looks at the number of keys.
const FORGET_EVERY: u64 = 1024;

impl RateLimiter {
    fn new(rate: f64) -> RateLimiter {
        RateLimiter::with(rate, false)
    }

    /// A limiter that also answers `has_token`.
    fn peekable(rate: f64) -> RateLimiter {
        RateLimiter::with(rate, true)
    }

    fn with(rate: f64, peekable: bool) -> RateLimiter {
        let buckets = (rate > 0.0 && rate.is_finite()).then(|| {
            let per_token = Duration::from_secs_f64(1.0 / rate).max(Duration::from_nanos(1));
            let burst = NonZeroU32::new((rate * 2.0).clamp(1.0, f64::from(u32::MAX)) as u32)
                .unwrap_or(NonZeroU32::MIN);
            let quota = Quota::with_period(per_token)
                .unwrap_or_else(|| Quota::per_second(NonZeroU32::MAX))
                .allow_burst(burst);
            Buckets {
                limiter: governor::RateLimiter::keyed(quota).with_middleware(),
                per_token,
                takes: AtomicU64::new(0),
                empty: peekable.then(|| Mutex::new(HashMap::new())),
            }
        });
        RateLimiter { buckets }
    }

    fn is_on(&self) -> bool {
        self.buckets.is_some()
    }

    /// Takes one token from `who`'s bucket; false when it is empty.
    fn allow(&self, who: &str) -> bool {
        self.take(who).is_ok()
    }

    /// Takes one token from `who`'s bucket; when it is empty, how long until it has one.
    fn take(&self, who: &str) -> Result<(), std::time::Duration> {
        use governor::clock::Clock;
        let Some(b) = &self.buckets else {
            return Ok(());
        };
        let takes = b.takes.fetch_add(1, Ordering::Relaxed);
        if takes % FORGET_EVERY == FORGET_EVERY - 1 && b.limiter.len() > MAX_KEYS {
            // Forget callers whose buckets are full again rather than grow without bound.
            b.limiter.retain_recent();
            b.limiter.shrink_to_fit();
        }
        let key = who.to_owned();
        let (took, left) = match b.limiter.check_key(&key) {
            Ok(snapshot) => (Ok(()), snapshot.remaining_burst_capacity()),
            Err(not_until) => (Err(not_until.wait_time_from(b.limiter.clock().now())), 0),
        };
        let Some(empty) = &b.empty else {
            return took;
        };
        let now = Instant::now();
        let mut empty = empty
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if left > 0 {
            empty.remove(&key);
        } else {
            if empty.len() > MAX_KEYS {
                empty.retain(|_, due| *due > now);
            }
            empty.insert(key, now + b.per_token);
        }
        took
    }

    /// Whether `who`'s bucket has a token, without taking it.
    fn has_token(&self, who: &str) -> bool {
        let Some(b) = &self.buckets else {
            return true;
        };
        let Some(empty) = &b.empty else {
            return true;
        };
        let empty = empty
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        empty.get(who).is_none_or(|due| *due <= Instant::now())
    }
}

impl<S, B> tower::Service<http::Request<B>> for Guard<S>
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

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_owned();
        // The service that was made ready is the one that must be called.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let conn = ConnInfo::of(req.extensions());
        let socket_peer = conn.as_ref().map(|c| c.state.peer());
        let own = req.extensions().get::<OwnCall>().is_some();
        let door_peer = req.extensions().get::<DoorPeer>().map(|p| p.ip);
        if is_open(&path) {
            // Health and reflection need no credentials, so none are read: a JWT sent to
            // them costs no signature check, and their streams are not bounded by one. Their
            // streams count against the stream caps, and are the first to go.
            let slot = match Kind::of(&path).map(|k| self.layer.streams.admit(socket_peer, k)) {
                Some(Err(e)) => return super::calls::answer(e),
                Some(Ok(slot)) => Some(slot),
                None => None,
            };
            req.extensions_mut().insert(CalledMethod(path));
            return Box::pin(async move {
                let answer = inner.call(req).await?;
                Ok(match slot {
                    Some(slot) => bounded(answer, slot, None),
                    None => answer,
                })
            });
        }
        let peer: Arc<str> = conn.map_or_else(
            || {
                req.extensions().get::<DoorPeer>().map_or_else(
                    || Arc::from(if own { "peer:mcp-door" } else { "peer:unknown" }),
                    |p| p.key.clone(),
                )
            },
            |c| c.peer,
        );
        let header = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(|v| v.to_str().unwrap_or(""));
        let mut check = self.layer.auth.precheck(header);
        if header.is_none() {
            // No bearer credentials: a client certificate verified by TLS may name the caller.
            let cert = req
                .extensions()
                .get::<TlsConnectInfo<ConnInfo>>()
                .and_then(|i| i.peer_certs())
                .and_then(|certs| certs.first().map(|c| self.layer.auth.check_certificate(c)));
            if let Some(c) = cert {
                check = Precheck::Decided(c);
            }
        }
        let layer = self.layer.clone();
        Box::pin(async move {
            let caller = match check {
                Precheck::Decided(caller) => caller,
                Precheck::Signature(jwt) => layer.verify(jwt, &peer).await,
            };
            let refusal = match &caller {
                Caller::Open => None,
                Caller::Refused(why) => {
                    tracing::debug!(method = %path, %peer, why = why.detail(), "authentication refused");
                    layer.failures.allow(&peer);
                    Some(Error::Unauthenticated(why.public_message().to_owned()))
                }
                Caller::Known(id) if !allowed(&path, id.role) => Some(Error::PermissionDenied(
                    format!("role {:?} may not call {path}", id.role),
                )),
                Caller::Known(_) => None,
            };
            if let Some(e) = refusal {
                return Ok(Status::from(e).into_http());
            }
            // Buckets are per credential (kind and name); unauthenticated servers limit per address.
            if layer.limiter.is_on() {
                let bucket = match &caller {
                    Caller::Known(id) => id.bucket(),
                    _ => peer.to_string(),
                };
                if let Err(wait) = layer.limiter.take(&bucket) {
                    return Ok(Status::from(rate_limited(wait)).into_http());
                }
                req.extensions_mut().insert(CallerBucket {
                    limiter: layer.limiter.clone(),
                    bucket,
                });
            }
            let stream = layer.streaming.contains(&path);
            let expires = match &caller {
                Caller::Known(id) if stream => id.expires,
                _ => None,
            };
            let slot = if stream {
                // A door's client with an address of its own is capped as that peer (the
                // JSON door's); the MCP door's subscriptions in the total alone.
                let admitted = match (own, door_peer) {
                    (true, Some(ip)) => layer
                        .streams
                        .admit(Some(crate::sockets::Peer::of(ip)), Kind::Authenticated),
                    (true, None) => layer.streams.admit_own(),
                    (false, _) => layer.streams.admit(socket_peer, Kind::Authenticated),
                };
                match admitted {
                    Ok(slot) => Some(slot),
                    Err(e) => return Ok(Status::from(e).into_http()),
                }
            } else {
                None
            };
            req.extensions_mut().insert(caller);
            req.extensions_mut().insert(CalledMethod(path));
            let answer = inner.call(req).await?;
            Ok(match slot {
                Some(slot) => bounded(answer, slot, expires),
                None => answer,
            })
        })
    }
}

/// A long-lived stream's answer, holding its slot until it ends, ended when it is shed or
/// at `expires` (its credential's end).
fn bounded(
    answer: http::Response<tonic::body::Body>,
    slot: StreamSlot,
    expires: Option<i64>,
) -> http::Response<tonic::body::Body> {
    answer.map(|body| {
        let (body, ender) = Endable::new(body, expires);
        slot.set_ender(ender);
        body.hold(Box::new(slot));
        tonic::body::Body::new(body)
    })
}

#[cfg(test)]
mod tests {
    use super::RateLimiter;

    #[test]
    fn a_bucket_holds_twice_the_rate_and_each_key_its_own() {
        let l = RateLimiter::new(2.0);
        assert!(l.is_on());
        for i in 0..4 {
            assert!(l.allow("a"), "take {i} of the burst of 4");
        }
        assert!(!l.allow("a"), "the fifth is refused");
        assert!(l.allow("b"), "another key has its own bucket");
        assert!(!RateLimiter::new(0.0).is_on(), "0 is no limit");
        assert!(RateLimiter::new(0.0).allow("a"));
    }

    #[test]
    fn has_token_says_whether_a_take_would_pass_without_taking() {
        let l = RateLimiter::peekable(1.0);
        assert!(l.has_token("peer"), "a key never seen");
        assert!(l.allow("peer"));
        assert!(l.has_token("peer"), "one of the burst of 2 left");
        assert!(l.has_token("peer"), "asking took nothing");
        assert!(l.allow("peer"));
        assert!(!l.has_token("peer"), "the burst spent");
        assert!(!l.allow("peer"));
        std::thread::sleep(std::time::Duration::from_millis(1_050));
        assert!(l.has_token("peer"), "a token back after a second");
        assert!(l.allow("peer"));
        assert!(!l.has_token("peer"), "and spent again");
    }
}
