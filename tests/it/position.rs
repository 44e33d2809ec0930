//! The record path: positions in commit order, listings that never pass a write in flight, the
//! DeliverTriggers stream, sink writers, and PostgreSQL sockets without Nagle's delay.
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use hcp_sense::grpc::pb::{
    self, deliver_triggers_response::Result as Answer, ingest_service_client::IngestServiceClient,
    record_service_client::RecordServiceClient,
};
use sea_orm::{ConnectionTrait, TransactionTrait};
use tonic::transport::Channel;

use crate::cli::{connect, set_up_weather, storm_warning};
use crate::helpers::{StoreKind, TestDb};
use crate::support::served::{Served, BIN};

/// One page of an unfiltered, ascending listing.
pub(crate) async fn list_page(
    ch: &Channel,
    page_size: i32,
    token: &str,
) -> pb::ListRecordsResponse {
    RecordServiceClient::new(ch.clone())
        .list_records(pb::ListRecordsRequest {
            page_size,
            page_token: token.to_owned(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
}

/// Every record id of an ascending listing, page by page from `token`, until it ends.
pub(crate) async fn list_all(ch: &Channel, page_size: i32, mut token: String) -> Vec<String> {
    let mut ids = Vec::new();
    loop {
        let page = list_page(ch, page_size, &token).await;
        ids.extend(page.records.into_iter().map(|r| r.record_id));
        if page.next_page_token.is_empty() {
            return ids;
        }
        token = page.next_page_token;
    }
}

/// A record row written in a transaction the test holds open: it takes the transaction's id
/// as its commit position, below any write that commits after it.
const OPEN_WRITE: &str = "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time) \
     VALUES ('in-flight', 'alice', '', 'user', 'weather', 'storm.warning', '{}', 'inbox', NULL, 'in-flight', 0)";

/// A listing never passes a write still in flight: a record whose transaction began before a
/// later one committed is listed after it commits, from the cursor the listing had reached,
/// exactly once. Ordered by clock or by a sequence alone, the later record would be listed
/// first and the cursor would pass the earlier one for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_waits_for_writes_in_flight_and_never_passes_one_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let served = Served::start(&db.url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut before = Vec::new();
    for i in 0..2 {
        let r = ingest
            .deliver_trigger(storm_warning(format!("before-{i}")))
            .await
            .expect("deliver")
            .into_inner();
        before.push(r.record_id);
    }
    let conn = db.connect().await;
    let open = conn.begin().await.expect("begin");
    open.execute_unprepared(OPEN_WRITE).await.expect("insert");
    let after = ingest
        .deliver_trigger(storm_warning("after".into()))
        .await
        .expect("deliver")
        .into_inner()
        .record_id;

    // While the write is open the listing holds back what committed after it began, and
    // does not end: it hands back a token to go on from.
    let started = std::time::Instant::now();
    let page = list_page(&ch, 10, "").await;
    let first: Vec<String> = page.records.iter().map(|r| r.record_id.clone()).collect();
    assert_eq!(first, before, "only what is settled");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(200),
        "it waited for the write in flight first"
    );
    assert!(!page.next_page_token.is_empty(), "the listing goes on");

    open.commit().await.expect("commit");
    let rest = list_all(&ch, 10, page.next_page_token).await;
    assert_eq!(
        rest,
        vec!["in-flight".to_owned(), after.clone()],
        "the write in flight, then the one after it, each once"
    );
    // A listing from the start now ends at once with all four, in commit position order.
    let all = list_all(&ch, 3, String::new()).await;
    assert_eq!(all.len(), 4);
    assert_eq!(&all[..2], &before[..]);
    assert_eq!(&all[2..], &["in-flight".to_owned(), after]);

    // The last page's resume token lists only what commits after it, then nothing.
    let last = list_page(&ch, 10, "").await;
    assert!(last.next_page_token.is_empty());
    assert!(!last.resume_page_token.is_empty());
    let later = ingest
        .deliver_trigger(storm_warning("later".into()))
        .await
        .expect("deliver")
        .into_inner()
        .record_id;
    assert_eq!(list_all(&ch, 10, last.resume_page_token).await, vec![later]);
}

/// Only this database's writes hold a listing back: a write transaction left open in another
/// database of the same cluster (another application's, a long migration) cannot commit a
/// record here, and the listing neither waits for it nor holds records back behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_open_in_another_database_holds_no_listing_back_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let elsewhere = TestDb::create(StoreKind::Postgres).await;
    let served = Served::start(&db.url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let other = elsewhere.connect().await;
    let open = other.begin().await.expect("begin");
    open.execute_unprepared("CREATE TABLE held (x int); INSERT INTO held VALUES (1)")
        .await
        .expect("a write elsewhere, left open");
    let id = IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning("while-elsewhere-writes".into()))
        .await
        .expect("deliver")
        .into_inner()
        .record_id;
    let started = std::time::Instant::now();
    let page = list_page(&ch, 10, "").await;
    let ids: Vec<String> = page.records.iter().map(|r| r.record_id.clone()).collect();
    assert_eq!(ids, vec![id], "the acknowledged record is listed");
    assert!(
        page.next_page_token.is_empty(),
        "and the listing is settled"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_millis(200),
        "without waiting for the other database's write"
    );
    open.rollback().await.expect("rollback");
}

