//! Hostile input across the RPCs: each bad request gets its expected status, and nothing is stored.
use base64::Engine as _;
use hcp_sense::grpc::convert::json_to_struct;
use hcp_sense::grpc::pb::{
    self, deliver_trigger_request::PayloadSource, register_pack_request, DeliverTriggerRequest,
};
use serde_json::json;
use tonic::Code;

use crate::helpers::{example, TestApp};
use crate::packs::{register, register_req};
use crate::support::trigger::{trigger, with_payload};

/// Records each case's outcome; the test fails listing every case that went wrong.
#[derive(Default)]
struct Table {
    cases: usize,
    wrong: Vec<String>,
}

impl Table {
    fn check<T: std::fmt::Debug>(
        &mut self,
        name: &str,
        want: Code,
        got: Result<tonic::Response<T>, tonic::Status>,
    ) {
        self.cases += 1;
        let code = got.as_ref().map_or_else(|s| s.code(), |_| Code::Ok);
        if code != want {
            self.wrong
                .push(format!("{name}: want {want:?}, got {got:?}"));
        }
        if let Err(s) = &got {
            if s.code() == Code::Internal {
                self.wrong
                    .push(format!("{name}: INTERNAL leaks no reason: {}", s.message()));
            }
        }
    }
}

fn manifest_with(edit: impl FnOnce(&mut serde_json::Value)) -> pb::RegisterPackRequest {
    let mut m = example("github.pack.json");
    edit(&mut m);
    register_req(&m)
}

fn text(t: &str) -> pb::RegisterPackRequest {
    pb::RegisterPackRequest {
        source: Some(register_pack_request::Source::ManifestText(t.into())),
    }
}

fn trig(edit: impl FnOnce(&mut DeliverTriggerRequest)) -> DeliverTriggerRequest {
    let mut t = with_payload(
        trigger("github", "issue.opened", "alice", "user"),
        json!({ "n": 1 }),
    );
    edit(&mut t);
    t
}

