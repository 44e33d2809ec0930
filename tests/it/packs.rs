//! PackService over real gRPC, on SQLite and PostgreSQL: registration, lint, reads, pagination, removal.
use hcp_sense::grpc::convert::{json_to_struct, struct_to_json};
use hcp_sense::grpc::pb::{
    self, lint_pack_request, register_pack_request, DeletePackRequest, GetPackRequest,
    LintPackRequest, ListPacksRequest, RegisterPackRequest,
};
use serde_json::{json, Value};
use tonic::Code;

use crate::helpers::{example, violations, TestApp};

const PACK_TABLES: [&str; 4] = ["packs", "pack_triggers", "pack_stimuli", "pack_commands"];

pub fn register_req(manifest: &Value) -> RegisterPackRequest {
    RegisterPackRequest {
        source: Some(register_pack_request::Source::Manifest(json_to_struct(
            manifest,
        ))),
    }
}

pub async fn register(app: &mut TestApp, manifest: &Value) -> pb::RegisterPackResponse {
    app.packs
        .register_pack(register_req(manifest))
        .await
        .expect("register pack")
        .into_inner()
}

async fn rows(app: &TestApp) -> Vec<i64> {
    let mut v = Vec::new();
    for t in PACK_TABLES {
        v.push(app.count(t).await);
    }
    v
}

fn simple(id: &str, refs: &[&str]) -> Value {
    json!({
        "id": id,
        "kind": "standard",
        "stimulusTriggers": refs.iter().map(|r| json!({ "ref": r })).collect::<Vec<_>>(),
        "policy": { "stimuli": refs.iter().map(|r| json!({ "ref": r, "operation": "read", "land": "user" })).collect::<Vec<_>>() },
        "binding": { "mode": "public" }
    })
}