/// Records written before positions existed keep their receive order, ahead of every record
/// written after the migration; new records number on from them.
async fn migration_keeps_receive_order(kind: StoreKind) {
    use hcp_sense_migration::{Migrator, MigratorTrait};
    let db = TestDb::create(kind).await;
    let store = db.store(2).await;
    let conn = store.connection();
    Migrator::up(conn, Some(2))
        .await
        .expect("first two migrations");
    // Inserted out of receive order.
    for (id, t) in [("old-b", 2000), ("old-c", 3000), ("old-a", 1000)] {
        conn.execute_unprepared(&format!(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, received_time) \
             VALUES ('{id}', 'alice', '', 'user', 'weather', 'storm.warning', '{{}}', 'inbox', {t})"
        ))
        .await
        .expect("old record");
    }
    store.migrate_up().await.expect("migrate");
    store.close().await;
    let served = Served::start(&db.url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let new = IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning("new".into()))
        .await
        .expect("deliver")
        .into_inner()
        .record_id;
    // A release from before positions, still serving (a rollout, a rollback), inserts
    // without them: its record lists after every one before it.
    db.connect()
        .await
        .execute_unprepared(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, received_time) \
             VALUES ('earlier-release', 'alice', '', 'user', 'weather', 'storm.warning', '{}', 'inbox', 0)",
        )
        .await
        .expect("earlier release's insert");
    assert_eq!(
        list_all(&ch, 2, String::new()).await,
        vec![
            "old-a".to_owned(),
            "old-b".into(),
            "old-c".into(),
            new,
            "earlier-release".into()
        ]
    );
}

on_both_stores!(migration_keeps_receive_order_of_earlier_records => migration_keeps_receive_order);

/// Two replicas, one with its clock 5 s behind, deliver concurrently while a reader pages
/// through the listing; once they stop, the reader goes on to the end. Every acknowledged
/// record is listed exactly once: the lagging replica's records, stamped 5 s in the past,
/// are not behind the reader's cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_clock_behind_list_without_skips_or_repeats_postgres() {
    two_replicas_one_clock_behind(&[]).await;
}

/// The same with records partitions one second wide: the listing pages across a partition
/// boundary every second, the lagging replica writes into the partitions of the database's
/// clock, and partitions the writes outrun are made by the writes that find none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_clock_behind_list_across_partitions_postgres() {
    let db = two_replicas_one_clock_behind(&["--record-partition-secs", "1"]).await;
    let spanned = crate::partitions::partitions_holding_records(&db).await;
    assert!(spanned >= 3, "the records span {spanned} partitions");
}

