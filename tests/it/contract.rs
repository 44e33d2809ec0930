//! Contract gaps a new user walks into: idempotency before policy, binding.degraded on every departure (and once
//! across replicas), brain degraded triggers, ids that cannot forge log fields, bounded drop keys, and admin listings.
use std::sync::Arc;
use std::time::Duration;

use hcp_sense::grpc::convert::struct_to_json;
use hcp_sense::grpc::pb::{
    self, policy_service_client::PolicyServiceClient, BindingState, DropReason, ListRecordsRequest,
};
use prost::Message;
use tonic::Code;

use crate::helpers::{example, spawn_app_with, StoreKind, TestApp};
use crate::identity::{opened, set_up};
use crate::packs::register;

async fn bind(app: &TestApp, who: &str, state: BindingState) -> pb::ReportBindingHealthResponse {
    PolicyServiceClient::new(app.channel.clone())
        .report_binding_health(pb::ReportBindingHealthRequest {
            principal: who.into(),
            pack_id: "github".into(),
            state: state as i32,
        })
        .await
        .expect("report")
        .into_inner()
}

async fn degraded_records(app: &mut TestApp, who: &str) -> Vec<serde_json::Value> {
    app.records
        .list_records(ListRecordsRequest {
            principal: who.into(),
            r#ref: "binding.degraded".into(),
            page_size: 1000,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .records
        .into_iter()
        .map(|r| struct_to_json(r.payload.unwrap_or_default()))
        .collect()
}

both_stores! {
    async fn s7_3_idempotency_comes_before_policy(app) {
        let mut app = app;
        set_up(&app.channel, "", &["alice"]).await;
        let mut t = opened("alice");
        t.trigger_id = "gh-delivery-7".into();
        let first = app.ingest.deliver_trigger(t.clone()).await.expect("first").into_inner();
        assert!(!first.record_id.is_empty());
        // The grant is revoked before the producer's retry arrives.
        app.policy.revoke_sense_enable(pb::RevokeSenseEnableRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("revoke");
        let retry = app.ingest.deliver_trigger(t.clone()).await.expect("retry").into_inner();
        assert_eq!(retry.record_id, first.record_id);
        assert!(retry.duplicate);
        assert_eq!(retry.disposition, pb::Disposition::RecordedInbox as i32);
        assert_eq!(retry.drop_reason, DropReason::Unspecified as i32);
        // A new trigger is dropped; the same id for another principal is a conflict.
        let mut other = opened("alice");
        other.trigger_id = "gh-delivery-8".into();
        assert_eq!(app.ingest.deliver_trigger(other).await.expect("new").into_inner().drop_reason, DropReason::NoGrant as i32);
        let mut forged = t.clone();
        forged.principal = "bob".into();
        assert_eq!(app.ingest.deliver_trigger(forged).await.expect_err("conflict").code(), Code::AlreadyExists);
        assert_eq!(app.count("records").await, 1);
        app.stop().await;
    }

    async fn s7_3_an_id_reused_with_another_payload_is_refused_not_answered_as_the_first(app) {
        use crate::support::trigger::with_payload;
        let mut app = app;
        set_up(&app.channel, "", &["alice"]).await;
        let mut t = with_payload(opened("alice"), serde_json::json!({"number": 7, "title": "a"}));
        t.trigger_id = "msg_1".into();
        let first = app.ingest.deliver_trigger(t.clone()).await.expect("first").into_inner();
        assert!(!first.duplicate);
        // A retry with its keys in another order is the same trigger.
        let retry = with_payload(t.clone(), serde_json::json!({"title": "a", "number": 7}));
        let again = app.ingest.deliver_trigger(retry).await.expect("retry").into_inner();
        assert!(again.duplicate);
        assert_eq!(again.record_id, first.record_id);
        // Another message under the same id: refused at the sink, before policy (a would-be
        // drop, once the grant is gone) and by ExplainTrigger alike; the first stays alone.
        let other = with_payload(t.clone(), serde_json::json!({"number": 8, "title": "a"}));
        let e = app.ingest.deliver_trigger(other.clone()).await.expect_err("other content");
        assert_eq!(e.code(), Code::AlreadyExists);
        assert!(e.message().contains("payload") && e.message().contains("msg_1"), "{}", e.message());
        let e = app.ingest.explain_trigger(pb::ExplainTriggerRequest { trigger: Some(other.clone()) }).await.expect_err("explained");
        assert_eq!(e.code(), Code::AlreadyExists);
        app.policy.revoke_sense_enable(pb::RevokeSenseEnableRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("revoke");
        let e = app.ingest.deliver_trigger(other).await.expect_err("other content, would drop");
        assert_eq!(e.code(), Code::AlreadyExists);
        assert_eq!(app.count("records").await, 1);
        app.stop().await;
    }

    async fn s7_7_3_deleting_a_linked_binding_produces_binding_degraded(app) {
        let mut app = app;
        set_up(&app.channel, "", &["alice", "bob"]).await;
        let gone = app.policy.delete_binding(pb::DeleteBindingRequest { principal: "alice".into(), pack_id: "github".into() })
            .await.expect("delete").into_inner();
        let o = gone.binding_degraded.expect("a linked binding that goes away has degraded");
        assert_eq!(o.disposition, pb::Disposition::RecordedInbox as i32);
        let recs = degraded_records(&mut app, "alice").await;
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0]["state"], "pending");
        assert_eq!(recs[0]["previous_state"], "linked");
        assert_eq!(recs[0]["deleted"], true);
        // A Binding that was not linked produces nothing when deleted.
        bind(&app, "bob", BindingState::Stale).await;
        let before = degraded_records(&mut app, "bob").await.len();
        let gone = app.policy.delete_binding(pb::DeleteBindingRequest { principal: "bob".into(), pack_id: "github".into() })
            .await.expect("delete").into_inner();
        assert!(gone.binding_degraded.is_none());
        assert_eq!(degraded_records(&mut app, "bob").await.len(), before);
        let e = app.policy.delete_binding(pb::DeleteBindingRequest { principal: "bob".into(), pack_id: "github".into() })
            .await.expect_err("twice");
        assert_eq!(e.code(), Code::NotFound);
        app.stop().await;
    }

    async fn s7_7_3_a_brain_binding_degraded_is_a_counted_drop_of_its_own(app) {
        let mut app = app;
        let mut m = example("github.pack.json");
        for s in m["policy"]["stimuli"].as_array_mut().expect("stimuli") {
            if s["ref"] == "binding.degraded" {
                s["land"] = "brain".into();
            }
        }
        let reg = register(&mut app, &m).await;
        assert!(reg.warnings.iter().any(|w| w.rule == "s7_7_3"), "{:?}", reg.warnings);
        for who in ["alice"] {
            app.policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: who.into(), pack_id: "github".into() }).await.expect("grant");
            app.policy.put_binding(pb::PutBindingRequest { principal: who.into(), pack_id: "github".into(), binding_id: "b".into(), state: 1 }).await.expect("bind");
            app.policy.activate_sense(pb::ActivateSenseRequest { principal: who.into(), pack_id: "github".into(), route: 1, filter: String::new() }).await.expect("on");
        }
        let r = bind(&app, "alice", BindingState::Stale).await;
        let o = r.binding_degraded.expect("produced");
        assert_eq!(o.drop_reason, DropReason::NoProject as i32);
        let spans = crate::trace::decisions(&[("hcp.pack_id", "github"), ("hcp.drop_reason", "no_project")]);
        assert!(!spans.is_empty(), "the drop is traced");
        let reports = app.records.list_drop_reports(pb::ListDropReportsRequest { pack_id: "github".into(), ..Default::default() })
            .await.expect("reports").into_inner().drop_reports;
        assert!(reports.iter().any(|d| d.reason == DropReason::NoProject as i32 && d.r#ref == "binding.degraded" && d.count == 1), "{reports:?}");
        app.stop().await;
    }

    async fn s7_4_execute_state_of_an_unregistered_pack_is_not_found(app) {
        let mut app = app;
        let e = app.policy.put_execute_state(pb::PutExecuteStateRequest { principal: "alice".into(), pack_id: "gitlab".into(), installed: true, activated: true, connected: true })
            .await.expect_err("unregistered");
        assert_eq!(e.code(), Code::NotFound);
        assert_eq!(app.count("execute_states").await, 0);
        app.stop().await;
    }

    async fn ids_that_could_forge_a_log_field_are_invalid(app) {
        let mut app = app;
        set_up(&app.channel, "", &["alice"]).await;
        for (field, bad) in [("principal", "alice hcp.principal=bob"), ("principal", "a=b"), ("principal", "a\u{85}b"), ("project", "p q"), ("trigger_id", "t\tx"), ("trigger_id", "x=y")] {
            let mut t = opened("alice");
            match field {
                "principal" => t.principal = bad.into(),
                "project" => t.project = bad.into(),
                _ => t.trigger_id = bad.into(),
            }
            let e = app.ingest.deliver_trigger(t).await.expect_err(bad);
            assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}");
            assert_eq!(crate::helpers::violations(&e)[0].0, field, "{bad:?}");
        }
        let e = app.policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: "bob smith".into(), pack_id: "github".into() })
            .await.expect_err("grant");
        assert_eq!(e.code(), Code::InvalidArgument);
        app.stop().await;
    }

    async fn admins_list_bindings_activations_and_members_page_by_page(app) {
        let mut app = app;
        let who = ["p1", "p2", "p3", "p4", "p5"];
        set_up(&app.channel, "", &who).await;
        app.policy.activate_sense(pb::ActivateSenseRequest { principal: String::new(), pack_id: "github".into(), route: 2, filter: String::new() }).await.expect("pack-wide");
        for p in who {
            app.policy.add_project_member(pb::AddProjectMemberRequest { project: "atlas".into(), principal: p.into() }).await.expect("member");
        }
        app.policy.add_project_member(pb::AddProjectMemberRequest { project: "zeta".into(), principal: "p1".into() }).await.expect("member");
        let mut token = String::new();
        let mut seen = Vec::new();
        loop {
            let r = app.policy.list_bindings(pb::ListBindingsRequest { pack_id: "github".into(), page_size: 2, page_token: token, ..Default::default() })
                .await.expect("bindings").into_inner();
            assert!(r.bindings.len() <= 2);
            seen.extend(r.bindings.into_iter().map(|b| b.principal));
            if r.next_page_token.is_empty() { break; }
            token = r.next_page_token;
        }
        assert_eq!(seen, who);
        let one = app.policy.list_bindings(pb::ListBindingsRequest { principal: "p3".into(), ..Default::default() }).await.expect("p3").into_inner();
        assert_eq!(one.bindings.len(), 1);
        assert_eq!(one.bindings[0].binding_id, "b-2");
        let acts = app.policy.list_activations(pb::ListActivationsRequest { pack_id: "github".into(), page_size: 1000, ..Default::default() }).await.expect("activations").into_inner();
        assert_eq!(acts.activations.len(), 6, "five principals and the pack-wide default");
        assert_eq!(acts.activations[0].principal, "", "the pack-wide default sorts first");
        assert_eq!(acts.activations[0].route, pb::Route::Silent as i32);
        let members = app.policy.list_project_members(pb::ListProjectMembersRequest { project: "atlas".into(), page_size: 3, ..Default::default() }).await.expect("members").into_inner();
        assert_eq!(members.members.len(), 3);
        let rest = app.policy.list_project_members(pb::ListProjectMembersRequest { project: "atlas".into(), page_size: 3, page_token: members.next_page_token.clone(), ..Default::default() }).await.expect("rest").into_inner();
        assert_eq!(rest.members.len(), 2);
        assert!(rest.next_page_token.is_empty());
        let p1 = app.policy.list_project_members(pb::ListProjectMembersRequest { principal: "p1".into(), ..Default::default() }).await.expect("p1").into_inner();
        assert_eq!(p1.members.iter().map(|m| m.project.as_str()).collect::<Vec<_>>(), ["atlas", "zeta"]);
        // A token continues only the listing it came from.
        let e = app.policy.list_project_members(pb::ListProjectMembersRequest { project: "zeta".into(), page_token: members.next_page_token, ..Default::default() }).await.expect_err("other filters");
        assert_eq!(e.code(), Code::InvalidArgument);
        let e = app.policy.list_bindings(pb::ListBindingsRequest { page_size: -1, ..Default::default() }).await.expect_err("negative");
        assert_eq!(e.code(), Code::InvalidArgument);
        app.stop().await;
    }

    async fn the_drop_key_cap_holds_across_flushes_and_restarts(app) {
        use hcp_sense::domain::trigger::DropReason as Why;
        use hcp_sense::service::{DropLog, LOG_FLUSH_EVERY};
        let metrics = Arc::new(hcp_sense::metrics::Metrics::new(100));
        let store = hcp_sense::store::Store::connect(&hcp_sense::config::StoreConfig::at(app.test_db.url.clone())).await.expect("store").delivery_tables();
        let life = hcp_sense::lifecycle::Lifecycle::new();
        let log = DropLog::start(store.clone(), metrics.clone(), vec![], LOG_FLUSH_EVERY, &life);
        for i in 0..10_050 {
            log.count(&format!("invented-{i}"), "x.y", Why::UnknownPack);
        }
        log.flush().await.expect("flush");
        for i in 0..100 {
            log.count(&format!("later-{i}"), "x.y", Why::UnknownPack);
        }
        log.count("invented-5", "x.y", Why::UnknownPack);
        log.flush().await.expect("flush");
        drop(log);
        // A restarted server knows the keys already stored.
        let keys = store.drop_report_keys(20_000).await.expect("keys");
        let log = DropLog::start(store.clone(), metrics, keys, LOG_FLUSH_EVERY, &life);
        for i in 0..100 {
            log.count(&format!("after-restart-{i}"), "x.y", Why::UnknownPack);
        }
        log.flush().await.expect("flush");
        assert_eq!(app.count("drop_reports").await, 10_001, "10,000 keys and the overflow row");
        let sum = |where_: &str| {
            let db = app.db.clone();
            let sql = format!("SELECT CAST(COALESCE(SUM(count), 0) AS BIGINT) AS n FROM drop_reports {where_}");
            async move {
                use sea_orm::ConnectionTrait;
                let row = db.query_one_raw(sea_orm::Statement::from_string(db.get_database_backend(), sql)).await.expect("sum").expect("row");
                row.try_get::<i64>("", "n").expect("n")
            }
        };
        assert_eq!(sum("").await, 10_251, "no drop goes uncounted");
        assert_eq!(sum("WHERE pack_id = '*'").await, 250);
        assert_eq!(sum("WHERE pack_id = 'invented-5'").await, 2);
        tokio::time::sleep(Duration::from_millis(10)).await;
        app.stop().await;
    }
}

