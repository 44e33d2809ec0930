//! The authentication and authorization layer: every call is authenticated, checked against its method's roles, and rate limited per caller.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::transport::server::TlsConnectInfo;

use super::calls::{answer, BoxFuture};
use super::conn::ConnInfo;
use crate::auth::{allowed, is_open, Authenticator, CalledMethod, Caller};
use crate::error::Error;

/// What a caller past its rate limit is told.
pub const RATE_LIMITED: &str = "rate limit for this caller exceeded; retry later";

#[derive(Clone, Debug)]
pub struct GuardLayer {
    auth: Arc<Authenticator>,
    limiter: Arc<RateLimiter>,
    /// Failed authentications per peer address; an address past it is refused unheard.
    failures: Arc<RateLimiter>,
}

impl GuardLayer {
    /// `rate_per_sec` 0 means no rate limit; `failures_per_sec` 0 means failed
    /// authentications are not limited.
    pub fn new(auth: Arc<Authenticator>, rate_per_sec: f64, failures_per_sec: f64) -> GuardLayer {
        GuardLayer {
            auth,
            limiter: Arc::new(RateLimiter::new(rate_per_sec)),
            failures: Arc::new(RateLimiter::new(failures_per_sec)),
        }
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
        let open = is_open(&path);
        let conn = ConnInfo::of(req.extensions());
        let peer: Arc<str> = conn.map_or_else(|| Arc::from("peer:unknown"), |c| c.peer);
        // An address that keeps failing authentication is not heard until its bucket refills,
        // so guessing costs the guesser time and the server no verification work.
        if !open && self.layer.auth.is_enabled() && !self.layer.failures.has_token(&peer) {
            return answer(Error::ResourceExhausted(
                "too many failed authentications from this address; retry later".into(),
            ));
        }
        let header = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(|v| v.to_str().unwrap_or(""));
        let mut caller = self.layer.auth.check(header);
        if header.is_none() {
            // No bearer credentials: a client certificate verified by TLS may name the caller.
            let cert = req
                .extensions()
                .get::<TlsConnectInfo<ConnInfo>>()
                .and_then(|i| i.peer_certs())
                .and_then(|certs| certs.first().map(|c| self.layer.auth.check_certificate(c)));
            if let Some(c) = cert {
                caller = c;
            }
        }
        let refusal = match &caller {
            _ if open => None,
            Caller::Open => None,
            Caller::Refused(why) => {
                tracing::debug!(method = %path, %peer, why = why.detail(), "authentication refused");
                self.layer.failures.allow(&peer);
                Some(Error::Unauthenticated(why.public_message().to_owned()))
            }
            Caller::Known(id) if !allowed(&path, id.role) => Some(Error::PermissionDenied(
                format!("role {:?} may not call {path}", id.role),
            )),
            Caller::Known(_) => None,
        };
        if let Some(e) = refusal {
            return answer(e);
        }
        // Buckets are per credential (kind and name); unauthenticated servers limit per address.
        if !open && self.layer.limiter.is_on() {
            let bucket = match &caller {
                Caller::Known(id) => id.bucket(),
                _ => peer.to_string(),
            };
            if !self.layer.limiter.allow(&bucket) {
                return answer(Error::ResourceExhausted(RATE_LIMITED.into()));
            }
            req.extensions_mut().insert(CallerBucket {
                limiter: self.layer.limiter.clone(),
                bucket,
            });
        }
        req.extensions_mut().insert(caller);
        req.extensions_mut().insert(CalledMethod(path));
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(inner.call(req))
    }
}