async fn two_replicas_one_clock_behind(extra: &[&str]) -> TestDb {
    let db = TestDb::create(StoreKind::Postgres).await;
    // Page tokens cross replicas that share their key.
    let mut key = vec!["--page-token-secret", "one-key-for-both-replicas"];
    key.extend(extra);
    let key = &key[..];
    let ahead = Served::start(&db.url, key);
    let ch_ahead = connect(&ahead.addr).await;
    set_up_weather(&ch_ahead).await;
    // libfaketime, preloaded into the server itself (Debian's faketime): the `faketime`
    // wrapper would run the server as its child, which outlives the wrapper when killed.
    let mut cmd = crate::support::served::serve_command(&db.url);
    cmd.env("LD_PRELOAD", LIBFAKETIME).env("FAKETIME", "-5s");
    cmd.args(key);
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "libfaketime must be installed (see .ci/run)"
    );
    let behind = Served::spawn(cmd);
    let ch_behind = connect(&behind.addr).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..8 {
        let ch = if w % 2 == 0 {
            ch_ahead.clone()
        } else {
            ch_behind.clone()
        };
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut ingest = IngestServiceClient::new(ch);
            let mut acked = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = ingest
                    .deliver_trigger(storm_warning(format!("w{w}-{i}")))
                    .await
                    .expect("deliver")
                    .into_inner();
                acked.push(r.record_id);
                i += 1;
            }
            acked
        }));
    }
    // Page through while the writes go on, from either replica.
    let mut seen: Vec<String> = Vec::new();
    let mut token = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut turn = 0;
    while std::time::Instant::now() < deadline {
        let ch = if turn % 2 == 0 { &ch_ahead } else { &ch_behind };
        turn += 1;
        let page = list_page(ch, 25, &token).await;
        seen.extend(page.records.into_iter().map(|r| r.record_id));
        // At the end of what has committed so far, go on from where this page ended.
        token = page.resume_page_token;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acked = Vec::new();
    let mut from_behind = BTreeSet::new();
    for (w, task) in writers.into_iter().enumerate() {
        let ids = task.await.expect("writer");
        if w % 2 == 1 {
            from_behind.extend(ids.iter().cloned());
        }
        acked.extend(ids);
    }
    seen.extend(list_all(&ch_behind, 100, token).await);
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for id in &seen {
        *counts.entry(id.as_str()).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "listed twice: {repeated:?}");
    let missing: Vec<_> = acked
        .iter()
        .filter(|id| !counts.contains_key(id.as_str()))
        .collect();
    assert!(
        acked.len() > 100,
        "the writers made progress: {}",
        acked.len()
    );
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged records skipped",
        missing.len(),
        acked.len()
    );
    assert_eq!(
        seen.len(),
        acked.len(),
        "nothing listed that was not acknowledged"
    );

    // The premise: the lagging replica stamped its records about 5 s in the past.
    let (mut behind, mut ahead) = ((0i64, 0i64), (0i64, 0i64));
    let mut token = String::new();
    loop {
        let page = list_page(&ch_ahead, 1000, &token).await;
        for r in &page.records {
            let t = r
                .receive_time
                .as_ref()
                .map_or(0, |t| t.seconds * 1000 + i64::from(t.nanos) / 1_000_000);
            let side = if from_behind.contains(&r.record_id) {
                &mut behind
            } else {
                &mut ahead
            };
            side.0 += t;
            side.1 += 1;
        }
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let lag_ms = ahead.0 / ahead.1.max(1) - behind.0 / behind.1.max(1);
    assert!(
        (4000..6000).contains(&lag_ms),
        "the lagging replica's records are {lag_ms} ms behind on average"
    );
    db
}

/// Debian's libfaketime (package faketime), which .ci/run installs.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The outcomes of one DeliverTriggers stream.
async fn stream(
    ch: &Channel,
    items: Vec<pb::DeliverTriggersRequest>,
) -> Vec<pb::DeliverTriggersResponse> {
    let mut answers = IngestServiceClient::new(ch.clone())
        .deliver_triggers(tokio_stream::iter(items))
        .await
        .expect("stream")
        .into_inner();
    let mut out = Vec::new();
    while let Some(a) = answers.message().await.expect("answer") {
        out.push(a);
    }
    out
}

fn item(t: pb::DeliverTriggerRequest) -> pb::DeliverTriggersRequest {
    pb::DeliverTriggersRequest { trigger: Some(t) }
}

