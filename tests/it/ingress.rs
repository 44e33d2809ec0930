//! Ingress routes: signed webhooks from real signers (the Standard Webhooks reference library, GitHub-style HMAC) become triggers through the one decision; forged, replayed, stale and oversized requests are refused.
use std::net::SocketAddr;
use std::process::Command;

use hcp_sense::grpc::pb::{
    self, ingress_service_client::IngressServiceClient, IngressKind, IngressMapping, IngressRoute,
};
use serde_json::{json, Value};
use tonic::transport::Channel;
use tonic::Code;

use crate::cli::set_up_weather;
use crate::helpers::{spawn_app_with, StoreKind, TestApp};

/// A Standard Webhooks secret: `whsec_` and base64 of 32 bytes.
pub const SECRET_NEW: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECRET_OLD: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const SECRET_OTHER: &str = "whsec_dGhpcyBpcyBub3QgdGhlIHJvdXRlJ3Mga2V5ISE=";
const GITHUB_SECRET: &str = "It's a Secret to Everybody";

pub async fn app_with_ingress(kind: StoreKind, max_payload: Option<usize>) -> TestApp {
    spawn_app_with(kind, |c| {
        c.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        if let Some(n) = max_payload {
            c.max_payload_bytes = n;
        }
    })
    .await
}

pub fn url(app: &TestApp, route: &str) -> String {
    format!(
        "http://{}/v1/ingress/{route}",
        app.ingress_addr.expect("ingress listener")
    )
}

/// Sends each request of `plan` with tests/python/ingress_sender.py; returns the answers.
async fn send(plan: Value) -> Vec<(u16, Value)> {
    send_plan(plan)
        .await
        .into_iter()
        .map(|a| (a["status"].as_u64().unwrap_or(0) as u16, a["body"].clone()))
        .collect()
}

/// The sender's answers as it gives them: status, body and Retry-After.
pub async fn send_plan(plan: Value) -> Vec<Value> {
    let answers = crate::support::python::run(
        "ingress_sender.py",
        "standardwebhooks and cloudevents",
        plan,
    )
    .await;
    answers.as_array().cloned().expect("answers")
}

/// `hcp-sense pipe` running examples/packs/storm-feed.sh for alice on the weather pack.
pub async fn pipe_storm_feed(app: &TestApp) -> std::process::Output {
    let server = format!("http://{}", app.addr);
    tokio::task::spawn_blocking(move || {
        Command::new(crate::support::served::BIN)
            .args([
                "pipe",
                "--server",
                &server,
                "--pack",
                "weather",
                "--principal",
                "alice",
                "--",
            ])
            .arg(crate::helpers::repo_path("examples/packs/storm-feed.sh"))
            .output()
            .expect("hcp-sense pipe")
    })
    .await
    .expect("join")
}

/// `broadcast`: a Standard Webhooks route of the weather pack that fans each webhook out, as a
/// storm warning, to every principal granted and activated.
pub fn broadcast_route() -> pb::PutIngressRouteRequest {
    let mut route = weather_route("broadcast", &[SECRET_NEW]);
    if let Some(r) = route.route.as_mut() {
        r.fan_out = true;
        r.mapping = Some(IngressMapping {
            r#ref: "'storm.warning'".into(),
            ..Default::default()
        });
    }
    route
}

