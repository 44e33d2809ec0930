//! ExplainTrigger against DeliverTrigger, activation filters, EraseRecords and retention by land, over real gRPC on both stores.
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use hcp_sense::grpc::pb::{
    self, record_service_client::RecordServiceClient, ActivateSenseRequest, BindingState,
    CheckVerdict, DeliverTriggerRequest, Disposition, DropReason, EraseRecordsRequest,
    ExplainTriggerRequest, ListRecordsRequest, Route,
};
use serde_json::json;
use tonic::Code;

use crate::helpers::{example, http_get, spawn_app_with, violations, StoreKind, TestApp};
use crate::packs::register;
use crate::sense::{activate, bind, deliver, drop_reports, grant, list, opened, ready, revoke};
use crate::support::trigger::{trigger, with_payload};

/// Sets an activation with a filter; the status when refused.
async fn activate_filtered(
    app: &mut TestApp,
    principal: &str,
    route: Route,
    filter: &str,
) -> Result<pb::SenseActivation, tonic::Status> {
    app.policy
        .activate_sense(ActivateSenseRequest {
            principal: principal.into(),
            pack_id: "github".into(),
            route: route as i32,
            filter: filter.into(),
        })
        .await
        .map(|r| r.into_inner().activation.expect("activation"))
}

async fn explain_call(
    app: &mut TestApp,
    trigger: Option<DeliverTriggerRequest>,
) -> Result<pb::ExplainTriggerResponse, tonic::Status> {
    app.ingest
        .explain_trigger(ExplainTriggerRequest { trigger })
        .await
        .map(tonic::Response::into_inner)
}

async fn explain(app: &mut TestApp, t: DeliverTriggerRequest) -> pb::ExplainTriggerResponse {
    explain_call(app, Some(t)).await.expect("explain")
}

/// An issue of a public or private repository.
fn issue(principal: &str, private: bool) -> DeliverTriggerRequest {
    with_payload(
        trigger("github", "issue.opened", principal, "user"),
        json!({ "issue": 1, "repository": { "private": private, "full_name": "acme/w" } }),
    )
}

const TYPICAL: &str = "payload.repository.private == false && ref.startsWith('issue.')";

/// The principals of the explain matrix: every grant × Binding × activation state.
const ACTIVATIONS: [&str; 6] = ["none", "off", "on", "drop", "error", "silent"];

fn matrix_principal(granted: bool, binding: usize, activation: usize) -> String {
    format!("p-{}-{binding}-{activation}", u8::from(granted))
}

