//! The telemetry phase: what exporting every span over OTLP costs the record path, measured against an OTLP/gRPC trace receiver here that counts the spans a server exports to it.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::{
    trace_service_server::{TraceService, TraceServiceServer},
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

use crate::load::{closed, Load};
use crate::report::{header, row};
use crate::seed::prepare;
use crate::server::Server;
use crate::{bin, Options};

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

/// DeliverTrigger with telemetry fully on (every span exported over OTLP to a local receiver)
/// against off, on one database, in one run.
pub async fn telemetry_cost(o: &Options) -> anyhow::Result<()> {
    println!("telemetry (sqlite): OTLP export of every span to a local receiver, against none");
    let counter = SpanCounter::default();
    let endpoint = counter.serve().await?;
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "sqlite", "telemetry", pop, &[]).await?;
    seeded.stop();
    header();
    let mut rates = Vec::new();
    for (name, env) in [
        ("off", vec![]),
        (
            "on",
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_TRACES_SAMPLER", "always_on"),
            ],
        ),
    ] {
        let server = Server::start_env(bin(o), &db.url, &[], &env)?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), o.first(), pop, Load::Recorded).await;
        row("sqlite", &format!("recorded, telemetry {name}"), &rec, None);
        let dropped = closed(&chs, o.duration(), o.first(), pop, Load::Dropped).await;
        row(
            "sqlite",
            &format!("dropped, telemetry {name}"),
            &dropped,
            None,
        );
        rates.push((rec.rate(), dropped.rate()));
        server.stop();
    }
    if let [off, on] = rates[..] {
        println!(
            "telemetry on / off: recorded {:.2}, dropped {:.2}; spans received {}\n",
            on.0 / off.0,
            on.1 / off.1,
            counter.spans()
        );
    }
    db.drop_db().await;
    Ok(())
}
