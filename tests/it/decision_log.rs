//! The decision log over real gRPC on both stores: an entry per decision with the check that decided it, the viewer rules, erasure, retention, the fold rule, and a replica reading another's entries.
use std::time::Duration;

use hcp_sense::auth::{AuthConfig, Role};
use hcp_sense::grpc::pb::{
    self, decision_service_client::DecisionServiceClient, BindingState, DecisionOutcome,
    Disposition, DropReason, EraseRecordsRequest, GetDecisionRequest, ListDecisionsRequest, Route,
};
use sea_orm::ConnectionTrait;
use serde_json::json;
use tonic::transport::Channel;
use tonic::Code;

use crate::helpers::{example, spawn_app_with, StoreKind, TestApp};
use crate::packs::register;
use crate::security::{bearer, token};
use crate::sense::{activate, bind, deliver, grant, opened, ready, revoke};

/// Runs the served binary with `args` (a client command).
fn hcp_sense(args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::support::served::BIN)
        .args(args)
        .output()
        .expect("run hcp-sense")
}

fn decisions(app: &TestApp) -> DecisionServiceClient<Channel> {
    DecisionServiceClient::new(app.channel.clone())
}

/// Every entry matching `req`, all pages.
async fn all(ch: &Channel, mut req: ListDecisionsRequest) -> Vec<pb::Decision> {
    let mut client = DecisionServiceClient::new(ch.clone());
    let mut out = Vec::new();
    loop {
        let page = client
            .list_decisions(req.clone())
            .await
            .expect("list decisions")
            .into_inner();
        out.extend(page.decisions);
        if page.next_page_token.is_empty() {
            return out;
        }
        req.page_token = page.next_page_token;
    }
}

async fn get(app: &TestApp, pack: &str, trigger_id: &str) -> Result<pb::Decision, tonic::Status> {
    decisions(app)
        .get_decision(GetDecisionRequest {
            pack_id: pack.into(),
            trigger_id: trigger_id.into(),
            viewer: String::new(),
        })
        .await
        .map(|r| r.into_inner().decision.expect("a decision"))
}

fn with_id(mut t: pb::DeliverTriggerRequest, id: &str) -> pb::DeliverTriggerRequest {
    t.trigger_id = id.into();
    t
}