both_stores! {
    // Each trigger of a stream is decided on its own and answered in order with its own
    // outcome, as DeliverTrigger would answer it; a refused one does not end the stream.
    async fn deliver_triggers_answers_each_trigger_in_order(app) {
        set_up_weather(&app.channel).await;
        let mut bad = storm_warning("bad".into());
        bad.pack_id = String::new();
        let mut stranger = storm_warning("stranger".into());
        stranger.principal = "mallory".into();
        let answers = stream(
            &app.channel,
            vec![
                item(storm_warning("s-1".into())),
                item(bad),
                pb::DeliverTriggersRequest { trigger: None },
                item(stranger),
                item(storm_warning("s-1".into())),
                item(storm_warning("s-2".into())),
            ],
        )
        .await;
        assert_eq!(
            answers.iter().map(|a| a.index).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 5]
        );
        let outcome = |i: usize| match &answers[i].result {
            Some(Answer::Outcome(o)) => o.clone(),
            other => panic!("answer {i}: {other:?}"),
        };
        let error = |i: usize| match &answers[i].result {
            Some(Answer::Error(e)) => e.clone(),
            other => panic!("answer {i}: {other:?}"),
        };
        let first = outcome(0);
        assert_eq!(first.disposition, pb::Disposition::RecordedInbox as i32);
        let e = error(1);
        assert_eq!(e.code, tonic::Code::InvalidArgument as i32);
        assert!(e.message.contains("pack_id"), "{}", e.message);
        let e = error(2);
        assert_eq!(e.code, tonic::Code::InvalidArgument as i32);
        assert!(e.message.contains("trigger"), "{}", e.message);
        let dropped = outcome(3);
        assert_eq!(dropped.disposition, pb::Disposition::Dropped as i32);
        assert_eq!(dropped.drop_reason, pb::DropReason::NoGrant as i32);
        let again = outcome(4);
        assert!(again.duplicate);
        assert_eq!(again.record_id, first.record_id);
        let second = outcome(5);
        assert_eq!(second.disposition, pb::Disposition::RecordedInbox as i32);
        assert_eq!(app.count("records").await, 2);
    }

    // Triggers of one stream sharing a trigger id: the first sent is the one recorded, and
    // each later one is answered against it, however the decisions interleave.
    async fn deliver_triggers_records_the_first_sent_of_a_trigger_id(app) {
        set_up_weather(&app.channel).await;
        let mut items = Vec::new();
        for i in 0..100 {
            items.push(item(storm_warning(format!("pair-{i}"))));
            let mut other = storm_warning(format!("pair-{i}"));
            other.principal = "bob".into();
            items.push(item(other));
        }
        let answers = stream(&app.channel, items).await;
        assert_eq!(answers.len(), 200);
        for pair in answers.chunks(2) {
            match (&pair[0].result, &pair[1].result) {
                (Some(Answer::Outcome(o)), Some(Answer::Error(e))) => {
                    assert_eq!(o.disposition, pb::Disposition::RecordedInbox as i32);
                    assert_eq!(e.code, tonic::Code::AlreadyExists as i32, "{}", e.message);
                }
                other => panic!("answers {}: {other:?}", pair[0].index),
            }
        }
        assert_eq!(app.count("records").await, 100);
    }

    // A stream of 3,000 triggers: every one answered once, in order, and every answer's
    // record already stored when the answer is read.
    async fn deliver_triggers_commits_before_each_answer(app) {
        set_up_weather(&app.channel).await;
        let n = 3000;
        let items: Vec<_> = (0..n).map(|i| item(storm_warning(format!("t-{i}")))).collect();
        let mut answers = IngestServiceClient::new(app.channel.clone())
            .deliver_triggers(tokio_stream::iter(items))
            .await
            .expect("stream")
            .into_inner();
        let mut next = 0;
        let mut ids = BTreeSet::new();
        while let Some(a) = answers.message().await.expect("answer") {
            assert_eq!(a.index, next);
            next += 1;
            let Some(Answer::Outcome(o)) = a.result else {
                panic!("answer {}: {:?}", a.index, a.result)
            };
            assert!(ids.insert(o.record_id.clone()));
            if a.index % 500 == 0 {
                let stored = app
                    .db
                    .query_one_raw(sea_orm::Statement::from_string(
                        app.db.get_database_backend(),
                        format!("SELECT COUNT(*) AS n FROM records WHERE record_id = '{}'", o.record_id),
                    ))
                    .await
                    .expect("query")
                    .and_then(|r| r.try_get::<i64>("", "n").ok());
                assert_eq!(stored, Some(1), "answer {} before its record", a.index);
            }
        }
        assert_eq!(next, n);
        assert_eq!(app.count("records").await, n as i64);
    }
}