async fn explain_agrees_with_deliver_on_every_combination(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    register(&mut app, &example("github.pack.json")).await;
    let mut principals = Vec::new();
    for granted in [false, true] {
        for binding in 0..3 {
            for (activation, kind) in ACTIVATIONS.iter().enumerate() {
                let who = matrix_principal(granted, binding, activation);
                if granted {
                    grant(&mut app, &who, "github").await;
                }
                match binding {
                    1 => {
                        bind(&mut app, &who, "github", BindingState::Stale).await;
                    }
                    2 => {
                        bind(&mut app, &who, "github", BindingState::Linked).await;
                    }
                    _ => {}
                }
                let filter = match *kind {
                    "drop" => "payload.repository.private",
                    "error" => "payload.missing == 1",
                    "silent" => "land == 'user' ? 'silent' : 'drop'",
                    _ => "",
                };
                match *kind {
                    "none" => {}
                    "off" => {
                        app.policy
                            .deactivate_sense(pb::DeactivateSenseRequest {
                                principal: who.clone(),
                                pack_id: "github".into(),
                            })
                            .await
                            .expect("deactivate");
                    }
                    _ => {
                        activate_filtered(&mut app, &who, Route::Inbox, filter)
                            .await
                            .expect("activate");
                    }
                }
                principals.push(who);
            }
        }
    }
    // Every principal with every trigger shape: known or unknown pack, declared or undeclared
    // ref, its Policy land or another; under no pack-wide activation, then a filtered one.
    let shapes = |who: &str| {
        let mut out = Vec::new();
        for pack in ["github", "nope"] {
            for r#ref in ["issue.opened", "issue.closed"] {
                for land in ["user", "project"] {
                    let mut t = issue(who, false);
                    t.pack_id = pack.into();
                    t.r#ref = r#ref.into();
                    t.land = land.into();
                    if land == "project" {
                        t.project = "acme".into();
                    }
                    out.push(t);
                }
            }
        }
        out
    };
    let mut compared = 0;
    let mut reasons = BTreeSet::new();
    for pack_wide in ["", TYPICAL] {
        if !pack_wide.is_empty() {
            activate_filtered(&mut app, "", Route::Silent, pack_wide)
                .await
                .expect("pack-wide activation");
        }
        // First every explanation: none records, counts or reports anything. The drop log
        // flushes every 250 ms: what was dropped before is settled first.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let mut explained = Vec::new();
        let before = (app.count("records").await, app.count("drop_reports").await);
        for who in &principals {
            for t in shapes(who) {
                explained.push((t.clone(), explain(&mut app, t).await));
            }
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(
            (app.count("records").await, app.count("drop_reports").await),
            before,
            "ExplainTrigger records and counts nothing"
        );
        for (t, e) in explained {
            let d = deliver(&mut app, t.clone()).await;
            assert_eq!(
                (e.disposition, e.drop_reason),
                (d.disposition, d.drop_reason),
                "{t:?}: explained {e:?}, delivered {d:?}"
            );
            let first_failing = e
                .checks
                .iter()
                .find(|c| c.verdict == CheckVerdict::Fail as i32)
                .map_or(0, |c| c.drop_reason);
            assert_eq!(first_failing, e.drop_reason, "{e:?}");
            let names: Vec<&str> = e.checks.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "pack",
                    "ref",
                    "grant",
                    "binding",
                    "land",
                    "activation",
                    "filter"
                ]
            );
            reasons.insert(d.drop_reason);
            compared += 1;
        }
    }
    assert_eq!(compared, 2 * principals.len() * 8);
    // Every reason but no_project (the hub's own) came up.
    for r in [
        DropReason::Unspecified,
        DropReason::UnknownPack,
        DropReason::UndeclaredRef,
        DropReason::NoGrant,
        DropReason::NoConnectedBinding,
        DropReason::LandMismatch,
        DropReason::ActivationOff,
        DropReason::Filtered,
        DropReason::FilterError,
    ] {
        assert!(reasons.contains(&(r as i32)), "{r:?} never came up");
    }
}

on_both_stores!(s7_3_explain_agrees_with_deliver_on_every_combination => explain_agrees_with_deliver_on_every_combination);

async fn explain_reads_the_facts_and_keeps_idempotency(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    activate_filtered(&mut app, "", Route::Silent, TYPICAL)
        .await
        .expect("pack-wide");
    let e = explain(&mut app, issue("alice", true)).await;
    assert_eq!(e.disposition, Disposition::RecordedInbox as i32, "{e:?}");
    assert_eq!(e.binding_id, "github-alice");
    let fact = |e: &pb::ExplainTriggerResponse, check: &str, key: &str| {
        e.checks
            .iter()
            .find(|c| c.name == check)
            .and_then(|c| c.facts.get(key).cloned())
            .unwrap_or_default()
    };
    assert_eq!(fact(&e, "ref", "policy_land"), "user");
    assert_eq!(fact(&e, "binding", "binding_state"), "linked");
    assert_eq!(fact(&e, "activation", "source"), "principal");
    assert_eq!(fact(&e, "activation", "route"), "inbox");
    // bob has no activation of his own: the pack-wide one, with its filter, is in force.
    grant(&mut app, "bob", "github").await;
    bind(&mut app, "bob", "github", BindingState::Linked).await;
    let e = explain(&mut app, issue("bob", true)).await;
    assert_eq!(e.drop_reason, DropReason::Filtered as i32, "{e:?}");
    assert_eq!(fact(&e, "activation", "source"), "pack_default");
    assert_eq!(fact(&e, "activation", "filter"), TYPICAL);
    assert_eq!(fact(&e, "filter", "result"), "drop");
    let e = explain(&mut app, issue("bob", false)).await;
    assert_eq!(e.disposition, Disposition::RecordedSilent as i32, "{e:?}");
    // A trigger id recorded before is answered with its record, even after the grant goes,
    // as DeliverTrigger answers it.
    let mut t = issue("alice", false);
    t.trigger_id = "gh-1".into();
    let first = deliver(&mut app, t.clone()).await;
    revoke(&mut app, "alice", "github").await;
    let e = explain(&mut app, t.clone()).await;
    assert_eq!(e.duplicate_record_id, first.record_id);
    assert_eq!(e.disposition, first.disposition);
    let again = deliver(&mut app, t.clone()).await;
    assert!(again.duplicate && again.record_id == first.record_id);
    // The grant check says why, though the duplicate answers.
    assert!(e
        .checks
        .iter()
        .any(|c| c.name == "grant" && c.verdict == CheckVerdict::Fail as i32));
    // The same trigger id for another principal: a conflict, as DeliverTrigger answers it.
    t.principal = "bob".into();
    let s = explain_call(&mut app, Some(t.clone()))
        .await
        .expect_err("conflict");
    assert_eq!(s.code(), Code::AlreadyExists);
    // Malformed input: INVALID_ARGUMENT naming the field, as DeliverTrigger; no trigger at all too.
    let mut bad = issue("alice", false);
    bad.r#ref = "Issue.Opened".into();
    let s = explain_call(&mut app, Some(bad))
        .await
        .expect_err("bad ref");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        violations(&s).iter().any(|(f, _)| f == "trigger.ref"),
        "{s:?}"
    );
    let s = explain_call(&mut app, None).await.expect_err("no trigger");
    assert!(violations(&s).iter().any(|(f, _)| f == "trigger"), "{s:?}");
}

