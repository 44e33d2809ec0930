//! WatchRecords: a listing continued by a stream with no gap and no repeat, on both stores, across replicas and restarts, with slow readers ended resumably.
use std::collections::BTreeSet;
use std::time::Duration;

use hcp_sense::grpc::pb::{
    self, ingest_service_client::IngestServiceClient, record_service_client::RecordServiceClient,
    watch_records_request::Start,
};
use tonic::transport::Channel;
use tonic::{Code, Streaming};
use tonic_types::StatusExt;

use crate::cli::{connect, set_up_weather, storm_warning};
use crate::helpers::{spawn_app_with, StoreKind, TestDb};
use crate::support::served::Served;

fn watch_req(start: Start) -> pb::WatchRecordsRequest {
    pb::WatchRecordsRequest {
        start: Some(start),
        ..Default::default()
    }
}

async fn open(ch: &Channel, start: Start) -> Streaming<pb::WatchRecordsResponse> {
    RecordServiceClient::new(ch.clone())
        .watch_records(watch_req(start))
        .await
        .expect("watch")
        .into_inner()
}

/// The resume token a status carries in its ErrorInfo.
fn resume_token_of(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .and_then(|i| i.metadata.get("resume_token").cloned())
        .unwrap_or_else(|| panic!("no resume token in {s:?}"))
}

/// Reads a watch until `want` record ids have arrived (or it ends); returns the ids in the
/// order received, the last resume token, and the status it ended with, if it did.
async fn read_until(
    stream: &mut Streaming<pb::WatchRecordsResponse>,
    want: usize,
    within: Duration,
) -> (Vec<String>, String, Option<tonic::Status>) {
    let mut ids = Vec::new();
    let mut token = String::new();
    let deadline = tokio::time::Instant::now() + within;
    while ids.len() < want {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Err(_) => break,
            Ok(Ok(Some(m))) => {
                ids.extend(m.records.into_iter().map(|r| r.record_id));
                token = m.resume_token;
            }
            Ok(Ok(None)) => break,
            Ok(Err(s)) => return (ids, token, Some(s)),
        }
    }
    (ids, token, None)
}

async fn deliver(ch: &Channel, ids: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut out = Vec::new();
    for id in ids {
        out.push(
            ingest
                .deliver_trigger(storm_warning(id))
                .await
                .expect("deliver")
                .into_inner()
                .record_id,
        );
    }
    out
}

fn exactly_once(got: &[String], want: &[String]) {
    let set: BTreeSet<&String> = got.iter().collect();
    assert_eq!(set.len(), got.len(), "a record was sent twice: {got:?}");
    assert_eq!(
        set,
        want.iter().collect::<BTreeSet<_>>(),
        "records missing or extra"
    );
}

