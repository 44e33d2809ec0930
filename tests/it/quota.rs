//! Quotas from outside: set, read, listed and deleted by admins, audited; over one a trigger is refused with the time to retry — over gRPC, in a DeliverTriggers stream, over HTTP and from NATS — neither recorded nor dropped, and a retry records it once.
use std::time::Duration;

use hcp_sense::grpc::pb::{
    self, audit_service_client::AuditServiceClient, deliver_triggers_response, Disposition,
};
use serde_json::json;
use tonic::Code;
use tonic_types::StatusExt;

use crate::cli::{connect, set_up_weather, storm_warning};
use crate::helpers::{http_get, spawn_app, violations, Replica, StoreKind, TestDb};
use crate::ingress::{
    app_with_ingress, broadcast_route, ingress, send_plan, standard, url, weather_route, SECRET_NEW,
};
use crate::support::served::Served;

fn put(pack_id: &str, principal: Option<&str>, rate: f64, burst: u32) -> pb::PutQuotaRequest {
    pb::PutQuotaRequest {
        pack_id: pack_id.into(),
        principal: principal.map(str::to_owned),
        rate_per_second: rate,
        burst,
    }
}

/// Sets the weather pack's quota through the admin API.
async fn pack_quota(app: &crate::helpers::TestApp, rate: f64, burst: u32) {
    app.policy
        .clone()
        .put_quota(put("weather", None, rate, burst))
        .await
        .expect("quota");
}

