//! Telemetry as operators use it: the real OTLP exporter into a receiver built from the
//! opentelemetry-proto definitions, /metrics checked by promtool and scraped by a real Prometheus,
//! and a dashboard whose every query uses a metric the service exposes.
use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hcp_sense::grpc::convert::json_to_struct;
use hcp_sense::grpc::pb::{
    ingest_service_client::IngestServiceClient, pack_service_client::PackServiceClient,
    policy_service_client::PolicyServiceClient, register_pack_request, ActivateSenseRequest,
    BindingState, DeliverTriggerRequest, GrantSenseEnableRequest, PutBindingRequest,
    RegisterPackRequest, Route,
};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use tonic::transport::Channel;

use crate::helpers::{example, http_get, repo_path, spawn_app, StoreKind, TestDb};
use crate::support::served::Served;
use crate::support::trigger::with_payload;

/// An OTLP/gRPC receiver keeping every span it is sent, and the names of the metrics.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Span>>>, Arc<Mutex<Vec<String>>>);

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let names = req
            .into_inner()
            .resource_metrics
            .into_iter()
            .flat_map(|r| r.scope_metrics)
            .flat_map(|s| s.metrics)
            .map(|m| m.name);
        if let Ok(mut v) = self.1.lock() {
            v.extend(names);
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = req
            .into_inner()
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans);
        if let Ok(mut v) = self.0.lock() {
            v.extend(spans);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn start_receiver() -> (Receiver, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let r = Receiver::default();
    let svc = TraceServiceServer::new(r.clone());
    let metrics = MetricsServiceServer::new(r.clone());
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(svc)
            .add_service(metrics)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    (r, format!("http://{addr}"))
}

fn attrs(s: &Span) -> HashMap<String, String> {
    s.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(other) => format!("{other:?}"),
                None => String::new(),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn trigger(pack: &str, r#ref: &str, land: &str) -> DeliverTriggerRequest {
    with_payload(
        crate::support::trigger::trigger(pack, r#ref, "otel-alice", land),
        serde_json::json!({ "secret": "do-not-export" }),
    )
}

/// Drives one trigger per drop reason and one per recorded route; the inbox one carries a traceparent.
async fn drive(ch: Channel, traceparent: &str) {
    let mut packs = PackServiceClient::new(ch.clone());
    let mut policy = PolicyServiceClient::new(ch.clone());
    let mut ingest = IngestServiceClient::new(ch);
    packs
        .register_pack(RegisterPackRequest {
            source: Some(register_pack_request::Source::Manifest(json_to_struct(
                &example("github.pack.json"),
            ))),
        })
        .await
        .expect("register");
    let who = || "otel-alice".to_string();
    ingest
        .deliver_trigger(trigger("nowhere", "issue.opened", "user"))
        .await
        .expect("unknown pack");
    ingest
        .deliver_trigger(trigger("github", "issue.deleted", "user"))
        .await
        .expect("undeclared");
    ingest
        .deliver_trigger(trigger("github", "issue.opened", "user"))
        .await
        .expect("no grant");
    policy
        .grant_sense_enable(GrantSenseEnableRequest {
            principal: who(),
            pack_id: "github".into(),
        })
        .await
        .expect("grant");
    ingest
        .deliver_trigger(trigger("github", "issue.opened", "user"))
        .await
        .expect("no binding");
    policy
        .put_binding(PutBindingRequest {
            principal: who(),
            pack_id: "github".into(),
            binding_id: "b-otel".into(),
            state: BindingState::Linked as i32,
        })
        .await
        .expect("bind");
    ingest
        .deliver_trigger(trigger("github", "issue.opened", "project"))
        .await
        .expect("land");
    ingest
        .deliver_trigger(trigger("github", "issue.opened", "user"))
        .await
        .expect("off");
    policy
        .activate_sense(ActivateSenseRequest {
            principal: who(),
            pack_id: "github".into(),
            route: Route::Inbox as i32,
            filter: String::new(),
        })
        .await
        .expect("activate");
    let mut req = tonic::Request::new(trigger("github", "issue.opened", "user"));
    req.metadata_mut()
        .insert("traceparent", traceparent.parse().expect("metadata"));
    ingest.deliver_trigger(req).await.expect("inbox");
    policy
        .activate_sense(ActivateSenseRequest {
            principal: who(),
            pack_id: "github".into(),
            route: Route::Silent as i32,
            filter: String::new(),
        })
        .await
        .expect("activate silent");
    ingest
        .deliver_trigger(trigger("github", "issue.opened", "user"))
        .await
        .expect("silent");
}

async fn served_with_otlp(endpoint: &str, extra_env: &[(&str, &str)]) -> (Served, TestDb) {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let mut cmd = crate::support::served::serve_command(&db.url);
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_SERVICE_NAME", "hcp-sense-test")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "200");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    (Served::spawn(cmd), db)
}

fn decisions(r: &Receiver) -> Vec<Span> {
    r.0.lock()
        .map(|v| {
            v.iter()
                .filter(|s| s.name == "sense.decision")
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_exports_one_decision_span_per_reason_and_route_and_continues_traceparent() {
    let (receiver, endpoint) = start_receiver().await;
    let (served, _db) = served_with_otlp(&endpoint, &[]).await;
    let ch = Channel::from_shared(format!("http://{}", served.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
    drive(ch, &format!("00-{trace_id}-{parent_id}-01")).await;
    assert!(served.terminate(), "SIGTERM exits 0 after flushing spans");
    let deadline = Instant::now() + Duration::from_secs(10);
    while decisions(&receiver).len() < 8 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spans = decisions(&receiver);
    let all: Vec<HashMap<String, String>> = spans.iter().map(attrs).collect();
    for reason in [
        "unknown_pack",
        "undeclared_ref",
        "no_grant",
        "no_connected_binding",
        "land_mismatch",
        "activation_off",
    ] {
        let found: Vec<_> = all
            .iter()
            .filter(|a| a.get("hcp.drop_reason").map(String::as_str) == Some(reason))
            .collect();
        assert_eq!(found.len(), 1, "one span for {reason}: {all:?}");
        let a = found[0];
        assert_eq!(
            a.get("hcp.disposition").map(String::as_str),
            Some("dropped")
        );
        assert_eq!(
            a.get("hcp.principal").map(String::as_str),
            Some("otel-alice")
        );
        for key in ["hcp.pack_id", "hcp.ref", "hcp.land"] {
            assert!(
                a.get(key).is_some_and(|v| !v.is_empty()),
                "{key} on {reason}"
            );
        }
    }
    for route in ["recorded_inbox", "recorded_silent"] {
        let found: Vec<_> = all
            .iter()
            .filter(|a| a.get("hcp.disposition").map(String::as_str) == Some(route))
            .collect();
        assert_eq!(found.len(), 1, "{route}: {all:?}");
        assert!(
            found[0].get("hcp.record_id").is_some_and(|v| v.len() == 36),
            "{route} carries its record id"
        );
    }
    // No payload in any span.
    let everything = format!(
        "{:?}",
        receiver.0.lock().map(|v| v.clone()).unwrap_or_default()
    );
    assert!(
        !everything.contains("do-not-export"),
        "a payload reached the traces"
    );
    // The inbox decision continues the caller's trace, under the RPC's span.
    let inbox = spans
        .iter()
        .find(|s| attrs(s).get("hcp.disposition").map(String::as_str) == Some("recorded_inbox"))
        .expect("inbox span");
    assert_eq!(hex(&inbox.trace_id), trace_id);
    let all_spans = receiver.0.lock().map(|v| v.clone()).unwrap_or_default();
    let rpc = all_spans
        .iter()
        .find(|s| s.span_id == inbox.parent_span_id)
        .expect("the decision's parent span");
    assert_eq!(rpc.name, "/hcp.sense.v1.IngestService/DeliverTrigger");
    assert_eq!(
        hex(&rpc.parent_span_id),
        parent_id,
        "the RPC span's parent is the caller's span"
    );
    // Metrics went over OTLP too.
    let metrics = receiver.1.lock().map(|v| v.clone()).unwrap_or_default();
    for name in [
        "hcp_sense.deliveries",
        "hcp_sense.rpc.duration",
        "hcp_sense.records.written",
        "hcp_sense.bindings",
    ] {
        assert!(
            metrics.iter().any(|m| m == name),
            "{name} not exported over OTLP: {metrics:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_decisions_are_kept_when_the_sampler_drops_everything_else() {
    let (receiver, endpoint) = start_receiver().await;
    let (served, _db) = served_with_otlp(&endpoint, &[("OTEL_TRACES_SAMPLER", "always_off")]).await;
    let ch = Channel::from_shared(format!("http://{}", served.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    drive(
        ch,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
    .await;
    assert!(served.terminate());
    let deadline = Instant::now() + Duration::from_secs(10);
    while decisions(&receiver).len() < 6 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all: Vec<_> = decisions(&receiver).iter().map(attrs).collect();
    assert_eq!(all.len(), 6, "exactly the six drops: {all:?}");
    assert!(all
        .iter()
        .all(|a| a.get("hcp.disposition").map(String::as_str) == Some("dropped")));
}

/// The metric names a PromQL expression uses.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("hcp_sense_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

both_stores! {
    async fn metrics_are_exposed_valid_and_cover_the_dashboard(app) {
        let mut app = app;
        let base = format!("http://{}", app.metrics_addr);
        assert_eq!(http_get(&format!("{base}/healthz")).trim(), "ok");
        assert_eq!(http_get(&format!("{base}/readyz")).trim(), "ready");
        crate::packs::register(&mut app, &example("github.pack.json")).await;
        let mut t = trigger("github", "issue.deleted", "user");
        app.ingest.deliver_trigger(t.clone()).await.expect("undeclared");
        t.r#ref = "issue.opened".into();
        app.ingest.deliver_trigger(t.clone()).await.expect("no grant");
        app.policy.grant_sense_enable(GrantSenseEnableRequest { principal: "otel-alice".into(), pack_id: "github".into() }).await.expect("grant");
        app.policy.put_binding(PutBindingRequest { principal: "otel-alice".into(), pack_id: "github".into(), binding_id: "b".into(), state: BindingState::Stale as i32 }).await.expect("bind");
        app.policy.put_binding(PutBindingRequest { principal: "otel-alice".into(), pack_id: "github".into(), binding_id: "b".into(), state: BindingState::Linked as i32 }).await.expect("bind");
        app.policy.activate_sense(ActivateSenseRequest { principal: "otel-alice".into(), pack_id: "github".into(), route: Route::Inbox as i32, filter: String::new() }).await.expect("activate");
        app.ingest.deliver_trigger(t.clone()).await.expect("recorded");
        // A quota of one: the next is admitted, the one after refused.
        app.policy.put_quota(hcp_sense::grpc::pb::PutQuotaRequest { pack_id: "github".into(), principal: Some("otel-alice".into()), rate_per_second: 0.001, burst: 1 }).await.expect("quota");
        app.ingest.deliver_trigger(t.clone()).await.expect("admitted");
        app.ingest.deliver_trigger(t).await.expect_err("throttled");
        let text = http_get(&format!("{base}/metrics"));
        for want in [
            r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="undeclared_ref",pack="github",ingress="grpc"} 1"#,
            r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="no_grant",pack="github",ingress="grpc"} 1"#,
            r#"hcp_sense_deliveries_total{disposition="recorded_inbox",drop_reason="",pack="github",ingress="grpc"} 2"#,
            r#"hcp_sense_records_written_total 2"#,
            r#"hcp_sense_quota_admitted_total{pack="github"} 1"#,
            r#"hcp_sense_quota_throttled_total{pack="github"} 1"#,
            r#"hcp_sense_bindings{state="linked"} 1"#,
            r#"hcp_sense_build_info{version=""#,
            r#"hcp_sense_rpc_duration_seconds_count{method="/hcp.sense.v1.IngestService/DeliverTrigger"} 5"#,
        ] {
            assert!(text.contains(want), "{want} missing from /metrics:\n{text}");
        }
        // promtool from Prometheus itself accepts the exposition.
        let mut child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool must be installed (see .ci/run)");
        use std::io::Write;
        child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write");
        let out = child.wait_with_output().expect("promtool");
        assert!(out.status.success(), "promtool check metrics:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // Every query of the dashboard uses a metric /metrics exposes.
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(repo_path("helm/hcp-sense/dashboards/hcp-sense.json")).expect("dashboard"),
        ).expect("dashboard JSON");
        let mut checked = 0;
        for panel in dash["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("expr");
                let names = metric_names(expr);
                assert!(!names.is_empty(), "{expr} uses no hcp-sense metric");
                for name in names {
                    assert!(text.lines().any(|l| l.starts_with(&name) && l[name.len()..].starts_with(['{', ' '])), "dashboard query `{expr}` uses {name}, which /metrics does not expose");
                    checked += 1;
                }
            }
        }
        assert!(checked >= 10);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_metrics() {
    let mut app = spawn_app(StoreKind::Sqlite).await;
    crate::packs::register(&mut app, &example("github.pack.json")).await;
    for _ in 0..3 {
        app.ingest
            .deliver_trigger(trigger("github", "issue.deleted", "user"))
            .await
            .expect("deliver");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: hcp-sense\n    static_configs:\n      - targets: ['{}']\n", app.metrics_addr),
    )
    .expect("config");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let mut prom = Command::new("prometheus")
        .args([
            &format!("--config.file={}", config.display()),
            &format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            &format!("--web.listen-address=127.0.0.1:{port}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("prometheus must be installed (see .ci/run)");
    let query = format!(
        "http://127.0.0.1:{port}/api/v1/query?query=hcp_sense_deliveries_total%7Bdrop_reason%3D%22undeclared_ref%22%7D"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    let found = loop {
        if Instant::now() > deadline {
            break false;
        }
        let o = Command::new("curl")
            .args(["-s", "--max-time", "2", &query])
            .output()
            .expect("curl");
        last = String::from_utf8_lossy(&o.stdout).into_owned();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&last) {
            if v["data"]["result"][0]["value"][1] == "3" {
                break true;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let _ = prom.kill();
    let _ = prom.wait();
    assert!(
        found,
        "Prometheus never reported the scraped counter: {last}"
    );
}
