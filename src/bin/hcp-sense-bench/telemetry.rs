//! An OTLP/gRPC trace receiver that counts the spans a server exports to it.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::{
    trace_service_server::{TraceService, TraceServiceServer},
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

#[derive(Clone, Default)]
pub struct SpanCounter(Arc<AtomicUsize>);

impl SpanCounter {
    /// Serves on an ephemeral port; returns the endpoint to give OTEL_EXPORTER_OTLP_ENDPOINT.
    pub async fn serve(&self) -> anyhow::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let svc = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Ok(endpoint)
    }

    pub fn spans(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl TraceService for SpanCounter {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = req
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(n, Ordering::Relaxed);
        Ok(tonic::Response::new(Default::default()))
    }
}