/// A client codec that sends its bytes as they are — what no generated client would encode,
/// such as a string field that is not UTF-8 — and decodes the answer as `U`.
struct Raw<U>(std::marker::PhantomData<U>);

impl<U> Default for Raw<U> {
    fn default() -> Self {
        Raw(std::marker::PhantomData)
    }
}

struct RawBytes;

impl tonic::codec::Encoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl<U: prost::Message + Default + Send + 'static> tonic::codec::Codec for Raw<U> {
    type Encode = Vec<u8>;
    type Decode = U;
    type Encoder = RawBytes;
    type Decoder = hcp_sense_api::codec::MessageDecoder<U>;

    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic::codec::Codec::decoder(&mut hcp_sense_api::codec::Codec::<(), U>::default())
    }
}

/// Stands for a string field's value in an encoded message, then is made invalid UTF-8.
const MARK: &str = "zzzzzzzz";

/// `msg` encoded, with the bytes of MARK replaced by bytes that are never UTF-8.
fn not_utf8(msg: &impl prost::Message) -> Vec<u8> {
    let mut bytes = msg.encode_to_vec();
    let at = bytes
        .windows(MARK.len())
        .position(|w| w == MARK.as_bytes())
        .expect("the mark is encoded");
    bytes[at..at + MARK.len()].fill(0xff);
    bytes
}