/// List, then watch from the listing's end while writers go on: every record exactly once, in
/// commit position order.
async fn list_then_watch_sees_every_record_once(kind: StoreKind) {
    let app = spawn_app_with(kind, |_| {}).await;
    let ch = app.channel.clone();
    set_up_weather(&ch).await;
    let early = deliver(&ch, (0..30).map(|i| format!("early-{i}"))).await;
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let ch = ch.clone();
            tokio::spawn(async move { deliver(&ch, (0..40).map(|i| format!("w{w}-{i}"))).await })
        })
        .collect();
    // A listing, page by page, while the writers run.
    let mut records = RecordServiceClient::new(ch.clone());
    let (mut listed, mut token) = (Vec::new(), String::new());
    let resume = loop {
        let page = records
            .list_records(pb::ListRecordsRequest {
                page_size: 7,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .expect("list")
            .into_inner();
        listed.extend(page.records.into_iter().map(|r| r.record_id));
        if page.next_page_token.is_empty() {
            break page.resume_page_token;
        }
        token = page.next_page_token;
    };
    let mut stream = open(&ch, Start::ResumeToken(resume)).await;
    let mut all = early.clone();
    for w in writers {
        all.extend(w.await.expect("writer"));
    }
    let (watched, _, end) = read_until(
        &mut stream,
        all.len() - listed.len(),
        Duration::from_secs(20),
    )
    .await;
    assert!(end.is_none(), "{end:?}");
    let seen: Vec<String> = listed.iter().chain(&watched).cloned().collect();
    exactly_once(&seen, &all);
    // Nothing more arrives: no repeat after the last.
    let (more, _, _) = read_until(&mut stream, 1, Duration::from_millis(500)).await;
    assert!(more.is_empty(), "{more:?}");
}
on_both_stores!(list_then_watch_sees_every_record_once => list_then_watch_sees_every_record_once);

/// A reader that stops reading falls behind, is ended RESOURCE_EXHAUSTED with a resume token,
/// and resuming from it (or from its last message's token) loses nothing and repeats nothing.
async fn a_slow_reader_is_ended_with_a_token_that_loses_nothing(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| {
        c.watch_max_behind = 5;
        c.watch_max_lag = Duration::from_secs(1);
    })
    .await;
    let ch = app.channel.clone();
    set_up_weather(&ch).await;
    // A reader with small HTTP/2 windows: what it does not take stays on the server's side.
    let slow = Channel::from_shared(format!("http://{}", app.addr))
        .expect("uri")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect");
    let mut stream = open(&slow, Start::FromNow(true)).await;
    // Large payloads fill the windows while this reader sleeps.
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut all = Vec::new();
    for i in 0..120 {
        let mut t = storm_warning(format!("slow-{i}"));
        t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::Payload(
            hcp_sense::grpc::convert::json_to_struct(
                &serde_json::json!({ "pad": "x".repeat(4000) }),
            ),
        ));
        all.push(
            ingest
                .deliver_trigger(t)
                .await
                .expect("deliver")
                .into_inner()
                .record_id,
        );
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (first, last_token, end) =
        read_until(&mut stream, all.len(), Duration::from_secs(20)).await;
    let end = end.expect("the slow reader was ended");
    assert_eq!(end.code(), Code::ResourceExhausted, "{end:?}");
    assert!(end.message().contains("resume"), "{}", end.message());
    let token = resume_token_of(&end);
    assert!(
        first.len() < all.len(),
        "it was ended before it had everything"
    );
    // From the status's token and from the last message's: the rest, once.
    for from in [token, last_token] {
        if from.is_empty() {
            continue;
        }
        let mut resumed = open(&ch, Start::ResumeToken(from)).await;
        let want = all.len() - first.len();
        let (rest, _, end) = read_until(&mut resumed, want, Duration::from_secs(20)).await;
        assert!(end.is_none(), "{end:?}");
        let mut seen = first.clone();
        seen.extend(rest);
        exactly_once(&seen, &all);
    }
}
on_both_stores!(a_slow_reader_is_ended_with_a_token_that_loses_nothing => a_slow_reader_is_ended_with_a_token_that_loses_nothing);