fn token(raw: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

both_stores! {
    async fn hostile_input_is_refused_with_a_clear_status_and_stores_nothing(app) {
        let mut app: TestApp = app;
        register(&mut app, &example("github.pack.json")).await;
        app.policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: "alice".into(), pack_id: "github".into() }).await.expect("grant");
        app.policy.put_binding(pb::PutBindingRequest { principal: "alice".into(), pack_id: "github".into(), binding_id: "b-1".into(), state: 1 }).await.expect("bind");
        register(&mut app, &json!({ "id": "zz-extra", "binding": { "mode": "public" } })).await;
        let before = app.snapshot(true).await;
        let (mut packs, mut policy, mut ingest, mut records) = (app.packs.clone(), app.policy.clone(), app.ingest.clone(), app.records.clone());
        let ia = Code::InvalidArgument;
        let mut t = Table::default();

        // RegisterPack / LintPack: wrong types, empty and oversized fields, SQL-looking and control characters, deep JSON.
        t.check("register: no manifest", ia, packs.register_pack(pb::RegisterPackRequest { source: None }).await);
        t.check("register: empty text", ia, packs.register_pack(text("")).await);
        t.check("register: truncated JSON", ia, packs.register_pack(text("{\"id\": \"x\"")).await);
        t.check("register: a list, not an object", ia, packs.register_pack(text("[1, 2]")).await);
        t.check("register: SQL in the id", ia, packs.register_pack(manifest_with(|m| m["id"] = json!("x'; DROP TABLE packs;--"))).await);
        t.check("register: control character in the id", ia, packs.register_pack(manifest_with(|m| m["id"] = json!("git\u{1}hub"))).await);
        t.check("register: SQL in a ref", ia, packs.register_pack(manifest_with(|m| m["stimulusTriggers"][0]["ref"] = json!("a'; DELETE FROM records;--"))).await);
        t.check("register: 10,000-character id", ia, packs.register_pack(manifest_with(|m| m["id"] = json!("p".repeat(10_000)))).await);
        t.check("register: kind is a number", ia, packs.register_pack(manifest_with(|m| m["kind"] = json!(42))).await);
        t.check("register: triggers are a string", ia, packs.register_pack(manifest_with(|m| m["stimulusTriggers"] = json!("issue.opened"))).await);
        t.check("register: 300-deep JSON text", ia, packs.register_pack(text(&format!("{}{}", "[".repeat(300), "]".repeat(300)))).await);
        t.check("register: binding mode unknown", ia, packs.register_pack(manifest_with(|m| m["binding"]["mode"] = json!("root"))).await);
        t.check("register: land with a newline", ia, packs.register_pack(manifest_with(|m| m["policy"]["stimuli"][0]["land"] = json!("user\nbrain"))).await);
        t.check("lint: no manifest", ia, packs.lint_pack(pb::LintPackRequest { source: None }).await);

        // Pack reads and removal.
        t.check("get: empty id", ia, packs.get_pack(pb::GetPackRequest { pack_id: String::new() }).await);
        t.check("get: path traversal", ia, packs.get_pack(pb::GetPackRequest { pack_id: "../../etc/passwd".into() }).await);
        t.check("get: 1,000-character id", ia, packs.get_pack(pb::GetPackRequest { pack_id: "p".repeat(1000) }).await);
        t.check("get: unknown pack", Code::NotFound, packs.get_pack(pb::GetPackRequest { pack_id: "gitlab".into() }).await);
        t.check("delete: SQL in the id", ia, packs.delete_pack(pb::DeletePackRequest { pack_id: "' OR 1=1 --".into() }).await);
        t.check("list packs: negative page size", ia, packs.list_packs(pb::ListPacksRequest { page_size: -5, page_token: String::new() }).await);
        t.check("list packs: garbage token", ia, packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: "!!not-base64!!".into() }).await);
        t.check("list packs: token of another list", ia, packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: token(b"records\n0\n1\x1fa") }).await);
        t.check("list packs: token that is not UTF-8", ia, packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: token(&[0xff, 0xfe, 0x00]) }).await);
        t.check("list packs: token with a forged filter", ia, packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: token(b"packs\nforged\ngithub") }).await);
        let real = packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: String::new() }).await.expect("page").into_inner().next_page_token;
        assert!(!real.is_empty());
        let raw = String::from_utf8(base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&real).expect("b64")).expect("utf8");
        t.check("list packs: a real token, altered", ia, packs.list_packs(pb::ListPacksRequest { page_size: 1, page_token: token(raw.replace("github", "aaaaaa").as_bytes()) }).await);

        // Policy.
        t.check("grant: empty principal", ia, policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: String::new(), pack_id: "github".into() }).await);
        t.check("grant: NUL in principal", ia, policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: "al\u{0}ice".into(), pack_id: "github".into() }).await);
        t.check("grant: padded principal", ia, policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: " alice ".into(), pack_id: "github".into() }).await);
        t.check("grant: 300-byte principal", ia, policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: "a".repeat(300), pack_id: "github".into() }).await);
        t.check("grant: unknown pack", Code::NotFound, policy.grant_sense_enable(pb::GrantSenseEnableRequest { principal: "mallory".into(), pack_id: "gitlab".into() }).await);
        t.check("activate: unknown route", ia, policy.activate_sense(pb::ActivateSenseRequest { principal: "alice".into(), pack_id: "github".into(), route: 99, filter: String::new() }).await);
        t.check("bind: unknown state", ia, policy.put_binding(pb::PutBindingRequest { principal: "alice".into(), pack_id: "github".into(), binding_id: "b-2".into(), state: 42 }).await);
        t.check("bind: empty binding id", ia, policy.put_binding(pb::PutBindingRequest { principal: "alice".into(), pack_id: "github".into(), binding_id: String::new(), state: 1 }).await);
        t.check("bind: the reserved identity `public`", ia, policy.put_binding(pb::PutBindingRequest { principal: "alice".into(), pack_id: "github".into(), binding_id: "public".into(), state: 1 }).await);
        t.check("health: no state", ia, policy.report_binding_health(pb::ReportBindingHealthRequest { principal: "alice".into(), pack_id: "github".into(), state: 0 }).await);
        t.check("execute state: SQL in the pack id", ia, policy.put_execute_state(pb::PutExecuteStateRequest { principal: "alice".into(), pack_id: "x;DROP".into(), ..Default::default() }).await);
        t.check("member: empty project", ia, policy.add_project_member(pb::AddProjectMemberRequest { project: String::new(), principal: "alice".into() }).await);
        t.check("grants: forged token", ia, policy.list_grants(pb::ListGrantsRequest { page_token: token(b"grants\n0000000000000000\ngithub\x1falice"), ..Default::default() }).await);

        // DeliverTrigger.
        t.check("deliver: empty ref", ia, ingest.deliver_trigger(trig(|t| t.r#ref.clear())).await);
        t.check("deliver: upper-case ref", ia, ingest.deliver_trigger(trig(|t| t.r#ref = "Issue.Opened".into())).await);
        t.check("deliver: empty land", ia, ingest.deliver_trigger(trig(|t| t.land.clear())).await);
        t.check("deliver: payload not JSON", ia, ingest.deliver_trigger(trig(|t| t.payload_source = Some(PayloadSource::PayloadJson("{'a': 1}".into())))).await);
        t.check("deliver: payload a list", ia, ingest.deliver_trigger(trig(|t| t.payload_source = Some(PayloadSource::PayloadJson("[1]".into())))).await);
        t.check("deliver: payload a string", ia, ingest.deliver_trigger(trig(|t| t.payload_source = Some(PayloadSource::PayloadJson("\"hi\"".into())))).await);
        t.check("deliver: unknown source", ia, ingest.deliver_trigger(trig(|t| t.source = 99)).await);
        t.check("deliver: 10,000-byte trigger id", ia, ingest.deliver_trigger(trig(|t| t.trigger_id = "t".repeat(10_000))).await);
        t.check("deliver: brain without project", ia, ingest.deliver_trigger(trig(|t| t.land = "brain".into())).await);
        t.check("deliver: DEL in project", ia, ingest.deliver_trigger(trig(|t| t.project = "p\u{7f}".into())).await);
        t.check("deliver: 100 KiB payload", ia, ingest.deliver_trigger(trig(|t| t.payload_source = Some(PayloadSource::Payload(json_to_struct(&json!({ "b": "x".repeat(100 << 10) })))))).await);

        // Reads.
        t.check("records: SQL in order_by", ia, records.list_records(pb::ListRecordsRequest { order_by: "principal; DROP TABLE records".into(), ..Default::default() }).await);
        t.check("records: negative nanos", ia, records.list_records(pb::ListRecordsRequest { start_time: Some(prost_types::Timestamp { seconds: 1, nanos: -1 }), ..Default::default() }).await);
        t.check("records: end before start", ia, records.list_records(pb::ListRecordsRequest {
            start_time: Some(prost_types::Timestamp { seconds: 100, nanos: 0 }), end_time: Some(prost_types::Timestamp { seconds: 1, nanos: 0 }), ..Default::default()
        }).await);
        t.check("records: a pack list's token", ia, records.list_records(pb::ListRecordsRequest { page_token: token(b"packs\n\ngithub"), ..Default::default() }).await);
        t.check("records: unknown route", ia, records.list_records(pb::ListRecordsRequest { route: 7, ..Default::default() }).await);
        t.check("records: control character in viewer", ia, records.list_records(pb::ListRecordsRequest { viewer: "a\u{1b}[31m".into(), ..Default::default() }).await);
        t.check("drop reports: unknown reason", ia, records.list_drop_reports(pb::ListDropReportsRequest { reason: 99, ..Default::default() }).await);

        assert!(t.cases >= 40, "only {} cases", t.cases);
        assert!(t.wrong.is_empty(), "{} of {} cases went wrong:\n{}", t.wrong.len(), t.cases, t.wrong.join("\n"));
        assert_eq!(app.snapshot(true).await, before, "a refused request stored something");
    }
}