pub fn weather_route(route_id: &str, secrets: &[&str]) -> pb::PutIngressRouteRequest {
    pb::PutIngressRouteRequest {
        route: Some(IngressRoute {
            route_id: route_id.into(),
            pack_id: "weather".into(),
            kind: IngressKind::StandardWebhooks as i32,
            mapping: Some(IngressMapping {
                r#ref: "'storm.' + body.level".into(),
                principal: "body.user".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        secrets: secrets.iter().map(|s| s.to_string()).collect(),
    }
}

pub fn ingress(app: &TestApp) -> IngressServiceClient<Channel> {
    IngressServiceClient::new(app.channel.clone())
}

pub fn standard(url: &str, secret: &str, msg_id: &str, body: Value) -> Value {
    json!({"url": url, "sign": "standard", "secret": secret, "msg_id": msg_id, "body": body.to_string()})
}

/// Standard Webhooks signed by the reference library: recorded once per webhook-id through
/// either secret of a rotation; forged, tampered, stale and unknown-route requests are 401
/// and count as nothing; a body that is not JSON, or maps to an invalid trigger, is 400
/// naming the field.
async fn standard_webhooks_are_verified_and_recorded_once(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    let put = ingress(&app)
        .put_ingress_route(weather_route("weather-alerts", &[SECRET_OLD, SECRET_NEW]))
        .await
        .expect("put route")
        .into_inner();
    assert!(put.created);
    assert_eq!(put.route.expect("route").secret_count, 2);
    let u = url(&app, "weather-alerts");
    let alert = json!({"level": "warning", "user": "alice", "area": "north"});
    let mut stale = standard(&u, SECRET_NEW, "msg_stale", alert.clone());
    stale["ts_offset"] = json!(-400);
    let mut edge = standard(&u, SECRET_NEW, "msg_edge", alert.clone());
    edge["ts_offset"] = json!(-290);
    let mut tampered = standard(&u, SECRET_NEW, "msg_tampered", alert.clone());
    tampered["tamper"] = json!(true);
    let mut not_json = standard(&u, SECRET_NEW, "msg_text", json!(null));
    not_json["body"] = json!("not json");
    let answers = send(json!([
        standard(&u, SECRET_NEW, "msg_1", alert.clone()),
        standard(&u, SECRET_NEW, "msg_1", alert.clone()),
        standard(&u, SECRET_OLD, "msg_2", alert.clone()),
        standard(&u, SECRET_OTHER, "msg_forged", alert.clone()),
        stale,
        edge,
        tampered,
        standard(
            &url(&app, "no-such-route"),
            SECRET_NEW,
            "msg_3",
            alert.clone()
        ),
        not_json,
        standard(
            &u,
            SECRET_NEW,
            "msg_bad_user",
            json!({"level": "warning", "user": "has space"})
        ),
        json!({"url": u, "sign": "none", "body": alert.to_string()}),
    ]))
    .await;
    let status: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(
        status,
        vec![202, 202, 202, 401, 401, 202, 401, 401, 400, 400, 401],
        "{answers:#?}"
    );
    let first = &answers[0].1["triggers"][0];
    assert_eq!(first["disposition"], "recorded_inbox", "{first}");
    assert_eq!(first["trigger_id"], "msg_1");
    let replay = &answers[1].1["triggers"][0];
    assert_eq!(
        replay["duplicate"], true,
        "a replayed webhook-id is the first record"
    );
    assert_eq!(answers[1].1["replay"], true, "{:?}", answers[1]);
    assert_eq!(answers[0].1["replay"], false, "{:?}", answers[0]);
    assert_eq!(replay["record_id"], first["record_id"]);
    assert_eq!(
        answers[8].1["violations"][0]["field"], "body",
        "{:?}",
        answers[8]
    );
    assert_eq!(
        answers[9].1["violations"][0]["field"], "principal",
        "{:?}",
        answers[9]
    );
    let listed = alice_records(&app).await;
    let mut ids: Vec<String> = listed.iter().map(|r| r.trigger_id.clone()).collect();
    ids.sort();
    assert_eq!(
        ids,
        vec!["msg_1", "msg_2", "msg_edge"],
        "each accepted webhook once"
    );
    assert_eq!(
        listed[0].payload.as_ref().map(|p| p.fields.len()),
        Some(3),
        "the body is the payload"
    );
    let metrics = reqwest_text(&format!("http://{}/metrics", app.metrics_addr)).await;
    assert!(
        metrics.contains(r#"hcp_sense_deliveries_total{disposition="recorded_inbox",drop_reason="",pack="weather",ingress="standard_webhooks"} 3"#),
        "three records counted by ingress; the replay is not decided again:\n{metrics}"
    );
    assert!(
        metrics.contains(r#"hcp_sense_ingress_replayed_total{ingress="standard_webhooks"} 1"#),
        "the replay, answered from the ledger:\n{metrics}"
    );
}
on_both_stores!(s7_6_standard_webhooks_are_verified_and_recorded_once => standard_webhooks_are_verified_and_recorded_once);

/// alice's records, oldest first (at most 100).
async fn alice_records(app: &TestApp) -> Vec<pb::Record> {
    records_of(app, "alice").await
}

/// A principal's records, oldest first (at most 100).
async fn records_of(app: &TestApp, principal: &str) -> Vec<pb::Record> {
    app.records
        .clone()
        .list_records(pb::ListRecordsRequest {
            principal: principal.into(),
            page_size: 100,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .records
}

/// A plain HTTP GET of a text body.
async fn reqwest_text(url: &str) -> String {
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", &url])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .await
    .expect("join")
}

/// GitHub-style webhooks: X-Hub-Signature-256 checked, the installation id mapped to the
/// principal through the pack's Bindings (the vendor push mapping), the body's digest the
/// trigger id (GitHub signs the body alone), the ref mapped from the body by the example route.
async fn github_webhooks_reach_the_principal_of_their_binding(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    let ch = app.channel.clone();
    pb::pack_service_client::PackServiceClient::new(ch.clone())
        .register_pack(crate::packs::register_req(&crate::helpers::example(
            "github.pack.json",
        )))
        .await
        .expect("register");
    let mut policy = pb::policy_service_client::PolicyServiceClient::new(ch.clone());
    for (who, binding) in [("alice", "42"), ("bob", "77")] {
        policy
            .grant_sense_enable(pb::GrantSenseEnableRequest {
                principal: who.into(),
                pack_id: "github".into(),
            })
            .await
            .expect("grant");
        policy
            .put_binding(pb::PutBindingRequest {
                principal: who.into(),
                pack_id: "github".into(),
                binding_id: binding.into(),
                state: pb::BindingState::Linked as i32,
            })
            .await
            .expect("binding");
    }
    policy
        .activate_sense(pb::ActivateSenseRequest {
            principal: String::new(),
            pack_id: "github".into(),
            route: 1,
            filter: String::new(),
        })
        .await
        .expect("activate");
    let example: pb::PutIngressRouteRequest = serde_json_to_put(
        &std::fs::read_to_string(crate::helpers::repo_path(
            "examples/github-issues.route.json",
        ))
        .expect("example route"),
    );
    ingress(&app)
        .put_ingress_route(pb::PutIngressRouteRequest {
            secrets: vec![GITHUB_SECRET.into()],
            ..example
        })
        .await
        .expect("put the example route");
    let u = url(&app, "github-issues");
    let hook = |delivery: &str, event: &str, installation: i64| {
        let object = if event == "issues" { "issue" } else { event };
        json!({
            "url": u, "sign": "github", "secret": GITHUB_SECRET,
            "headers": {"x-github-event": event, "x-github-delivery": delivery},
            "body": json!({"action": "opened", "installation": {"id": installation}, object: {"number": 1}}).to_string(),
        })
    };
    let mut forged = hook("d-forged", "issues", 42);
    forged["secret"] = json!("not the route's secret at all");
    let answers = send(json!([
        hook("d-1", "issues", 42),
        hook("d-2", "issues", 77),
        hook("d-1", "issues", 42),
        hook("d-3", "issues", 5),
        hook("d-4", "pull_request", 42),
        forged,
    ]))
    .await;
    let status: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(status, vec![202, 202, 202, 400, 202, 401], "{answers:#?}");
    let t = |i: usize| answers[i].1["triggers"][0].clone();
    assert_eq!(
        (t(0)["principal"].clone(), t(0)["disposition"].clone()),
        (json!("alice"), json!("recorded_inbox"))
    );
    assert_eq!(t(1)["principal"], "bob");
    assert_eq!(t(2)["duplicate"], true);
    assert!(
        t(0)["trigger_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("sha256:") && id.len() == 71),
        "the body's digest: {}",
        t(0)
    );
    assert_eq!(answers[3].1["violations"][0]["field"], "mapping.binding_id");
    assert_eq!(
        t(4)["drop_reason"],
        "undeclared_ref",
        "an event the pack does not declare is dropped, counted, not refused"
    );
}
on_both_stores!(s7_6_github_webhooks_reach_the_principal_of_their_binding => github_webhooks_reach_the_principal_of_their_binding);

/// The example route file is a PutIngressRouteRequest in proto3 JSON (as grpcurl sends it).
fn serde_json_to_put(text: &str) -> pb::PutIngressRouteRequest {
    let v: Value = serde_json::from_str(text).expect("JSON");
    let r = &v["route"];
    let m = &r["mapping"];
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    assert_eq!(r["kind"], "INGRESS_KIND_GITHUB");
    pb::PutIngressRouteRequest {
        route: Some(IngressRoute {
            route_id: s(&r["routeId"]),
            pack_id: s(&r["packId"]),
            kind: IngressKind::Github as i32,
            mapping: Some(IngressMapping {
                r#ref: s(&m["ref"]),
                binding_id: s(&m["bindingId"]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        secrets: Vec::new(),
    }
}

/// The weather route "r" with one change to its mapping.
fn mapped(f: fn(&mut IngressMapping)) -> pb::PutIngressRouteRequest {
    let mut req = weather_route("r", &[SECRET_NEW]);
    if let Some(m) = req.route.as_mut().and_then(|r| r.mapping.as_mut()) {
        f(m);
    }
    req
}

/// Route administration: bad mappings and secrets are INVALID_ARGUMENT naming the field (and
/// the expression's position); secrets never come back, not even in the audit log; lists page.
async fn routes_are_checked_and_their_secrets_kept(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    let mut c = ingress(&app);
    let refused = |mut req: pb::PutIngressRouteRequest, f: fn(&mut pb::PutIngressRouteRequest)| {
        f(&mut req);
        req
    };
    let cases: Vec<(pb::PutIngressRouteRequest, Code, &str)> = vec![
        (
            mapped(|m| m.r#ref = "body.level +".into()),
            Code::InvalidArgument,
            "route.mapping.ref",
        ),
        (
            mapped(|m| m.r#ref = "body.items.map(x, x)[0]".into()),
            Code::InvalidArgument,
            "comprehension",
        ),
        (
            mapped(|m| m.principal = "env.USER".into()),
            Code::InvalidArgument,
            "route.mapping.principal",
        ),
        (weather_route("r", &[]), Code::InvalidArgument, "secrets"),
        (
            weather_route("r", &["whsec_tooshort"]),
            Code::InvalidArgument,
            "secrets[0]",
        ),
        (
            weather_route("r", &[SECRET_NEW; 9]),
            Code::InvalidArgument,
            "secrets",
        ),
        (
            weather_route("Bad Route", &[SECRET_NEW]),
            Code::InvalidArgument,
            "route.route_id",
        ),
        (
            refused(weather_route("r", &[SECRET_NEW]), |r| {
                r.route.as_mut().expect("r").kind = 0
            }),
            Code::InvalidArgument,
            "route.kind",
        ),
        (
            refused(weather_route("r", &[SECRET_NEW]), |r| {
                r.route.as_mut().expect("r").pack_id = "nope".into()
            }),
            Code::NotFound,
            "route.pack_id",
        ),
    ];
    for (req, code, needle) in cases {
        let e = c.put_ingress_route(req).await.expect_err("refused");
        assert_eq!(e.code(), code, "{e:?}");
        assert!(e.message().contains(needle), "{needle} in {e:?}");
    }
    // Eight secrets is the limit: accepted.
    c.put_ingress_route(weather_route("r", &[SECRET_NEW; 8]))
        .await
        .expect("eight secrets");
    for id in ["a", "b", "c"] {
        let put = c
            .put_ingress_route(weather_route(id, &[SECRET_NEW]))
            .await
            .expect("put")
            .into_inner();
        assert!(put.created);
    }
    let again = c
        .put_ingress_route(weather_route("a", &[SECRET_OLD]))
        .await
        .expect("replace")
        .into_inner();
    assert!(!again.created, "a put of an existing id replaces it");
    let page = c
        .list_ingress_routes(pb::ListIngressRoutesRequest {
            page_size: 2,
            page_token: String::new(),
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(
        page.routes
            .iter()
            .map(|r| r.route_id.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    let rest = c
        .list_ingress_routes(pb::ListIngressRoutesRequest {
            page_size: 2,
            page_token: page.next_page_token,
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(
        rest.routes
            .iter()
            .map(|r| r.route_id.as_str())
            .collect::<Vec<_>>(),
        ["c", "r"]
    );
    assert!(rest.next_page_token.is_empty());
    let got = c
        .get_ingress_route(pb::GetIngressRouteRequest {
            route_id: "r".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.route.as_ref().map(|r| r.secret_count), Some(8));
    let audit = pb::audit_service_client::AuditServiceClient::new(app.channel.clone())
        .list_audit_events(pb::ListAuditEventsRequest {
            pack_id: "weather".into(),
            page_size: 100,
            ..Default::default()
        })
        .await
        .expect("audit")
        .into_inner();
    let text = format!("{got:?}{audit:?}");
    assert!(
        audit
            .audit_events
            .iter()
            .any(|e| e.rpc == "PutIngressRoute"),
        "route changes are audited"
    );
    for secret in [SECRET_NEW, SECRET_OLD] {
        assert!(!text.contains(&secret[6..]), "a secret came back: {text}");
    }
    c.delete_ingress_route(pb::DeleteIngressRouteRequest {
        route_id: "a".into(),
    })
    .await
    .expect("delete");
    let e = c
        .delete_ingress_route(pb::DeleteIngressRouteRequest {
            route_id: "a".into(),
        })
        .await
        .expect_err("gone");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get_ingress_route(pb::GetIngressRouteRequest {
            route_id: "a".into(),
        })
        .await
        .expect_err("gone");
    assert_eq!(e.code(), Code::NotFound);
}
on_both_stores!(routes_are_checked_and_their_secrets_kept => routes_are_checked_and_their_secrets_kept);

/// The body limit is the payload limit, at its exact boundary: n bytes are taken, n+1 are 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_body_over_the_payload_limit_is_413() {
    let limit = 1024;
    let app = app_with_ingress(StoreKind::Sqlite, Some(limit)).await;
    set_up_weather(&app.channel).await;
    ingress(&app)
        .put_ingress_route(weather_route("weather-alerts", &[SECRET_NEW]))
        .await
        .expect("put route");
    let u = url(&app, "weather-alerts");
    let body_of = |len: usize| {
        let base = json!({"level": "warning", "user": "alice", "pad": ""}).to_string();
        json!({"level": "warning", "user": "alice", "pad": "x".repeat(len - base.len())})
            .to_string()
    };
    let (at, over) = (body_of(limit), body_of(limit + 1));
    assert_eq!((at.len(), over.len()), (limit, limit + 1));
    let req = |id: &str, body: &str| json!({"url": u, "sign": "standard", "secret": SECRET_NEW, "msg_id": id, "body": body});
    let answers = send(json!([req("at-limit", &at), req("over-limit", &over)])).await;
    assert_eq!(
        answers.iter().map(|a| a.0).collect::<Vec<_>>(),
        vec![202, 413],
        "{answers:#?}"
    );
}

/// A public pack's route that fans out: one event, one trigger per principal granted and
/// activated, each decided and recorded on its own; a redelivery records none again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_public_pack_fans_one_event_out_to_every_activated_principal() {
    let app = app_with_ingress(StoreKind::Sqlite, None).await;
    set_up_weather(&app.channel).await;
    let mut policy = app.policy.clone();
    policy
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "bob".into(),
            pack_id: "weather".into(),
        })
        .await
        .expect("grant bob");
    ingress(&app)
        .put_ingress_route(broadcast_route())
        .await
        .expect("put fan-out route");
    let u = url(&app, "broadcast");
    let answers = send(json!([
        standard(&u, SECRET_NEW, "evt_1", json!({"area": "north"})),
        standard(&u, SECRET_NEW, "evt_1", json!({"area": "north"})),
    ]))
    .await;
    assert_eq!(answers[0].0, 202, "{answers:?}");
    let people = |i: usize| {
        answers[i].1["triggers"]
            .as_array()
            .expect("triggers")
            .iter()
            .map(|t| {
                (
                    t["principal"].as_str().unwrap_or("").to_owned(),
                    t["duplicate"].as_bool().unwrap_or(false),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        people(0),
        vec![("alice".into(), false), ("bob".into(), false)]
    );
    assert_eq!(
        people(1),
        vec![("alice".into(), true), ("bob".into(), true)]
    );
}

/// CloudEvents made by the SDK, in binary and structured mode: `type` less the route's prefix
/// is the ref, `subject` the principal, `source`#`id` the trigger id (a redelivered event is
/// the first record), `data` the payload; an event without a required attribute, or with data
/// that is not an object, is 400 naming it.
async fn cloudevents_in_both_modes_become_triggers(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    let mut plain = weather_route("plain", &[SECRET_NEW]);
    if let Some(m) = plain.route.as_mut().and_then(|r| r.mapping.as_mut()) {
        m.r#ref = "event.type".into();
    }
    let e = ingress(&app)
        .put_ingress_route(plain)
        .await
        .expect_err("only CloudEvents routes read `event`");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("route.mapping.ref") && e.message().contains("`event`"),
        "{e:?}"
    );
    let mut route = weather_route("events", &[SECRET_NEW]);
    if let Some(r) = route.route.as_mut() {
        r.kind = IngressKind::Cloudevents as i32;
        r.cloudevents_type_prefix = "com.example.".into();
        r.mapping = None;
    }
    ingress(&app)
        .put_ingress_route(route)
        .await
        .expect("put CloudEvents route");
    let u = url(&app, "events");
    let event = |mode: &str, msg: &str, id: &str, attrs: Value, data: Value| {
        let mut ev = json!({"type": "com.example.storm.warning", "source": "/sensors/7", "subject": "alice", "id": id, "specversion": "1.0"});
        for (k, v) in attrs.as_object().cloned().unwrap_or_default() {
            if v.is_null() {
                ev.as_object_mut().map(|o| o.remove(&k));
            } else {
                ev[k] = v;
            }
        }
        json!({"url": u, "sign": "cloudevents", "secret": SECRET_NEW, "msg_id": msg, "mode": mode, "event": ev, "data": data})
    };
    // A route that reads the event's own ref and subject: structured mode, where the
    // signature covers them. In binary mode they are unsigned ce- headers: refused.
    let mut by_body = weather_route("events-by-body", &[SECRET_NEW]);
    if let Some(r) = by_body.route.as_mut() {
        r.kind = IngressKind::Cloudevents as i32;
    }
    ingress(&app)
        .put_ingress_route(by_body)
        .await
        .expect("put a CloudEvents route mapped from the data");
    let mut by_event = weather_route("events-by-event", &[SECRET_NEW]);
    if let Some(r) = by_event.route.as_mut() {
        r.kind = IngressKind::Cloudevents as i32;
        if let Some(m) = r.mapping.as_mut() {
            m.principal = "event.subject".into();
        }
    }
    ingress(&app)
        .put_ingress_route(by_event)
        .await
        .expect("put a CloudEvents route mapping the subject");
    let to = |ev: Value, route: &str| {
        let mut ev = ev;
        ev["url"] = json!(url(&app, route));
        ev
    };
    let mine = json!({"level": "warning", "user": "alice", "area": "east"});
    let answers = send(json!([
        event("binary", "m1", "e1", json!({}), json!({"area": "north"})),
        event(
            "structured",
            "m2",
            "e2",
            json!({}),
            json!({"area": "south"})
        ),
        event(
            "structured",
            "m3",
            "e2",
            json!({}),
            json!({"area": "south"})
        ),
        event(
            "structured",
            "m4",
            "e4",
            json!({"subject": null}),
            json!({"area": "east"})
        ),
        event(
            "structured",
            "m5",
            "e5",
            json!({"type": "com.example.hail"}),
            json!({"area": "west"})
        ),
        event(
            "binary",
            "m6",
            "e6",
            json!({}),
            json!(["not", "an", "object"])
        ),
        to(
            event("binary", "m7", "e7", json!({}), mine.clone()),
            "events-by-body"
        ),
        to(
            event("binary", "m8", "e8", json!({}), mine.clone()),
            "events-by-event"
        ),
        to(
            event("structured", "m9", "e9", json!({}), mine.clone()),
            "events-by-event"
        ),
    ]))
    .await;
    let status: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(
        status,
        vec![400, 202, 202, 400, 202, 400, 202, 400, 202],
        "{answers:#?}"
    );
    let t = |i: usize| answers[i].1["triggers"][0].clone();
    let field = |i: usize| answers[i].1["violations"][0]["field"].clone();
    assert_eq!(field(0), "ce-type", "{:?}", answers[0]);
    assert!(
        answers[0].1["violations"][0]["description"]
            .as_str()
            .is_some_and(|d| d.contains("structured mode")),
        "{:?}",
        answers[0]
    );
    assert_eq!(t(1)["trigger_id"], "/sensors/7#e2");
    assert_eq!(t(1)["disposition"], "recorded_inbox");
    assert_eq!(
        t(2)["duplicate"],
        true,
        "the same source and id is the same event"
    );
    assert_eq!(field(3), "subject");
    assert_eq!(
        t(4)["drop_reason"],
        "undeclared_ref",
        "`hail` is not declared: dropped, counted"
    );
    assert_eq!(field(5), "data");
    assert_eq!(
        (t(6)["trigger_id"].clone(), t(6)["disposition"].clone()),
        (json!("m7"), json!("recorded_inbox")),
        "binary mode mapped from the data: the signed webhook-id is the trigger id"
    );
    assert_eq!(field(7), "mapping.principal");
    assert_eq!(t(8)["principal"], "alice");
    let listed = alice_records(&app).await;
    let areas: Vec<String> = listed
        .iter()
        .map(|r| {
            format!(
                "{:?}",
                r.payload
                    .as_ref()
                    .and_then(|p| p.fields.get("area"))
                    .and_then(|v| v.kind.clone())
            )
        })
        .collect();
    assert_eq!(listed.len(), 3, "{areas:?}");
    assert!(
        areas[0].contains("south") && areas[1].contains("east") && areas[2].contains("east"),
        "data is the payload: {areas:?}"
    );
}
on_both_stores!(s7_6_cloudevents_in_both_modes_become_triggers => cloudevents_in_both_modes_become_triggers);

/// `hcp-sense pipe` runs a sense_only pack's command: every line a trigger (a repeated
/// trigger id the first record, an undeclared ref a counted drop), a malformed line or one the
/// server refuses reported on stderr with its line number, the command's exit code passed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_pipe_delivers_a_pack_commands_lines_and_passes_its_exit_code_on() {
    let app = app_with_ingress(StoreKind::Sqlite, None).await;
    set_up_weather(&app.channel).await;
    let out = pipe_storm_feed(&app).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "the command's exit code: {stderr}"
    );
    assert!(stderr.contains("line 4: not JSON"), "{stderr}");
    assert!(
        stderr.contains("line 6: ") && stderr.contains("ref"),
        "{stderr}"
    );
    assert!(
        stderr.contains("7 lines: 4 recorded, 1 dropped, 2 refused"),
        "a repeated trigger id counts as recorded (its first record): {stderr}"
    );
    let listed = alice_records(&app).await;
    assert_eq!(
        listed.len(),
        3,
        "feed-1 once, feed-2, and the line without an id"
    );
}

/// The ingress listener's sockets: one that never sends, one that stops half-way through its
/// headers and one left idle after a request are all closed after --http-idle-timeout-secs;
/// a request in time is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_sent_ingress_sockets_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.http_idle_timeout = std::time::Duration::from_secs(1);
    })
    .await;
    let addr = app.ingress_addr.expect("ingress listener");
    let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut half = tokio::net::TcpStream::connect(addr).await.expect("connect");
    half.write_all(b"POST /v1/ingress/x HTTP/1.1\r\nhost: a\r\n")
        .await
        .expect("half");
    let mut kept = tokio::net::TcpStream::connect(addr).await.expect("connect");
    kept.write_all(b"POST /v1/ingress/x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .expect("request");
    let mut answer = [0u8; 12];
    kept.read_exact(&mut answer).await.expect("answered");
    assert_eq!(
        &answer, b"HTTP/1.1 401",
        "an unknown route reads as unsigned"
    );
    for (what, s) in [
        ("silent", &mut silent),
        ("half-sent", &mut half),
        ("kept alive", &mut kept),
    ] {
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "the {what} socket was not closed");
    }
}

/// The store goes silent under a webhook: the sender is answered 503 with Retry-After within
/// the request timeout, nothing is acknowledged, and its retry once the store is back is
/// recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_store_answers_webhooks_503_and_their_retry_records_once_postgres() {
    let db = crate::helpers::TestDb::create(StoreKind::Postgres).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let listen = format!("127.0.0.1:{port}");
    let (proxy, served) = crate::support::proxy::FreezingProxy::serve(
        &db,
        &["--request-timeout-secs", "2", "--ingress-listen", &listen],
    )
    .await;
    let ch = crate::cli::connect(&served.addr).await;
    set_up_weather(&ch).await;
    IngressServiceClient::new(ch.clone())
        .put_ingress_route(weather_route("weather-alerts", &[SECRET_NEW]))
        .await
        .expect("put route");
    let u = format!("http://{listen}/v1/ingress/weather-alerts");
    let alert = json!({"level": "warning", "user": "alice"});
    proxy.freeze(true);
    let started = std::time::Instant::now();
    let answers = send(json!([standard(
        &u,
        SECRET_NEW,
        "msg_outage",
        alert.clone()
    )]))
    .await;
    assert_eq!(answers[0].0, 503, "{answers:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    proxy.freeze(false);
    let mut recorded = None;
    for _ in 0..100 {
        let a = send(json!([standard(
            &u,
            SECRET_NEW,
            "msg_outage",
            alert.clone()
        )]))
        .await;
        if a[0].0 == 202 {
            recorded = Some(a[0].1["triggers"][0].clone());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let t = recorded.expect("recorded once the store is back");
    assert_eq!(t["disposition"], "recorded_inbox", "{t}");
    let conn = db.connect().await;
    use sea_orm::ConnectionTrait;
    let n: i64 = conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT COUNT(*) AS n FROM records WHERE producer_trigger_id = 'msg_outage'",
        ))
        .await
        .expect("query")
        .expect("row")
        .try_get("", "n")
        .expect("n");
    assert_eq!(n, 1, "recorded exactly once");
}

/// The principal a replay tries to move a record to.
async fn grant_bob_weather(app: &TestApp) {
    pb::policy_service_client::PolicyServiceClient::new(app.channel.clone())
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "bob".into(),
            pack_id: "weather".into(),
        })
        .await
        .expect("grant bob");
}

/// A captured signed request, replayed within the tolerance with any header changed — the
/// ones the mapping or the kind reads (`ce-*`, X-GitHub-Event, X-GitHub-Delivery, a header
/// named like a field), its content type (switching CloudEvents modes) — is its first record
/// or refused: never a new record, never one for another principal.
async fn a_replayed_signed_request_is_its_first_record_or_refused(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    grant_bob_weather(&app).await;
    let put = |route: pb::PutIngressRouteRequest| {
        let mut c = ingress(&app);
        async move { c.put_ingress_route(route).await.expect("put route") }
    };
    put(weather_route("sw", &[SECRET_NEW])).await;
    let mut gh = weather_route("gh", &[GITHUB_SECRET]);
    let mut ce = weather_route("ce", &[SECRET_NEW]);
    let mut ce_default = weather_route("ce-default", &[SECRET_NEW]);
    if let (Some(g), Some(c), Some(d)) = (
        gh.route.as_mut(),
        ce.route.as_mut(),
        ce_default.route.as_mut(),
    ) {
        g.kind = IngressKind::Github as i32;
        c.kind = IngressKind::Cloudevents as i32;
        d.kind = IngressKind::Cloudevents as i32;
        d.mapping = None;
    }
    put(gh).await;
    put(ce).await;
    put(ce_default).await;
    let body = json!({"level": "warning", "user": "alice", "area": "north"});
    let event = |mode: &str, msg: &str, route: &str| {
        json!({"url": url(&app, route), "sign": "cloudevents", "secret": SECRET_NEW, "msg_id": msg, "mode": mode,
               "event": {"type": "storm.warning", "source": "/s", "subject": "alice", "id": msg, "specversion": "1.0"},
               "data": body})
    };
    // The originals: one signed request of each kind, each recorded for alice.
    let originals = json!([
        standard(&url(&app, "sw"), SECRET_NEW, "sw-1", body.clone()),
        {"url": url(&app, "gh"), "sign": "github", "secret": GITHUB_SECRET, "body": body.to_string(),
         "headers": {"x-github-event": "issues", "x-github-delivery": "d-1"}},
        event("binary", "ce-1", "ce"),
        event("structured", "ce-2", "ce-default"),
    ]);
    let changes = [
        json!({"x-user": "bob", "user": "bob", "hcp-principal": "bob", "ce-subject": "bob"}),
        json!({"ce-id": "fresh", "ce-source": "/other", "ce-type": "storm.watch", "x-github-delivery": "d-2"}),
        json!({"x-github-event": "pull_request", "content-type": "text/plain"}),
        json!({"content-type": "application/cloudevents+json"}),
        json!({"content-type": "application/json", "ce-specversion": "1.0", "ce-id": "x", "ce-source": "/x", "ce-type": "storm.warning", "ce-subject": "bob"}),
        json!({"ce-subject": null, "ce-type": null, "x-github-event": null}),
    ];
    let mut plan = originals.as_array().cloned().unwrap_or_default();
    for change in &changes {
        for i in 0..4 {
            plan.push(json!({"replay": i, "set_headers": change}));
        }
    }
    let answers = send(Value::Array(plan)).await;
    let first: Vec<Value> = answers[..4]
        .iter()
        .map(|(status, b)| {
            assert_eq!(*status, 202, "an original: {b}");
            let t = &b["triggers"][0];
            assert_eq!(
                (t["principal"].clone(), t["disposition"].clone()),
                (json!("alice"), json!("recorded_inbox")),
                "{b}"
            );
            t["record_id"].clone()
        })
        .collect();
    for (n, (status, b)) in answers[4..].iter().enumerate() {
        let (route, change) = (n % 4, &changes[n / 4]);
        match status {
            202 => {
                let t = &b["triggers"][0];
                assert_eq!(b["triggers"].as_array().map(Vec::len), Some(1), "{b}");
                assert_eq!(
                    (
                        t["record_id"].clone(),
                        t["duplicate"].clone(),
                        t["principal"].clone()
                    ),
                    (first[route].clone(), json!(true), json!("alice")),
                    "replay of request {route} with {change}: not its first record: {b}"
                );
            }
            400 | 401 | 409 => {}
            other => panic!("replay of request {route} with {change}: {other} {b}"),
        }
    }
    assert_eq!(
        alice_records(&app).await.len(),
        4,
        "one record per original"
    );
    assert_eq!(
        records_of(&app, "bob").await.len(),
        0,
        "a replay never records for another principal"
    );
    // A mapping that would read what the signature does not cover (nor the ledger pins) is
    // refused when put.
    let mut reads_delivery_header = weather_route("gh-delivery", &[GITHUB_SECRET]);
    if let Some(r) = reads_delivery_header.route.as_mut() {
        r.kind = IngressKind::Github as i32;
        if let Some(m) = r.mapping.as_mut() {
            m.r#ref = "'storm.' + headers['x-github-delivery']".into();
        }
    }
    let e = ingress(&app)
        .put_ingress_route(reads_delivery_header)
        .await
        .expect_err("an unsigned header");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let v = crate::helpers::violations(&e);
    assert_eq!(v[0].0, "route.mapping.ref", "{v:?}");
    assert!(
        v[0].1.contains("x-github-delivery") && v[0].1.contains("does not cover"),
        "{v:?}"
    );
}
on_both_stores!(s7_6_a_replayed_signed_request_is_its_first_record_or_refused => a_replayed_signed_request_is_its_first_record_or_refused);

/// A mapping's bound on what it builds counts a header read at MAX_HEADER_BYTES, and a request
/// may carry no more: a mapping of 32 header reads is kept and one of 33 refused when the route
/// is put; a signed request with 16 KiB of headers is recorded, one past 32 KiB becomes no
/// record (400 naming `headers`, or 431 from the listener).
async fn mappings_count_headers_at_what_a_request_may_carry(kind: StoreKind) {
    use hcp_sense::ingress::mapping::MAX_HEADER_BYTES;
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    let reads = |n: usize| {
        let mut r = weather_route("padded", &[SECRET_NEW]);
        if let Some(m) = r.route.as_mut().and_then(|r| r.mapping.as_mut()) {
            m.r#ref = format!(
                "size([{}]) > 0 && body.level == 'warning' ? 'storm.warning' : 'none'",
                vec!["headers['webhook-id']"; n].join(", ")
            );
        }
        r
    };
    let fits = (1 << 20) / MAX_HEADER_BYTES;
    let s = ingress(&app)
        .put_ingress_route(reads(fits + 1))
        .await
        .expect_err("one header read too many");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        crate::helpers::violations(&s)
            .iter()
            .any(|(f, d)| f == "route.mapping.ref" && d.contains("may build")),
        "{s:?}"
    );
    ingress(&app)
        .put_ingress_route(reads(fits))
        .await
        .expect("as many header reads as fill the bound");
    let u = url(&app, "padded");
    let alert = json!({"level": "warning", "user": "alice"});
    let padded = |id: &str, n: usize| {
        let mut r = standard(&u, SECRET_NEW, id, alert.clone());
        r["headers"] = json!({ "x-pad": "p".repeat(n) });
        r
    };
    let answers = send(json!([
        padded("msg_half", MAX_HEADER_BYTES / 2),
        padded("msg_over", MAX_HEADER_BYTES + 1),
    ]))
    .await;
    assert_eq!(answers[0].0, 202, "{:?}", answers[0]);
    let (status, body) = &answers[1];
    assert!(
        *status == 431 || (*status == 400 && body["violations"][0]["field"] == "headers"),
        "{status} {body}"
    );
    let ids: Vec<String> = alice_records(&app)
        .await
        .into_iter()
        .map(|r| r.trigger_id)
        .collect();
    assert_eq!(ids, ["msg_half"]);
}
on_both_stores!(mappings_count_headers_at_what_a_request_may_carry => mappings_count_headers_at_what_a_request_may_carry);

/// The four signed deliveries of the ledger tests, signed at `ts`: a Standard Webhook and a
/// GitHub one for bob (not granted: dropped), and the same for alice (recorded).
fn ledger_plan(app_url: &dyn Fn(&str) -> String, ts: u64) -> Vec<Value> {
    let sw = |msg: &str, user: &str| {
        let mut r = standard(
            &app_url("sw"),
            SECRET_NEW,
            msg,
            json!({"level": "warning", "user": user}),
        );
        r["ts"] = json!(ts);
        r
    };
    let gh = |user: &str| {
        json!({"url": app_url("gh"), "sign": "github", "secret": GITHUB_SECRET,
               "body": json!({"level": "warning", "user": user, "at": ts}).to_string()})
    };
    vec![
        sw("sw-bob", "bob"),
        gh("bob"),
        sw("sw-alice", "alice"),
        gh("alice"),
    ]
}

async fn put_ledger_routes(ch: &Channel) {
    let mut c = IngressServiceClient::new(ch.clone());
    c.put_ingress_route(weather_route("sw", &[SECRET_NEW]))
        .await
        .expect("put sw");
    let mut gh = weather_route("gh", &[GITHUB_SECRET]);
    if let Some(r) = gh.route.as_mut() {
        r.kind = IngressKind::Github as i32;
    }
    c.put_ingress_route(gh).await.expect("put gh");
}

/// `replayed` is the first answer `first` again, marked a replay, its records `duplicate`.
fn assert_first_answer(first: &(u16, Value), replayed: &(u16, Value), what: &str) {
    assert_eq!(replayed.0, 202, "{what}: {replayed:?}");
    assert_eq!(replayed.1["replay"], true, "{what}: {replayed:?}");
    assert_eq!(first.1["replay"], false, "{what}: {first:?}");
    let mut expected = first.1["triggers"].clone();
    for t in expected.as_array_mut().into_iter().flatten() {
        if !t["record_id"].is_null() {
            t["duplicate"] = json!(true);
        }
    }
    assert_eq!(replayed.1["triggers"], expected, "{what}");
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A signed delivery is decided once: replayed after what would change its outcome — the
/// dropped principal granted, the recorded one's records erased — it gets its first answer,
/// and nothing is recorded or counted again. A new delivery is decided on today's policy.
async fn a_signed_delivery_is_decided_once_whatever_changes_after(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    put_ledger_routes(&app.channel).await;
    let at = |route: &str| url(&app, route);
    let plan = ledger_plan(&at, unix_now());
    let first = send(Value::Array(plan.clone())).await;
    for (n, (status, b)) in first.iter().enumerate() {
        assert_eq!(*status, 202, "{b}");
        let t = &b["triggers"][0];
        let expected = if n < 2 { "dropped" } else { "recorded_inbox" };
        assert_eq!(t["disposition"], expected, "{b}");
    }
    assert_eq!(first[0].1["triggers"][0]["drop_reason"], "no_grant");
    grant_bob_weather(&app).await;
    let erased = app
        .records
        .clone()
        .erase_records(pb::EraseRecordsRequest {
            principal: "alice".into(),
            pack_id: "weather".into(),
        })
        .await
        .expect("erase")
        .into_inner();
    assert_eq!(erased.erased_count, 2);
    let mut again = plan.clone();
    let mut fresh = standard(
        &at("sw"),
        SECRET_NEW,
        "sw-bob-2",
        json!({"level": "warning", "user": "bob"}),
    );
    fresh["ts"] = plan[0]["ts"].clone();
    again.push(fresh);
    let replayed = send(Value::Array(again)).await;
    for (n, what) in [
        "bob's webhook",
        "bob's GitHub delivery",
        "alice's webhook",
        "alice's GitHub delivery",
    ]
    .iter()
    .enumerate()
    {
        assert_first_answer(&first[n], &replayed[n], what);
    }
    assert_eq!(replayed[4].0, 202);
    assert_eq!(
        replayed[4].1["triggers"][0]["disposition"], "recorded_inbox",
        "a new delivery is decided on the policy of now: {:?}",
        replayed[4]
    );
    assert_eq!(
        records_of(&app, "bob").await.len(),
        1,
        "only the new delivery"
    );
    assert_eq!(
        alice_records(&app).await.len(),
        0,
        "an erased record is not made again by a replay"
    );
    assert_eq!(
        app.count("ingress_ledger").await,
        5,
        "one ledger row per delivery"
    );
    let metrics = reqwest_text(&format!("http://{}/metrics", app.metrics_addr)).await;
    for line in [
        r#"hcp_sense_ingress_replayed_total{ingress="standard_webhooks"} 2"#,
        r#"hcp_sense_ingress_replayed_total{ingress="github"} 2"#,
        r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="no_grant",pack="weather",ingress="standard_webhooks"} 1"#,
        r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="no_grant",pack="weather",ingress="github"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
}
on_both_stores!(s7_6_a_signed_delivery_is_decided_once_whatever_changes_after => a_signed_delivery_is_decided_once_whatever_changes_after);

/// The ledger is the store's: a delivery decided on one replica, replayed on another after
/// the grant that would record it, gets its first answer there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_signed_delivery_replayed_on_another_replica_gets_its_first_answer_postgres() {
    let a = app_with_ingress(StoreKind::Postgres, None).await;
    set_up_weather(&a.channel).await;
    put_ledger_routes(&a.channel).await;
    let b = crate::helpers::Replica::start_with(&a.test_db.url, |c| {
        c.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    })
    .await;
    let b_ingress = b.ingress_addr.expect("b's ingress listener");
    let plan = ledger_plan(&|route: &str| url(&a, route), unix_now());
    let first = send(Value::Array(plan.clone())).await;
    grant_bob_weather(&a).await;
    let on_b: Vec<Value> = plan
        .iter()
        .map(|r| {
            let mut r = r.clone();
            let u = r["url"].as_str().unwrap_or_default().to_owned();
            let path = u.split_once("/v1/").map_or("", |(_, p)| p).to_owned();
            r["url"] = json!(format!("http://{b_ingress}/v1/{path}"));
            r
        })
        .collect();
    let replayed = send(Value::Array(on_b)).await;
    for n in 0..4 {
        assert_first_answer(
            &first[n],
            &replayed[n],
            &format!("delivery {n} on replica b"),
        );
    }
    assert_eq!(records_of(&a, "bob").await.len(), 0);
    assert_eq!(alice_records(&a).await.len(), 2);
    b.stop().await;
}

/// The ledger's rows at their boundaries: a claim holds until the microsecond it lapses, then
/// the same content may take it over; a decided row answers until the microsecond it
/// expires, then anything may; other content is refused while a row lives; a released claim
/// (a request refused before deciding) lets the same content claim again at once; a row is
/// shared by every delivery naming one of its scopes; a row carried over from the per-route
/// ledger answers its route; pruning takes the earliest expired rows, about a batch at a time.
async fn the_ingress_ledger_keeps_a_delivery_until_it_expires(kind: StoreKind) {
    use hcp_sense::store::{LedgerKey, LedgerState::*};
    let db = crate::helpers::TestDb::create(kind).await;
    let connection =
        hcp_sense::store::Store::connect(&hcp_sense::config::StoreConfig::at(db.url.clone()))
            .await
            .expect("connect");
    connection.migrate_up().await.expect("migrate");
    let store = connection.ingress_tables();
    let s1 = vec!["s1".to_owned()];
    let both = vec!["s1".to_owned(), "s2".to_owned()];
    let s3 = vec!["s3".to_owned()];
    let at = |scopes: &'static [String], key: &'static str, digest: &'static str| LedgerKey {
        route_id: "r",
        scopes,
        key,
        digest,
    };
    let s1: &'static [String] = Box::leak(s1.into_boxed_slice());
    let both: &'static [String] = Box::leak(both.into_boxed_slice());
    let s3: &'static [String] = Box::leak(s3.into_boxed_slice());
    let d = at(s1, "k", "c1");
    let other = at(s1, "k", "c2");
    let claim = |d: LedgerKey<'static>, now: i64, until: i64, expire: Option<i64>| {
        let store = store.clone();
        async move {
            store
                .claim_ingress_delivery(&d, now, until, expire)
                .await
                .expect("claim")
        }
    };
    let read = |d: LedgerKey<'static>, now: i64| {
        let store = store.clone();
        async move { store.ingress_delivery(&d, now).await.expect("read") }
    };
    assert_eq!(claim(d.clone(), 1_000, 1_500, Some(2_000)).await, Claimed);
    assert_eq!(read(d.clone(), 1_100).await, Some(Pending));
    assert_eq!(claim(d.clone(), 1_499, 1_900, Some(2_000)).await, Pending);
    assert_eq!(
        claim(other.clone(), 1_100, 1_900, Some(2_000)).await,
        OtherContent
    );
    assert_eq!(
        claim(d.clone(), 1_500, 1_900, Some(2_000)).await,
        Claimed,
        "a lapsed claim is taken over"
    );
    store
        .settle_ingress_delivery(&d, 1_600, "[1]")
        .await
        .expect("settle");
    assert_eq!(read(d.clone(), 1_999).await, Some(Decided("[1]".into())));
    assert_eq!(
        claim(d.clone(), 1_999, 2_500, Some(9_000)).await,
        Decided("[1]".into())
    );
    assert_eq!(
        claim(other.clone(), 1_999, 2_500, Some(9_000)).await,
        OtherContent
    );
    assert_eq!(read(d.clone(), 2_000).await, None, "expired at its expiry");
    assert_eq!(
        claim(other.clone(), 2_000, 2_500, Some(5_000)).await,
        Claimed,
        "an expired row is anyone's"
    );
    store
        .settle_ingress_delivery(&other, 2_100, "[2]")
        .await
        .expect("settle");
    assert_eq!(
        read(at(both, "k", "c2"), 2_600).await,
        Some(Decided("[2]".into())),
        "a delivery verified by two keys finds the row of either"
    );
    assert_eq!(
        read(at(s3, "k", "c2"), 2_600).await,
        None,
        "another key's scope"
    );
    // A claim released by a refusal: the same content claims it again, other content not.
    let refused = at(s1, "k3", "c3");
    assert_eq!(
        claim(refused.clone(), 3_000, 9_000, Some(9_000)).await,
        Claimed
    );
    store
        .release_ingress_delivery(&refused)
        .await
        .expect("release");
    assert_eq!(read(refused.clone(), 3_001).await, None);
    assert_eq!(
        claim(at(s1, "k3", "c4"), 3_001, 9_000, Some(9_000)).await,
        OtherContent
    );
    assert_eq!(
        claim(refused.clone(), 3_001, 9_000, Some(9_000)).await,
        Claimed
    );
    // A row of the per-route ledger, carried over by the migration.
    let conn = db.connect().await;
    sea_orm::ConnectionTrait::execute_unprepared(
        &conn,
        "INSERT INTO ingress_ledger (scope, delivery_key, route_id, decide_time, answer) \
         VALUES ('route:r', 'kl', 'r', 0, '[9]')",
    )
    .await
    .expect("a carried-over row");
    assert_eq!(
        read(at(s3, "kl", "c9"), 5).await,
        Some(Decided("[9]".into()))
    );
    let elsewhere = LedgerKey {
        route_id: "other",
        ..at(s3, "kl", "c9")
    };
    assert_eq!(
        read(elsewhere, 5).await,
        None,
        "a carried-over row is its route's"
    );
    // Pruning.
    let prune = |now: i64, limit: u64| {
        let store = store.clone();
        async move { store.prune_ingress_ledger(now, limit).await.expect("prune") }
    };
    prune(i64::MAX - 1, 250).await;
    let keys: Vec<&'static str> = ["p0", "p1", "p2", "p3", "p4", "p5"].into();
    for (n, expiry) in [100, 101, 102, 103, 104, 105].into_iter().enumerate() {
        let p = at(s1, keys[n], "c");
        assert_eq!(claim(p.clone(), 0, 50, Some(expiry)).await, Claimed);
        store
            .settle_ingress_delivery(&p, 0, "[]")
            .await
            .expect("settle");
    }
    let forever = at(s1, "for-ever", "c");
    assert_eq!(claim(forever.clone(), 0, 50, None).await, Claimed);
    store
        .settle_ingress_delivery(&forever, 0, "[]")
        .await
        .expect("settle");
    assert_eq!(prune(104, 2).await, 2);
    assert_eq!(prune(104, 250).await, 3);
    assert_eq!(prune(104, 250).await, 0);
    assert!(read(at(s1, "p5", "c"), 104).await.is_some());
    assert!(read(forever.clone(), i64::MAX).await.is_some());
    assert_eq!(prune(i64::MAX, 250).await, 1);
    assert!(read(forever, 0).await.is_some());
    drop(store);
    connection.close().await;
}
on_both_stores!(the_ingress_ledger_keeps_a_delivery_until_it_expires => the_ingress_ledger_keeps_a_delivery_until_it_expires);

/// A delivery id names one delivery: the same webhook-id validly signed over another body, or
/// the same GitHub body under another X-GitHub-Event, is 409 and records nothing (answered as
/// a replay, it would be an acknowledged message silently lost); the same content again, even
/// signed at another time, is the first answer. GitHub routes may read X-GitHub-Event because
/// the ledger pins it with the body.
async fn a_delivery_id_reused_for_other_content_is_refused(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    put_ledger_routes(&app.channel).await;
    let mut by_event = weather_route("gh-event", &[GITHUB_SECRET]);
    if let Some(r) = by_event.route.as_mut() {
        r.kind = IngressKind::Github as i32;
        if let Some(m) = r.mapping.as_mut() {
            m.r#ref =
                "headers['x-github-event'] == 'storm' ? 'storm.warning' : 'storm.' + headers['x-github-event']"
                    .into();
        }
    }
    ingress(&app)
        .put_ingress_route(by_event)
        .await
        .expect("a GitHub route reading X-GitHub-Event");
    let alert = |user: &str, area: &str| json!({"level": "warning", "user": user, "area": area});
    let now = unix_now();
    let mut first = standard(
        &url(&app, "sw"),
        SECRET_NEW,
        "msg-1",
        alert("alice", "north"),
    );
    first["ts"] = json!(now);
    let mut other_body = standard(
        &url(&app, "sw"),
        SECRET_NEW,
        "msg-1",
        alert("alice", "south"),
    );
    other_body["ts"] = json!(now);
    // A sender's retry: the same id and body, signed again a second later.
    let mut retry = standard(
        &url(&app, "sw"),
        SECRET_NEW,
        "msg-1",
        alert("alice", "north"),
    );
    retry["ts"] = json!(now + 1);
    let gh_body = alert("alice", "east").to_string();
    let gh = |event: &str| {
        json!({"url": url(&app, "gh-event"), "sign": "github", "secret": GITHUB_SECRET,
               "body": gh_body, "headers": {"x-github-event": event}})
    };
    let answers = send(json!([
        first,
        other_body,
        retry,
        gh("storm"),
        gh("push"),
        {"replay": 3, "set_headers": {"x-github-event": "issues"}},
        gh("storm"),
    ]))
    .await;
    assert_eq!(answers[0].0, 202, "{:?}", answers[0]);
    assert_eq!(
        answers[1].0, 409,
        "other content under a used id: {:?}",
        answers[1]
    );
    let why = answers[1].1["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("webhook-id `msg-1`")
            && why.contains("another body")
            && why.contains("nothing was decided"),
        "{why}"
    );
    assert_first_answer(&answers[0], &answers[2], "a retry signed at another time");
    assert_eq!(answers[3].0, 202, "{:?}", answers[3]);
    assert_eq!(answers[3].1["triggers"][0]["disposition"], "recorded_inbox");
    for (n, what) in [
        (4, "another event"),
        (5, "a captured request's event header changed"),
    ] {
        assert_eq!(answers[n].0, 409, "{what}: {:?}", answers[n]);
        assert!(
            answers[n].1["error"]
                .as_str()
                .is_some_and(|e| e.contains("X-GitHub-Event")),
            "{what}: {:?}",
            answers[n]
        );
    }
    assert_first_answer(&answers[3], &answers[6], "GitHub's redelivery");
    let areas: Vec<String> = alice_records(&app)
        .await
        .iter()
        .map(|r| {
            r.payload
                .as_ref()
                .and_then(|p| p.fields.get("area"))
                .and_then(|v| match &v.kind {
                    Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(areas, ["north", "east"], "nothing of the refused content");
    // A second sender, with a secret of its own, on the same pack, using the same id for
    // another message: the ledgers differ, the records meet, and it is refused, not answered
    // with the first sender's record.
    ingress(&app)
        .put_ingress_route(weather_route("sw-other", &[SECRET_OTHER]))
        .await
        .expect("a second sender's route");
    let mut second_sender = standard(
        &url(&app, "sw-other"),
        SECRET_OTHER,
        "msg-1",
        alert("alice", "west"),
    );
    second_sender["ts"] = json!(unix_now());
    let answers = send(json!([second_sender])).await;
    assert_eq!(answers[0].0, 409, "{:?}", answers[0]);
    let why = answers[0].1["error"].as_str().unwrap_or_default();
    assert!(why.contains("msg-1") && why.contains("payload"), "{why}");
    assert_eq!(
        alice_records(&app).await.len(),
        2,
        "still only north and east"
    );
}
on_both_stores!(s7_6_a_delivery_id_reused_for_other_content_is_refused => a_delivery_id_reused_for_other_content_is_refused);

/// The route path is not signed: a captured request posted to another route holding the same
/// secret (of the same pack with another mapping, or listing it beside others) is the
/// delivery's first answer there — a drop stays a drop after the grant, an erased record is
/// not made again, no route decides it a second time. A route without that secret refuses it.
async fn a_delivery_sent_to_a_route_sharing_its_secret_is_decided_once(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    put_ledger_routes(&app.channel).await;
    let put = |route: pb::PutIngressRouteRequest| {
        let mut c = ingress(&app);
        async move { c.put_ingress_route(route).await.expect("put route") }
    };
    // A sibling naming the principal another way, holding the secret beside a new one.
    let mut sibling = weather_route("sibling", &[SECRET_OTHER, SECRET_NEW]);
    if let Some(m) = sibling.route.as_mut().and_then(|r| r.mapping.as_mut()) {
        m.principal = "body.user == 'bob' ? 'bob' : 'alice'".into();
    }
    put(sibling).await;
    put(weather_route("stranger", &[SECRET_OTHER])).await;
    let mut gh_sibling = weather_route("gh-sibling", &[GITHUB_SECRET]);
    if let Some(r) = gh_sibling.route.as_mut() {
        r.kind = IngressKind::Github as i32;
    }
    put(gh_sibling).await;
    let plan = ledger_plan(&|route: &str| url(&app, route), unix_now());
    let first = send(Value::Array(plan.clone())).await;
    assert_eq!(
        first[0].1["triggers"][0]["drop_reason"], "no_grant",
        "{:?}",
        first[0]
    );
    grant_bob_weather(&app).await;
    app.records
        .clone()
        .erase_records(pb::EraseRecordsRequest {
            principal: "alice".into(),
            pack_id: "weather".into(),
        })
        .await
        .expect("erase");
    // The sender re-posts each captured request, byte for byte, to another route.
    let mut moved = plan.clone();
    for (n, route) in [
        (0, "sibling"),
        (1, "gh-sibling"),
        (2, "sibling"),
        (3, "gh-sibling"),
        (0, "stranger"),
    ] {
        moved.push(json!({"replay": n, "url": url(&app, route)}));
    }
    let answers = send(Value::Array(moved)).await;
    for (n, what) in [
        (4, "bob's dropped webhook at the sibling"),
        (5, "bob's dropped GitHub delivery at the sibling"),
        (6, "alice's erased webhook at the sibling"),
        (7, "alice's erased GitHub delivery at the sibling"),
    ] {
        assert_first_answer(&first[n - 4], &answers[n], what);
    }
    assert_eq!(
        answers[8].0, 401,
        "a route without the secret: {:?}",
        answers[8]
    );
    assert_eq!(
        records_of(&app, "bob").await.len(),
        0,
        "no drop became a record"
    );
    assert_eq!(
        alice_records(&app).await.len(),
        0,
        "no erased record made again"
    );
    let metrics = reqwest_text(&format!("http://{}/metrics", app.metrics_addr)).await;
    for line in [
        r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="no_grant",pack="weather",ingress="standard_webhooks"} 1"#,
        r#"hcp_sense_deliveries_total{disposition="dropped",drop_reason="no_grant",pack="weather",ingress="github"} 1"#,
    ] {
        assert!(
            metrics.contains(line),
            "decided once: {line} in:\n{metrics}"
        );
    }
}
on_both_stores!(s7_6_a_delivery_sent_to_a_route_sharing_its_secret_is_decided_once => a_delivery_sent_to_a_route_sharing_its_secret_is_decided_once);

/// Copies of a new signed delivery arriving at once (a sender's retries racing, a burst of a
/// captured request) are decided once: one answer decides, every other copy waits for it and
/// gets it as a replay; one record, one count.
async fn concurrent_copies_of_a_delivery_are_decided_once(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    put_ledger_routes(&app.channel).await;
    let original = standard(
        &url(&app, "sw"),
        SECRET_NEW,
        "msg-burst",
        json!({"level": "warning", "user": "alice"}),
    );
    let gh = json!({"url": url(&app, "gh"), "sign": "github", "secret": GITHUB_SECRET,
                    "body": json!({"level": "warning", "user": "alice", "n": 1}).to_string()});
    // Each new delivery goes out as 16 copies at once.
    let burst = |mut r: Value| {
        r["copies"] = json!(16);
        r
    };
    let answers = send(json!([burst(original), burst(gh)])).await;
    for (n, what) in [
        (0, "the webhook's copies"),
        (16, "the GitHub delivery's copies"),
    ] {
        let copies = &answers[n..n + 16];
        for (status, b) in copies {
            assert_eq!(*status, 202, "{what}: {b}");
        }
        let deciding: Vec<_> = copies
            .iter()
            .filter(|(_, b)| b["replay"] == false)
            .collect();
        assert_eq!(deciding.len(), 1, "{what}: one decides: {copies:?}");
        let record = &deciding[0].1["triggers"][0]["record_id"];
        for (_, b) in copies {
            assert_eq!(&b["triggers"][0]["record_id"], record, "{what}: one record");
        }
    }
    let metrics = reqwest_text(&format!("http://{}/metrics", app.metrics_addr)).await;
    for line in [
        r#"hcp_sense_ingress_replayed_total{ingress="standard_webhooks"} 15"#,
        r#"hcp_sense_ingress_replayed_total{ingress="github"} 15"#,
        r#"hcp_sense_deliveries_total{disposition="recorded_inbox",drop_reason="",pack="weather",ingress="standard_webhooks"} 1"#,
        r#"hcp_sense_deliveries_total{disposition="recorded_inbox",drop_reason="",pack="weather",ingress="github"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    assert_eq!(alice_records(&app).await.len(), 2);
}
on_both_stores!(s7_6_concurrent_copies_of_a_delivery_are_decided_once => concurrent_copies_of_a_delivery_are_decided_once);

/// A claim whose replica stopped mid-decision: a copy arriving while it holds waits until 80%
/// of the call's time and is answered 503 with Retry-After (never a hang into the sender's
/// deadline, never a second decision); once the claim lapses, the next copy decides.
async fn a_claim_left_by_a_stopped_replica_lapses(kind: StoreKind) {
    use hcp_sense::ingress::signature::verify;
    use hcp_sense::store::{LedgerKey, LedgerState};
    use hmac::{Hmac, KeyInit, Mac};
    let app = spawn_app_with(kind, |c| {
        c.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.request_timeout = std::time::Duration::from_secs(2);
    })
    .await;
    set_up_weather(&app.channel).await;
    put_ledger_routes(&app.channel).await;
    let body = json!({"level": "warning", "user": "alice", "claimed": true}).to_string();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(GITHUB_SECRET.as_bytes()).expect("key");
    mac.update(body.as_bytes());
    let headers = std::collections::BTreeMap::from([(
        "x-hub-signature-256".to_owned(),
        format!("sha256={}", hex::encode(mac.finalize().into_bytes())),
    )]);
    let v = verify(
        hcp_sense::domain::ingress::IngressKind::Github,
        &[GITHUB_SECRET.to_owned()],
        &headers,
        body.as_bytes(),
        0,
    )
    .expect("signed");
    let key = v.key();
    let ledger = LedgerKey {
        route_id: "gh",
        scopes: &v.scopes,
        key: &key,
        digest: &v.content_digest,
    };
    // The stopped replica's claim, holding for 4 s more.
    let store = hcp_sense::store::Store::connect(&hcp_sense::config::StoreConfig::at(
        app.test_db.url.clone(),
    ))
    .await
    .expect("connect");
    let now = hcp_sense::store::now_micros();
    let held_until = now + 4_000_000;
    assert_eq!(
        store
            .ingress_tables()
            .claim_ingress_delivery(&ledger, now, held_until, None)
            .await
            .expect("claim"),
        LedgerState::Claimed
    );
    let request =
        json!({"url": url(&app, "gh"), "sign": "github", "secret": GITHUB_SECRET, "body": body});
    let waiting = send_plan(json!([request.clone()])).await;
    assert_eq!(waiting[0]["status"], 503, "{waiting:?}");
    assert_eq!(waiting[0]["retry_after"], "1", "{waiting:?}");
    // Answered by the wait's own bound (80% of the call's time), saying why, not cut off by the
    // call's timeout.
    assert!(
        waiting[0]["body"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("a copy of this delivery is being decided")),
        "{waiting:?}"
    );
    assert_eq!(
        alice_records(&app).await.len(),
        0,
        "not decided while claimed"
    );
    // Past the claim: the next copy decides it, once.
    let lapse = u64::try_from(held_until - hcp_sense::store::now_micros()).unwrap_or(0);
    tokio::time::sleep(std::time::Duration::from_micros(lapse + 1)).await;
    let decided = send_plan(json!([request.clone(), request])).await;
    assert_eq!(decided[0]["status"], 202, "{decided:?}");
    assert_eq!(decided[0]["body"]["replay"], false, "{decided:?}");
    assert_eq!(decided[1]["body"]["replay"], true, "{decided:?}");
    assert_eq!(alice_records(&app).await.len(), 1);
    store.close().await;
}
on_both_stores!(s7_6_a_claim_left_by_a_stopped_replica_lapses => a_claim_left_by_a_stopped_replica_lapses);