on_both_stores!(explain_reads_the_facts_and_keeps_idempotency => explain_reads_the_facts_and_keeps_idempotency);

async fn filters_are_checked_at_activation_and_nothing_is_written_when_refused(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    activate_filtered(&mut app, "alice", Route::Silent, TYPICAL)
        .await
        .expect("typical filter");
    let before = app.snapshot(false).await;
    let long = format!("ref == '{}'", "x".repeat(1100));
    let deep = format!("{}true{}", "(".repeat(300), ")".repeat(300));
    let many = format!("size([{}1]) > 0", "1,".repeat(299));
    // Six payload values joined by `+` may build more than an evaluation is allowed.
    let joined = "size(payload.a + payload.b + payload.c + payload.d + payload.e + payload.f) > 0";
    for (filter, says) in [
        ("ref ==", "line 1, column"),
        ("payload.labels.exists(l, l == 'bug')", "comprehension"),
        ("[1,2].map(x, [1,2].map(y, x))", "comprehension"),
        ("principal == 'alice'", "`principal`"),
        ("1 + 'a'", "always fails"),
        ("'inbx'", "always"),
        ("  ", "blank"),
        (long.as_str(), "bytes"),
        (deep.as_str(), ""),
        (many.as_str(), "terms"),
        (joined, "concatenation"),
    ] {
        let s = activate_filtered(&mut app, "alice", Route::Inbox, filter)
            .await
            .expect_err(filter);
        assert_eq!(s.code(), Code::InvalidArgument, "{filter}");
        let v = violations(&s);
        assert!(
            v.iter().any(|(f, d)| f == "filter" && d.contains(says)),
            "{}: {v:?}",
            &filter[..filter.len().min(40)]
        );
    }
    assert_eq!(
        app.snapshot(false).await,
        before,
        "a refused filter writes nothing"
    );
    // Exactly 1,024 bytes is taken; 1,025 is not.
    let at = format!("ref == '{}'", "x".repeat(1024 - 9));
    assert_eq!(at.len(), 1024);
    activate_filtered(&mut app, "alice", Route::Inbox, &at)
        .await
        .expect("1,024 bytes");
    let over = format!("ref == '{}'", "x".repeat(1024 - 8));
    assert!(activate_filtered(&mut app, "alice", Route::Inbox, &over)
        .await
        .is_err());
}

on_both_stores!(filters_are_checked_at_activation_and_nothing_is_written_when_refused => filters_are_checked_at_activation_and_nothing_is_written_when_refused);

