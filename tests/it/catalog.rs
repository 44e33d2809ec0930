//! The trigger catalog from outside: payload schemas checked at every ingress before the decision (gRPC, a stream, ExplainTrigger, HTTP, `hcp-sense pipe`; NATS in nats.rs), nothing of a refused payload recorded or counted, idempotency first; ListTriggerTypes paged, filtered and read by runtimes and readers.
use hcp_sense::auth::Role;
use hcp_sense::grpc::pb::{
    self, deliver_triggers_response, pack_service_client::PackServiceClient,
};
use serde_json::{json, Value};
use tonic::Code;

use crate::helpers::{example, spawn_app_with, violations, StoreKind, TestApp};
use crate::ingress::{app_with_ingress, ingress, send_plan, standard, url, SECRET_NEW};
use crate::security::{bearer, token};
use crate::support::trigger::{trigger, with_payload};

/// Registers the `tracker` pack (examples/tracker.pack.yaml), grants alice and switches Sense
/// on pack-wide.
pub async fn set_up_tracker(ch: &tonic::transport::Channel) {
    crate::cli::set_up_public_pack(ch, "tracker.pack.yaml", "tracker").await
}

fn ticket() -> Value {
    json!({"key": "OPS-7", "title": "Disk full", "priority": "high", "reporter": "ann"})
}

/// A ticket that breaks the schema twice: an enum and an item's type.
fn bad_ticket() -> Value {
    json!({"key": "OPS-7", "title": "Disk full", "priority": "urgent", "reporter": "ann",
        "labels": ["disk", 5]})
}

fn created(payload: Value, trigger_id: &str) -> pb::DeliverTriggerRequest {
    let mut t = with_payload(
        trigger("tracker", "ticket.created", "alice", "user"),
        payload,
    );
    t.trigger_id = trigger_id.into();
    t
}

/// The two violations of `bad_ticket`, each naming the payload's pointer and the keyword.
fn assert_bad_ticket(v: &[(String, String)], prefix: &str) {
    let mut fields: Vec<&str> = v.iter().map(|(f, _)| f.as_str()).collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            format!("{prefix}payload/labels/1"),
            format!("{prefix}payload/priority")
        ],
        "{v:?}"
    );
    for (f, d) in v {
        let keyword = if f.ends_with("priority") {
            "`enum`"
        } else {
            "`type`"
        };
        assert!(
            d.contains(keyword) && d.contains("ticket.created"),
            "{f}: {d}"
        );
    }
}