/// The bad starts and the bound on open watches, each at its boundary.
async fn watch_requests_are_checked_and_watches_bounded(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| c.max_watches = 2).await;
    let ch = app.channel.clone();
    set_up_weather(&ch).await;
    let mut client = RecordServiceClient::new(ch.clone());
    let e = client
        .watch_records(pb::WatchRecordsRequest::default())
        .await
        .expect_err("no start");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        crate::helpers::violations(&e)
            .iter()
            .any(|(f, _)| f == "start"),
        "{e:?}"
    );
    let e = client
        .watch_records(watch_req(Start::ResumeToken("bm90IGEgdG9rZW4".into())))
        .await
        .expect_err("forged token");
    assert!(
        crate::helpers::violations(&e)
            .iter()
            .any(|(f, _)| f == "resume_token"),
        "{e:?}"
    );
    let e = client
        .watch_records(watch_req(Start::AfterRecordId("no-such-record".into())))
        .await
        .expect_err("unknown record");
    assert_eq!(e.code(), Code::NotFound);
    // A token of another listing's filters is refused, not read as this one's.
    let other = client
        .list_records(pb::ListRecordsRequest {
            principal: "bob".into(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .resume_page_token;
    let e = client
        .watch_records(watch_req(Start::ResumeToken(other)))
        .await
        .expect_err("other filters");
    assert!(e.message().contains("other filters"), "{e:?}");
    // Two watches open; the third is refused; one closed, a third opens.
    let a = open(&ch, Start::FromNow(true)).await;
    let _b = open(&ch, Start::FromNow(true)).await;
    let e = client
        .watch_records(watch_req(Start::FromNow(true)))
        .await
        .expect_err("third");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    drop(a);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match client.watch_records(watch_req(Start::FromNow(true))).await {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert_eq!(e.code(), Code::ResourceExhausted);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the closed watch's slot never came back: {e:?}"),
        }
    }
    drop(_b);
}
on_both_stores!(watch_requests_are_checked_and_watches_bounded => watch_requests_are_checked_and_watches_bounded);

/// A watch from a record id sends what committed after it; an idle watch gets progress
/// messages whose token resumes at the same place.
async fn a_watch_starts_after_a_record_and_idles_with_progress(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| c.watch_progress = Duration::from_secs(1)).await;
    let ch = app.channel.clone();
    set_up_weather(&ch).await;
    let ids = deliver(&ch, (0..5).map(|i| format!("r-{i}"))).await;
    let mut stream = open(&ch, Start::AfterRecordId(ids[1].clone())).await;
    let (got, _, end) = read_until(&mut stream, 3, Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, ids[2..].to_vec(), "after the record, in commit order");
    // Idle: a progress message, empty, with a token.
    let m = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("progress within 5 s")
        .expect("open")
        .expect("a message");
    assert!(m.records.is_empty());
    assert!(!m.resume_token.is_empty());
    let later = deliver(&ch, ["later".to_owned()]).await;
    let mut resumed = open(&ch, Start::ResumeToken(m.resume_token)).await;
    let (got, _, _) = read_until(&mut resumed, 1, Duration::from_secs(10)).await;
    assert_eq!(got, later);
}
on_both_stores!(a_watch_starts_after_a_record_and_idles_with_progress => a_watch_starts_after_a_record_and_idles_with_progress);

/// Two replicas on one PostgreSQL: records written through one reach a watcher on the other,
/// and after that replica is killed the watcher resumes on the first with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_follows_writes_through_another_replica_and_survives_a_kill_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let mut a = Served::start(&db.url, &["--page-token-secret", "shared-secret"]);
    let b = Served::start(&db.url, &["--page-token-secret", "shared-secret"]);
    let (cha, chb) = (connect(&a.addr).await, connect(&b.addr).await);
    set_up_weather(&chb).await;
    let mut stream = open(&cha, Start::FromNow(true)).await;
    let first = deliver(&chb, (0..20).map(|i| format!("via-b-{i}"))).await;
    let (got, token, end) = read_until(&mut stream, first.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, first, "through the other replica, in commit order");
    a.kill9();
    let second = deliver(&chb, (0..20).map(|i| format!("after-kill-{i}"))).await;
    let mut resumed = open(&chb, Start::ResumeToken(token)).await;
    let (got, _, end) = read_until(&mut resumed, second.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(
        got, second,
        "resumed on the other replica: nothing lost, nothing repeated"
    );
}