fn ingest_path(method: &str) -> http::uri::PathAndQuery {
    http::uri::PathAndQuery::try_from(format!("/hcp.sense.v1.IngestService/{method}"))
        .expect("path")
}

/// `opened("alice")` with MARK in `field`.
fn marked(field: &str) -> pb::DeliverTriggerRequest {
    let mut t = opened("alice");
    match field {
        "pack_id" => t.pack_id = MARK.into(),
        "ref" => t.r#ref = MARK.into(),
        "principal" => t.principal = MARK.into(),
        "land" => t.land = MARK.into(),
        "project" => t.project = MARK.into(),
        "trigger_id" => t.trigger_id = MARK.into(),
        _ => {
            t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::PayloadJson(
                MARK.into(),
            ))
        }
    }
    t
}

/// INVALID_ARGUMENT naming `field` and saying why.
fn names(e: &tonic::Status, field: &str) {
    assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
    let v = crate::helpers::violations(e);
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].0, field, "{e:?}");
    assert!(v[0].1.contains("UTF-8"), "{v:?}");
    assert!(
        e.message().starts_with(&format!("{field}: ")),
        "{}",
        e.message()
    );
}

both_stores! {
    async fn a_string_field_that_is_not_utf8_is_invalid_argument_naming_it(app) {
        let mut app = app;
        set_up(&app.channel, "", &["alice"]).await;
        let mut grpc = tonic::client::Grpc::new(app.channel.clone());
        let fields = ["pack_id", "ref", "principal", "land", "project", "trigger_id", "payload_json"];
        for field in fields {
            grpc.ready().await.expect("ready");
            let e = grpc
                .unary(tonic::Request::new(not_utf8(&marked(field))), ingest_path("DeliverTrigger"), Raw::<pb::DeliverTriggerResponse>::default())
                .await
                .expect_err(field);
            names(&e, field);
            grpc.ready().await.expect("ready");
            let explain = pb::ExplainTriggerRequest { trigger: Some(marked(field)) };
            let e = grpc
                .unary(tonic::Request::new(not_utf8(&explain)), ingest_path("ExplainTrigger"), Raw::<pb::ExplainTriggerResponse>::default())
                .await
                .expect_err(field);
            names(&e, &format!("trigger.{field}"));
            // In a stream: the trigger before it is answered, then the stream ends naming the
            // field as DeliverTrigger would; the one after it is never read.
            let good = |id: &str| {
                let mut t = opened("alice");
                t.trigger_id = format!("{id}-{field}");
                pb::DeliverTriggersRequest { trigger: Some(t) }.encode_to_vec()
            };
            let bad = not_utf8(&pb::DeliverTriggersRequest { trigger: Some(marked(field)) });
            grpc.ready().await.expect("ready");
            let mut answers = grpc
                .streaming(
                    tonic::Request::new(tokio_stream::iter(vec![good("before"), bad, good("after")])),
                    ingest_path("DeliverTriggers"),
                    Raw::<pb::DeliverTriggersResponse>::default(),
                )
                .await
                .expect("the stream opens")
                .into_inner();
            let first = answers.message().await.expect("answered").expect("an answer");
            assert_eq!(first.index, 0);
            assert!(
                matches!(&first.result, Some(pb::deliver_triggers_response::Result::Outcome(o)) if o.disposition == pb::Disposition::RecordedInbox as i32),
                "{first:?}"
            );
            let e = answers.message().await.expect_err("the stream ends with the status");
            names(&e, field);
        }
        // One record per stream, each the trigger before the broken one.
        assert_eq!(app.count("records").await, fields.len() as i64);
        let ids: Vec<String> = app
            .records
            .list_records(ListRecordsRequest { principal: "alice".into(), page_size: 100, ..Default::default() })
            .await
            .expect("records")
            .into_inner()
            .records
            .into_iter()
            .map(|r| r.trigger_id)
            .collect();
        assert!(ids.iter().all(|id| id.starts_with("before-")), "{ids:?}");
        app.stop().await;
    }

    async fn a_disabled_activation_has_no_route_in_every_answer(app) {
        let mut app = app;
        set_up(&app.channel, "", &["alice"]).await;
        let mut policy = PolicyServiceClient::new(app.channel.clone());
        let state = |who: &str| pb::GetPackStateRequest { principal: who.into(), pack_id: "github".into() };
        for (principal, asked) in [("alice", "alice"), ("", "bob")] {
            for route in [pb::Route::Silent, pb::Route::Inbox] {
                let on = policy
                    .activate_sense(pb::ActivateSenseRequest { principal: principal.into(), pack_id: "github".into(), route: route as i32, filter: String::new() })
                    .await
                    .expect("activate")
                    .into_inner()
                    .activation
                    .expect("activation");
                assert!(on.enabled);
                assert_eq!(on.route, route as i32);
                let s = policy.get_pack_state(state(asked)).await.expect("state").into_inner().sense.expect("sense");
                assert!(s.enabled && s.route == route as i32, "{s:?}");
                let off = policy
                    .deactivate_sense(pb::DeactivateSenseRequest { principal: principal.into(), pack_id: "github".into() })
                    .await
                    .expect("deactivate")
                    .into_inner()
                    .activation
                    .expect("activation");
                assert!(!off.enabled);
                assert_eq!(off.route, pb::Route::Unspecified as i32, "after {route:?}: {off:?}");
                let s = policy.get_pack_state(state(asked)).await.expect("state").into_inner().sense.expect("sense");
                assert!(!s.enabled, "{s:?}");
                assert_eq!(s.route, off.route, "GetPackState agrees with DeactivateSense");
                let listed = policy
                    .list_activations(pb::ListActivationsRequest { pack_id: "github".into(), principal: principal.into(), ..Default::default() })
                    .await
                    .expect("list")
                    .into_inner()
                    .activations;
                let row = listed.iter().find(|a| a.principal == principal).expect("listed");
                assert_eq!((row.enabled, row.route), (false, off.route), "{listed:?}");
            }
        }
        // Switched off, a trigger is dropped as activation_off; on again it takes the route named.
        let r = app.ingest.deliver_trigger(opened("alice")).await.expect("deliver").into_inner();
        assert_eq!(r.drop_reason, DropReason::ActivationOff as i32);
        app.stop().await;
    }
}