/// A payload's numbers are doubles whatever their value, so one filter decides 6.5, 9 and -3
/// alike over gRPC, and CEL's type identifiers are types, not variables.
async fn filters_read_every_json_number_as_a_double_and_name_types(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    let decide = |n: serde_json::Value| {
        with_payload(
            trigger("github", "issue.opened", "alice", "user"),
            json!({ "n": n, "s": "x" }),
        )
    };
    for (filter, direct) in [
        ("payload.n * 2.0 > 10.0", true),
        (
            "type(payload.s) == string && double(payload.n) * 2.0 > 10.0",
            false,
        ),
    ] {
        activate_filtered(&mut app, "alice", Route::Inbox, filter)
            .await
            .unwrap_or_else(|s| panic!("{filter}: {s:?}"));
        for (n, want) in [
            (json!(6.5), None),
            (json!(9), None),
            (json!(-3), Some(DropReason::Filtered)),
            (json!(5), Some(DropReason::Filtered)),
        ] {
            let r = deliver(&mut app, decide(n.clone())).await;
            let got = (r.disposition == Disposition::Dropped as i32)
                .then(|| DropReason::try_from(r.drop_reason).expect("reason"));
            assert_eq!(got, want, "{filter} on {n} ({direct})");
        }
    }
    // Across kinds: equal by value; arithmetic that mixes them fails as CEL's does.
    for (filter, n, want) in [
        ("payload.n == 9", json!(9), None),
        ("int(payload.n) == 9", json!(9.5), None),
        (
            "type(payload.n) == double && type(payload.n) != int",
            json!(9),
            None,
        ),
        (
            "payload.n + 1 > 2.0",
            json!(9),
            Some(DropReason::FilterError),
        ),
    ] {
        activate_filtered(&mut app, "alice", Route::Inbox, filter)
            .await
            .unwrap_or_else(|s| panic!("{filter}: {s:?}"));
        let r = deliver(&mut app, decide(n.clone())).await;
        let got = (r.disposition == Disposition::Dropped as i32)
            .then(|| DropReason::try_from(r.drop_reason).expect("reason"));
        assert_eq!(got, want, "{filter} on {n}");
    }
    // A name that is neither a variable nor a type is still refused.
    let s = activate_filtered(&mut app, "alice", Route::Inbox, "type(ref) == str")
        .await
        .expect_err("unknown name");
    assert!(
        violations(&s)
            .iter()
            .any(|(f, d)| f == "filter" && d.contains("`str`")),
        "{s:?}"
    );
    app.stop().await;
}

on_both_stores!(filters_read_every_json_number_as_a_double_and_name_types => filters_read_every_json_number_as_a_double_and_name_types);

async fn filtered_triggers_are_dropped_counted_and_the_filter_is_kept(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    let a = activate_filtered(&mut app, "alice", Route::Silent, TYPICAL)
        .await
        .expect("activate");
    assert_eq!(a.filter, TYPICAL);
    let public = deliver(&mut app, issue("alice", false)).await;
    assert_eq!(public.disposition, Disposition::RecordedSilent as i32);
    let private = deliver(&mut app, issue("alice", true)).await;
    assert_eq!(private.drop_reason, DropReason::Filtered as i32);
    // A payload without the field the filter reads: an error at evaluation, its own reason.
    let bare = deliver(&mut app, opened("alice")).await;
    assert_eq!(bare.drop_reason, DropReason::FilterError as i32);
    // A filter naming a route overrides the activation's.
    activate_filtered(
        &mut app,
        "alice",
        Route::Silent,
        "has(payload.repository) ? 'inbox' : 'drop'",
    )
    .await
    .expect("routing filter");
    assert_eq!(
        deliver(&mut app, issue("alice", true)).await.disposition,
        Disposition::RecordedInbox as i32
    );
    assert_eq!(
        deliver(&mut app, opened("alice")).await.drop_reason,
        DropReason::Filtered as i32
    );
    // Counted, reported and on /metrics under their own reasons.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reasons: BTreeSet<i32> = drop_reports(&mut app, "github")
            .await
            .iter()
            .map(|d| d.reason)
            .collect();
        if reasons.contains(&(DropReason::Filtered as i32))
            && reasons.contains(&(DropReason::FilterError as i32))
        {
            break;
        }
        assert!(Instant::now() < deadline, "drop reports: {reasons:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    for reason in ["filtered", "filter_error"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("hcp_sense_deliveries_total")
                    && l.contains(&format!("drop_reason=\"{reason}\""))),
            "{reason} on /metrics"
        );
    }
    // The state shows the filter in force; switching off clears it, and switching on
    // without one means none, whatever was set before.
    let state = app
        .policy
        .get_pack_state(pb::GetPackStateRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect("state")
        .into_inner();
    assert!(state
        .sense
        .expect("sense")
        .filter
        .contains("has(payload.repository)"));
    app.policy
        .deactivate_sense(pb::DeactivateSenseRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect("off");
    activate(&mut app, "alice", "github", Route::Inbox).await;
    let listed = app
        .policy
        .list_activations(pb::ListActivationsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .activations;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].filter, "");
    assert_eq!(
        deliver(&mut app, opened("alice")).await.disposition,
        Disposition::RecordedInbox as i32
    );
}