async fn every_outcome_has_its_entry_with_the_deciding_check(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    let recorded = deliver(&mut app, with_id(opened("alice"), "t-rec")).await;
    assert_eq!(recorded.disposition, Disposition::RecordedInbox as i32);
    // bob holds no grant: dropped, the grant check deciding.
    let dropped = deliver(&mut app, with_id(opened("bob"), "t-drop")).await;
    assert_eq!(dropped.drop_reason, DropReason::NoGrant as i32);
    // A retry of the recorded trigger: a duplicate, answered with its first record.
    let again = deliver(&mut app, with_id(opened("alice"), "t-rec")).await;
    assert!(again.duplicate);
    // An undeclared ref, and an unknown pack.
    let mut undeclared = with_id(opened("alice"), "t-undeclared");
    undeclared.r#ref = "issue.closed".into();
    deliver(&mut app, undeclared).await;
    // Over a quota: refused before the decision.
    app.policy
        .put_quota(pb::PutQuotaRequest {
            pack_id: "github".into(),
            principal: None,
            rate_per_second: 0.001,
            burst: 1,
        })
        .await
        .expect("quota");
    deliver(&mut app, with_id(opened("alice"), "t-quota-1")).await;
    let refused = app
        .ingest
        .deliver_trigger(with_id(opened("alice"), "t-quota-2"))
        .await
        .expect_err("over the quota");
    assert_eq!(refused.code(), Code::ResourceExhausted);

    let e = get(&app, "github", "t-rec").await.expect("recorded entry");
    // The newest entry of t-rec is its duplicate; the first is the record's.
    assert_eq!(e.outcome, DecisionOutcome::Duplicate as i32);
    assert_eq!(e.record_id, recorded.record_id);
    assert_eq!(e.check, "idempotency");
    let rec = all(
        &app.channel,
        ListDecisionsRequest {
            trigger_id: "t-rec".into(),
            outcome: DecisionOutcome::Inbox as i32,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(rec.len(), 1, "one entry for the record: {rec:?}");
    assert_eq!(rec[0].record_id, recorded.record_id);
    assert_eq!(rec[0].binding_id, "github-alice");
    assert_eq!(rec[0].check, "route");
    assert_eq!(rec[0].source, "grpc:DeliverTrigger");

    let d = get(&app, "github", "t-drop").await.expect("drop entry");
    assert_eq!(d.outcome, DecisionOutcome::Dropped as i32);
    assert_eq!(d.drop_reason, DropReason::NoGrant as i32);
    assert_eq!(d.check, "grant");
    assert!(
        d.detail.contains("bob"),
        "the check says what it read: {}",
        d.detail
    );
    assert!(d.record_id.is_empty());

    let u = get(&app, "github", "t-undeclared")
        .await
        .expect("undeclared entry");
    assert_eq!(u.drop_reason, DropReason::UndeclaredRef as i32);
    assert_eq!(u.check, "ref");

    let q = get(&app, "github", "t-quota-2")
        .await
        .expect("refused entry");
    assert_eq!(q.outcome, DecisionOutcome::Refused as i32);
    assert_eq!(q.check, "quota");

    // Listing filters: by principal, by outcome, by drop reason, by source.
    let bobs = all(
        &app.channel,
        ListDecisionsRequest {
            principal: "bob".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(bobs.len(), 1);
    let drops = all(
        &app.channel,
        ListDecisionsRequest {
            outcome: DecisionOutcome::Dropped as i32,
            drop_reason: DropReason::UndeclaredRef as i32,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(drops.len(), 1);
    let grpc = all(
        &app.channel,
        ListDecisionsRequest {
            source: "grpc".into(),
            ..Default::default()
        },
    )
    .await;
    // A source's `%` and `_` are themselves, not LIKE's wildcards.
    for wild in ["%", "g_pc", "_"] {
        let none = all(
            &app.channel,
            ListDecisionsRequest {
                source: wild.into(),
                ..Default::default()
            },
        )
        .await;
        assert!(none.is_empty(), "source {wild:?} matched {none:#?}");
    }
    let every = all(&app.channel, ListDecisionsRequest::default()).await;
    // recorded, dropped, duplicate, undeclared, quota-1 recorded, quota-2 refused.
    assert_eq!(every.len(), 6, "{every:#?}");
    assert_eq!(grpc.len(), every.len());
    let times: Vec<_> = every
        .iter()
        .map(|d| d.decide_time.as_ref().map(|t| (t.seconds, t.nanos)))
        .collect();
    let mut sorted = times.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(times, sorted, "newest first");
    app.stop().await;
}
on_both_stores!(s7_3_3_every_outcome_has_its_entry_with_the_deciding_check => every_outcome_has_its_entry_with_the_deciding_check);

async fn why_it_was_dropped_survives_a_policy_change(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    register(&mut app, &example("github.pack.json")).await;
    bind(&mut app, "alice", "github", BindingState::Linked).await;
    activate(&mut app, "alice", "github", Route::Inbox).await;
    let r = deliver(&mut app, with_id(opened("alice"), "gh-123")).await;
    assert_eq!(r.drop_reason, DropReason::NoGrant as i32);
    grant(&mut app, "alice", "github").await;
    let explained = app
        .ingest
        .explain_trigger(pb::ExplainTriggerRequest {
            trigger: Some(with_id(opened("alice"), "gh-123")),
        })
        .await
        .expect("explain")
        .into_inner();
    assert_eq!(explained.disposition, Disposition::RecordedInbox as i32);
    let then = get(&app, "github", "gh-123").await.expect("kept");
    assert_eq!(then.drop_reason, DropReason::NoGrant as i32);
    assert_eq!(then.check, "grant");
    // And from the command line, as an operator asks.
    let out = hcp_sense(&[
        "why",
        "--server",
        &format!("http://{}", app.addr),
        "--pack",
        "github",
        "--trigger-id",
        "gh-123",
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("dropped: no_grant"), "{text}");
    assert!(text.contains("decided by grant"), "{text}");
    let missing = hcp_sense(&[
        "why",
        "--server",
        &format!("http://{}", app.addr),
        "--pack",
        "github",
        "--trigger-id",
        "never-sent",
    ]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("NotFound"));
    app.stop().await;
}
on_both_stores!(why_it_was_dropped_survives_a_policy_change => why_it_was_dropped_survives_a_policy_change);

const ADMIN: &str = "decision-admin-token";
const ALICE: &str = "decision-alice-token";
const BOB: &str = "decision-bob-token";
const RUNTIME: &str = "decision-runtime-token";

async fn a_principal_reads_only_its_own_decisions(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| {
        c.auth_failure_rate_per_sec = 0.0;
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", ADMIN, Role::Admin, None),
                token("harness", RUNTIME, Role::Runtime, None),
                token("alice", ALICE, Role::Reader, Some("alice")),
                token("bob", BOB, Role::Reader, Some("bob")),
            ],
            jwt: None,
        };
    })
    .await;
    crate::identity::set_up(&app.channel, ADMIN, &["alice"]).await;
    let mut ingest =
        pb::ingest_service_client::IngestServiceClient::new(bearer(&app.channel, RUNTIME));
    for (who, id) in [("alice", "a-1"), ("bob", "b-1")] {
        ingest
            .deliver_trigger(with_id(crate::identity::opened(who), id))
            .await
            .expect("deliver");
    }
    let list = |tok: &'static str, req: ListDecisionsRequest| {
        let ch = app.channel.clone();
        async move {
            DecisionServiceClient::new(bearer(&ch, tok))
                .list_decisions(req)
                .await
                .map(|r| r.into_inner().decisions)
        }
    };
    let mine = list(ALICE, ListDecisionsRequest::default())
        .await
        .expect("alice reads");
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].principal, "alice");
    let bobs = list(
        ALICE,
        ListDecisionsRequest {
            principal: "bob".into(),
            ..Default::default()
        },
    )
    .await
    .expect_err("alice may not name bob");
    assert_eq!(bobs.code(), Code::PermissionDenied);
    assert!(!bobs.message().contains("b-1"));
    let as_bob = list(
        ALICE,
        ListDecisionsRequest {
            viewer: "bob".into(),
            ..Default::default()
        },
    )
    .await
    .expect_err("nor read as bob's viewer");
    assert_eq!(as_bob.code(), Code::PermissionDenied);
    // Looking bob's trigger up by id finds nothing for alice: not even that it exists.
    let probe = DecisionServiceClient::new(bearer(&app.channel, ALICE))
        .get_decision(GetDecisionRequest {
            pack_id: "github".into(),
            trigger_id: "b-1".into(),
            viewer: String::new(),
        })
        .await
        .expect_err("bob's");
    assert_eq!(probe.code(), Code::NotFound);
    let runtime = list(RUNTIME, ListDecisionsRequest::default())
        .await
        .expect_err("a runtime reads none");
    assert_eq!(runtime.code(), Code::PermissionDenied);
    let admin = list(ADMIN, ListDecisionsRequest::default())
        .await
        .expect("admin reads all");
    assert_eq!(admin.len(), 2);
    app.stop().await;
}
on_both_stores!(a_principal_reads_only_its_own_decisions => a_principal_reads_only_its_own_decisions);

async fn brain_entries_need_membership_and_erasure_takes_a_principals_entries(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
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
    let mut t = crate::sense::trig("alice", "note.shared", "brain");
    t.pack_id = "notes".into();
    t.project = "apollo".into();
    t.trigger_id = "n-1".into();
    assert_eq!(
        deliver(&mut app, t).await.disposition,
        Disposition::RecordedInbox as i32
    );
    let viewer = |v: &str| ListDecisionsRequest {
        viewer: v.into(),
        pack_id: "notes".into(),
        ..Default::default()
    };
    assert!(
        all(&app.channel, viewer("alice")).await.is_empty(),
        "not a member yet"
    );
    assert!(
        all(&app.channel, viewer("")).await.is_empty(),
        "no viewer, no brain"
    );
    app.policy
        .add_project_member(pb::AddProjectMemberRequest {
            project: "apollo".into(),
            principal: "alice".into(),
        })
        .await
        .expect("member");
    assert_eq!(all(&app.channel, viewer("alice")).await.len(), 1);
    assert!(all(&app.channel, viewer("bob")).await.is_empty());

    ready(&mut app, "alice").await;
    ready(&mut app, "carol").await;
    deliver(&mut app, with_id(opened("alice"), "e-1")).await;
    deliver(&mut app, with_id(opened("carol"), "e-2")).await;
    revoke(&mut app, "alice", "github").await;
    deliver(&mut app, with_id(opened("alice"), "e-3")).await;
    app.records
        .erase_records(EraseRecordsRequest {
            principal: "alice".into(),
            pack_id: String::new(),
        })
        .await
        .expect("erase");
    let left = all(
        &app.channel,
        ListDecisionsRequest {
            viewer: "alice".into(),
            ..Default::default()
        },
    )
    .await;
    assert!(left.iter().all(|d| d.principal != "alice"), "{left:?}");
    assert_eq!(left.len(), 1, "carol's stays");
    assert_eq!(app.count("decisions").await, 1);
    app.stop().await;
}
on_both_stores!(s7_5_2_brain_entries_need_membership_and_erasure_takes_a_principals_entries => brain_entries_need_membership_and_erasure_takes_a_principals_entries);

/// A principal's entries come from two indexes (drops by principal, recorded entries through
/// the principal's records): read by principal a page of one at a time, they are the entries
/// the everyone-listing holds for it, in its order; each outcome alone reads one side. An
/// erasure reads the whole log, however far apart its entries are.
async fn a_principals_listing_merges_recorded_and_dropped_entries(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    ready(&mut app, "bob").await;
    for i in 0..4 {
        deliver(&mut app, with_id(opened("alice"), &format!("a-r-{i}"))).await;
        let mut undeclared = crate::sense::trig("alice", "issue.nope", "user");
        undeclared.trigger_id = format!("a-d-{i}");
        assert_eq!(
            deliver(&mut app, undeclared).await.disposition,
            Disposition::Dropped as i32
        );
        deliver(&mut app, with_id(opened("bob"), &format!("b-r-{i}"))).await;
    }
    let ids =
        |ds: Vec<pb::Decision>| -> Vec<String> { ds.into_iter().map(|d| d.trigger_id).collect() };
    let everyone: Vec<pb::Decision> = all(&app.channel, ListDecisionsRequest::default())
        .await
        .into_iter()
        .filter(|d| d.principal == "alice")
        .collect();
    let by_principal = |outcome: DecisionOutcome, page_size: i32| ListDecisionsRequest {
        principal: "alice".into(),
        outcome: outcome as i32,
        page_size,
        ..Default::default()
    };
    let paged = all(&app.channel, by_principal(DecisionOutcome::Unspecified, 1)).await;
    assert_eq!(paged.len(), 8, "{paged:?}");
    assert_eq!(ids(paged), ids(everyone));
    let inbox = all(&app.channel, by_principal(DecisionOutcome::Inbox, 3)).await;
    assert_eq!(inbox.len(), 4);
    assert!(inbox.iter().all(|d| d.trigger_id.starts_with("a-r-")));
    let dropped = all(&app.channel, by_principal(DecisionOutcome::Dropped, 3)).await;
    assert_eq!(dropped.len(), 4);
    assert!(dropped.iter().all(|d| d.trigger_id.starts_with("a-d-")));

    // An entry far past the others in the log's order (three SQLite erase ranges away).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros();
    app.db
        .execute_unprepared(&format!(
            "INSERT INTO decisions (seq, decided_time, pack_id, ref, principal, land, source, outcome) \
             VALUES (250001, {now}, 'github', 'issue.opened', 'alice', 'user', 'grpc:DeliverTrigger', 'refused')"
        ))
        .await
        .expect("a far entry");
    app.records
        .erase_records(EraseRecordsRequest {
            principal: "alice".into(),
            pack_id: String::new(),
        })
        .await
        .expect("erase");
    let left = all(&app.channel, ListDecisionsRequest::default()).await;
    assert_eq!(left.len(), 4, "{left:?}");
    assert!(left.iter().all(|d| d.principal == "bob"));
    app.stop().await;
}
on_both_stores!(a_principals_listing_merges_recorded_and_dropped_entries => a_principals_listing_merges_recorded_and_dropped_entries);

async fn a_drop_flood_folds_and_every_answer_is_counted(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |c| {
        c.decision_fold_per_key = 5;
        c.decision_fold_in_all = 20;
    })
    .await;
    ready(&mut app, "alice").await;
    let n = 400usize;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let mut ingest = app.ingest.clone();
        tasks.spawn(async move {
            // Principals p0..p9 hold no grant: every one is dropped.
            let t = with_id(opened(&format!("p{}", i % 10)), &format!("f-{i}"));
            // UNAVAILABLE is an answer to retry: on a loaded machine the policy view may be
            // reloading (decisions fail closed meanwhile), and nothing was decided or logged.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                match ingest.deliver_trigger(t.clone()).await {
                    Ok(answer) => break answer.into_inner(),
                    Err(s)
                        if s.code() == Code::Unavailable
                            && std::time::Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(s) => panic!("acknowledged: {s:?}"),
                }
            }
        });
    }
    let mut dropped = 0;
    while let Some(r) = tasks.join_next().await {
        if r.expect("task").disposition == Disposition::Dropped as i32 {
            dropped += 1;
        }
    }
    assert_eq!(dropped, n);
    // Past the second every fold has its entry.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let every = all(
        &app.channel,
        ListDecisionsRequest {
            pack_id: "github".into(),
            ..Default::default()
        },
    )
    .await;
    let answers: i64 = every.iter().map(|d| 1 + d.folded).sum();
    assert_eq!(
        answers, n as i64,
        "entries and their folded counts are the answers"
    );
    assert!(every.len() < n, "the flood folded: {} entries", every.len());
    // The drop reports stay exact.
    let reports = crate::sense::drop_reports(&mut app, "github").await;
    let counted: i64 = reports.iter().map(|r| r.count).sum();
    assert_eq!(counted, n as i64);
    app.stop().await;
}
on_both_stores!(a_drop_flood_folds_and_every_answer_is_counted => a_drop_flood_folds_and_every_answer_is_counted);