/// The tail's horizon on PostgreSQL: a write left open in another database of the cluster
/// holds no watch back, while one open in this database holds back every record committed
/// after it began, so that its own record, at the lower position, is sent first and not
/// skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_waits_for_writes_open_in_its_database_only_postgres() {
    use sea_orm::{ConnectionTrait, TransactionTrait};
    let db = TestDb::create(StoreKind::Postgres).await;
    let elsewhere = TestDb::create(StoreKind::Postgres).await;
    let served = Served::start(&db.url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut stream = open(&ch, Start::FromNow(true)).await;

    let other = elsewhere.connect().await;
    let open_elsewhere = other.begin().await.expect("begin");
    open_elsewhere
        .execute_unprepared("CREATE TABLE held (x int); INSERT INTO held VALUES (1)")
        .await
        .expect("a write in another database, left open");
    let first = deliver(&ch, ["while-elsewhere-writes".to_owned()]).await;
    let (got, _, end) = read_until(&mut stream, 1, Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(
        got, first,
        "sent while the other database's write stays open"
    );

    let here = db.connect().await;
    let open_here = here.begin().await.expect("begin");
    open_here
        .execute_unprepared(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, \
                                  producer_trigger_id, received_time) \
             VALUES ('held-open', 'alice', '', 'user', 'weather', 'storm.warning', '{}', 'inbox', \
                     'held-open', 1)",
        )
        .await
        .expect("a record written in this database, left open");
    let after = deliver(&ch, ["after-the-open-write".to_owned()]).await;
    let (got, _, end) = read_until(&mut stream, 1, Duration::from_millis(1500)).await;
    assert!(end.is_none(), "{end:?}");
    assert!(
        got.is_empty(),
        "nothing is sent past a write still open below it: {got:?}"
    );
    open_here.commit().await.expect("commit");
    let (got, _, end) = read_until(&mut stream, 2, Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(
        got,
        vec!["held-open".to_owned(), after[0].clone()],
        "the open write's record first, at its lower position, then the later one"
    );
    open_elsewhere.rollback().await.expect("rollback");
}

/// §7.5.2 in a watch: a brain record reaches a viewer only while it is a member of the
/// record's project, checked as each record is sent.
async fn s7_5_2_a_watch_sends_brain_records_only_to_members(kind: StoreKind) {
    use serde_json::json;
    let mut app = spawn_app_with(kind, |_| {}).await;
    let mut m = crate::helpers::example("github.pack.json");
    m["id"] = json!("notes");
    m["stimulusTriggers"] =
        json!([{ "ref": "note.shared" }, { "ref": "note.seen" }, { "ref": "binding.degraded" }]);
    m["policy"]["stimuli"] = json!([
        { "ref": "note.shared", "operation": "read", "land": "brain" },
        { "ref": "note.seen", "operation": "read", "land": "user" },
        { "ref": "binding.degraded", "operation": "read", "land": "user" }
    ]);
    crate::packs::register(&mut app, &m).await;
    let ch = app.channel.clone();
    let mut policy = pb::policy_service_client::PolicyServiceClient::new(ch.clone());
    policy
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "notes".into(),
        })
        .await
        .expect("grant");
    policy
        .put_binding(pb::PutBindingRequest {
            principal: "alice".into(),
            pack_id: "notes".into(),
            binding_id: "b-alice".into(),
            state: pb::BindingState::Linked as i32,
        })
        .await
        .expect("bind");
    policy
        .activate_sense(pb::ActivateSenseRequest {
            principal: "alice".into(),
            pack_id: "notes".into(),
            route: 1,
            filter: String::new(),
        })
        .await
        .expect("activate");
    let note = |id: &str, r#ref: &str, land: &str| pb::DeliverTriggerRequest {
        trigger_id: id.into(),
        project: if land == "brain" {
            "apollo".into()
        } else {
            String::new()
        },
        ..crate::support::trigger::trigger("notes", r#ref, "alice", land)
    };
    let mut stream = RecordServiceClient::new(ch.clone())
        .watch_records(pb::WatchRecordsRequest {
            viewer: "bob".into(),
            pack_id: "notes".into(),
            start: Some(Start::FromNow(true)),
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner();
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut send = async |t: pb::DeliverTriggerRequest| {
        let r = ingest
            .deliver_trigger(t)
            .await
            .expect("deliver")
            .into_inner();
        assert_eq!(
            r.disposition,
            pb::Disposition::RecordedInbox as i32,
            "{r:?}"
        );
        r.record_id
    };
    let hidden = send(note("brain-before", "note.shared", "brain")).await;
    let marker = send(note("user-marker", "note.seen", "user")).await;
    let (got, _, end) = read_until(&mut stream, 1, Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, vec![marker], "the brain record is not bob's to see");
    let _ = hidden;
    policy
        .add_project_member(pb::AddProjectMemberRequest {
            project: "apollo".into(),
            principal: "bob".into(),
        })
        .await
        .expect("member");
    let shown = send(note("brain-after", "note.shared", "brain")).await;
    let (got, _, end) = read_until(&mut stream, 1, Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, vec![shown], "a member now");
}
on_both_stores!(s7_5_2_a_watch_sends_brain_records_only_to_members => s7_5_2_a_watch_sends_brain_records_only_to_members);

/// A database gone silent ends watches UNAVAILABLE with a resume token; once it is back, a
/// watch from that token gets what committed since, nothing lost or repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_ends_watches_resumably_postgres() {
    use crate::support::proxy::FreezingProxy;
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &[]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut stream = open(&ch, Start::FromNow(true)).await;
    let before = deliver(&ch, (0..3).map(|i| format!("before-{i}"))).await;
    let (got, _, end) = read_until(&mut stream, before.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, before);
    proxy.freeze(true);
    let (more, _, end) = read_until(&mut stream, 1, Duration::from_secs(15)).await;
    assert!(more.is_empty(), "{more:?}");
    let end = end.expect("the watch ended during the outage");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    let token = resume_token_of(&end);
    proxy.freeze(false);
    // Delivered once the store answers again (the first calls may still fail over).
    let mut after = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut i = 0;
    while after.len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store did not come back"
        );
        if let Ok(r) = ingest
            .deliver_trigger(storm_warning(format!("after-{i}")))
            .await
        {
            after.push(r.into_inner().record_id);
            i += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut resumed = loop {
        match RecordServiceClient::new(ch.clone())
            .watch_records(watch_req(Start::ResumeToken(token.clone())))
            .await
        {
            Ok(s) => break s.into_inner(),
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let (got, _, end) = read_until(&mut resumed, after.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, after, "what committed after the outage, once");
}

/// Shutdown ends open watches UNAVAILABLE with a resume token at once, so they move to
/// another replica and the server does not wait out its grace period for them.
async fn shutdown_ends_watches_resumably_and_promptly(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let served = Served::start(&db.url, &["--shutdown-grace-secs", "20"]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut stream = open(&ch, Start::FromNow(true)).await;
    let sent = deliver(&ch, ["before-shutdown".to_owned()]).await;
    let (got, _, _) = read_until(&mut stream, 1, Duration::from_secs(10)).await;
    assert_eq!(got, sent);
    let waiter =
        tokio::spawn(async move { read_until(&mut stream, 1, Duration::from_secs(15)).await });
    let (clean, took) = tokio::task::spawn_blocking(move || served.terminate_timed())
        .await
        .expect("terminate");
    assert!(clean, "exit 0");
    assert!(
        took < Duration::from_secs(10),
        "an open watch held shutdown for {took:?}"
    );
    let (more, _, end) = waiter.await.expect("reader");
    assert!(more.is_empty());
    let end = end.expect("the watch was ended");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    assert!(!resume_token_of(&end).is_empty());
}
on_both_stores!(shutdown_ends_watches_resumably_and_promptly => shutdown_ends_watches_resumably_and_promptly);

/// With no watch open the tail reads nothing; the next watch, from an old token, catches up
/// from the store and then follows the ring started afresh: nothing lost across the gap.
async fn a_watch_after_an_idle_spell_misses_nothing(kind: StoreKind) {
    let app = spawn_app_with(kind, |_| {}).await;
    let ch = app.channel.clone();
    set_up_weather(&ch).await;
    let mut first = open(&ch, Start::FromNow(true)).await;
    let a = deliver(&ch, ["a".to_owned()]).await;
    let (got, token, _) = read_until(&mut first, 1, Duration::from_secs(10)).await;
    assert_eq!(got, a);
    drop(first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = deliver(&ch, (0..5).map(|i| format!("idle-{i}"))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut second = open(&ch, Start::ResumeToken(token)).await;
    let (got, _, end) = read_until(&mut second, idle.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, idle, "what committed while nobody watched");
    let live = deliver(&ch, (0..5).map(|i| format!("live-{i}"))).await;
    let (got, _, end) = read_until(&mut second, live.len(), Duration::from_secs(10)).await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(got, live, "then live, from the ring");
}
on_both_stores!(a_watch_after_an_idle_spell_misses_nothing => a_watch_after_an_idle_spell_misses_nothing);
