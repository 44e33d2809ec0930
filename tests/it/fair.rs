//! The sink's fair queue seen from outside: a flooding pack and a quiet one, each trigger recorded once, each pack's wait measured and traced apart.
use hcp_sense::grpc::pb::{self, Disposition};

use crate::helpers::{example, spawn_app, spawn_app_with, StoreKind, TestApp};
use crate::support::trigger::trigger;

/// Registers `weather` under another id, grants alice and turns Sense on for it.
async fn weather_as(app: &TestApp, pack_id: &str) {
    let mut manifest = example("weather.pack.yaml");
    manifest["id"] = serde_json::json!(pack_id);
    app.packs
        .clone()
        .register_pack(crate::packs::register_req(&manifest))
        .await
        .expect("register");
    let mut policy = app.policy.clone();
    policy
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: pack_id.into(),
        })
        .await
        .expect("grant");
    policy
        .activate_sense(pb::ActivateSenseRequest {
            pack_id: pack_id.into(),
            route: pb::Route::Inbox as i32,
            ..Default::default()
        })
        .await
        .expect("activate");
}

/// 64 callers flood one pack with 2,560 triggers while another pack delivers 20, one at a
/// time: every trigger is recorded once, each pack's queue wait is its own series, the
/// flood's queue is empty once it is answered, and each decision's span carries its wait.
async fn a_flood_and_a_quiet_pack_are_recorded_once_with_waits_per_pack(kind: StoreKind) {
    let app = spawn_app(kind).await;
    let (flood, quiet) = ("flood-fair", format!("quiet-fair-{kind:?}").to_lowercase());
    weather_as(&app, flood).await;
    weather_as(&app, &quiet).await;
    let mut callers = tokio::task::JoinSet::new();
    for c in 0..64 {
        let mut ingest = app.ingest.clone();
        callers.spawn(async move {
            for n in 0..40 {
                let r = ingest
                    .deliver_trigger(pb::DeliverTriggerRequest {
                        trigger_id: format!("f-{c}-{n}"),
                        ..trigger(flood, "storm.warning", "alice", "user")
                    })
                    .await
                    .expect("flood delivered")
                    .into_inner();
                assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
                assert!(!r.duplicate);
            }
        });
    }
    let mut ingest = app.ingest.clone();
    for n in 0..20 {
        let r = ingest
            .deliver_trigger(pb::DeliverTriggerRequest {
                trigger_id: format!("q-{n}"),
                ..trigger(&quiet, "storm.warning", "alice", "user")
            })
            .await
            .expect("quiet delivered")
            .into_inner();
        assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
    }
    while let Some(done) = callers.join_next().await {
        done.expect("a flood caller");
    }
    assert_eq!(app.count("records").await, 2_580, "each trigger once");
    let metrics = crate::helpers::http_get(&format!("http://{}/metrics", app.metrics_addr));
    for line in [
        format!(r#"hcp_sense_sink_queue_wait_seconds_count{{pack="{quiet}"}} 20"#),
        format!(r#"hcp_sense_sink_queue_wait_seconds_count{{pack="{flood}"}} 2560"#),
        format!(r#"hcp_sense_sink_queued_records{{pack="{flood}"}} 0"#),
        // Every caller answered once, through the window of answers handed out at a time.
        format!(r#"hcp_sense_sink_resume_wait_seconds_count{{pack="{quiet}"}} 20"#),
        format!(r#"hcp_sense_sink_resume_wait_seconds_count{{pack="{flood}"}} 2560"#),
    ] {
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    let spans = crate::trace::decisions(&[("hcp.pack_id", quiet.as_str())]);
    assert_eq!(spans.len(), 20, "{spans:?}");
    for s in &spans {
        let wait = s.get("hcp.queue_wait_us").map(|w| w.parse::<u64>());
        assert!(matches!(wait, Some(Ok(_))), "{s:?}");
    }
}
on_both_stores!(a_flood_and_a_quiet_pack_are_recorded_once_with_waits_per_pack => a_flood_and_a_quiet_pack_are_recorded_once_with_waits_per_pack);

/// The sink's batches so far: how many, and the records in them.
fn batches(app: &TestApp) -> (u64, u64) {
    let metrics = crate::helpers::http_get(&format!("http://{}/metrics", app.metrics_addr));
    let read = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in:\n{metrics}")) as u64
    };
    (
        read("hcp_sense_sink_batch_records_count "),
        read("hcp_sense_sink_batch_records_sum "),
    )
}

/// `--sink-commit-delay-ms 20` and 200 triggers a second, each started on its schedule (open
/// loop): once the writer has counted the rate, several records share each commit, and every
/// trigger is answered recorded and stored once.
async fn at_a_steady_rate_a_commit_delay_shares_commits(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| {
        c.sink_commit_delay = std::time::Duration::from_millis(20);
    })
    .await;
    weather_as(&app, "paced").await;
    let mut calls = tokio::task::JoinSet::new();
    let mut every = tokio::time::interval(std::time::Duration::from_millis(5));
    for n in 0..200 {
        every.tick().await;
        let mut ingest = app.ingest.clone();
        calls.spawn(async move {
            let r = ingest
                .deliver_trigger(pb::DeliverTriggerRequest {
                    trigger_id: format!("p-{n}"),
                    ..trigger("paced", "storm.warning", "alice", "user")
                })
                .await
                .expect("delivered")
                .into_inner();
            assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
            assert!(!r.duplicate);
        });
    }
    while let Some(done) = calls.join_next().await {
        done.expect("a call");
    }
    assert_eq!(app.count("records").await, 200, "each trigger once");
    let (count, records) = batches(&app);
    assert_eq!(records, 200);
    // At 200 a second a 20 ms wait gathers about four: the first tenth of a second (before a
    // rate is counted) commits one by one, the rest in shared commits.
    assert!(count <= 120, "{count} commits for 200 records");
}
on_both_stores!(at_a_steady_rate_a_commit_delay_shares_commits => at_a_steady_rate_a_commit_delay_shares_commits);