/// Delivers `n` triggers with ids `{prefix}0..n` from principals p0..p4, who hold no grant:
/// every one is dropped, and answered so.
async fn drop_each(app: &mut TestApp, prefix: &str, n: usize) {
    for i in 0..n {
        let t = with_id(opened(&format!("p{}", i % 5)), &format!("{prefix}{i}"));
        let answer = deliver(app, t).await;
        assert_eq!(answer.disposition, Disposition::Dropped as i32);
    }
}

/// The pack's dropped entries are exactly those `drop_each` made, each written once.
async fn each_dropped_listed_once(app: &TestApp, prefix: &str, n: usize) {
    let every = all(
        &app.channel,
        ListDecisionsRequest {
            pack_id: "github".into(),
            outcome: DecisionOutcome::Dropped as i32,
            ..Default::default()
        },
    )
    .await;
    let mut ids: Vec<String> = every.iter().map(|d| d.trigger_id.clone()).collect();
    ids.sort();
    let mut want: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "each entry written once");
}

/// A store that refuses the log's writes costs no delivery its answer, and the entries taken
/// meanwhile are written, each once, when it takes writes again (on SQLite, by the log's own
/// connection, opened again after the failure).
async fn entries_a_store_refused_are_written_when_it_takes_them_again(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |_| {}).await;
    ready(&mut app, "alice").await;
    let sqlite = kind == StoreKind::Sqlite;
    let refuse = if sqlite {
        vec!["CREATE TRIGGER refuse BEFORE INSERT ON decisions BEGIN SELECT RAISE(ABORT, 'injected'); END"]
    } else {
        vec![
            "CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse BEFORE INSERT ON decisions FOR EACH ROW EXECUTE FUNCTION refuse()",
        ]
    };
    for sql in refuse {
        app.db.execute_unprepared(sql).await.expect(sql);
    }
    let n = 30;
    drop_each(&mut app, "r-", n).await;
    // Several flushes are refused; nothing is half-written.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(app.count("decisions").await, 0);
    let mend = if sqlite {
        "DROP TRIGGER refuse"
    } else {
        "DROP TRIGGER refuse ON decisions"
    };
    app.db.execute_unprepared(mend).await.expect(mend);
    each_dropped_listed_once(&app, "r-", n).await;
    app.stop().await;
}
on_both_stores!(entries_a_store_refused_are_written_when_it_takes_them_again => entries_a_store_refused_are_written_when_it_takes_them_again);

