//! Telemetry setup: tracing to stdout (JSON or text, level by RUST_LOG) and, when the standard
//! `OTEL_*` variables name an endpoint, spans exported over OTLP/gRPC.
use std::io::IsTerminal;

use opentelemetry::trace::{Link, SpanKind, TraceId, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::{Sampler, SamplingResult, SdkTracerProvider, ShouldSample};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// The name of every decision span; its attributes carry the `hcp.` prefix.
pub const DECISION_SPAN: &str = "sense.decision";

/// Holds the exporter; flushes it when shut down.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    meters: Option<SdkMeterProvider>,
}

impl Telemetry {
    /// Exports the spans still buffered, then stops the exporter.
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
        if let Some(m) = self.meters {
            let _ = m.force_flush();
            let _ = m.shutdown();
        }
    }
}

/// Whether spans are exported (the OpenTelemetry layer is installed): without it no span
/// carries a trace, and a decision's entry has no trace id to look up.
static SPANS_EXPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process exports spans (see `SPANS_EXPORTED`).
pub fn spans_exported() -> bool {
    SPANS_EXPORTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether the standard environment asks for OTLP trace export.
pub fn otlp_requested() -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Samples as `OTEL_TRACES_SAMPLER` says, except that a decision span that
/// drops a trigger is always kept, unless the operator opted in to sampling them.
#[derive(Debug, Clone)]
struct KeepDrops {
    inner: Sampler,
    sample_drops: bool,
}

impl ShouldSample for KeepDrops {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        if !self.sample_drops && name == DECISION_SPAN {
            let is_drop = attributes
                .iter()
                .any(|kv| kv.key.as_str() == "hcp.disposition" && kv.value.as_str() == "dropped");
            if is_drop {
                return Sampler::AlwaysOn
                    .should_sample(parent, trace_id, name, kind, attributes, links);
            }
        }
        self.inner
            .should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// The sampler `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` name (default parentbased_always_on).
fn env_sampler() -> Sampler {
    let arg = std::env::var("OTEL_TRACES_SAMPLER_ARG")
        .ok()
        .and_then(|a| a.parse::<f64>().ok())
        .unwrap_or(1.0);
    match std::env::var("OTEL_TRACES_SAMPLER")
        .unwrap_or_default()
        .as_str()
    {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(arg),
        "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        "parentbased_traceidratio" => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(arg)))
        }
        _ => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
    }
}

/// What RUST_LOG asks for (`info` without it). The MCP SDK's service logs are off unless
/// RUST_LOG names `rmcp`: it logs each client that leaves a subscription or a session as an
/// error ("fail to response message", "failed to send pending response during drain"), one
/// or two lines a client, which would bury the service's own errors under the normal comings
/// and goings of MCP clients.
fn log_filter(rust_log: Option<&str>) -> EnvFilter {
    let asked = rust_log.filter(|s| !s.trim().is_empty()).unwrap_or("info");
    let mut filter = EnvFilter::try_new(asked).unwrap_or_else(|_| EnvFilter::new("info"));
    if !asked.contains("rmcp") {
        if let Ok(d) = "rmcp::service=off".parse() {
            filter = filter.add_directive(d);
        }
    }
    filter
}

/// Installs the global subscriber. `sample_drops` lets the sampler drop
/// decision spans of dropped triggers like any other span.
pub fn init(format: LogFormat, sample_drops: bool) -> Telemetry {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    let ansi = std::io::stdout().is_terminal();
    let fmt = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_ansi(false)
            .boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer()
            .pretty()
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Compact => tracing_subscriber::fmt::layer()
            .compact()
            .with_ansi(ansi)
            .boxed(),
    }
    .with_filter(filter);

    let mut telemetry = Telemetry::default();
    let otel = if otlp_requested() {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => {
                let provider = SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_sampler(KeepDrops {
                        inner: env_sampler(),
                        sample_drops,
                    })
                    .with_resource(Resource::builder().build())
                    .build();
                let tracer = provider.tracer("hcp-sense");
                telemetry.provider = Some(provider);
                // The service's own spans, whatever RUST_LOG says about logs.
                let targets = Targets::new().with_target("hcp_sense", LevelFilter::INFO);
                Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(targets),
                )
            }
            Err(e) => {
                eprintln!("OTLP trace export not started: {e}");
                None
            }
        }
    } else {
        None
    };
    let metrics_off =
        std::env::var("OTEL_METRICS_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    if otlp_requested() && !metrics_off {
        match opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => {
                let meters = SdkMeterProvider::builder()
                    .with_periodic_exporter(exporter)
                    .with_resource(Resource::builder().build())
                    .build();
                opentelemetry::global::set_meter_provider(meters.clone());
                telemetry.meters = Some(meters);
            }
            Err(e) => eprintln!("OTLP metric export not started: {e}"),
        }
    }
    let exported = otel.is_some();
    if tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()
        .is_ok()
        && exported
    {
        SPANS_EXPORTED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    telemetry
}

/// Logging only, for the short-lived subcommands.
pub fn init_logging(format: LogFormat) {
    let _ = init(format, true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mcp_sdks_service_logs_are_off_unless_rust_log_names_them() {
        for (rust_log, off) in [
            (None, true),
            (Some(""), true),
            (Some("debug"), true),
            (Some("warn,rmcp=debug"), false),
        ] {
            let f = log_filter(rust_log).to_string();
            assert_eq!(f.contains("rmcp::service=off"), off, "{rust_log:?}: {f}");
        }
    }
}