fn series(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The retry delay a refusal carries as google.rpc.RetryInfo, and that it says QUOTA_EXCEEDED.
fn retry_delay(s: &tonic::Status) -> Duration {
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    let info = s.get_details_error_info().expect("ErrorInfo");
    assert_eq!(info.reason, "QUOTA_EXCEEDED");
    s.get_details_retry_info()
        .and_then(|r| r.retry_delay)
        .expect("RetryInfo with a delay")
}

/// Admins put, get, list (paged, filtered) and delete quotas; every bad field is refused by
/// name; a principal given empty is refused, not taken for the pack; every change is audited.
async fn run_quotas_are_kept_listed_and_audited(kind: StoreKind) {
    let app = spawn_app(kind).await;
    set_up_weather(&app.channel).await;
    let mut policy = app.policy.clone();
    let unknown = policy
        .put_quota(put("nope", None, 1.0, 1))
        .await
        .expect_err("unknown pack");
    assert_eq!(unknown.code(), Code::NotFound);
    for (req, field) in [
        (put("weather", None, 0.0, 1), "rate_per_second"),
        (put("weather", None, f64::NAN, 1), "rate_per_second"),
        (put("weather", None, 2e6, 1), "rate_per_second"),
        (put("weather", None, 1.0, 1_000_001), "burst"),
        (put("weather", Some(""), 1.0, 1), "principal"),
        (put("weather", Some("has space"), 1.0, 1), "principal"),
        (put("", None, 1.0, 1), "pack_id"),
    ] {
        let e = policy.put_quota(req.clone()).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{req:?}");
        assert_eq!(violations(&e)[0].0, field, "{req:?}: {e:?}");
    }
    let pack = policy
        .put_quota(put("weather", None, 2.5, 0))
        .await
        .expect("pack-wide")
        .into_inner()
        .quota
        .expect("quota");
    assert_eq!(
        (pack.principal, pack.burst),
        (None, 3),
        "burst: a second's worth"
    );
    for p in ["alice", "bob", "carol"] {
        policy
            .put_quota(put("weather", Some(p), 10.0, 5))
            .await
            .expect("principal's");
    }
    let got = policy
        .get_quota(pb::GetQuotaRequest {
            pack_id: "weather".into(),
            principal: Some("bob".into()),
        })
        .await
        .expect("get")
        .into_inner()
        .quota
        .expect("quota");
    assert_eq!((got.rate_per_second, got.burst), (10.0, 5));
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = policy
            .list_quotas(pb::ListQuotasRequest {
                pack_id: "weather".into(),
                page_size: 3,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .expect("list")
            .into_inner();
        assert!(page.quotas.len() <= 3);
        seen.extend(page.quotas.into_iter().map(|q| q.principal));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(
        seen,
        [
            None,
            Some("alice".into()),
            Some("bob".into()),
            Some("carol".into())
        ]
    );
    let bob = policy
        .list_quotas(pb::ListQuotasRequest {
            principal: "bob".into(),
            ..Default::default()
        })
        .await
        .expect("by principal")
        .into_inner();
    assert_eq!(bob.quotas.len(), 1);
    policy
        .delete_quota(pb::DeleteQuotaRequest {
            pack_id: "weather".into(),
            principal: Some("bob".into()),
        })
        .await
        .expect("delete");
    let gone = policy
        .delete_quota(pb::DeleteQuotaRequest {
            pack_id: "weather".into(),
            principal: Some("bob".into()),
        })
        .await
        .expect_err("deleted already");
    assert_eq!(gone.code(), Code::NotFound);
    let audit = AuditServiceClient::new(app.channel.clone())
        .list_audit_events(pb::ListAuditEventsRequest {
            pack_id: "weather".into(),
            principal: "bob".into(),
            ..Default::default()
        })
        .await
        .expect("audit")
        .into_inner()
        .audit_events;
    let rpcs: Vec<&str> = audit.iter().map(|e| e.rpc.as_str()).collect();
    assert!(rpcs.starts_with(&["DeleteQuota", "PutQuota"]), "{rpcs:?}");
    assert!(audit[0].after.is_empty() && audit[0].before.contains("\"burst\":5"));
    // Deleting the pack deletes its quotas.
    app.packs
        .clone()
        .delete_pack(pb::DeletePackRequest {
            pack_id: "weather".into(),
        })
        .await
        .expect("delete pack");
    assert_eq!(app.count("sense_quotas").await, 0);
}
on_both_stores!(quotas_are_kept_listed_and_audited => run_quotas_are_kept_listed_and_audited);

/// Burst 3 at one per second: three recorded, the fourth RESOURCE_EXHAUSTED with RetryInfo,
/// recorded nowhere and counted as no drop; a retried recorded id is its first record over
/// quota; ExplainTrigger tells; after the delay the next one is recorded. A principal's own
/// quota holds that principal alone.
async fn run_over_quota_a_trigger_is_refused_with_retry_info_and_never_recorded(kind: StoreKind) {
    let app = spawn_app(kind).await;
    set_up_weather(&app.channel).await;
    let (mut policy, mut ingest) = (app.policy.clone(), app.ingest.clone());
    policy
        .put_quota(put("weather", None, 1.0, 3))
        .await
        .expect("quota");
    let mut first = String::new();
    for n in 0..3 {
        let r = ingest
            .deliver_trigger(storm_warning(format!("q-{n}")))
            .await
            .expect("within the burst")
            .into_inner();
        assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
        if n == 0 {
            first = r.record_id;
        }
    }
    let refused = ingest
        .deliver_trigger(storm_warning("q-3".into()))
        .await
        .expect_err("the burst's n+1");
    let delay = retry_delay(&refused);
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(1),
        "{delay:?}"
    );
    assert!(
        refused.message().contains("pack `weather`"),
        "{}",
        refused.message()
    );
    let again = ingest
        .deliver_trigger(storm_warning("q-0".into()))
        .await
        .expect("a recorded id comes first whatever the quota")
        .into_inner();
    assert!(again.duplicate);
    assert_eq!(again.record_id, first);
    let explained = ingest
        .explain_trigger(pb::ExplainTriggerRequest {
            trigger: Some(storm_warning("q-3".into())),
        })
        .await
        .expect("explain")
        .into_inner()
        .quota
        .expect("quota check");
    assert!(!explained.admits);
    assert_eq!(explained.pack_quota.map(|q| q.burst), Some(3));
    assert!(explained.principal_quota.is_none());
    assert!(explained.retry_delay.is_some());
    assert_eq!(app.count("records").await, 3);
    assert_eq!(
        app.count("drop_reports").await,
        0,
        "nothing counted as dropped"
    );
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    assert_eq!(
        series(
            &metrics,
            r#"hcp_sense_quota_admitted_total{pack="weather"}"#
        ),
        3.0
    );
    assert!(
        series(
            &metrics,
            r#"hcp_sense_quota_throttled_total{pack="weather"}"#
        ) >= 1.0
    );
    assert!(
        !metrics.contains(r#"disposition="dropped""#),
        "no drop counted"
    );
    tokio::time::sleep(delay + Duration::from_millis(20)).await;
    let later = ingest
        .deliver_trigger(storm_warning("q-3".into()))
        .await
        .expect("a token has come")
        .into_inner();
    assert!(!later.duplicate);
    assert_eq!(app.count("records").await, 4);

    // alice's own quota: one; the pack's is raised out of the way.
    policy
        .put_quota(put("weather", None, 1000.0, 1000))
        .await
        .expect("raise");
    policy
        .put_quota(put("weather", Some("alice"), 0.01, 1))
        .await
        .expect("alice's");
    ingest
        .deliver_trigger(storm_warning("a-1".into()))
        .await
        .expect("alice's one");
    let e = ingest
        .deliver_trigger(storm_warning("a-2".into()))
        .await
        .expect_err("alice's second");
    assert!(
        retry_delay(&e) > Duration::from_secs(50),
        "1/100 per second"
    );
    assert!(e.message().contains("principal `alice`"), "{}", e.message());
    let bob = ingest
        .deliver_trigger(crate::support::trigger::trigger(
            "weather",
            "storm.warning",
            "bob",
            "user",
        ))
        .await
        .expect("bob is not alice: decided (dropped, not granted)")
        .into_inner();
    assert_eq!(bob.disposition, Disposition::Dropped as i32);
}
on_both_stores!(over_quota_a_trigger_is_refused_with_retry_info_and_never_recorded => run_over_quota_a_trigger_is_refused_with_retry_info_and_never_recorded);

/// In a DeliverTriggers stream each trigger over quota gets its own RESOURCE_EXHAUSTED outcome
/// with the delay, and the stream goes on.
async fn run_a_stream_refuses_each_trigger_over_quota_on_its_own(kind: StoreKind) {
    let app = spawn_app(kind).await;
    set_up_weather(&app.channel).await;
    pack_quota(&app, 0.01, 2).await;
    let items: Vec<pb::DeliverTriggersRequest> = (0..5)
        .map(|n| pb::DeliverTriggersRequest {
            trigger: Some(storm_warning(format!("s-{n}"))),
        })
        .collect();
    let mut out = app
        .ingest
        .clone()
        .deliver_triggers(tokio_stream::iter(items))
        .await
        .expect("stream")
        .into_inner();
    let (mut recorded, mut refused) = (0, 0);
    while let Some(item) = out.message().await.expect("item") {
        match item.result.expect("result") {
            deliver_triggers_response::Result::Outcome(o) => {
                assert_eq!(o.disposition, Disposition::RecordedInbox as i32);
                recorded += 1;
            }
            deliver_triggers_response::Result::Error(e) => {
                assert_eq!(e.code, Code::ResourceExhausted as i32, "{e:?}");
                let d = e.retry_delay.expect("retry delay");
                assert!(d.seconds > 0 || d.nanos > 0, "{d:?}");
                refused += 1;
            }
        }
    }
    assert_eq!((recorded, refused), (2, 3));
    assert_eq!(app.count("records").await, 2);
}
on_both_stores!(a_stream_refuses_each_trigger_over_quota_on_its_own => run_a_stream_refuses_each_trigger_over_quota_on_its_own);

/// Webhooks over quota are 429 with Retry-After and record nothing; the replay of a decided
/// delivery is still its first answer; the refused one sent again later is recorded once.
async fn run_a_webhook_over_quota_is_429_with_retry_after(kind: StoreKind) {
    let app = app_with_ingress(kind, None).await;
    set_up_weather(&app.channel).await;
    ingress(&app)
        .put_ingress_route(weather_route("alerts", &[SECRET_NEW]))
        .await
        .expect("route");
    pack_quota(&app, 1.0, 1).await;
    let u = url(&app, "alerts");
    let alert = json!({"level": "warning", "user": "alice"});
    let answers = send_plan(json!([
        standard(&u, SECRET_NEW, "msg_1", alert.clone()),
        standard(&u, SECRET_NEW, "msg_2", alert.clone()),
        standard(&u, SECRET_NEW, "msg_1", alert.clone()),
    ]))
    .await;
    assert_eq!(answers[0]["status"], 202, "{answers:?}");
    assert_eq!(answers[1]["status"], 429, "{answers:?}");
    assert_eq!(answers[1]["retry_after"], "1", "{answers:?}");
    assert!(answers[1]["body"]["error"]
        .as_str()
        .is_some_and(|m| m.contains("quota")));
    assert_eq!(answers[2]["status"], 202);
    assert_eq!(answers[2]["body"]["replay"], true);
    assert_eq!(app.count("records").await, 1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let later = send_plan(json!([standard(&u, SECRET_NEW, "msg_2", alert)])).await;
    assert_eq!(later[0]["status"], 202, "{later:?}");
    assert_eq!(app.count("records").await, 2);
}
on_both_stores!(a_webhook_over_quota_is_429_with_retry_after => run_a_webhook_over_quota_is_429_with_retry_after);

/// Two replicas on one PostgreSQL share each quota's bucket: 40 triggers at once, half on each,
/// against a burst of 10 that does not refill within the test: exactly 10 recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_across_replicas_postgres() {
    let app = spawn_app(StoreKind::Postgres).await;
    set_up_weather(&app.channel).await;
    let other = Replica::start(&app.test_db.url).await;
    pack_quota(&app, 0.001, 10).await;
    // The other replica hears of the quota through the policy channel.
    let mut other_policy =
        pb::policy_service_client::PolicyServiceClient::new(other.channel.clone());
    let mut heard = false;
    for _ in 0..100 {
        let explained = pb::ingest_service_client::IngestServiceClient::new(other.channel.clone())
            .explain_trigger(pb::ExplainTriggerRequest {
                trigger: Some(storm_warning("probe".into())),
            })
            .await
            .expect("explain")
            .into_inner();
        if explained.quota.is_some_and(|q| q.pack_quota.is_some()) {
            heard = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(heard, "the other replica applies the quota");
    let _ = other_policy
        .get_quota(pb::GetQuotaRequest {
            pack_id: "weather".into(),
            principal: None,
        })
        .await
        .expect("read on the other replica");
    let mut callers = tokio::task::JoinSet::new();
    for n in 0..40 {
        let ch = if n % 2 == 0 {
            app.channel.clone()
        } else {
            other.channel.clone()
        };
        callers.spawn(async move {
            pb::ingest_service_client::IngestServiceClient::new(ch)
                .deliver_trigger(storm_warning(format!("r-{n}")))
                .await
                .map(|r| r.into_inner().disposition)
                .map_err(|s| s.code())
        });
    }
    let (mut recorded, mut refused) = (0, 0);
    while let Some(r) = callers.join_next().await {
        match r.expect("caller") {
            Ok(d) => {
                assert_eq!(d, Disposition::RecordedInbox as i32);
                recorded += 1;
            }
            Err(code) => {
                assert_eq!(code, Code::ResourceExhausted);
                refused += 1;
            }
        }
    }
    assert_eq!((recorded, refused), (10, 30));
    assert_eq!(app.count("records").await, 10);
    other.stop().await;
}

/// The ids recorded so far, and whether any was recorded twice.
async fn recorded_ids(
    db: &sea_orm::DatabaseConnection,
) -> (usize, std::collections::BTreeSet<String>) {
    use hcp_sense::store::entity::records;
    use sea_orm::EntityTrait;
    let rows = records::Entity::find().all(db).await.expect("records");
    let n = rows.len();
    (
        n,
        rows.into_iter()
            .filter_map(|r| r.producer_trigger_id)
            .collect(),
    )
}

/// 16 callers flood a pack with a quota of 200 per second, each retrying what is refused after
/// the delay it is told; the server is killed with -9 midway and started again: every trigger
/// acknowledged before the kill is recorded, and after the retries every trigger is recorded
/// exactly once.
async fn run_a_kill_during_a_throttled_flood_loses_nothing_acknowledged(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let mut served = Served::start(&db.url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    pb::policy_service_client::PolicyServiceClient::new(ch.clone())
        .put_quota(put("weather", None, 200.0, 20))
        .await
        .expect("quota");
    const CALLERS: usize = 16;
    const EACH: usize = 60;
    let flood = |ch: tonic::transport::Channel,
                 c: usize,
                 acked: std::sync::Arc<std::sync::Mutex<Vec<String>>>| async move {
        let mut ingest = pb::ingest_service_client::IngestServiceClient::new(ch);
        let mut throttled = 0u32;
        for n in 0..EACH {
            let id = format!("k-{c}-{n}");
            loop {
                match ingest.deliver_trigger(storm_warning(id.clone())).await {
                    Ok(_) => {
                        acked.lock().expect("acked").push(id.clone());
                        break;
                    }
                    Err(s) if s.code() == Code::ResourceExhausted => {
                        throttled += 1;
                        tokio::time::sleep(retry_delay(&s)).await;
                    }
                    Err(_) => return throttled,
                }
            }
        }
        throttled
    };
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut callers = tokio::task::JoinSet::new();
    for c in 0..CALLERS {
        callers.spawn(flood(ch.clone(), c, acked.clone()));
    }
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while recorded_ids(&conn).await.0 < CALLERS * EACH / 3 {
        assert!(tokio::time::Instant::now() < deadline, "flood stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    served.kill9();
    let mut throttled = 0;
    while let Some(t) = callers.join_next().await {
        throttled += t.expect("caller");
    }
    assert!(throttled > 0, "the flood was throttled");
    let before_kill: Vec<String> = acked.lock().expect("acked").clone();
    let (_, ids) = recorded_ids(&conn).await;
    for id in &before_kill {
        assert!(ids.contains(id), "{id} was acknowledged, then lost");
    }
    assert!(before_kill.len() < CALLERS * EACH, "killed midway");
    // Started again, the callers send everything once more (the acknowledged ones too).
    let again = Served::start(&db.url, &[]);
    let ch = connect(&again.addr).await;
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut callers = tokio::task::JoinSet::new();
    for c in 0..CALLERS {
        callers.spawn(flood(ch.clone(), c, acked.clone()));
    }
    while let Some(t) = callers.join_next().await {
        t.expect("caller");
    }
    assert_eq!(acked.lock().expect("acked").len(), CALLERS * EACH);
    let (n, ids) = recorded_ids(&conn).await;
    assert_eq!(
        (n, ids.len()),
        (CALLERS * EACH, CALLERS * EACH),
        "each once"
    );
}
on_both_stores!(a_kill_during_a_throttled_flood_loses_nothing_acknowledged => run_a_kill_during_a_throttled_flood_loses_nothing_acknowledged);

/// `hcp-sense pipe` over a quota waits the delay it is told and delivers every line: the same
/// tally as without a quota, at the quota's pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipe_over_quota_waits_and_delivers_every_line() {
    let app = spawn_app(StoreKind::Sqlite).await;
    set_up_weather(&app.channel).await;
    pack_quota(&app, 2.0, 1).await;
    let started = std::time::Instant::now();
    let out = crate::ingress::pipe_storm_feed(&app).await;
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("7 lines: 4 recorded, 1 dropped, 2 refused"),
        "{stderr}"
    );
    // Four new triggers (the repeated id is its first record whatever the quota), one token
    // at a time at two a second: three waits of half a second.
    assert!(took >= Duration::from_millis(1_400), "{took:?}");
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    assert!(
        series(
            &metrics,
            r#"hcp_sense_quota_throttled_total{pack="weather"}"#
        ) >= 1.0
    );
}

/// A webhook fanning out to three principals is admitted whole or refused whole: with a burst
/// of five, one is recorded for all three, the next (which would need three of two left) is 429
/// with nothing recorded; one wider than the burst waits for a full bucket rather than never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_is_admitted_whole_or_refused_whole() {
    let app = app_with_ingress(StoreKind::Postgres, None).await;
    set_up_weather(&app.channel).await;
    let mut policy = app.policy.clone();
    for p in ["bob", "carol"] {
        policy
            .grant_sense_enable(pb::GrantSenseEnableRequest {
                principal: p.into(),
                pack_id: "weather".into(),
            })
            .await
            .expect("grant");
    }
    ingress(&app)
        .put_ingress_route(broadcast_route())
        .await
        .expect("route");
    policy
        .put_quota(put("weather", None, 0.001, 5))
        .await
        .expect("quota");
    let u = url(&app, "broadcast");
    let answers = send_plan(json!([
        standard(&u, SECRET_NEW, "evt_1", json!({"area": "north"})),
        standard(&u, SECRET_NEW, "evt_2", json!({"area": "south"})),
    ]))
    .await;
    assert_eq!(answers[0]["status"], 202, "{answers:?}");
    assert_eq!(
        answers[0]["body"]["triggers"].as_array().map(Vec::len),
        Some(3)
    );
    assert_eq!(answers[1]["status"], 429, "{answers:?}");
    assert_eq!(
        app.count("records").await,
        3,
        "all of the first, none of the second"
    );
    // A burst of two: the three-way fan-out takes the whole (full) bucket.
    policy
        .put_quota(put("weather", None, 0.001, 2))
        .await
        .expect("narrower");
    policy
        .delete_quota(pb::DeleteQuotaRequest {
            pack_id: "weather".into(),
            principal: None,
        })
        .await
        .expect("delete");
    policy
        .put_quota(put("weather", None, 0.001, 2))
        .await
        .expect("a full bucket of two");
    let wide = send_plan(json!([
        standard(&u, SECRET_NEW, "evt_3", json!({"area": "east"})),
        standard(&u, SECRET_NEW, "evt_4", json!({"area": "west"})),
    ]))
    .await;
    assert_eq!(wide[0]["status"], 202, "{wide:?}");
    assert_eq!(wide[1]["status"], 429, "{wide:?}");
    assert_eq!(app.count("records").await, 6);
}

/// Delivers a storm warning with `id` on `channel`: its disposition, or the refusal.
async fn deliver_on(channel: &tonic::transport::Channel, id: &str) -> Result<i32, tonic::Status> {
    pb::ingest_service_client::IngestServiceClient::new(channel.clone())
        .deliver_trigger(storm_warning(id.into()))
        .await
        .map(|r| r.into_inner().disposition)
}

/// A pause keeps the burst: at 1/100 per second with a burst of five, five deliveries 1.5 s
/// apart (past a lease's second) are all admitted, on PostgreSQL as on SQLite; the sixth is
/// refused, told the time the bucket needs for one token (about 92 s: 7.5 s have brought
/// 0.075 of one).
async fn run_a_pause_keeps_the_tokens_of_the_burst(kind: StoreKind) {
    let app = spawn_app(kind).await;
    set_up_weather(&app.channel).await;
    pack_quota(&app, 0.01, 5).await;
    for n in 0..5 {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        let d = deliver_on(&app.channel, &format!("p-{n}"))
            .await
            .unwrap_or_else(|e| panic!("delivery {n} of the burst of five: {e:?}"));
        assert_eq!(d, Disposition::RecordedInbox as i32);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let refused = deliver_on(&app.channel, "p-5")
        .await
        .expect_err("the burst's n+1");
    let delay = retry_delay(&refused);
    assert!(
        delay > Duration::from_secs(85) && delay <= Duration::from_secs(100),
        "{delay:?}"
    );
    assert_eq!(app.count("records").await, 5);
}
on_both_stores!(a_pause_keeps_the_tokens_of_the_burst => run_a_pause_keeps_the_tokens_of_the_burst);

/// When a delivery is over both its principal's quota and its pack's, it is told the longer
/// wait, and the quota it is: a retry after that wait is admitted (a retry after the shorter
/// would be refused again). Either way round.
async fn run_over_two_quotas_the_longest_wait_is_told(kind: StoreKind) {
    let app = spawn_app(kind).await;
    set_up_weather(&app.channel).await;
    let mut policy = app.policy.clone();
    for (n, (pack_rate, alice_rate)) in [(1.0, 4.0), (4.0, 1.0)].into_iter().enumerate() {
        policy
            .put_quota(put("weather", None, pack_rate, 1))
            .await
            .expect("pack's");
        policy
            .put_quota(put("weather", Some("alice"), alice_rate, 1))
            .await
            .expect("alice's");
        // Both buckets full (a changed rule keeps what the bucket held): wait for them.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        deliver_on(&app.channel, &format!("l-{n}-0"))
            .await
            .expect("one token of each");
        let refused = deliver_on(&app.channel, &format!("l-{n}-1"))
            .await
            .expect_err("both spent");
        let delay = retry_delay(&refused);
        // The longer: a whole second's token (less the moments since it was spent).
        assert!(
            delay > Duration::from_millis(600) && delay <= Duration::from_secs(1),
            "{delay:?}: {}",
            refused.message()
        );
        let longer = if pack_rate < alice_rate {
            "the quota of pack `weather`"
        } else {
            "the quota of principal `alice`"
        };
        assert!(refused.message().contains(longer), "{}", refused.message());
        tokio::time::sleep(delay).await;
        let later = deliver_on(&app.channel, &format!("l-{n}-1"))
            .await
            .expect("admitted after the wait it was told");
        assert_eq!(later, Disposition::RecordedInbox as i32);
    }
    assert_eq!(app.count("records").await, 4);
}
on_both_stores!(over_two_quotas_the_longest_wait_is_told => run_over_two_quotas_the_longest_wait_is_told);

/// Tokens one replica leased and left unspent go back to the fleet's bucket, and no more: one
/// delivery on the first replica leases the whole burst of five (it spends one); after its
/// lease has lapsed the other replica admits the four left, and nothing more is admitted
/// anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unspent_leased_tokens_go_back_to_the_fleet_and_no_more_postgres() {
    let app = spawn_app(StoreKind::Postgres).await;
    set_up_weather(&app.channel).await;
    let other = Replica::start(&app.test_db.url).await;
    pack_quota(&app, 0.001, 5).await;
    let explain = |ch: tonic::transport::Channel| async move {
        pb::ingest_service_client::IngestServiceClient::new(ch)
            .explain_trigger(pb::ExplainTriggerRequest {
                trigger: Some(storm_warning("probe".into())),
            })
            .await
            .expect("explain")
            .into_inner()
            .quota
    };
    let mut heard = false;
    for _ in 0..100 {
        if explain(other.channel.clone())
            .await
            .is_some_and(|q| q.pack_quota.is_some())
        {
            heard = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(heard, "the other replica applies the quota");
    deliver_on(&app.channel, "f-0").await.expect("the first");
    // The first replica holds the other four, leased: the store's bucket is empty until they
    // come back (within two seconds: a lease's second, then the sweep's).
    let mut back = false;
    for _ in 0..100 {
        if explain(other.channel.clone())
            .await
            .is_some_and(|q| q.admits)
        {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(back, "the unspent tokens went back to the store's bucket");
    for n in 1..5 {
        let d = deliver_on(&other.channel, &format!("f-{n}"))
            .await
            .unwrap_or_else(|e| panic!("token {n} of five: {e:?}"));
        assert_eq!(d, Disposition::RecordedInbox as i32);
    }
    for (ch, id) in [(&other.channel, "f-5"), (&app.channel, "f-6")] {
        let e = deliver_on(ch, id).await.expect_err("the burst's n+1");
        assert!(retry_delay(&e) > Duration::from_secs(100), "{e:?}");
    }
    assert_eq!(app.count("records").await, 5);
    other.stop().await;
}