both_stores! {
    async fn s7_1_1_register_json_and_yaml_then_read_back(app) {
        let mut app = app;
        let github = example("github.pack.json");
        let r = register(&mut app, &github).await;
        assert!(r.created);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let p = r.pack.expect("pack");
        assert_eq!(p.pack_id, "github");
        assert_eq!(p.generation, 1);
        assert_eq!(p.binding_mode, pb::BindingMode::User as i32);
        assert_eq!(p.stimulus_triggers.len(), 3);

        let yaml = std::fs::read_to_string(crate::helpers::repo_path("examples/weather.pack.yaml")).expect("yaml");
        let r = app.packs.register_pack(RegisterPackRequest {
            source: Some(register_pack_request::Source::ManifestText(yaml)),
        }).await.expect("register yaml").into_inner();
        let weather = r.pack.expect("pack");
        assert_eq!(weather.kind, pb::PackKind::SenseOnly as i32);
        assert_eq!(weather.binding_hub, "none");

        let got = app.packs.get_pack(GetPackRequest { pack_id: "github".into() })
            .await.expect("get").into_inner().pack.expect("pack");
        assert_eq!(struct_to_json(got.manifest.clone().expect("manifest")), github);
        assert_eq!(got.stimuli.iter().map(|s| s.land.as_str()).collect::<Vec<_>>(), ["user", "project", "user"]);
        assert_eq!(got.commands.len(), 2);
        assert_eq!(rows(&app).await, vec![2, 4, 4, 2]);
    }

    async fn s7_1_3_a_pack_that_fails_lint_leaves_no_row(app) {
        let mut app = app;
        let err = app.packs.register_pack(register_req(&example("broken.pack.json")))
            .await.expect_err("lint must refuse");
        assert_eq!(err.code(), Code::InvalidArgument);
        let v = violations(&err);
        let rules: Vec<&str> = v.iter().filter_map(|(_, d)| d.split(':').next()).collect();
        for want in ["s7_1_2", "s7_1_3", "s7_1_4", "s7_9_2"] {
            assert!(rules.contains(&want), "{want} missing from {v:?}");
        }
        assert!(v.iter().any(|(f, _)| f == "policy.stimuli[0].operation"), "{v:?}");
        // The message is bounded (grpc-message travels in the trailers): it names the first
        // violations and how many more the details list.
        assert!(
            err.message().contains("s7_1_2") && err.message().contains("more violations (in the status details)"),
            "{}",
            err.message()
        );
        assert_eq!(rows(&app).await, vec![0, 0, 0, 0]);

        // A failing re-registration leaves the earlier declaration as it was.
        register(&mut app, &simple("broken", &["build.finished"])).await;
        let before = rows(&app).await;
        app.packs.register_pack(register_req(&example("broken.pack.json"))).await.expect_err("refused");
        assert_eq!(rows(&app).await, before);
        let p = app.packs.get_pack(GetPackRequest { pack_id: "broken".into() })
            .await.expect("get").into_inner().pack.expect("pack");
        assert_eq!(p.generation, 1);
        assert_eq!(p.stimulus_triggers[0].r#ref, "build.finished");
    }

    async fn s7_1_2_bad_refs_are_refused_over_grpc(app) {
        let mut app = app;
        for bad in ["", "Issue.Opened", "issue..opened", ".issue", "issue."] {
            let m = simple("p", &[bad]);
            let err = app.packs.register_pack(register_req(&m)).await.expect_err(bad);
            assert_eq!(err.code(), Code::InvalidArgument);
            assert!(violations(&err).iter().any(|(f, d)| f == "stimulusTriggers[0].ref" && d.starts_with("s7_1_2")), "{bad:?}: {err:?}");
        }
        let err = app.packs.register_pack(register_req(&simple("p", &["a.b", "a.b"]))).await.expect_err("dup");
        assert!(violations(&err).iter().any(|(f, d)| f == "stimulusTriggers[1].ref" && d.contains("more than once")));
        assert_eq!(rows(&app).await, vec![0, 0, 0, 0]);
    }

    async fn s7_7_1_warnings_do_not_refuse(app) {
        let mut app = app;
        let mut m = simple("crm", &["deal.won"]);
        m["binding"] = json!({ "mode": "user", "hub": "crm" });
        let r = register(&mut app, &m).await;
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        assert_eq!(r.warnings[0].rule, "s7_7_1");
        assert_eq!(r.warnings[0].severity, pb::Severity::Warning as i32);
        assert_eq!(app.count("packs").await, 1);
    }

    async fn reregistering_replaces_the_declaration_atomically(app) {
        let mut app = app;
        register(&mut app, &simple("ci", &["build.started", "build.finished", "build.failed"])).await;
        let r = register(&mut app, &simple("ci", &["deploy.done"])).await;
        assert!(!r.created);
        let p = r.pack.expect("pack");
        assert_eq!(p.generation, 2);
        let secs = |t: Option<prost_types::Timestamp>| t.map(|t| (t.seconds, t.nanos)).expect("time");
        assert!(secs(p.update_time) >= secs(p.create_time));
        let got = app.packs.get_pack(GetPackRequest { pack_id: "ci".into() })
            .await.expect("get").into_inner().pack.expect("pack");
        assert_eq!(got.stimulus_triggers.iter().map(|t| t.r#ref.as_str()).collect::<Vec<_>>(), ["deploy.done"]);
        assert_eq!(rows(&app).await, vec![1, 1, 1, 0]);

        // Concurrent re-registrations: each is whole, none is mixed with another.
        let mut tasks = Vec::new();
        for i in 0..8 {
            let mut client = app.packs.clone();
            let refs: Vec<String> = (0..=i).map(|j| format!("e{j}.x")).collect();
            let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
            let req = register_req(&simple("ci", &refs));
            tasks.push(tokio::spawn(async move { client.register_pack(req).await }));
        }
        for t in tasks {
            t.await.expect("join").expect("concurrent register");
        }
        let got = app.packs.get_pack(GetPackRequest { pack_id: "ci".into() })
            .await.expect("get").into_inner().pack.expect("pack");
        assert_eq!(got.generation, 10);
        let n = got.stimulus_triggers.len() as i64;
        assert_eq!(rows(&app).await, vec![1, n, n, 0]);
        let manifest = struct_to_json(got.manifest.expect("manifest"));
        assert_eq!(manifest["stimulusTriggers"].as_array().map(Vec::len), Some(n as usize));
    }

    async fn lint_pack_stores_nothing(app) {
        let mut app = app;
        let r = app.packs.lint_pack(LintPackRequest {
            source: Some(lint_pack_request::Source::Manifest(json_to_struct(&example("broken.pack.json")))),
        }).await.expect("lint").into_inner();
        assert!(!r.valid);
        assert_eq!(r.pack_id, "broken");
        assert!(r.findings.iter().any(|f| f.rule == "s7_1_4" && f.field == "stimulusTriggers[1].source"));
        let r = app.packs.lint_pack(LintPackRequest {
            source: Some(lint_pack_request::Source::ManifestText(example("github.pack.json").to_string())),
        }).await.expect("lint").into_inner();
        assert!(r.valid);
        assert!(r.findings.is_empty());
        assert_eq!(rows(&app).await, vec![0, 0, 0, 0]);
    }

    async fn list_packs_paginates(app) {
        let mut app = app;
        for i in (0..7).rev() {
            register(&mut app, &simple(&format!("pack-{i}"), &["x.y"])).await;
        }
        let mut seen = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let r = app.packs.list_packs(ListPacksRequest { page_size: 3, page_token: token.clone() })
                .await.expect("list").into_inner();
            pages += 1;
            seen.extend(r.packs.into_iter().map(|p| p.pack_id));
            if r.next_page_token.is_empty() { break; }
            token = r.next_page_token;
        }
        assert_eq!(pages, 3);
        assert_eq!(seen, (0..7).map(|i| format!("pack-{i}")).collect::<Vec<_>>());
        let all = app.packs.list_packs(ListPacksRequest::default()).await.expect("list").into_inner();
        assert_eq!(all.packs.len(), 7);
        assert!(all.next_page_token.is_empty());

        let err = app.packs.list_packs(ListPacksRequest { page_size: -1, page_token: String::new() })
            .await.expect_err("negative");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("page_size"));
        let err = app.packs.list_packs(ListPacksRequest { page_size: 3, page_token: "not-a-token".into() })
            .await.expect_err("tampered");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("page_token"));
    }

    async fn get_and_delete_pack(app) {
        let mut app = app;
        let err = app.packs.get_pack(GetPackRequest { pack_id: "nope".into() }).await.expect_err("missing");
        assert_eq!(err.code(), Code::NotFound);
        assert!(err.message().contains("nope"));
        let err = app.packs.get_pack(GetPackRequest { pack_id: String::new() }).await.expect_err("empty id");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("pack_id"));

        register(&mut app, &example("github.pack.json")).await;
        register(&mut app, &simple("other", &["a.b"])).await;
        app.packs.delete_pack(DeletePackRequest { pack_id: "github".into() }).await.expect("delete");
        let err = app.packs.get_pack(GetPackRequest { pack_id: "github".into() }).await.expect_err("gone");
        assert_eq!(err.code(), Code::NotFound);
        let err = app.packs.delete_pack(DeletePackRequest { pack_id: "github".into() }).await.expect_err("again");
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(rows(&app).await, vec![1, 1, 1, 0]);
    }

    async fn register_without_a_manifest_is_invalid(app) {
        let mut app = app;
        let err = app.packs.register_pack(RegisterPackRequest { source: None }).await.expect_err("none");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(violations(&err).iter().any(|(f, _)| f == "manifest"));
        let err = app.packs.register_pack(RegisterPackRequest {
            source: Some(register_pack_request::Source::ManifestText("id: [unclosed".into())),
        }).await.expect_err("bad text");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(violations(&err).iter().any(|(f, _)| f == "manifest_text"));
        let err = app.packs.register_pack(RegisterPackRequest {
            source: Some(register_pack_request::Source::ManifestText("\"just a string\"".into())),
        }).await.expect_err("not an object");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(rows(&app).await, vec![0, 0, 0, 0]);
    }

    async fn health_reports_serving(app) {
        let mut health = tonic_health::pb::health_client::HealthClient::new(app.channel.clone());
        for service in ["", "hcp.sense.v1.PackService"] {
            let r = health.check(tonic_health::pb::HealthCheckRequest { service: service.into() })
                .await.expect("check").into_inner();
            assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
        }
        app.stop().await;
    }
}