fn dropped_any(metrics: &str) -> bool {
    metrics.lines().any(|l| {
        l.starts_with("hcp_sense_deliveries_total{")
            && l.contains(r#"pack="tracker""#)
            && l.contains(r#"disposition="dropped""#)
    })
}

/// DeliverTrigger, a DeliverTriggers stream and ExplainTrigger refuse a payload its schema
/// refuses with a BadRequest violation per failure (the instance's pointer, the keyword),
/// record nothing and count no drop; a ref without a schema takes any object; a retried
/// recorded trigger id is answered with its first record whatever its payload now.
async fn run_grpc_ingress_checks_the_payload_schema(kind: StoreKind) {
    let app = crate::helpers::spawn_app(kind).await;
    set_up_tracker(&app.channel).await;
    let mut ingest = app.ingest.clone();
    let e = ingest
        .deliver_trigger(created(bad_ticket(), "t-bad"))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_bad_ticket(&violations(&e), "");
    let ok = ingest
        .deliver_trigger(created(ticket(), "t-1"))
        .await
        .expect("recorded")
        .into_inner();
    let first = ok;
    assert_eq!(first.disposition, pb::Disposition::RecordedInbox as i32);
    // The same id again with a payload the schema refuses is another message, refused for
    // its payload; the same trigger again is its first record.
    let e = ingest
        .deliver_trigger(created(bad_ticket(), "t-1"))
        .await
        .expect_err("not a retry");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_bad_ticket(&violations(&e), "");
    let again = ingest
        .deliver_trigger(created(ticket(), "t-1"))
        .await
        .expect("the first record")
        .into_inner();
    assert_eq!(
        (again.record_id.as_str(), again.duplicate),
        (first.record_id.as_str(), true)
    );
    // No schema: any object.
    let mut closed = with_payload(
        trigger("tracker", "ticket.closed", "alice", "user"),
        json!({"anything": [1, {"x": null}]}),
    );
    closed.trigger_id = "c-1".into();
    ingest.deliver_trigger(closed).await.expect("no schema");
    // A stream: the bad item answered on its own, the rest recorded.
    let items = [ticket(), bad_ticket(), ticket()]
        .into_iter()
        .enumerate()
        .map(|(n, p)| pb::DeliverTriggersRequest {
            trigger: Some(created(p, &format!("s-{n}"))),
        })
        .collect::<Vec<_>>();
    let mut out = ingest
        .deliver_triggers(tokio_stream::iter(items))
        .await
        .expect("stream")
        .into_inner();
    let mut answers = Vec::new();
    while let Some(item) = out.message().await.expect("item") {
        answers.push(item.result.expect("result"));
    }
    assert_eq!(answers.len(), 3);
    match &answers[1] {
        deliver_triggers_response::Result::Error(e) => {
            assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}");
            let v: Vec<(String, String)> = e
                .violations
                .iter()
                .map(|v| (v.field.clone(), v.description.clone()))
                .collect();
            assert_bad_ticket(&v, "");
        }
        other => panic!("the bad item was not refused: {other:?}"),
    }
    for a in [&answers[0], &answers[2]] {
        assert!(
            matches!(a, deliver_triggers_response::Result::Outcome(_)),
            "{a:?}"
        );
    }
    // ExplainTrigger: the same refusal, fields named as that request holds them.
    let e = ingest
        .explain_trigger(pb::ExplainTriggerRequest {
            trigger: Some(created(bad_ticket(), "")),
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_bad_ticket(&violations(&e), "trigger.");
    assert_eq!(app.count("records").await, 4, "t-1, c-1, s-0, s-2");
    let metrics = crate::helpers::http_get(&format!("http://{}/metrics", app.metrics_addr));
    assert!(!dropped_any(&metrics), "{metrics}");
}
on_both_stores!(s7_3_2_grpc_ingress_checks_the_payload_schema => run_grpc_ingress_checks_the_payload_schema);

/// A webhook whose payload breaks the schema is 400 with the violations in JSON, nothing
/// recorded; the one that keeps it is recorded.
async fn run_http_ingress_checks_the_payload_schema(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_tracker(&app.channel).await;
    ingress(&app)
        .put_ingress_route(pb::PutIngressRouteRequest {
            route: Some(pb::IngressRoute {
                route_id: "tickets".into(),
                pack_id: "tracker".into(),
                kind: pb::IngressKind::StandardWebhooks as i32,
                mapping: Some(pb::IngressMapping {
                    r#ref: "'ticket.created'".into(),
                    principal: "'alice'".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            secrets: vec![SECRET_NEW.into()],
        })
        .await
        .expect("route");
    let u = url(&app, "tickets");
    let answers = send_plan(json!([
        standard(&u, SECRET_NEW, "msg_bad", bad_ticket()),
        standard(&u, SECRET_NEW, "msg_ok", ticket()),
    ]))
    .await;
    assert_eq!(answers[0]["status"], 400, "{answers:?}");
    let v: Vec<(String, String)> = answers[0]["body"]["violations"]
        .as_array()
        .expect("violations")
        .iter()
        .map(|v| {
            (
                v["field"].as_str().unwrap_or_default().to_owned(),
                v["description"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_bad_ticket(&v, "");
    assert_eq!(answers[1]["status"], 202, "{answers:?}");
    assert_eq!(app.count("records").await, 1);
}
on_both_stores!(s7_3_2_http_ingress_checks_the_payload_schema => run_http_ingress_checks_the_payload_schema);

/// `hcp-sense pipe`: a line whose payload breaks the schema is reported on stderr with its line
/// number; the others are delivered.
async fn run_pipe_checks_the_payload_schema(kind: StoreKind) {
    let app = crate::helpers::spawn_app(kind).await;
    set_up_tracker(&app.channel).await;
    let lines = [
        json!({"ref": "ticket.created", "trigger_id": "p-1", "payload": ticket()}),
        json!({"ref": "ticket.created", "trigger_id": "p-2", "payload": bad_ticket()}),
        json!({"ref": "ticket.created", "trigger_id": "p-3", "payload": ticket()}),
    ];
    let script: String = lines.iter().map(|l| format!("echo '{l}'\n")).collect();
    let server = format!("http://{}", app.addr);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::support::served::BIN)
            .args([
                "pipe",
                "--server",
                &server,
                "--pack",
                "tracker",
                "--principal",
                "alice",
            ])
            .args(["--", "sh", "-c", &script])
            .output()
            .expect("hcp-sense pipe")
    })
    .await
    .expect("join");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 2:") && stderr.contains("payload/priority"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("line 1:") && !stderr.contains("line 3:"),
        "{stderr}"
    );
    assert_eq!(app.count("records").await, 2, "{stderr}");
}
on_both_stores!(s7_3_2_pipe_checks_the_payload_schema => run_pipe_checks_the_payload_schema);

async fn list(
    packs: &mut PackServiceClient<tonic::transport::Channel>,
    req: pb::ListTriggerTypesRequest,
) -> Result<pb::ListTriggerTypesResponse, tonic::Status> {
    packs.list_trigger_types(req).await.map(|r| r.into_inner())
}

/// ListTriggerTypes pages through every declared ref in (pack, ref) order, one at a time,
/// filters by pack, shows land, description and schema (the hub's for binding.degraded), and
/// for a principal whether it could receive each now.
async fn run_trigger_types_are_listed(kind: StoreKind) {
    let mut app = crate::helpers::spawn_app(kind).await;
    set_up_tracker(&app.channel).await;
    crate::packs::register(&mut app, &example("github.pack.json")).await;
    let mut packs = app.packs.clone();
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = list(
            &mut packs,
            pb::ListTriggerTypesRequest {
                page_size: 1,
                page_token: token.clone(),
                ..Default::default()
            },
        )
        .await
        .expect("page");
        assert!(page.trigger_types.len() <= 1);
        seen.extend(page.trigger_types);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let keys: Vec<(&str, &str)> = seen
        .iter()
        .map(|t| (t.pack_id.as_str(), t.r#ref.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("github", "binding.degraded"),
            ("github", "issue.opened"),
            ("github", "pull_request.review_requested"),
            ("tracker", "ticket.closed"),
            ("tracker", "ticket.created"),
        ]
    );
    let degraded: Value = serde_json::from_str(&seen[0].payload_schema).expect("hub schema");
    assert_eq!(degraded["required"], json!(["state"]));
    assert_eq!(seen[2].land, "project");
    assert!(seen[1].payload_schema.is_empty() && seen[1].receivability.is_none());
    let created: Value = serde_json::from_str(&seen[4].payload_schema).expect("schema");
    assert_eq!(
        created,
        example("tracker.pack.yaml")["stimulusTriggers"][0]["payloadSchema"]
    );
    assert_eq!(seen[4].description, "A ticket was opened in the tracker.");
    // A token is for the listing it came from.
    let first = list(
        &mut packs,
        pb::ListTriggerTypesRequest {
            page_size: 1,
            ..Default::default()
        },
    )
    .await
    .expect("page");
    let e = list(
        &mut packs,
        pb::ListTriggerTypesRequest {
            page_size: 1,
            page_token: first.next_page_token,
            pack_id: "tracker".into(),
            ..Default::default()
        },
    )
    .await
    .expect_err("another listing's token");
    assert_eq!(e.code(), Code::InvalidArgument);
    // By pack, for a principal: alice is granted and Sense is on; bob is not granted.
    for (who, receivable, reasons) in [("alice", true, vec![]), ("bob", false, vec!["no_grant"])] {
        let page = list(
            &mut packs,
            pb::ListTriggerTypesRequest {
                pack_id: "tracker".into(),
                principal: who.into(),
                ..Default::default()
            },
        )
        .await
        .expect("page");
        assert_eq!(page.trigger_types.len(), 2);
        for t in &page.trigger_types {
            let r = t.receivability.as_ref().expect("asked");
            assert_eq!(
                (r.principal.as_str(), r.receivable),
                (who, receivable),
                "{t:?}"
            );
            assert_eq!(r.drop_reasons, reasons, "{t:?}");
        }
    }
    // github: alice has no grant there, no Binding, and Sense is off.
    let page = list(
        &mut packs,
        pb::ListTriggerTypesRequest {
            pack_id: "github".into(),
            principal: "alice".into(),
            ..Default::default()
        },
    )
    .await
    .expect("page");
    let r = page.trigger_types[1].receivability.clone().expect("asked");
    assert!(!r.receivable);
    assert!(r.drop_reasons.contains(&"no_grant".to_owned()), "{r:?}");
    for (req, code, field) in [
        (
            pb::ListTriggerTypesRequest {
                pack_id: "nope".into(),
                ..Default::default()
            },
            Code::NotFound,
            "",
        ),
        (
            pb::ListTriggerTypesRequest {
                pack_id: "Bad Id".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "pack_id",
        ),
        (
            pb::ListTriggerTypesRequest {
                principal: "has space".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "principal",
        ),
        (
            pb::ListTriggerTypesRequest {
                page_size: -1,
                ..Default::default()
            },
            Code::InvalidArgument,
            "page_size",
        ),
    ] {
        let e = list(&mut packs, req.clone()).await.expect_err("refused");
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        if !field.is_empty() {
            assert_eq!(violations(&e)[0].0, field, "{req:?}");
        }
    }
}
on_both_stores!(trigger_types_are_listed => run_trigger_types_are_listed);

/// A runtime lists for any principal; a reader for its own (named or not) and no other; a
/// pack registered again with a new schema is listed and checked with it at once.
async fn run_trigger_types_for_runtimes_and_readers(kind: StoreKind) {
    const ADMIN: &str = "catalog-admin";
    const RUNTIME: &str = "catalog-runtime";
    const READER: &str = "catalog-reader-bob";
    let app: TestApp = spawn_app_with(kind, |c| {
        c.auth.tokens = vec![
            token("ops", ADMIN, Role::Admin, None),
            token("harness", RUNTIME, Role::Runtime, None),
            token("bob-reader", READER, Role::Reader, Some("bob")),
        ];
    })
    .await;
    let mut admin = PackServiceClient::new(bearer(&app.channel, ADMIN));
    admin
        .register_pack(crate::packs::register_req(&example("tracker.pack.yaml")))
        .await
        .expect("register");
    let mut runtime = PackServiceClient::new(bearer(&app.channel, RUNTIME));
    let r = runtime
        .list_trigger_types(pb::ListTriggerTypesRequest {
            principal: "carol".into(),
            ..Default::default()
        })
        .await
        .expect("runtime")
        .into_inner();
    assert_eq!(
        r.trigger_types[0]
            .receivability
            .as_ref()
            .expect("asked")
            .principal,
        "carol"
    );
    let mut reader = PackServiceClient::new(bearer(&app.channel, READER));
    let own = reader
        .list_trigger_types(pb::ListTriggerTypesRequest::default())
        .await
        .expect("reader")
        .into_inner();
    assert_eq!(own.trigger_types.len(), 2);
    for t in &own.trigger_types {
        assert_eq!(
            t.receivability.as_ref().expect("own principal").principal,
            "bob"
        );
    }
    let e = reader
        .list_trigger_types(pb::ListTriggerTypesRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await
        .expect_err("another principal");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = reader
        .lint_pack(pb::LintPackRequest::default())
        .await
        .expect_err("readers do not manage packs");
    assert_eq!(e.code(), Code::PermissionDenied);
    // A new version of the schema: `priority` may now be `urgent`.
    let mut m = example("tracker.pack.yaml");
    m["stimulusTriggers"][0]["payloadSchema"]["properties"]["priority"]["enum"]
        .as_array_mut()
        .expect("enum")
        .push(json!("urgent"));
    admin
        .register_pack(crate::packs::register_req(&m))
        .await
        .expect("again");
    let listed = runtime
        .list_trigger_types(pb::ListTriggerTypesRequest {
            pack_id: "tracker".into(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert!(listed.trigger_types[1].payload_schema.contains("urgent"));
    let mut ingest =
        pb::ingest_service_client::IngestServiceClient::new(bearer(&app.channel, RUNTIME));
    let urgent = json!({"key": "OPS-7", "title": "x", "priority": "urgent", "reporter": "ann"});
    let ok = ingest
        .deliver_trigger(created(urgent, ""))
        .await
        .expect("conforms to the new schema")
        .into_inner();
    // Decided (no one is granted here), not refused.
    assert_eq!(ok.disposition, pb::Disposition::Dropped as i32);
}
on_both_stores!(trigger_types_for_runtimes_and_readers => run_trigger_types_for_runtimes_and_readers);

/// Hostile schemas are refused at registration with the trigger and the pointer named, and
/// nothing of the pack is stored.
async fn run_hostile_schemas_are_refused_at_registration(kind: StoreKind) {
    let app = crate::helpers::spawn_app(kind).await;
    let mut packs = app.packs.clone();
    // Deeper than a schema may nest, within what a google.protobuf.Struct carries.
    let deep = (0..17).fold(json!({"type": "string"}), |s, _| json!({ "allOf": [s] }));
    let many: Vec<Value> = (0..2_000).map(|i| json!(i)).collect();
    for (schema, field) in [
        (
            json!({"properties": {"a": {"pattern": "^(a|a)*\\1$"}}}),
            "/properties/a/pattern",
        ),
        (
            json!({"anyOf": [{"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]}),
            "",
        ),
        (json!({"$ref": "#"}), ""),
        (json!({"$ref": "https://example.com/x.json"}), "/$ref"),
        (json!({"enum": many}), ""),
        (deep, ""),
    ] {
        let mut m = example("tracker.pack.yaml");
        m["stimulusTriggers"][1]["payloadSchema"] = schema.clone();
        let e = packs
            .register_pack(crate::packs::register_req(&m))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{schema}");
        let v = violations(&e);
        assert_eq!(
            v[0].0,
            format!("stimulusTriggers[1].payloadSchema{field}"),
            "{schema}: {v:?}"
        );
        assert!(v[0].1.contains("ticket.closed"), "{v:?}");
    }
    assert_eq!(app.count("packs").await, 0);
}
on_both_stores!(hostile_schemas_are_refused_at_registration => run_hostile_schemas_are_refused_at_registration);

/// A pack of `refs` trigger types, each with a schema of about 30 KB (a long description).
fn bulky_pack(pack_id: &str, refs: usize) -> Value {
    let refs: Vec<String> = (0..refs).map(|i| format!("bulk.r{i:02}")).collect();
    json!({
        "id": pack_id,
        "kind": "sense_only",
        "stimulusTriggers": refs.iter().map(|r| json!({
            "ref": r,
            "payloadSchema": {
                "type": "object",
                "description": format!("{r} ").repeat(30_000 / (r.len() + 1)),
            },
        })).collect::<Vec<_>>(),
        "policy": {
            "stimuli": refs.iter().map(|r| json!({"ref": r, "operation": "read", "land": "user"}))
                .collect::<Vec<_>>(),
        },
        "binding": {"mode": "public", "hub": "none"},
    })
}

/// ListTriggerTypes ends a page before the type that would take its items past 1 MiB
/// encoded, whatever page_size asks for, with a token for the rest: 40 types of 30 KB each
/// (1.2 MB) come in two pages, the first as full as the bound allows, and paging through
/// yields every type exactly once. (A stock client's receive limit is 4 MiB.)
async fn run_a_page_of_trigger_types_has_a_byte_bound(kind: StoreKind) {
    use prost::Message;
    const BOUND: usize = 1024 * 1024;
    let mut app = crate::helpers::spawn_app(kind).await;
    for id in ["bulk1", "bulk2"] {
        crate::packs::register(&mut app, &bulky_pack(id, 20)).await;
    }
    let mut packs = app.packs.clone();
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = list(
            &mut packs,
            pb::ListTriggerTypesRequest {
                page_size: 1000,
                page_token: token.clone(),
                ..Default::default()
            },
        )
        .await
        .expect("list");
        assert!(page.encoded_len() <= BOUND + 1024, "{}", page.encoded_len());
        seen.extend(
            page.trigger_types
                .iter()
                .map(|t| (t.pack_id.clone(), t.r#ref.clone())),
        );
        token = page.next_page_token.clone();
        pages.push(page);
        if token.is_empty() {
            break;
        }
    }
    let mut all: Vec<(String, String)> = Vec::new();
    for p in ["bulk1", "bulk2"] {
        for i in 0..20 {
            all.push((p.to_owned(), format!("bulk.r{i:02}")));
        }
    }
    assert_eq!(seen, all, "every type once, in order");
    assert_eq!(pages.len(), 2);
    // The boundary: the first page's items fit; with the next one they would not.
    let cost = |t: &pb::TriggerType| t.encoded_len() + 3 + 2;
    let first: usize = pages[0].trigger_types.iter().map(cost).sum();
    assert!(first <= BOUND, "{first}");
    assert!(
        first + cost(&pages[1].trigger_types[0]) > BOUND,
        "the first page stopped early: {first}"
    );
    // A page_size under the bound still ends pages first.
    let small = list(
        &mut packs,
        pb::ListTriggerTypesRequest {
            page_size: 3,
            ..Default::default()
        },
    )
    .await
    .expect("list");
    assert_eq!(small.trigger_types.len(), 3);
    assert!(!small.next_page_token.is_empty());
}
on_both_stores!(a_page_of_trigger_types_has_a_byte_bound => run_a_page_of_trigger_types_has_a_byte_bound);

/// The costs of patterns at the payload limit: a pattern whose worst case over the largest
/// payload is over the budget is refused at registration, naming its pointer and the numbers;
/// one within it is accepted, and a payload large enough to be checked on the check pool is
/// answered as inline (refused naming the pointer, or recorded). Manifest text nested past its
/// bound is refused naming `manifest_text`. A deleted pack's compiled trigger types are let go.
async fn run_pattern_costs_are_bounded_at_the_payload_limit(kind: StoreKind) {
    let app = crate::helpers::spawn_app(kind).await;
    set_up_tracker(&app.channel).await;
    let mut packs = app.packs.clone();
    let mut m = example("tracker.pack.yaml");
    m["stimulusTriggers"][1]["payloadSchema"] =
        json!({"properties": {"a": {"pattern": "a[ab]{3637}c"}}});
    let e = packs
        .register_pack(crate::packs::register_req(&m))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument);
    let v = violations(&e);
    assert_eq!(
        v[0].0, "stimulusTriggers[1].payloadSchema/properties/a/pattern",
        "{v:?}"
    );
    assert!(
        v[0].1.contains("58304 units/byte")
            && v[0].1.contains("--max-payload-bytes 65536")
            && v[0].1.contains("budget of 33554432"),
        "{v:?}"
    );
    // 40,000 levels of YAML: refused before it is parsed.
    let e = packs
        .register_pack(pb::RegisterPackRequest {
            source: Some(pb::register_pack_request::Source::ManifestText(
                "- ".repeat(40_000) + "x\n",
            )),
        })
        .await
        .expect_err("too deep");
    assert_eq!(e.code(), Code::InvalidArgument);
    let v = violations(&e);
    assert_eq!(v[0].0, "manifest_text", "{v:?}");
    assert!(v[0].1.contains("64 levels"), "{v:?}");
    // Within the budget: accepted; a 60 KB string is checked off the workers.
    m["stimulusTriggers"][1]["payloadSchema"] =
        json!({"properties": {"a": {"pattern": "a[ab]{20}c"}}});
    packs
        .register_pack(crate::packs::register_req(&m))
        .await
        .expect("accepted");
    let closed = |a: String, id: &str| {
        let mut t = with_payload(
            trigger("tracker", "ticket.closed", "alice", "user"),
            json!({ "a": a }),
        );
        t.trigger_id = id.into();
        t
    };
    let mut ingest = app.ingest.clone();
    let e = ingest
        .deliver_trigger(closed("ab".repeat(30_000), "big-1"))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(violations(&e)[0].0, "payload/a");
    let ok = ingest
        .deliver_trigger(closed(
            "ab".repeat(30_000) + "a" + &"b".repeat(20) + "c",
            "big-2",
        ))
        .await
        .expect("recorded")
        .into_inner();
    assert_eq!(ok.disposition, pb::Disposition::RecordedInbox as i32);
    assert_eq!(app.count("records").await, 1);
}
on_both_stores!(pattern_costs_are_bounded_at_the_payload_limit => run_pattern_costs_are_bounded_at_the_payload_limit);

/// A deleted pack's compiled trigger types are not kept by the store, on the replica that deleted it
/// and on one that reloads its view after.
async fn run_a_deleted_packs_catalog_is_let_go(kind: StoreKind) {
    let db = crate::helpers::TestDb::create(kind).await;
    let store = db.store(2).await;
    store.migrate_up().await.expect("migrated");
    let other = db.store(2).await;
    let tables = store.policy_tables();
    let m = hcp_sense::domain::pack::lint(&example("tracker.pack.yaml"))
        .manifest
        .expect("valid");
    let actor = hcp_sense::store::audit::Actor {
        subject: "t".into(),
        role: "admin".into(),
        rpc: "RegisterPack".into(),
    };
    tables.put_pack(&actor, &m, 1).await.expect("stored");
    let p = tables.load_pack_policy("tracker").await.expect("loaded");
    assert!(p.is_some_and(|p| p.trigger_types.schema("ticket.created").is_some()));
    other.policy_tables().load_policy().await.expect("view");
    assert_eq!(
        (
            tables.trigger_types_held(),
            other.policy_tables().trigger_types_held()
        ),
        (1, 1)
    );
    assert!(tables
        .delete_pack(&actor, "tracker")
        .await
        .expect("deleted"));
    assert_eq!(tables.trigger_types_held(), 0);
    // The other replica hears of it (or reloads the whole view): let go there too.
    other.policy_tables().load_policy().await.expect("view");
    assert_eq!(other.policy_tables().trigger_types_held(), 0);
}
on_both_stores!(a_deleted_packs_catalog_is_let_go => run_a_deleted_packs_catalog_is_let_go);