/// A listing that goes away while its write of the log waits on the store takes no entry and
/// no drop count with it: the write runs on, and every drop is listed and counted once.
async fn a_listing_that_goes_away_mid_write_loses_no_entry_or_count(kind: StoreKind) {
    use sea_orm::TransactionTrait;
    // No background write: what is taken stays pending until a listing writes it, so the
    // listings below are the ones that take the batch out of memory.
    let mut app = spawn_app_with(kind, |c| c.log_flush_interval = Duration::from_secs(3_600)).await;
    ready(&mut app, "alice").await;
    let n = 20;
    drop_each(&mut app, "g-", n).await;
    // Another session takes the write lock of the log's tables, so the writes the listings
    // start wait on it past their callers' deadlines.
    let hold = app.db.begin().await.expect("begin");
    let lock = if kind == StoreKind::Sqlite {
        "DELETE FROM decisions WHERE 1 = 0"
    } else {
        "LOCK TABLE decisions, drop_reports IN EXCLUSIVE MODE"
    };
    hold.execute_unprepared(lock).await.expect(lock);
    let mut listing = tonic::Request::new(ListDecisionsRequest {
        pack_id: "github".into(),
        ..Default::default()
    });
    listing.set_timeout(Duration::from_millis(200));
    let gone = decisions(&app).list_decisions(listing).await;
    let mut reports = tonic::Request::new(pb::ListDropReportsRequest {
        pack_id: "github".into(),
        ..Default::default()
    });
    reports.set_timeout(Duration::from_millis(200));
    let gone_too = app.records.list_drop_reports(reports).await;
    for (what, answer) in [("decisions", gone.err()), ("drop reports", gone_too.err())] {
        let code = answer.map(|s| s.code());
        // The server answers UNAVAILABLE at the caller's deadline; the client may give up first.
        assert!(
            matches!(
                code,
                Some(Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled)
            ),
            "the listing of {what} ended while its write waited for the held lock: {code:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    hold.rollback().await.expect("rollback");
    each_dropped_listed_once(&app, "g-", n).await;
    let counted: i64 = crate::sense::drop_reports(&mut app, "github")
        .await
        .iter()
        .map(|r| r.count)
        .sum();
    assert_eq!(counted, n as i64, "each drop counted once");
    app.stop().await;
}
on_both_stores!(a_listing_that_goes_away_mid_write_loses_no_entry_or_count => a_listing_that_goes_away_mid_write_loses_no_entry_or_count);

async fn entries_past_retention_are_pruned_and_the_log_can_be_off(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |c| {
        c.decision_retention = Duration::from_secs(1);
        c.prune_interval = Duration::from_secs(1);
        // One-second partitions on PostgreSQL, so retention drops them whole.
        c.database.partition_width = Duration::from_secs(1);
    })
    .await;
    ready(&mut app, "alice").await;
    deliver(&mut app, with_id(opened("alice"), "old-1")).await;
    deliver(&mut app, with_id(opened("bob"), "old-2")).await;
    assert!(get(&app, "github", "old-1").await.is_ok());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if get(&app, "github", "old-1").await.is_err()
            && get(&app, "github", "old-2").await.is_err()
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "entries outlived their retention"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The records themselves are kept (no record retention was set).
    assert_eq!(
        crate::sense::list(&mut app, pb::ListRecordsRequest::default())
            .await
            .len(),
        1
    );
    app.stop().await;

    let mut off = spawn_app_with(kind, |c| c.decision_log = false).await;
    ready(&mut off, "alice").await;
    deliver(&mut off, with_id(opened("alice"), "x-1")).await;
    deliver(&mut off, with_id(opened("bob"), "x-2")).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(off.count("decisions").await, 0);
    assert_eq!(
        get(&off, "github", "x-1").await.expect_err("off").code(),
        Code::NotFound
    );
    off.stop().await;
}
on_both_stores!(entries_past_retention_are_pruned_and_the_log_can_be_off => entries_past_retention_are_pruned_and_the_log_can_be_off);

async fn listing_requests_are_checked(kind: StoreKind) {
    let app = spawn_app_with(kind, |_| {}).await;
    let mut c = decisions(&app);
    let bad = c
        .list_decisions(ListDecisionsRequest {
            outcome: 99,
            ..Default::default()
        })
        .await
        .expect_err("unknown outcome");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("outcome"));
    let bad = c
        .list_decisions(ListDecisionsRequest {
            page_token: "forged".into(),
            ..Default::default()
        })
        .await
        .expect_err("forged token");
    assert_eq!(bad.code(), Code::InvalidArgument);
    let bad = c
        .get_decision(GetDecisionRequest {
            pack_id: "github".into(),
            ..Default::default()
        })
        .await
        .expect_err("no trigger id");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("trigger_id"));
    let bad = c
        .list_decisions(ListDecisionsRequest {
            page_size: -1,
            ..Default::default()
        })
        .await
        .expect_err("negative page size");
    assert!(bad.message().contains("page_size"));
    // A viewer with a control character is refused naming the field, without echoing it.
    let bad = c
        .list_decisions(ListDecisionsRequest {
            viewer: "bob\u{7}".into(),
            ..Default::default()
        })
        .await
        .expect_err("control character");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("viewer"), "{}", bad.message());
    assert!(!bad.message().contains('\u{7}'), "{}", bad.message());
    app.stop().await;
}
on_both_stores!(listing_requests_are_checked => listing_requests_are_checked);