/// `--sink-writers` takes 1 to 64: both bounds serve, one past either is refused at start.
/// On PostgreSQL each writer holds a connection of its own (64 are asked of SQLite, which has
/// one writer whatever is asked, to leave the shared test server's connections to others).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_writers_from_1_to_64_postgres() {
    for bad in ["0", "65"] {
        let db = TestDb::create(StoreKind::Postgres).await;
        let o = Command::new(BIN)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--database-url",
                &db.url,
                "--sink-writers",
                bad,
            ])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{bad} accepted");
        assert!(err.contains("--sink-writers must be from 1 to 64"), "{err}");
    }
    for (good, kind) in [
        ("1", StoreKind::Postgres),
        ("6", StoreKind::Postgres),
        ("64", StoreKind::Sqlite),
    ] {
        let db = TestDb::create(kind).await;
        let served = Served::start(&db.url, &["--sink-writers", good]);
        let ch = connect(&served.addr).await;
        set_up_weather(&ch).await;
        let mut calls = Vec::new();
        for i in 0..64 {
            let mut ingest = IngestServiceClient::new(ch.clone());
            calls.push(tokio::spawn(async move {
                ingest
                    .deliver_trigger(storm_warning(format!("t-{i}")))
                    .await
                    .map(|r| r.into_inner().disposition)
            }));
        }
        for c in calls {
            assert_eq!(
                c.await.expect("call").expect("deliver"),
                pb::Disposition::RecordedInbox as i32
            );
        }
        if kind == StoreKind::Sqlite {
            assert!(served.terminate());
            continue;
        }
        let writers = db
            .connect()
            .await
            .query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Postgres,
                "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE datname = current_database()",
            ))
            .await
            .expect("query")
            .and_then(|r| r.try_get::<i64>("", "n").ok())
            .unwrap_or(0);
        // The writers, the pool's connection (at least one), the policy listener, this query.
        assert!(
            writers >= good.parse::<i64>().expect("n") + 3,
            "{good} writers hold a connection each: {writers} sessions"
        );
        assert!(served.terminate());
    }
}

/// The service's PostgreSQL connections are TCP sockets with Nagle's algorithm off: the
/// socket PostgreSQL sees as this test's store connection has TCP_NODELAY set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sockets_have_tcp_nodelay_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let store = db.store(1).await;
    let row = store
        .connection()
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT inet_client_port() AS port",
        ))
        .await
        .expect("query")
        .expect("row");
    let port = u16::try_from(row.try_get::<i32>("", "port").expect("port")).expect("u16");
    let me = rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("pidfd");
    let mut found = None;
    for entry in std::fs::read_dir("/proc/self/fd").expect("fds").flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(dup) =
            rustix::process::pidfd_getfd(&me, fd, rustix::process::PidfdGetfdFlags::empty())
        else {
            continue;
        };
        let sock = socket2::SockRef::from(&dup);
        let local = sock.local_addr().ok().and_then(|a| a.as_socket());
        if local.is_some_and(|a| a.port() == port) {
            found = Some(sock.tcp_nodelay().expect("TCP_NODELAY"));
        }
    }
    assert_eq!(found, Some(true), "the store's socket (local port {port})");
    store.close().await;
}

/// Under `--rate-limit-per-sec`, each trigger of a stream after the first takes a token of its
/// own, as a DeliverTrigger call would: at 1 a second (bursts of 2) the call's token covers
/// the first trigger, the second takes the other, and the rest are RESOURCE_EXHAUSTED in their
/// places while the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_triggers_takes_a_rate_limit_token_per_trigger_sqlite() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    {
        let open = Served::start(&db.url, &[]);
        set_up_weather(&connect(&open.addr).await).await;
        assert!(open.terminate());
    }
    let limited = Served::start(&db.url, &["--rate-limit-per-sec", "1"]);
    let ch = connect(&limited.addr).await;
    let answers = stream(
        &ch,
        (0..5)
            .map(|i| item(storm_warning(format!("r-{i}"))))
            .collect(),
    )
    .await;
    assert_eq!(answers.len(), 5);
    for a in &answers[..2] {
        assert!(
            matches!(&a.result, Some(Answer::Outcome(o)) if o.disposition == pb::Disposition::RecordedInbox as i32),
            "{a:?}"
        );
    }
    for a in &answers[2..] {
        assert!(
            matches!(&a.result, Some(Answer::Error(e)) if e.code == tonic::Code::ResourceExhausted as i32),
            "{a:?}"
        );
    }
}
