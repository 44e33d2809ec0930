//! A tower layer around every gRPC call: a span that continues the caller's W3C trace, and the call's latency.
use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use prost::Message;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::pb;
use crate::metrics::Metrics;

/// The methods the server serves, as `/package.Service/Method`; other paths are labelled `other`.
fn known_methods() -> HashSet<String> {
    methods_where(|_| true)
}

/// The methods the server serves whose answer is a stream of messages.
pub(super) fn streaming_methods() -> HashSet<String> {
    methods_where(|m| m.server_streaming())
}

/// The served methods, as `/package.Service/Method`, that `keep` keeps.
fn methods_where(keep: impl Fn(&prost_types::MethodDescriptorProto) -> bool) -> HashSet<String> {
    let mut out = HashSet::new();
    for fds in [
        pb::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ] {
        if let Ok(set) = prost_types::FileDescriptorSet::decode(fds) {
            for file in set.file {
                for svc in &file.service {
                    for m in svc.method.iter().filter(|m| keep(m)) {
                        out.insert(format!("/{}.{}/{}", file.package(), svc.name(), m.name()));
                    }
                }
            }
        }
    }
    out
}

#[derive(Clone, Debug)]
pub struct RpcLayer {
    metrics: Arc<Metrics>,
    methods: Arc<HashSet<String>>,
}

impl RpcLayer {
    pub fn new(metrics: Arc<Metrics>) -> RpcLayer {
        RpcLayer {
            metrics,
            methods: Arc::new(known_methods()),
        }
    }
}

impl<S> tower::Layer<S> for RpcLayer {
    type Service = Rpc<S>;
    fn layer(&self, inner: S) -> Rpc<S> {
        Rpc {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Rpc<S> {
    inner: S,
    layer: RpcLayer,
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

impl<S, B> tower::Service<http::Request<B>> for Rpc<S>
where
    S: tower::Service<http::Request<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        let method = if self.layer.methods.contains(path) {
            path.to_owned()
        } else {
            "other".to_owned()
        };
        let parent = TraceContextPropagator::new().extract(&Headers(req.headers()));
        let span = tracing::info_span!(
            "grpc.request",
            otel.name = %method,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.method = %method,
        );
        let _ = span.set_parent(parent);
        // The service that was made ready is the one that must be called.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let metrics = self.layer.metrics.clone();
        let started = Instant::now();
        Box::pin(
            async move {
                let out = inner.call(req).await;
                metrics.rpc(&method, started.elapsed());
                out
            }
            .instrument(span),
        )
    }
}