async fn the_oldest_entries_go_past_the_most_kept(kind: StoreKind) {
    let mut app = spawn_app_with(kind, |c| {
        c.decision_retention = Duration::ZERO;
        c.decision_max_entries = 6;
        c.prune_interval = Duration::from_secs(1);
        c.database.partition_width = Duration::from_secs(1);
    })
    .await;
    ready(&mut app, "alice").await;
    for s in 0..4 {
        for i in 0..4 {
            deliver(&mut app, with_id(opened("bob"), &format!("b-{s}-{i}"))).await;
        }
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if kind == StoreKind::Postgres {
            // The bound reads the planner's count, which autovacuum's ANALYZE keeps.
            use sea_orm::ConnectionTrait;
            app.db
                .execute_unprepared("ANALYZE decisions")
                .await
                .expect("analyze");
        }
        let oldest_gone = get(&app, "github", "b-0-0").await.is_err();
        if oldest_gone {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the oldest entries outlived the bound"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        get(&app, "github", "b-3-3").await.is_ok(),
        "the newest stay"
    );
    let kept = app.count("decisions").await;
    match kind {
        StoreKind::Sqlite => assert_eq!(kept, 6),
        // Whole partitions: the bound and at most the partition that crossed it.
        StoreKind::Postgres => assert!((6..=10).contains(&kept), "{kept} kept"),
    }
    app.stop().await;
}
on_both_stores!(the_oldest_entries_go_past_the_most_kept => the_oldest_entries_go_past_the_most_kept);

/// An entry written on one replica is read on the other: a record's at once (it is in the
/// record's commit, the hub's binding.degraded included), a drop's once the writing replica
/// flushes its batch, which stopping it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_written_on_one_replica_is_read_on_the_other_postgres() {
    let mut a = spawn_app_with(StoreKind::Postgres, |_| {}).await;
    ready(&mut a, "alice").await;
    let b = crate::helpers::Replica::start(&a.test_db.url).await;
    let mut ingest_b = pb::ingest_service_client::IngestServiceClient::new(b.channel.clone());
    let r = ingest_b
        .deliver_trigger(with_id(opened("alice"), "on-b-rec"))
        .await
        .expect("deliver on b")
        .into_inner();
    assert_eq!(r.disposition, Disposition::RecordedInbox as i32);
    let e = get(&a, "github", "on-b-rec")
        .await
        .expect("b's record entry, read on a");
    assert_eq!(
        (e.record_id.as_str(), e.check.as_str()),
        (r.record_id.as_str(), "route")
    );
    // The hub's record, produced on a, with its entry in the Binding's transaction.
    let gone = a
        .policy
        .delete_binding(pb::DeleteBindingRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect("delete binding")
        .into_inner();
    let degraded = gone.binding_degraded.expect("binding.degraded");
    let hub = all(
        &b.channel,
        ListDecisionsRequest {
            r#ref: "binding.degraded".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(hub.len(), 1, "{hub:?}");
    assert_eq!(
        (
            hub[0].source.as_str(),
            hub[0].record_id.as_str(),
            hub[0].outcome
        ),
        (
            "hub",
            degraded.record_id.as_str(),
            DecisionOutcome::Inbox as i32
        )
    );
    // A drop on b, read on a once b has stopped: stopping flushes the batch.
    let d = ingest_b
        .deliver_trigger(with_id(opened("bob"), "on-b-drop"))
        .await
        .expect("drop on b")
        .into_inner();
    assert_eq!(d.drop_reason, DropReason::NoGrant as i32);
    b.stop().await;
    let e = get(&a, "github", "on-b-drop")
        .await
        .expect("b's drop entry, read on a");
    assert_eq!(
        (e.drop_reason, e.check.as_str()),
        (DropReason::NoGrant as i32, "grant")
    );
    // And a's drop on a replica started afterwards, once a's batch is written.
    deliver(&mut a, with_id(opened("bob"), "on-a-drop")).await;
    let c = crate::helpers::Replica::start(&a.test_db.url).await;
    let mut on_c = DecisionServiceClient::new(c.channel.clone());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let found = on_c
            .get_decision(GetDecisionRequest {
                pack_id: "github".into(),
                trigger_id: "on-a-drop".into(),
                viewer: String::new(),
            })
            .await;
        match found {
            Ok(d) => {
                let d = d.into_inner().decision.expect("decision");
                assert_eq!(d.drop_reason, DropReason::NoGrant as i32);
                break;
            }
            Err(e) if e.code() == Code::NotFound => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a's drop never reached c"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    c.stop().await;
    a.stop().await;
}
