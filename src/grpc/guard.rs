//! The authentication and authorization layer: every call is authenticated (failed signatures bounded per address, never valid ones), checked against its method's roles, rate limited per caller, and its answer stream bounded by the caller's credential.
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::transport::server::TlsConnectInfo;
use tonic::Status;

use super::calls::BoxFuture;
use super::conn::ConnInfo;
use super::lifetime::UntilExpiry;
use crate::auth::{allowed, is_open, Authenticator, CalledMethod, Caller, Precheck, Unverified};
use crate::error::Error;
use crate::metrics::Metrics;

/// What a caller past its rate limit is told.
pub const RATE_LIMITED: &str = "rate limit for this caller exceeded; retry later";

/// Signature checks running at once, in all, for callers whose address is past its budget of
/// failed authentications: whatever such addresses send, their signatures cost at most this
/// many cores.
pub const OVER_BUDGET_CHECKS: usize = 1;

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
}

impl GuardLayer {
    /// `rate_per_sec` 0 means no rate limit; `failures_per_sec` 0 means failed
    /// authentications never slow an address down.
    pub fn new(
        auth: Arc<Authenticator>,
        rate_per_sec: f64,
        failures_per_sec: f64,
        metrics: Arc<Metrics>,
    ) -> GuardLayer {
        GuardLayer {
            auth,
            limiter: Arc::new(RateLimiter::new(rate_per_sec)),
            failures: Arc::new(RateLimiter::new(failures_per_sec)),
            over_budget: Arc::new(Semaphore::new(OVER_BUDGET_CHECKS)),
            metrics,
            streaming: Arc::new(super::layer::streaming_methods()),
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
    /// Takes a token; false when the caller's bucket is empty.
    pub fn allow(&self) -> bool {
        self.limiter.allow(&self.bucket)
    }
}

/// Token buckets per caller: `rate` calls a second, bursts of twice that.
#[derive(Debug)]
struct RateLimiter {
    rate: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl RateLimiter {
    fn new(rate: f64) -> RateLimiter {
        RateLimiter {
            rate,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn is_on(&self) -> bool {
        self.rate > 0.0
    }

    /// Takes one token from `who`'s bucket; false when it is empty.
    fn allow(&self, who: &str) -> bool {
        self.take(who, true)
    }

    /// Whether `who`'s bucket has a token, without taking it.
    fn has_token(&self, who: &str) -> bool {
        self.take(who, false)
    }

    fn take(&self, who: &str, consume: bool) -> bool {
        if self.rate <= 0.0 {
            return true;
        }
        let Ok(mut b) = self.buckets.lock() else {
            return true;
        };
        let now = Instant::now();
        let burst = self.rate * 2.0;
        if b.len() > 100_000 {
            // Forget idle callers rather than grow without bound.
            b.retain(|_, (_, t)| now.duration_since(*t).as_secs() < 60);
        }
        let (tokens, last) = b.entry(who.to_owned()).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * self.rate).min(burst);
        *last = now;
        if *tokens >= 1.0 {
            if consume {
                *tokens -= 1.0;
            }
            true
        } else {
            false
        }
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
        if is_open(&path) {
            // Health and reflection need no credentials, so none are read: a JWT sent to
            // them costs no signature check, and their streams are not bounded by one.
            req.extensions_mut().insert(CalledMethod(path));
            return Box::pin(inner.call(req));
        }
        let conn = ConnInfo::of(req.extensions());
        let peer: Arc<str> = conn.map_or_else(|| Arc::from("peer:unknown"), |c| c.peer);
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
                if !layer.limiter.allow(&bucket) {
                    return Ok(
                        Status::from(Error::ResourceExhausted(RATE_LIMITED.into())).into_http()
                    );
                }
                req.extensions_mut().insert(CallerBucket {
                    limiter: layer.limiter.clone(),
                    bucket,
                });
            }
            let expires = match &caller {
                Caller::Known(id) if layer.streaming.contains(&path) => id.expires,
                _ => None,
            };
            req.extensions_mut().insert(caller);
            req.extensions_mut().insert(CalledMethod(path));
            let answer = inner.call(req).await?;
            Ok(match expires {
                Some(at) => answer.map(|body| tonic::body::Body::new(UntilExpiry::new(body, at))),
                None => answer,
            })
        })
    }
}