/// Two replicas on one PostgreSQL flip one Binding between linked and stale 50 times at once:
/// each real departure from linked is recorded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_7_3_two_replicas_emit_binding_degraded_once_per_departure() {
    let mut a = spawn_app_with(StoreKind::Postgres, |_| {}).await;
    let mut config = hcp_sense::config::Config::for_database(a.test_db.url.clone());
    config.migrate = false;
    let b = hcp_sense::app::App::build(config).await.expect("replica b");
    let b_addr = b.local_addr();
    let (stop_b, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(b.run_until(async move {
        let _ = stopped.await;
    }));
    set_up(&a.channel, "", &["alice"]).await;
    let b_ch = tonic::transport::Channel::from_shared(format!("http://{b_addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect b");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let ch = if i % 2 == 0 {
            a.channel.clone()
        } else {
            b_ch.clone()
        };
        let state = if i % 3 == 0 {
            BindingState::Linked
        } else {
            BindingState::Stale
        };
        tasks.push(tokio::spawn(async move {
            let mut c = PolicyServiceClient::new(ch);
            loop {
                match c
                    .report_binding_health(pb::ReportBindingHealthRequest {
                        principal: "alice".into(),
                        pack_id: "github".into(),
                        state: state as i32,
                    })
                    .await
                {
                    Ok(r) => return r.into_inner(),
                    // A replica catching up with the other's change answers UNAVAILABLE.
                    Err(s) if s.code() == Code::Unavailable => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(s) => panic!("report: {s:?}"),
                }
            }
        }));
    }
    let mut departures = 0;
    let mut produced = 0;
    let (mut prev_linked, mut wrote_linked) = (0, 0);
    for t in tasks {
        let r = t.await.expect("task");
        let to = r.binding.as_ref().map(|b| b.state).unwrap_or_default();
        let linked = BindingState::Linked as i32;
        prev_linked += usize::from(r.previous_state == linked);
        wrote_linked += usize::from(to == linked);
        if r.previous_state == linked && to != linked {
            departures += 1;
        }
        if r.binding_degraded.is_some() {
            produced += 1;
        }
    }
    // The writes took turns: each saw the state the one before it wrote, so the states seen
    // before are the first state (linked) and every state written but the last.
    let last = a
        .policy
        .list_bindings(pb::ListBindingsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await
        .expect("bindings")
        .into_inner()
        .bindings[0]
        .state;
    assert_eq!(
        prev_linked,
        1 + wrote_linked - usize::from(last == BindingState::Linked as i32),
        "two writers saw the same previous state"
    );
    let recorded = degraded_records(&mut a, "alice").await.len();
    assert!(departures > 0, "the flips left linked at least once");
    assert_eq!(
        produced, departures,
        "one trigger per departure seen by the writers"
    );
    assert_eq!(recorded, departures, "one record per departure");
    let _ = stop_b.send(());
    let _ = served.await;
    a.stop().await;
}

/// A stock grpcio client (its default 8 KiB/16 KiB metadata limits) is refused a payload that
/// breaks its schema in more places than are reported, each quoting a value of thousands of
/// characters, in each script: it is told INVALID_ARGUMENT with the first 8 violations, each
/// description within 200 characters, in trailers under 8 KiB — not RESOURCE_EXHAUSTED
/// "Stream removed", which would read as a quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_2_a_refusal_of_long_values_in_any_script_fits_grpcio_default_trailers() {
    let mut app = spawn_app_with(StoreKind::Sqlite, |_| {}).await;
    register(&mut app, &example("tracker.pack.yaml")).await;
    let addr = app.addr.to_string();
    for script in ["ascii", "cyrillic", "cjk", "emoji"] {
        let addr = addr.clone();
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new("python3")
                .args(["tests/python/long_refusal.py", &addr, "proto", script])
                .current_dir(crate::helpers::repo_path(""))
                .output()
                .expect("python3 with grpcio (see .ci/run)")
        })
        .await
        .expect("python");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{script}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let told: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON object");
        assert_eq!(told["code"], "INVALID_ARGUMENT", "{script}: {told}");
        let violations = told["violations"].as_array().expect("violations");
        assert_eq!(violations.len(), 8, "{script}: {told}");
        for v in violations {
            let field = v[0].as_str().unwrap_or_default();
            let description = v[1].as_str().unwrap_or_default();
            assert!(field.starts_with("payload"), "{script}: {v}");
            assert!(description.chars().count() <= 200, "{script}: {v}");
        }
        let bytes = told["trailer_bytes"].as_u64().expect("trailer bytes");
        assert!(bytes <= 7 * 1024, "{script}: {bytes} bytes of trailers");
        let message = told["message"].as_str().unwrap_or_default();
        assert!(message.len() <= 384, "{script}: {message}");
        eprintln!("{script}: {bytes} bytes of trailers; {message}");
    }
    app.stop().await;
}