on_both_stores!(filtered_triggers_are_dropped_counted_and_the_filter_is_kept => filtered_triggers_are_dropped_counted_and_the_filter_is_kept);

/// A filter set on one replica is in force on the other and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_holds_on_another_replica_and_after_a_restart_postgres() {
    let mut a = spawn_app_with(StoreKind::Postgres, |_| {}).await;
    ready(&mut a, "alice").await;
    let b = crate::helpers::Replica::start(&a.test_db.url).await;
    activate_filtered(&mut a, "alice", Route::Inbox, TYPICAL)
        .await
        .expect("filter on a");
    let mut ingest = pb::ingest_service_client::IngestServiceClient::new(b.channel.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = ingest.deliver_trigger(issue("alice", true)).await;
        if let Ok(r) = &r {
            if r.get_ref().drop_reason == DropReason::Filtered as i32 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "replica b never applied the filter: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    b.stop().await;
    // A server started afresh on the store reads the filter with the activation.
    let b = crate::helpers::Replica::start(&a.test_db.url).await;
    let mut ingest = pb::ingest_service_client::IngestServiceClient::new(b.channel.clone());
    let r = ingest
        .deliver_trigger(issue("alice", true))
        .await
        .expect("deliver")
        .into_inner();
    assert_eq!(r.drop_reason, DropReason::Filtered as i32);
    let r = ingest
        .deliver_trigger(issue("alice", false))
        .await
        .expect("deliver")
        .into_inner();
    assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
    b.stop().await;
}

async fn alice_records(app: &mut TestApp) -> Vec<pb::Record> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let page = app
            .records
            .list_records(ListRecordsRequest {
                principal: "alice".into(),
                page_size: 1000,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .expect("list")
            .into_inner();
        out.extend(page.records);
        if page.next_page_token.is_empty() {
            return out;
        }
        token = page.next_page_token;
    }
}

async fn erase(app: &mut TestApp, principal: &str, pack: &str) -> Result<i64, tonic::Status> {
    app.records
        .erase_records(EraseRecordsRequest {
            principal: principal.into(),
            pack_id: pack.into(),
        })
        .await
        .map(|r| r.into_inner().erased_count)
}

async fn erasure_takes_every_record_of_the_principal_and_only_those(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    ready(&mut app, "bob").await;
    // More than two batches of alice's, a few of bob's.
    let n = hcp_sense::service::ERASE_BATCH as usize * 2 + 7;
    let mut stream_in = Vec::new();
    for i in 0..n {
        let mut t = issue("alice", false);
        t.trigger_id = format!("a-{i}");
        stream_in.push(t);
    }
    let mut ingest = app.ingest.clone();
    let sent = tokio::spawn(async move {
        for t in stream_in {
            ingest.deliver_trigger(t).await.expect("deliver");
        }
    });
    for _ in 0..3 {
        deliver(&mut app, opened("bob")).await;
    }
    sent.await.expect("sent");
    // Refused without a principal, or with a malformed one: an erasure never means everyone.
    for (who, pack) in [
        ("", ""),
        ("", "github"),
        ("al ice", ""),
        ("alice", "bad pack!"),
    ] {
        let s = erase(&mut app, who, pack).await.expect_err("refused");
        assert_eq!(s.code(), Code::InvalidArgument, "{who:?} {pack:?}");
    }
    assert_eq!(
        alice_records(&mut app).await.len(),
        n,
        "refusals erased nothing"
    );
    // Another pack's: none of these.
    assert_eq!(erase(&mut app, "alice", "weather").await.expect("erase"), 0);
    assert_eq!(
        erase(&mut app, "alice", "github").await.expect("erase"),
        n as i64
    );
    assert!(alice_records(&mut app).await.is_empty());
    assert_eq!(
        list(
            &mut app,
            ListRecordsRequest {
                principal: "bob".into(),
                ..Default::default()
            }
        )
        .await
        .len(),
        3,
        "bob's records stay"
    );
    assert_eq!(erase(&mut app, "alice", "").await.expect("again"), 0);
    // Audited with the count, never the records.
    let audit = pb::audit_service_client::AuditServiceClient::new(app.channel.clone())
        .list_audit_events(pb::ListAuditEventsRequest {
            principal: "alice".into(),
            page_size: 100,
            ..Default::default()
        })
        .await
        .expect("audit")
        .into_inner()
        .audit_events;
    let erasures: Vec<_> = audit
        .iter()
        .filter(|e| e.rpc.ends_with("EraseRecords"))
        .collect();
    assert_eq!(erasures.len(), 3, "{audit:?}");
    assert!(erasures
        .iter()
        .any(|e| e.after.contains(&format!("\"erased_records\":{n}"))));
    assert!(
        erasures.iter().all(|e| !e.after.contains("acme/w")),
        "no payload in the audit"
    );
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    assert!(
        metrics.lines().any(|l| l
            .starts_with("hcp_sense_records_deleted_total{cause=\"erasure\"}")
            && l.ends_with(&format!(" {n}"))),
        "erased records counted"
    );
}

on_both_stores!(erasure_takes_every_record_of_the_principal_and_only_those => erasure_takes_every_record_of_the_principal_and_only_those);

/// Erasure while deliveries go on and a watch follows: deliveries all answered, and neither
/// the watch nor a listing shows an erased record after the erasure answered.
async fn erasure_under_deliveries_and_watches(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    ready(&mut app, "bob").await;
    let mut watch = RecordServiceClient::new(app.channel.clone())
        .watch_records(pb::WatchRecordsRequest {
            principal: "alice".into(),
            start: Some(pb::watch_records_request::Start::FromNow(true)),
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner();
    // The watch is read all along; each record id with the time it arrived.
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, String)>();
    let reader = tokio::spawn(async move {
        while let Ok(Some(m)) = watch.message().await {
            let at = Instant::now();
            for r in m.records {
                if seen_tx.send((at, r.record_id)).is_err() {
                    return;
                }
            }
        }
    });
    for _ in 0..600 {
        deliver(&mut app, issue("alice", false)).await;
    }
    let before: BTreeSet<String> = alice_records(&mut app)
        .await
        .into_iter()
        .map(|r| r.record_id)
        .collect();
    assert_eq!(before.len(), 600);
    // Deliveries for both go on throughout.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut producers = Vec::new();
    for who in ["alice", "bob", "alice", "bob"] {
        let mut ingest = app.ingest.clone();
        let stop = stop.clone();
        producers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                ingest
                    .deliver_trigger(issue(who, false))
                    .await
                    .expect("every delivery is answered during an erasure");
                n += 1;
            }
            n
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let erased = erase(&mut app, "alice", "").await.expect("erase");
    assert!(erased >= 600, "{erased}");
    let answered = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut delivered = 0;
    for p in producers {
        delivered += p.await.expect("producer");
    }
    assert!(delivered > 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    reader.abort();
    let mut seen = Vec::new();
    while let Ok(s) = seen_rx.try_recv() {
        seen.push(s);
    }
    let remaining: BTreeSet<String> = alice_records(&mut app)
        .await
        .into_iter()
        .map(|r| r.record_id)
        .collect();
    assert!(remaining.is_disjoint(&before), "an erased record is listed");
    // Every record committed after the erasure reached the watch.
    let arrived: BTreeSet<&String> = seen.iter().map(|(_, id)| id).collect();
    assert!(
        remaining.iter().all(|id| arrived.contains(id)),
        "the watch missed records"
    );
    // Sent before the answer, a record may arrive just after it; none arrives well after.
    let late: Vec<&String> = seen
        .iter()
        .filter(|(at, id)| *at > answered + Duration::from_millis(300) && !remaining.contains(id))
        .map(|(_, id)| id)
        .collect();
    assert!(
        late.is_empty(),
        "the watch sent {} erased records after the erasure answered",
        late.len()
    );
}

on_both_stores!(erasure_under_deliveries_and_watches => erasure_under_deliveries_and_watches);

/// A watch that has not read for a while holds its place in the tail's ring: the records it
/// has not been sent yet are erased from there too. What it was sent before the erasure (what
/// HTTP/2 flow control let through) is all of the erased it may see.
async fn a_lagging_watch_is_not_sent_erased_records(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    let ch = app.channel.clone();
    lagging_watch_erased(&mut app, &ch).await;
}

/// Opens a watch of alice's records on `watch_on`, does not read it while 4,000 large records
/// are delivered and erased through `app`, then reads it.
async fn lagging_watch_erased(app: &mut TestApp, watch_on: &tonic::transport::Channel) {
    let mut watch = RecordServiceClient::new(watch_on.clone())
        .watch_records(pb::WatchRecordsRequest {
            principal: "alice".into(),
            start: Some(pb::watch_records_request::Start::FromNow(true)),
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner();
    const N: usize = 4000;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let mut ingest = app.ingest.clone();
        tasks.push(tokio::spawn(async move {
            for _ in (w..N).step_by(8) {
                let mut t = issue("alice", false);
                t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::PayloadJson(
                    json!({ "repository": { "private": false }, "text": "x".repeat(4000) })
                        .to_string(),
                ));
                ingest.deliver_trigger(t).await.expect("deliver");
            }
        }));
    }
    for t in tasks {
        t.await.expect("deliveries");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(erase(app, "alice", "").await.expect("erase"), N as i64);
    // Another replica hears of it by NOTIFY.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut received = 0usize;
    while let Ok(Ok(Some(m))) = tokio::time::timeout(Duration::from_secs(2), watch.message()).await
    {
        received += m.records.len();
    }
    assert!(
        received < N / 2,
        "a watch behind by {N} records was sent {received} of them after they were erased"
    );
}

/// The same with the watch on another replica, which hears of the erasure from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_watch_on_another_replica_is_not_sent_erased_records_postgres() {
    let mut a = spawn_app_with(StoreKind::Postgres, |_| {}).await;
    ready(&mut a, "alice").await;
    let b = crate::helpers::Replica::start(&a.test_db.url).await;
    lagging_watch_erased(&mut a, &b.channel).await;
    b.stop().await;
}

on_both_stores!(a_lagging_watch_is_not_sent_erased_records => a_lagging_watch_is_not_sent_erased_records);

async fn retention_by_land_keeps_each_land_its_own_age(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |c| {
        c.record_retention = Some(Duration::from_secs(1));
        c.record_retention_lands = Some(hcp_sense::config::LandAges(
            hcp_sense::domain::model::Retention::parse_lands("project=0").expect("lands"),
        ));
        c.prune_interval = Duration::from_secs(1);
    })
    .await;
    ready(&mut app, "alice").await;
    app.policy
        .add_project_member(pb::AddProjectMemberRequest {
            project: "acme".into(),
            principal: "alice".into(),
        })
        .await
        .expect("member");
    let mut review = trigger(
        "github",
        "pull_request.review_requested",
        "alice",
        "project",
    );
    review.project = "acme".into();
    for _ in 0..3 {
        deliver(&mut app, opened("alice")).await;
        let r = deliver(&mut app, review.clone()).await;
        assert_ne!(r.disposition, Disposition::Dropped as i32, "{r:?}");
    }
    let lands = |recs: Vec<pb::Record>| recs.into_iter().map(|r| r.land).collect::<Vec<_>>();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = lands(alice_records(&mut app).await);
        if !now.iter().any(|l| l == "user") {
            assert_eq!(now, ["project"; 3], "the project land (0: for ever) stays");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "user records past 1 s were not pruned: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        lands(alice_records(&mut app).await).len(),
        3,
        "kept for ever"
    );
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    assert!(metrics.lines().any(|l| l
        .starts_with("hcp_sense_records_deleted_total{cause=\"retention\"}")
        && l.ends_with(" 3")));
}

on_both_stores!(retention_by_land_keeps_each_land_its_own_age => retention_by_land_keeps_each_land_its_own_age);

#[test]
fn record_retention_flag_takes_ages_by_land_and_names_what_it_cannot_read() {
    let c = hcp_sense::config::Config::from_args([
        "hcp-sense",
        "--record-retention",
        "user=30d,brain=365d",
        "--record-retention-secs",
        "3600",
    ])
    .expect("parses");
    let r = c.retention();
    assert_eq!(r.default, Some(Duration::from_secs(3600)));
    assert_eq!(r.lands["user"], Some(Duration::from_secs(30 * 86_400)));
    assert_eq!(r.lands["brain"], Some(Duration::from_secs(365 * 86_400)));
    let e = hcp_sense::config::Config::from_args(["hcp-sense", "--record-retention", "user=30w"])
        .expect_err("bad age")
        .to_string();
    assert!(e.contains("--record-retention") && e.contains("30w"), "{e}");
    let none = hcp_sense::config::Config::from_args(["hcp-sense"]).expect("defaults");
    assert!(!none.retention().prunes(), "keeps everything by default");
}
