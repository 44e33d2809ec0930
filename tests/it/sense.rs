//! The Sense loop over real gRPC on both stores, clause by clause: grant, Binding, land, activation, recording, isolation.
use std::time::{Duration, Instant};

use hcp_sense::grpc::convert::json_to_struct;
use hcp_sense::grpc::pb::{
    self, deliver_trigger_request::PayloadSource, ActivateSenseRequest, AddProjectMemberRequest,
    BindingState, DeactivateSenseRequest, DeleteBindingRequest, DeliverTriggerRequest,
    DeliverTriggerResponse, Disposition, DropReason, GetPackStateRequest, GrantSenseEnableRequest,
    ListDropReportsRequest, ListGrantsRequest, ListRecordsRequest, PutBindingRequest,
    PutExecuteStateRequest, RemoveProjectMemberRequest, ReportBindingHealthRequest,
    RevokeSenseEnableRequest, Route, TriggerSource,
};
use sea_orm::EntityTrait;
use serde_json::{json, Value};
use tonic::Code;

use crate::helpers::{example, violations, TestApp};
use crate::packs::register;
use crate::support::trigger::{trigger, with_payload};

/// A trigger for `github` that passes every check once alice is set up.
pub(crate) fn trig(principal: &str, r#ref: &str, land: &str) -> DeliverTriggerRequest {
    with_payload(
        trigger("github", r#ref, principal, land),
        json!({ "issue": 42 }),
    )
}

pub(crate) fn opened(principal: &str) -> DeliverTriggerRequest {
    trig(principal, "issue.opened", "user")
}

pub(crate) async fn deliver(app: &mut TestApp, t: DeliverTriggerRequest) -> DeliverTriggerResponse {
    app.ingest
        .deliver_trigger(t)
        .await
        .expect("a well-formed trigger is acknowledged")
        .into_inner()
}

/// Delivers `t` `times` times; each is answered as a retry, with the record `first`.
pub(crate) async fn retried(
    app: &mut TestApp,
    t: &DeliverTriggerRequest,
    first: &str,
    times: usize,
) {
    for n in 0..times {
        let again = deliver(app, t.clone()).await;
        assert!(
            again.duplicate && again.record_id == first,
            "retry {n}: {again:?}"
        );
    }
}

pub(crate) async fn grant(app: &mut TestApp, principal: &str, pack: &str) {
    app.policy
        .grant_sense_enable(GrantSenseEnableRequest {
            principal: principal.into(),
            pack_id: pack.into(),
        })
        .await
        .expect("grant");
}

pub(crate) async fn revoke(app: &mut TestApp, principal: &str, pack: &str) {
    app.policy
        .revoke_sense_enable(RevokeSenseEnableRequest {
            principal: principal.into(),
            pack_id: pack.into(),
        })
        .await
        .expect("revoke");
}

pub(crate) async fn bind(
    app: &mut TestApp,
    principal: &str,
    pack: &str,
    state: BindingState,
) -> pb::PutBindingResponse {
    app.policy
        .put_binding(PutBindingRequest {
            principal: principal.into(),
            pack_id: pack.into(),
            binding_id: format!("{pack}-{principal}"),
            state: state as i32,
        })
        .await
        .expect("bind")
        .into_inner()
}

pub(crate) async fn activate(app: &mut TestApp, principal: &str, pack: &str, route: Route) {
    app.policy
        .activate_sense(ActivateSenseRequest {
            principal: principal.into(),
            pack_id: pack.into(),
            route: route as i32,
            filter: String::new(),
        })
        .await
        .expect("activate");
}

pub(crate) async fn deactivate(app: &mut TestApp, principal: &str, pack: &str) {
    app.policy
        .deactivate_sense(DeactivateSenseRequest {
            principal: principal.into(),
            pack_id: pack.into(),
        })
        .await
        .expect("deactivate");
}

/// Registers `github` and gives `principal` everything a recorded trigger needs.
pub(crate) async fn ready(app: &mut TestApp, principal: &str) {
    if app
        .packs
        .get_pack(pb::GetPackRequest {
            pack_id: "github".into(),
        })
        .await
        .is_err()
    {
        register(app, &example("github.pack.json")).await;
    }
    grant(app, principal, "github").await;
    bind(app, principal, "github", BindingState::Linked).await;
    activate(app, principal, "github", Route::Inbox).await;
}

pub(crate) fn dropped(r: &DeliverTriggerResponse) -> Option<DropReason> {
    (r.disposition == Disposition::Dropped as i32)
        .then(|| DropReason::try_from(r.drop_reason).expect("reason"))
}

pub(crate) async fn list(app: &mut TestApp, req: ListRecordsRequest) -> Vec<pb::Record> {
    app.records
        .list_records(req)
        .await
        .expect("list records")
        .into_inner()
        .records
}

pub(crate) async fn drop_reports(app: &mut TestApp, pack: &str) -> Vec<pb::DropReport> {
    app.records
        .list_drop_reports(ListDropReportsRequest {
            pack_id: pack.into(),
            ..Default::default()
        })
        .await
        .expect("drop reports")
        .into_inner()
        .drop_reports
}

both_stores! {
    async fn s7_3_decision_walks_every_reason_in_order(app) {
        let mut app = app;
        register(&mut app, &example("github.pack.json")).await;
        let mut unknown = opened("alice");
        unknown.pack_id = "gitlab".into();
        assert_eq!(dropped(&deliver(&mut app, unknown).await), Some(DropReason::UnknownPack));
        assert_eq!(dropped(&deliver(&mut app, trig("alice", "issue.deleted", "user")).await), Some(DropReason::UndeclaredRef));
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::NoGrant));
        grant(&mut app, "alice", "github").await;
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::NoConnectedBinding));
        bind(&mut app, "alice", "github", BindingState::Linked).await;
        assert_eq!(dropped(&deliver(&mut app, trig("alice", "issue.opened", "project")).await), Some(DropReason::LandMismatch));
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::ActivationOff));
        assert_eq!(app.count("records").await, 0, "no drop leaves a record");
        activate(&mut app, "alice", "github", Route::Inbox).await;
        let r = deliver(&mut app, opened("alice")).await;
        assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
        assert_eq!(r.drop_reason, DropReason::Unspecified as i32);
        assert!(!r.record_id.is_empty());
        activate(&mut app, "alice", "github", Route::Silent).await;
        let r = deliver(&mut app, opened("alice")).await;
        assert_eq!(r.disposition, Disposition::RecordedSilent as i32);
        assert_eq!(app.count("records").await, 2);

        // Every drop was counted, per pack, ref and reason.
        let reports = drop_reports(&mut app, "").await;
        let mut seen: Vec<(String, String, i32, i64)> =
            reports.iter().map(|d| (d.pack_id.clone(), d.r#ref.clone(), d.reason, d.count)).collect();
        seen.sort();
        let mut want = vec![
            ("gitlab".to_owned(), "issue.opened".to_owned(), DropReason::UnknownPack as i32, 1),
            ("github".into(), "issue.deleted".into(), DropReason::UndeclaredRef as i32, 1),
            ("github".into(), "issue.opened".into(), DropReason::NoGrant as i32, 1),
            ("github".into(), "issue.opened".into(), DropReason::NoConnectedBinding as i32, 1),
            ("github".into(), "issue.opened".into(), DropReason::LandMismatch as i32, 1),
            ("github".into(), "issue.opened".into(), DropReason::ActivationOff as i32, 1),
        ];
        want.sort();
        assert_eq!(seen, want);
    }

    async fn s7_3_every_drop_decision_is_traced_with_its_reason(app) {
        let mut app = app;
        let who = format!("tracer-{}", app.count("packs").await + i64::from(std::process::id() as u16));
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let who = format!("{who}-{nanos}");
        register(&mut app, &example("github.pack.json")).await;
        let mut unknown = opened(&who);
        unknown.pack_id = "nowhere".into();
        deliver(&mut app, unknown).await;
        deliver(&mut app, trig(&who, "issue.deleted", "user")).await;
        deliver(&mut app, opened(&who)).await;
        grant(&mut app, &who, "github").await;
        deliver(&mut app, opened(&who)).await;
        bind(&mut app, &who, "github", BindingState::Linked).await;
        deliver(&mut app, trig(&who, "issue.opened", "project")).await;
        deliver(&mut app, opened(&who)).await;
        activate(&mut app, &who, "github", Route::Silent).await;
        let rec = deliver(&mut app, opened(&who)).await;
        for reason in ["unknown_pack", "undeclared_ref", "no_grant", "no_connected_binding", "land_mismatch", "activation_off"] {
            let spans = crate::trace::decisions(&[("hcp.principal", who.as_str()), ("hcp.drop_reason", reason)]);
            assert_eq!(spans.len(), 1, "one span for {reason}");
            assert_eq!(spans[0].get("hcp.disposition").map(String::as_str), Some("dropped"));
            assert!(spans[0].contains_key("hcp.pack_id") && spans[0].contains_key("hcp.ref") && spans[0].contains_key("hcp.land"));
        }
        let spans = crate::trace::decisions(&[("hcp.principal", who.as_str()), ("hcp.disposition", "recorded_silent")]);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].get("hcp.record_id"), Some(&rec.record_id));
    }

    async fn s7_3_2_without_the_grant_the_producer_is_acknowledged_and_the_trigger_dropped(app) {
        let mut app = app;
        register(&mut app, &example("github.pack.json")).await;
        bind(&mut app, "bob", "github", BindingState::Linked).await;
        activate(&mut app, "bob", "github", Route::Inbox).await;
        let r = deliver(&mut app, opened("bob")).await;
        assert_eq!(r.disposition, Disposition::Dropped as i32);
        assert_eq!(r.drop_reason, DropReason::NoGrant as i32);
        assert!(r.record_id.is_empty());
        assert_eq!(app.count("records").await, 0);
    }

    async fn s7_3_1_revocation_applies_to_every_delivery_started_after_it_returns(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        // Deliveries run on while the grant is revoked.
        let mut ingest = app.ingest.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let runner = tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                let r = ingest.deliver_trigger(opened("alice")).await.expect("deliver").into_inner();
                seen.push((started, r.disposition));
            }
            seen
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        revoke(&mut app, "alice", "github").await;
        let revoked_at = Instant::now();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = runner.await.expect("runner");
        let after: Vec<_> = seen.iter().filter(|(t, _)| *t > revoked_at).collect();
        assert!(!after.is_empty());
        assert!(after.iter().all(|(_, d)| *d == Disposition::Dropped as i32), "a delivery after the revoke was recorded");
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::NoGrant));
        // Granting again restores delivery.
        grant(&mut app, "alice", "github").await;
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
    }

    async fn s7_3_3_undeclared_refs_are_dropped_and_reported(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        for _ in 0..3 {
            assert_eq!(dropped(&deliver(&mut app, trig("alice", "issue.deleted", "user")).await), Some(DropReason::UndeclaredRef));
        }
        deliver(&mut app, trig("alice", "repo.starred", "user")).await;
        assert_eq!(app.count("records").await, 0);
        let reports = drop_reports(&mut app, "github").await;
        assert_eq!(reports.len(), 2);
        assert_eq!((reports[0].r#ref.as_str(), reports[0].count), ("issue.deleted", 3));
        assert_eq!((reports[1].r#ref.as_str(), reports[1].count), ("repo.starred", 1));
        let (first, last) = (reports[0].first_seen_time.expect("first"), reports[0].last_seen_time.expect("last"));
        assert!((first.seconds, first.nanos) <= (last.seconds, last.nanos));
        // Filters and pagination.
        let page = app.records.list_drop_reports(ListDropReportsRequest {
            pack_id: "github".into(), reason: DropReason::UndeclaredRef as i32, page_size: 1, page_token: String::new(),
        }).await.expect("page").into_inner();
        assert_eq!(page.drop_reports.len(), 1);
        let next = app.records.list_drop_reports(ListDropReportsRequest {
            pack_id: "github".into(), reason: DropReason::UndeclaredRef as i32, page_size: 1, page_token: page.next_page_token.clone(),
        }).await.expect("page 2").into_inner();
        assert_eq!(next.drop_reports[0].r#ref, "repo.starred");
        assert!(next.next_page_token.is_empty());
        let err = app.records.list_drop_reports(ListDropReportsRequest {
            pack_id: "github".into(), reason: DropReason::NoGrant as i32, page_size: 1, page_token: page.next_page_token.clone(),
        }).await.expect_err("token from another filter");
        assert_eq!(err.code(), Code::InvalidArgument);
        let none = app.records.list_drop_reports(ListDropReportsRequest {
            pack_id: "github".into(), reason: DropReason::NoGrant as i32, ..Default::default()
        }).await.expect("none").into_inner();
        assert!(none.drop_reports.is_empty());
    }

    async fn s7_3_4_only_a_linked_binding_connects_and_public_packs_need_none(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        for state in [BindingState::Stale, BindingState::NeedsReauth, BindingState::Pending, BindingState::Error] {
            bind(&mut app, "alice", "github", state).await;
            assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::NoConnectedBinding), "{state:?}");
        }
        app.policy.delete_binding(DeleteBindingRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("delete binding");
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::NoConnectedBinding));
        bind(&mut app, "alice", "github", BindingState::Linked).await;
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        assert_eq!(dropped(&deliver(&mut app, trig("alice", "issue.opened", "brain-ish")).await), Some(DropReason::LandMismatch));

        // A public pack records without any Binding, under the identity `public`.
        register(&mut app, &example("weather.pack.yaml")).await;
        grant(&mut app, "alice", "weather").await;
        activate(&mut app, "", "weather", Route::Inbox).await;
        let mut t = trig("alice", "storm.warning", "user");
        t.pack_id = "weather".into();
        let r = deliver(&mut app, t).await;
        assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
        let recs = list(&mut app, ListRecordsRequest { pack_id: "weather".into(), ..Default::default() }).await;
        assert_eq!(recs[0].binding_id, "public");
    }

    async fn s7_4_1_deactivating_sense_leaves_execute_state_untouched(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        app.policy.put_execute_state(PutExecuteStateRequest {
            principal: "alice".into(), pack_id: "github".into(), installed: true, activated: true, connected: true,
        }).await.expect("execute state");
        let before = app.snapshot(false).await;
        let execute_before: Vec<String> = before.iter().filter(|t| t.starts_with("execute_states")).cloned().collect();
        deactivate(&mut app, "alice", "github").await;
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::ActivationOff));
        activate(&mut app, "alice", "github", Route::Silent).await;
        deactivate(&mut app, "", "github").await;
        revoke(&mut app, "alice", "github").await;
        let after = app.snapshot(false).await;
        let execute_after: Vec<String> = after.iter().filter(|t| t.starts_with("execute_states")).cloned().collect();
        assert_eq!(execute_before, execute_after, "Sense changes left Execute state byte for byte");
        let state = app.policy.get_pack_state(GetPackStateRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("state").into_inner();
        let exec = state.execute.expect("execute");
        assert!(exec.installed && exec.activated && exec.connected);
        assert!(!state.sense.expect("sense").granted);
    }

    async fn s7_4_1_execute_state_changes_leave_sense_alone(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let sense_tables = |snap: Vec<String>| -> Vec<String> { snap.into_iter().filter(|t| !t.starts_with("execute_states")).collect() };
        let before = sense_tables(app.snapshot(false).await);
        for (installed, activated, connected) in [(true, true, true), (false, false, false), (true, false, false)] {
            app.policy.put_execute_state(PutExecuteStateRequest {
                principal: "alice".into(), pack_id: "github".into(), installed, activated, connected,
            }).await.expect("execute state");
            // Execute being off neither switches Sense off nor stops a delivery.
            assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        }
        assert_eq!(before, sense_tables(app.snapshot(false).await));
        let s = app.policy.get_pack_state(GetPackStateRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("state").into_inner();
        let sense = s.sense.expect("sense");
        assert!(sense.granted && sense.enabled && sense.deliverable);
        assert_eq!(sense.route, Route::Inbox as i32);
        assert_eq!(sense.binding.expect("binding").state, BindingState::Linked as i32);
        let exec = s.execute.expect("execute");
        assert!(exec.installed && !exec.activated && !exec.connected);
    }

    async fn s7_4_2_on_routes_to_inbox_or_silent_and_off_to_drop(app) {
        let mut app = app;
        register(&mut app, &example("github.pack.json")).await;
        grant(&mut app, "alice", "github").await;
        bind(&mut app, "alice", "github", BindingState::Linked).await;
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::ActivationOff), "no activation is off");
        // Pack-wide activation, default route inbox.
        app.policy.activate_sense(ActivateSenseRequest { principal: String::new(), pack_id: "github".into(), route: 0, filter: String::new() })
            .await.expect("activate");
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        activate(&mut app, "alice", "github", Route::Silent).await;
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedSilent as i32);
        deactivate(&mut app, "alice", "github").await;
        assert_eq!(dropped(&deliver(&mut app, opened("alice")).await), Some(DropReason::ActivationOff), "own off beats pack-wide on");
        // Switching on again without a route means inbox, as the proto says, not the earlier silent:
        // an admin who leaves the route out expects records to surface.
        activate(&mut app, "alice", "github", Route::Silent).await;
        app.policy.activate_sense(ActivateSenseRequest { principal: "alice".into(), pack_id: "github".into(), route: 0, filter: String::new() })
            .await.expect("activate");
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        let recs = list(&mut app, ListRecordsRequest { principal: "alice".into(), ..Default::default() }).await;
        let routes: Vec<i32> = recs.iter().map(|r| r.route).collect();
        assert_eq!(routes, [Route::Inbox as i32, Route::Silent as i32, Route::Inbox as i32]);
        let err = app.policy.activate_sense(ActivateSenseRequest { principal: "alice".into(), pack_id: "github".into(), route: 9, filter: String::new() })
            .await.expect_err("unknown route");
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = app.policy.activate_sense(ActivateSenseRequest { principal: "alice".into(), pack_id: "nope".into(), route: 1, filter: String::new() })
            .await.expect_err("unknown pack");
        assert_eq!(err.code(), Code::NotFound);
    }

    async fn s7_5_1_records_are_attributable_to_principal_binding_land_pack_and_ref(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let mut t = opened("alice");
        t.trigger_id = "delivery-7".into();
        t.payload_source = Some(PayloadSource::PayloadJson(r#"{"title":"Crash","labels":["bug"],"n":1.5}"#.into()));
        let r = deliver(&mut app, t).await;
        let recs = list(&mut app, ListRecordsRequest::default()).await;
        assert_eq!(recs.len(), 1);
        let rec = &recs[0];
        assert_eq!(rec.record_id, r.record_id);
        assert_eq!(
            (rec.principal.as_str(), rec.binding_id.as_str(), rec.land.as_str(), rec.pack_id.as_str(), rec.r#ref.as_str()),
            ("alice", "github-alice", "user", "github", "issue.opened")
        );
        assert_eq!(rec.trigger_id, "delivery-7");
        assert_eq!(rec.route, Route::Inbox as i32);
        assert!(rec.receive_time.is_some());
        let payload = hcp_sense::grpc::convert::struct_to_json(rec.payload.clone().expect("payload"));
        assert_eq!(payload, json!({ "title": "Crash", "labels": ["bug"], "n": 1.5 }));
    }

    async fn s7_5_2_brain_records_need_project_membership_at_read_time(app) {
        let mut app = app;
        let mut m = example("github.pack.json");
        m["id"] = json!("notes");
        m["stimulusTriggers"] = json!([{ "ref": "note.shared" }, { "ref": "binding.degraded" }]);
        m["policy"]["stimuli"] = json!([
            { "ref": "note.shared", "operation": "read", "land": "brain" },
            { "ref": "binding.degraded", "operation": "read", "land": "user" }
        ]);
        register(&mut app, &m).await;
        grant(&mut app, "alice", "notes").await;
        bind(&mut app, "alice", "notes", BindingState::Linked).await;
        activate(&mut app, "alice", "notes", Route::Inbox).await;
        let mut t = trig("alice", "note.shared", "brain");
        t.pack_id = "notes".into();
        let err = app.ingest.deliver_trigger(t.clone()).await.expect_err("brain needs a project");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(violations(&err).iter().any(|(f, _)| f == "project"));
        t.project = "apollo".into();
        assert_eq!(deliver(&mut app, t).await.disposition, Disposition::RecordedInbox as i32);

        let as_viewer = |viewer: &str| ListRecordsRequest { viewer: viewer.into(), pack_id: "notes".into(), ..Default::default() };
        assert!(list(&mut app, as_viewer("alice")).await.is_empty(), "not a member yet");
        assert!(list(&mut app, as_viewer("")).await.is_empty(), "no viewer, no brain");
        app.policy.add_project_member(AddProjectMemberRequest { project: "apollo".into(), principal: "alice".into() })
            .await.expect("add member");
        let recs = list(&mut app, as_viewer("alice")).await;
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].project, "apollo");
        assert!(list(&mut app, as_viewer("bob")).await.is_empty(), "bob is not a member");
        let removed = app.policy.remove_project_member(RemoveProjectMemberRequest { project: "apollo".into(), principal: "alice".into() })
            .await.expect("remove").into_inner();
        assert!(removed.removed);
        assert!(list(&mut app, as_viewer("alice")).await.is_empty(), "membership is checked at read time");
    }

    async fn s7_2_5_s7_5_3_reading_records_grants_and_changes_nothing(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        deliver(&mut app, opened("alice")).await;
        deliver(&mut app, trig("alice", "issue.deleted", "user")).await;
        drop_reports(&mut app, "").await;
        let before = app.snapshot(true).await;
        for _ in 0..3 {
            list(&mut app, ListRecordsRequest { viewer: "alice".into(), ..Default::default() }).await;
            drop_reports(&mut app, "github").await;
        }
        assert_eq!(before, app.snapshot(true).await);
    }

    async fn s7_2_1_s7_2_2_s7_2_3_deliveries_change_no_table_but_the_sink(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        register(&mut app, &example("weather.pack.yaml")).await;
        grant(&mut app, "carol", "github").await;
        bind(&mut app, "dave", "github", BindingState::Stale).await;
        grant(&mut app, "dave", "github").await;
        app.policy.put_execute_state(PutExecuteStateRequest {
            principal: "alice".into(), pack_id: "github".into(), installed: true, activated: false, connected: true,
        }).await.expect("execute state");
        app.policy.add_project_member(AddProjectMemberRequest { project: "apollo".into(), principal: "alice".into() })
            .await.expect("member");
        let before = app.snapshot(false).await;
        let kinds: Vec<DeliverTriggerRequest> = vec![
            opened("alice"),
            trig("alice", "issue.deleted", "user"),
            opened("bob"),
            opened("carol"),
            opened("dave"),
            trig("alice", "issue.opened", "project"),
            { let mut t = opened("alice"); t.pack_id = "unknown".into(); t },
            { let mut t = trig("alice", "storm.warning", "user"); t.pack_id = "weather".into(); t },
            {
                let mut t = trig("alice", "binding.degraded", "user");
                t.payload_source = Some(PayloadSource::Payload(json_to_struct(&json!({ "state": "error" }))));
                t
            },
            { let mut t = opened("alice"); t.trigger_id = "dup-1".into(); t },
        ];
        let mut tasks = Vec::new();
        for w in 0..8 {
            let mut ingest = app.ingest.clone();
            let kinds = kinds.clone();
            tasks.push(tokio::spawn(async move {
                let mut recorded = 0;
                for i in 0..125 {
                    let t = kinds[(i + w) % kinds.len()].clone();
                    let r = ingest.deliver_trigger(t).await.expect("deliver").into_inner();
                    if r.disposition != Disposition::Dropped as i32 && !r.duplicate {
                        recorded += 1;
                    }
                }
                recorded
            }));
        }
        let mut recorded = 0;
        for t in tasks {
            recorded += t.await.expect("task");
        }
        assert_eq!(app.snapshot(false).await, before, "1,000 deliveries changed a table other than the sink");
        assert_eq!(app.count("records").await, recorded);
        assert!(recorded > 0 && recorded < 1000);
    }

    async fn s7_2_4_sense_rpcs_never_write_execute_state(app) {
        let mut app = app;
        register(&mut app, &example("github.pack.json")).await;
        app.policy.put_execute_state(PutExecuteStateRequest {
            principal: "alice".into(), pack_id: "github".into(), installed: true, activated: true, connected: false,
        }).await.expect("execute state");
        let execute = |snap: Vec<String>| snap.into_iter().filter(|t| t.starts_with("execute_states")).collect::<Vec<_>>();
        let before = execute(app.snapshot(false).await);
        ready(&mut app, "alice").await;
        deliver(&mut app, opened("alice")).await;
        app.policy.report_binding_health(ReportBindingHealthRequest {
            principal: "alice".into(), pack_id: "github".into(), state: BindingState::Stale as i32,
        }).await.expect("report");
        deactivate(&mut app, "alice", "github").await;
        revoke(&mut app, "alice", "github").await;
        app.policy.delete_binding(DeleteBindingRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("delete binding");
        app.packs.delete_pack(pb::DeletePackRequest { pack_id: "github".into() }).await.expect("delete pack");
        list(&mut app, ListRecordsRequest::default()).await;
        assert_eq!(before, execute(app.snapshot(false).await));
    }

    async fn s7_7_3_the_service_delivers_binding_degraded_when_a_binding_leaves_linked(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let report = |state: BindingState| ReportBindingHealthRequest {
            principal: "alice".into(), pack_id: "github".into(), state: state as i32,
        };
        let r = app.policy.report_binding_health(report(BindingState::Stale)).await.expect("report").into_inner();
        assert_eq!(r.previous_state, BindingState::Linked as i32);
        assert_eq!(r.binding.expect("binding").state, BindingState::Stale as i32);
        let out = r.binding_degraded.expect("a binding.degraded trigger was delivered");
        assert_eq!(out.disposition, Disposition::RecordedInbox as i32);
        let recs = list(&mut app, ListRecordsRequest { r#ref: "binding.degraded".into(), ..Default::default() }).await;
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].record_id, out.record_id);
        assert_eq!(recs[0].binding_id, "github-alice");
        let payload = hcp_sense::grpc::convert::struct_to_json(recs[0].payload.clone().expect("payload"));
        assert_eq!(payload["state"], "stale");
        assert_eq!(payload["previous_state"], "linked");
        // Already away from linked: no new trigger.
        let r = app.policy.report_binding_health(report(BindingState::NeedsReauth)).await.expect("report").into_inner();
        assert!(r.binding_degraded.is_none());
        // Linked again, then error: a second one.
        app.policy.report_binding_health(report(BindingState::Linked)).await.expect("report");
        let r = app.policy.report_binding_health(report(BindingState::Error)).await.expect("report").into_inner();
        assert!(r.binding_degraded.is_some());
        assert_eq!(list(&mut app, ListRecordsRequest { r#ref: "binding.degraded".into(), ..Default::default() }).await.len(), 2);
        // The same pipeline: without the grant it is dropped and counted.
        app.policy.report_binding_health(report(BindingState::Linked)).await.expect("report");
        revoke(&mut app, "alice", "github").await;
        let r = app.policy.report_binding_health(report(BindingState::Pending)).await.expect("report").into_inner();
        let out = r.binding_degraded.expect("decided");
        assert_eq!(out.disposition, Disposition::Dropped as i32);
        assert_eq!(out.drop_reason, DropReason::NoGrant as i32);
        assert_eq!(app.count("records").await, 2);
        // A pack that does not declare the ref gets none.
        let mut m = example("github.pack.json");
        m["id"] = json!("plain");
        m["stimulusTriggers"] = json!([{ "ref": "issue.opened" }]);
        m["policy"]["stimuli"] = json!([{ "ref": "issue.opened", "operation": "read", "land": "user" }]);
        register(&mut app, &m).await;
        grant(&mut app, "alice", "plain").await;
        bind(&mut app, "alice", "plain", BindingState::Linked).await;
        activate(&mut app, "alice", "plain", Route::Inbox).await;
        let r = app.policy.report_binding_health(ReportBindingHealthRequest {
            principal: "alice".into(), pack_id: "plain".into(), state: BindingState::Stale as i32,
        }).await.expect("report").into_inner();
        assert!(r.binding_degraded.is_none());
        assert_eq!(app.count("records").await, 2);
        // Unknown binding, missing state.
        let err = app.policy.report_binding_health(ReportBindingHealthRequest {
            principal: "zed".into(), pack_id: "github".into(), state: BindingState::Stale as i32,
        }).await.expect_err("no binding");
        assert_eq!(err.code(), Code::NotFound);
        let err = app.policy.report_binding_health(ReportBindingHealthRequest {
            principal: "alice".into(), pack_id: "github".into(), state: 0,
        }).await.expect_err("no state");
        assert_eq!(err.code(), Code::InvalidArgument);
    }

    async fn s7_7_2_binding_degraded_from_a_producer_needs_one_of_the_five_states(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        for bad in [json!({ "state": "broken" }), json!({ "state": "LINKED" }), json!({ "state": 1 })] {
            let mut t = trig("alice", "binding.degraded", "user");
            t.payload_source = Some(PayloadSource::Payload(json_to_struct(&bad)));
            let err = app.ingest.deliver_trigger(t).await.expect_err("bad state");
            assert_eq!(err.code(), Code::InvalidArgument);
            assert!(violations(&err).iter().any(|(f, d)| f == "payload.state" && d.contains("s7_7_2")), "{err:?}");
        }
        assert_eq!(app.count("records").await, 0);
        let mut t = trig("alice", "binding.degraded", "user");
        t.payload_source = Some(PayloadSource::Payload(json_to_struct(&json!({ "state": "needs_reauth" }))));
        assert_eq!(deliver(&mut app, t).await.disposition, Disposition::RecordedInbox as i32);
    }

    async fn s7_8_polls_timers_and_monitors_are_not_delivered(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        for source in [TriggerSource::Poll, TriggerSource::Timer, TriggerSource::Monitor] {
            let mut t = opened("alice");
            t.source = source as i32;
            let err = app.ingest.deliver_trigger(t).await.expect_err("refused");
            assert_eq!(err.code(), Code::InvalidArgument);
            assert!(violations(&err).iter().any(|(f, d)| f == "source" && d.contains("s7_8")));
        }
        let mut t = opened("alice");
        t.source = 77;
        assert_eq!(app.ingest.deliver_trigger(t).await.expect_err("unknown").code(), Code::InvalidArgument);
        assert_eq!(app.count("records").await, 0);
        assert!(drop_reports(&mut app, "").await.is_empty(), "refused input is not a drop");
        let mut t = opened("alice");
        t.source = TriggerSource::Push as i32;
        assert_eq!(deliver(&mut app, t).await.disposition, Disposition::RecordedInbox as i32);
    }

    async fn malformed_triggers_are_invalid_argument_naming_the_field(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        type Break = Box<dyn Fn(&mut DeliverTriggerRequest)>;
        let cases: Vec<(&str, Break)> = vec![
            ("pack_id", Box::new(|t| t.pack_id.clear())),
            ("ref", Box::new(|t| t.r#ref = "Issue.Opened".into())),
            ("ref", Box::new(|t| t.r#ref = "issue..opened".into())),
            ("principal", Box::new(|t| t.principal.clear())),
            ("principal", Box::new(|t| t.principal = "al\u{7}ice".into())),
            ("land", Box::new(|t| t.land.clear())),
            ("payload", Box::new(|t| t.payload_source = Some(PayloadSource::PayloadJson("[1, 2]".into())))),
            ("payload_json", Box::new(|t| t.payload_source = Some(PayloadSource::PayloadJson("{not json".into())))),
            ("payload", Box::new(|t| t.payload_source = Some(PayloadSource::Payload(json_to_struct(&json!({ "blob": "x".repeat(70_000) })))))),
            ("trigger_id", Box::new(|t| t.trigger_id = "t".repeat(300))),
        ];
        for (field, break_it) in cases {
            let mut t = opened("alice");
            break_it(&mut t);
            let err = app.ingest.deliver_trigger(t).await.expect_err(field);
            assert_eq!(err.code(), Code::InvalidArgument, "{field}");
            assert!(violations(&err).iter().any(|(f, _)| f == field), "{field}: {err:?}");
            assert!(err.message().contains(field), "{field}: {}", err.message());
        }
        assert_eq!(app.count("records").await, 0);
        // No payload at all is an empty object.
        let mut t = opened("alice");
        t.payload_source = None;
        assert_eq!(deliver(&mut app, t).await.disposition, Disposition::RecordedInbox as i32);
    }

    async fn a_repeated_trigger_id_returns_the_first_record(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let mut t = opened("alice");
        t.trigger_id = "gh-1".into();
        let first = deliver(&mut app, t.clone()).await;
        let again = deliver(&mut app, t.clone()).await;
        assert!(!first.duplicate && again.duplicate);
        assert_eq!(first.record_id, again.record_id);
        assert_eq!(again.disposition, Disposition::RecordedInbox as i32);
        assert_eq!(app.count("records").await, 1);
        t.trigger_id = "gh-2".into();
        assert_ne!(deliver(&mut app, t).await.record_id, first.record_id);
        assert_eq!(app.count("records").await, 2);
        // The same id for another principal's trigger is refused, not answered with alice's record.
        ready(&mut app, "bob").await;
        let mut other = opened("bob");
        other.trigger_id = "gh-1".into();
        let err = app.ingest.deliver_trigger(other).await.expect_err("reused trigger id");
        assert_eq!(err.code(), Code::AlreadyExists);
        assert!(!err.message().contains(&first.record_id));
        assert_eq!(app.count("records").await, 2);
        // Trigger ids are the pack's own: the same id from another pack is a new record.
        crate::cli::set_up_weather(&app.channel).await;
        let weather = app
            .ingest
            .deliver_trigger(crate::cli::storm_warning("gh-1".into()))
            .await
            .expect("another pack's gh-1")
            .into_inner();
        assert!(!weather.duplicate);
        assert_ne!(weather.record_id, first.record_id);
        assert_eq!(app.count("records").await, 3);
    }

    async fn list_records_filters_and_pages_stably(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        ready(&mut app, "bob").await;
        for i in 0..12 {
            let who = if i % 3 == 0 { "bob" } else { "alice" };
            let r = if i % 2 == 0 { "issue.opened" } else { "pull_request.review_requested" };
            let land = if i % 2 == 0 { "user" } else { "project" };
            deliver(&mut app, trig(who, r, land)).await;
        }
        activate(&mut app, "alice", "github", Route::Silent).await;
        deliver(&mut app, opened("alice")).await;
        assert_eq!(list(&mut app, ListRecordsRequest { principal: "bob".into(), ..Default::default() }).await.len(), 4);
        assert_eq!(list(&mut app, ListRecordsRequest { r#ref: "issue.opened".into(), ..Default::default() }).await.len(), 7);
        assert_eq!(list(&mut app, ListRecordsRequest { land: "project".into(), principal: "alice".into(), ..Default::default() }).await.len(), 4);
        assert_eq!(list(&mut app, ListRecordsRequest { route: Route::Silent as i32, ..Default::default() }).await.len(), 1);
        assert_eq!(list(&mut app, ListRecordsRequest { pack_id: "weather".into(), ..Default::default() }).await.len(), 0);

        let all = list(&mut app, ListRecordsRequest::default()).await;
        assert_eq!(all.len(), 13);
        let key = |r: &pb::Record| { let t = r.receive_time.expect("time"); (t.seconds, t.nanos, r.record_id.clone()) };
        assert!(all.windows(2).all(|w| key(&w[0]) < key(&w[1])), "oldest first by default");
        // Time range: [5th, 9th) by receive time.
        let (from, to) = (all[4].receive_time, all[8].receive_time);
        let ranged = list(&mut app, ListRecordsRequest { start_time: from, end_time: to, ..Default::default() }).await;
        assert_eq!(ranged.iter().map(|r| r.record_id.clone()).collect::<Vec<_>>(),
                   all[4..8].iter().map(|r| r.record_id.clone()).collect::<Vec<_>>());

        for order in ["receive_time asc", "receive_time desc"] {
            let mut got = Vec::new();
            let mut token = String::new();
            let mut inserted = false;
            loop {
                let page = app.records.list_records(ListRecordsRequest {
                    page_size: 5, page_token: token.clone(), order_by: order.into(), ..Default::default()
                }).await.expect("page").into_inner();
                assert!(page.records.len() <= 5);
                got.extend(page.records.into_iter().map(|r| r.record_id));
                if !inserted {
                    // Concurrent inserts between pages neither repeat nor hide earlier records.
                    for _ in 0..3 { deliver(&mut app, opened("bob")).await; }
                    inserted = true;
                }
                if page.next_page_token.is_empty() { break; }
                token = page.next_page_token;
            }
            let mut dedup = got.clone();
            dedup.sort();
            dedup.dedup();
            assert_eq!(dedup.len(), got.len(), "{order}: a record repeated");
            for r in &all {
                assert!(got.contains(&r.record_id), "{order}: a record was skipped");
            }
            let known: Vec<&String> = got.iter().filter(|id| all.iter().any(|r| &r.record_id == *id)).collect();
            let mut want: Vec<&String> = all.iter().map(|r| &r.record_id).collect();
            if order.ends_with("desc") {
                want.reverse();
            }
            assert_eq!(known, want, "{order}");
        }

        let page = app.records.list_records(ListRecordsRequest { page_size: 2, ..Default::default() })
            .await.expect("page").into_inner();
        let err = app.records.list_records(ListRecordsRequest {
            page_size: 2, page_token: page.next_page_token, principal: "bob".into(), ..Default::default()
        }).await.expect_err("token from another listing");
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = app.records.list_records(ListRecordsRequest { order_by: "principal".into(), ..Default::default() })
            .await.expect_err("order_by");
        assert!(err.message().contains("order_by"));
    }

    async fn grants_are_listed_paginated_and_need_a_known_pack(app) {
        let mut app = app;
        register(&mut app, &example("github.pack.json")).await;
        register(&mut app, &example("weather.pack.yaml")).await;
        for p in ["u1", "u2", "u3"] {
            grant(&mut app, p, "github").await;
        }
        grant(&mut app, "u1", "weather").await;
        grant(&mut app, "u1", "weather").await;
        let mut seen = Vec::new();
        let mut token = String::new();
        loop {
            let r = app.policy.list_grants(ListGrantsRequest { page_size: 2, page_token: token.clone(), ..Default::default() })
                .await.expect("grants").into_inner();
            seen.extend(r.grants.into_iter().map(|g| format!("{}/{}", g.pack_id, g.principal)));
            if r.next_page_token.is_empty() { break; }
            token = r.next_page_token;
        }
        assert_eq!(seen, ["github/u1", "github/u2", "github/u3", "weather/u1"]);
        let r = app.policy.list_grants(ListGrantsRequest { principal: "u1".into(), ..Default::default() })
            .await.expect("grants").into_inner();
        assert_eq!(r.grants.len(), 2);
        let err = app.policy.grant_sense_enable(GrantSenseEnableRequest { principal: "u1".into(), pack_id: "nope".into() })
            .await.expect_err("unknown pack");
        assert_eq!(err.code(), Code::NotFound);
        let err = app.policy.grant_sense_enable(GrantSenseEnableRequest { principal: String::new(), pack_id: "github".into() })
            .await.expect_err("no principal");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("principal"));
        let r = app.policy.revoke_sense_enable(RevokeSenseEnableRequest { principal: "u9".into(), pack_id: "github".into() })
            .await.expect("revoke").into_inner();
        assert!(!r.revoked);
        // Deleting a pack removes its grants.
        app.packs.delete_pack(pb::DeletePackRequest { pack_id: "github".into() }).await.expect("delete");
        assert_eq!(app.count("sense_grants").await, 1);
    }

    async fn policy_is_reloaded_at_start(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let url = app.test_db.url.clone();
        // A second server on the same database sees the policy the first one wrote.
        let second = hcp_sense::app::App::build(hcp_sense::config::Config::for_database(url)).await.expect("build");
        let view = second.hub().policy.view();
        let pack = view.pack("github").expect("pack loaded");
        let alice = pack.principals.get("alice").expect("alice loaded");
        assert!(alice.granted && alice.binding.is_some() && alice.activation.is_some());
        assert_eq!(pack.lands.get("issue.opened").map(String::as_str), Some("user"));
        drop(second);
        let _ = Value::Null;
    }
}

both_stores! {
    async fn group_commit_answers_concurrent_repeats_with_one_record(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let mut tasks = Vec::new();
        for i in 0..40 {
            let mut ingest = app.ingest.clone();
            let mut t = opened("alice");
            t.trigger_id = format!("burst-{}", i % 4);
            tasks.push(tokio::spawn(async move { ingest.deliver_trigger(t).await.expect("deliver").into_inner() }));
        }
        let mut by_trigger: std::collections::HashMap<usize, Vec<String>> = Default::default();
        for (i, t) in tasks.into_iter().enumerate() {
            let r = t.await.expect("task");
            assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
            by_trigger.entry(i % 4).or_default().push(r.record_id);
        }
        for ids in by_trigger.values() {
            assert!(ids.iter().all(|id| id == &ids[0]), "one record per trigger id: {ids:?}");
        }
        assert_eq!(app.count("records").await, 4);
    }

    async fn a_retry_is_answered_with_its_first_record_until_that_record_is_erased(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let mut t = opened("alice");
        t.trigger_id = "gh-erased".into();
        let first = deliver(&mut app, t.clone()).await;
        assert!(!first.duplicate);
        // Retries of an id this replica recorded are answered from a read of the first record.
        for _ in 0..3 {
            let again = deliver(&mut app, t.clone()).await;
            assert!(again.duplicate);
            assert_eq!(again.record_id, first.record_id);
            assert_eq!(again.disposition, Disposition::RecordedInbox as i32);
        }
        // Other content under the id is still refused, not answered with the first record.
        let other = with_payload(t.clone(), json!({ "issue": 43 }));
        let err = app.ingest.deliver_trigger(other).await.expect_err("other content");
        assert_eq!(err.code(), Code::AlreadyExists);
        assert_eq!(app.count("records").await, 1);
        // Erased, the first record is gone: the read finds nothing and the retry records anew.
        app.records
            .erase_records(pb::EraseRecordsRequest { principal: "alice".into(), pack_id: "github".into() })
            .await
            .expect("erase");
        assert_eq!(app.count("records").await, 0);
        let anew = deliver(&mut app, t.clone()).await;
        assert!(!anew.duplicate, "an erased record is not an answer");
        assert_ne!(anew.record_id, first.record_id);
        let again = deliver(&mut app, t).await;
        assert!(again.duplicate);
        assert_eq!(again.record_id, anew.record_id);
        assert_eq!(app.count("records").await, 1);
    }

    async fn a_failed_batch_answers_unavailable_and_records_nothing(app) {
        let mut app = app;
        ready(&mut app, "alice").await;
        let sqlite = app.db.get_database_backend() == sea_orm::DbBackend::Sqlite;
        let (break_sql, mend_sql) = if sqlite {
            ("CREATE TRIGGER refuse BEFORE INSERT ON records BEGIN SELECT RAISE(ABORT, 'injected'); END", "DROP TRIGGER refuse")
        } else {
            ("ALTER TABLE records ADD CONSTRAINT refuse CHECK (length(pack_id) < 0) NOT VALID", "ALTER TABLE records DROP CONSTRAINT refuse")
        };
        use sea_orm::ConnectionTrait;
        app.db.execute_unprepared(break_sql).await.expect("inject failure");
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let mut ingest = app.ingest.clone();
            tasks.push(tokio::spawn(async move { ingest.deliver_trigger(opened("alice")).await }));
        }
        for t in tasks {
            let err = t.await.expect("task").expect_err("no acknowledgement without a record");
            assert_eq!(err.code(), Code::Unavailable);
        }
        assert_eq!(app.count("records").await, 0);
        app.db.execute_unprepared(mend_sql).await.expect("mend");
        assert_eq!(deliver(&mut app, opened("alice")).await.disposition, Disposition::RecordedInbox as i32);
        assert_eq!(app.count("records").await, 1);
    }
}

/// A retry is answered on the replica it reaches with what the store holds now, whichever
/// replica erased the record or recorded the id again: a replica's copy of a first record
/// never outlives the record, nor answers for another record under the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_one_replica_meets_an_erasure_and_a_new_record_made_on_another_postgres() {
    use hcp_sense::grpc::pb::{
        ingest_service_client::IngestServiceClient, record_service_client::RecordServiceClient,
    };
    let mut a = crate::helpers::spawn_app(crate::helpers::StoreKind::Postgres).await;
    ready(&mut a, "alice").await;
    let b = crate::helpers::Replica::start(&a.test_db.url).await;
    let mut b_ingest = IngestServiceClient::new(b.channel.clone());
    let b_records = RecordServiceClient::new(b.channel.clone());
    let erase_on_b = || {
        let mut r = b_records.clone();
        async move {
            r.erase_records(pb::EraseRecordsRequest {
                principal: "alice".into(),
                pack_id: "github".into(),
            })
            .await
            .expect("erase on b")
        }
    };
    let mut t = opened("alice");
    t.trigger_id = "gh-replicas".into();
    let first = deliver(&mut a, t.clone()).await;
    assert!(!first.duplicate);
    retried(&mut a, &t, &first.record_id, 3).await;
    // Erased through b, then recorded through b with other content under the same id.
    erase_on_b().await;
    let other = with_payload(t.clone(), json!({ "issue": 43 }));
    let on_b = b_ingest
        .deliver_trigger(other.clone())
        .await
        .expect("b records the id anew")
        .into_inner();
    assert!(
        !on_b.duplicate && on_b.record_id != first.record_id,
        "{on_b:?}"
    );
    // On a, the first content is now another message under a taken id, never a replay.
    let err = a
        .ingest
        .deliver_trigger(t.clone())
        .await
        .expect_err("the id is b's record's now");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    retried(&mut a, &other, &on_b.record_id, 3).await;
    // Erased through b again: a's retry of the content it answered lately records anew.
    erase_on_b().await;
    let anew = deliver(&mut a, other.clone()).await;
    assert!(
        !anew.duplicate,
        "an erased record is not an answer: {anew:?}"
    );
    assert_ne!(anew.record_id, on_b.record_id);
    assert_eq!(a.count("records").await, 1);
    b.stop().await;
}

/// PostgreSQL connections cut under load: every answer is an acknowledgement
/// with a record, or UNAVAILABLE; no acknowledged record is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_loss_under_load_never_acknowledges_without_a_record_postgres() {
    use sea_orm::ConnectionTrait;
    let mut app = crate::helpers::spawn_app(crate::helpers::StoreKind::Postgres).await;
    ready(&mut app, "alice").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let mut ingest = app.ingest.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let (mut acked, mut unavailable, mut i) = (Vec::new(), 0, 0);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut t = opened("alice");
                t.trigger_id = format!("w{w}-{i}");
                i += 1;
                match ingest.deliver_trigger(t).await {
                    Ok(r) => acked.push(r.into_inner().record_id),
                    Err(e) => {
                        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                        unavailable += 1;
                    }
                }
            }
            (acked, unavailable)
        }));
    }
    let name = app
        .test_db
        .url
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let admin = sea_orm::Database::connect(crate::helpers::postgres_admin_url())
        .await
        .expect("admin");
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        admin
            .execute_unprepared(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
            ))
            .await
            .expect("terminate");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut acked, mut unavailable) = (Vec::new(), 0);
    for t in tasks {
        let (a, u) = t.await.expect("task");
        acked.extend(a);
        unavailable += u;
    }
    let _ = admin.close().await;
    assert!(!acked.is_empty());
    // The test's own connection may have been cut too.
    let db = app.test_db.connect().await;
    let stored: Vec<String> = hcp_sense::store::entity::records::Entity::find()
        .all(&db)
        .await
        .expect("records")
        .into_iter()
        .map(|r| r.record_id)
        .collect();
    for id in &acked {
        assert_eq!(
            stored.iter().filter(|s| *s == id).count(),
            1,
            "acknowledged {id} is stored exactly once"
        );
    }
    eprintln!(
        "acknowledged {}, unavailable {unavailable}, stored {}",
        acked.len(),
        stored.len()
    );
}

