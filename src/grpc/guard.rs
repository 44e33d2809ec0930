//! The authentication and authorization layer: every call is authenticated, checked against its method's roles, and rate limited per caller.
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

use crate::auth::{allowed, is_open, Authenticator, CalledMethod, Caller};

#[derive(Clone, Debug)]
pub struct GuardLayer {
    auth: Arc<Authenticator>,
    limiter: Arc<RateLimiter>,
}

impl GuardLayer {
    /// `rate_per_sec` 0 means no rate limit.
    pub fn new(auth: Arc<Authenticator>, rate_per_sec: f64) -> GuardLayer {
        GuardLayer {
            auth,
            limiter: Arc::new(RateLimiter::new(rate_per_sec)),
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

    fn allow(&self, who: &str) -> bool {
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
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

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
        let header = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let mut caller = self.layer.auth.check(header);
        if header.is_none() {
            // No bearer credentials: a verified client certificate may name the caller.
            let cert = req
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.peer_certs())
                .and_then(|certs| {
                    certs
                        .first()
                        .and_then(|c| self.layer.auth.check_certificate(c))
                });
            if let Some(id) = cert {
                caller = Caller::Known(id);
            }
        }
        let path = req.uri().path().to_owned();
        let open = is_open(&path);
        let refusal = match &caller {
            _ if open => None,
            Caller::Open => None,
            Caller::Refused(why) => Some(Status::unauthenticated(why.clone())),
            Caller::Known(id) if !allowed(&path, id.role) => Some(Status::permission_denied(
                format!("role {:?} may not call {path}", id.role),
            )),
            Caller::Known(_) => None,
        };
        let who = match &caller {
            Caller::Known(id) => id.subject.clone(),
            _ => "anonymous".to_owned(),
        };
        let refusal = refusal.or_else(|| {
            (!open && !self.layer.limiter.allow(&who)).then(|| {
                Status::resource_exhausted(format!("rate limit for `{who}` exceeded; retry later"))
            })
        });
        if let Some(status) = refusal {
            return Box::pin(async move { Ok(status.into_http()) });
        }
        req.extensions_mut().insert(caller);
        req.extensions_mut().insert(CalledMethod(path));
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(inner.call(req))
    }
}