async fn retention_prunes_expired_records(kind: crate::helpers::StoreKind) {
    let mut app = crate::helpers::spawn_app_with(kind, |c| {
        c.record_retention = Some(Duration::from_secs(1));
        c.prune_interval = Duration::from_secs(1);
    })
    .await;
    ready(&mut app, "alice").await;
    // One with a trigger id, retried: its first record is read, and on PostgreSQL copied.
    let mut keyed = opened("alice");
    keyed.trigger_id = "gh-retained".into();
    let first = deliver(&mut app, keyed.clone()).await;
    retried(&mut app, &keyed, &first.record_id, 2).await;
    for _ in 0..2 {
        deliver(&mut app, opened("alice")).await;
    }
    assert_eq!(app.count("records").await, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while app.count("records").await > 0 {
        assert!(Instant::now() < deadline, "expired records were not pruned");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Pruned, the first record answers no retry: the id records anew.
    let anew = deliver(&mut app, keyed).await;
    assert!(
        !anew.duplicate && anew.record_id != first.record_id,
        "{anew:?}"
    );
    let fresh = deliver(&mut app, opened("alice")).await;
    let recs = list(&mut app, ListRecordsRequest::default()).await;
    let mut kept: Vec<_> = recs.iter().map(|r| r.record_id.as_str()).collect();
    kept.sort_unstable();
    let mut young = [anew.record_id.as_str(), fresh.record_id.as_str()];
    young.sort_unstable();
    assert_eq!(kept, young, "records younger than the retention stay");
}

on_both_stores!(retention_prunes_expired_records => retention_prunes_expired_records);

/// Every admin change of a row goes through one audited write: the row before and after as
/// JSON, in the change's transaction; a change that found nothing and left nothing (revoking
/// a grant twice, removing a member who is not one) is not an event.
async fn admin_changes_are_audited_once_each_and_no_ops_not_at_all(
    kind: crate::helpers::StoreKind,
) {
    let mut app = crate::helpers::spawn_app(kind).await;
    register(&mut app, &example("github.pack.json")).await;
    let grant = || GrantSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "github".into(),
    };
    let revoke = || RevokeSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "github".into(),
    };
    app.policy.grant_sense_enable(grant()).await.expect("grant");
    app.policy
        .grant_sense_enable(grant())
        .await
        .expect("grant again");
    app.policy
        .revoke_sense_enable(revoke())
        .await
        .expect("revoke");
    app.policy
        .revoke_sense_enable(revoke())
        .await
        .expect("revoke again");
    let member = || RemoveProjectMemberRequest {
        project: "p1".into(),
        principal: "alice".into(),
    };
    app.policy
        .remove_project_member(member())
        .await
        .expect("remove a non-member");
    let mut audit = pb::audit_service_client::AuditServiceClient::new(app.channel.clone());
    let events = audit
        .list_audit_events(pb::ListAuditEventsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await
        .expect("audit")
        .into_inner()
        .audit_events;
    let rpcs: Vec<&str> = events.iter().rev().map(|e| e.rpc.as_str()).collect();
    assert_eq!(
        rpcs,
        ["GrantSenseEnable", "GrantSenseEnable", "RevokeSenseEnable"],
        "{events:?}"
    );
    let row = |t: &str| -> Value {
        if t.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(t).expect("JSON")
        }
    };
    let (first, again, revoked) = (&events[2], &events[1], &events[0]);
    assert_eq!(
        (row(&first.before), row(&first.after)["principal"].clone()),
        (Value::Null, json!("alice"))
    );
    assert_eq!(
        row(&again.before),
        row(&again.after),
        "granting again keeps the first grant"
    );
    assert_eq!(
        (row(&revoked.before)["pack_id"].clone(), row(&revoked.after)),
        (json!("github"), Value::Null)
    );
}
on_both_stores!(admin_changes_are_audited_once_each_and_no_ops_not_at_all => admin_changes_are_audited_once_each_and_no_ops_not_at_all);
