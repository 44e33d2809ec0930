//! Records partitioned on PostgreSQL: listing, idempotency and erasure across partition boundaries, retention by whole partitions, a write that finds no partition, and the conversion of an unpartitioned table by `migrate up`.
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use hcp_sense::grpc::pb::{self, ListRecordsRequest};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

use crate::helpers::{http_get, spawn_app_with, StoreKind, TestApp, TestDb};
use crate::sense::{deliver, opened, ready};

/// One scalar of a query on the test's database.
async fn scalar(db: &DatabaseConnection, sql: &str) -> i64 {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("query")
        .expect("a row")
        .try_get_by_index::<i64>(0)
        .expect("a number")
}

/// How many partitions hold a record.
pub(crate) async fn partitions_holding_records(db: &TestDb) -> i64 {
    scalar(
        &db.connect().await,
        "SELECT count(DISTINCT tableoid)::bigint FROM records",
    )
    .await
}

/// Partitions attached to `records`.
async fn attached(db: &DatabaseConnection) -> i64 {
    scalar(
        db,
        "SELECT count(*)::bigint FROM pg_inherits WHERE inhparent = 'records'::regclass",
    )
    .await
}

/// A server on PostgreSQL with records partitions one second wide, and alice and bob set up.
async fn one_second_partitions(adjust: impl FnOnce(&mut hcp_sense::config::Config)) -> TestApp {
    let mut app = spawn_app_with(StoreKind::Postgres, |c| {
        c.database.partition_width = Duration::from_secs(1);
        c.prune_interval = Duration::from_secs(1);
        adjust(c);
    })
    .await;
    ready(&mut app, "alice").await;
    ready(&mut app, "bob").await;
    app
}

fn keyed(principal: &str, id: &str) -> pb::DeliverTriggerRequest {
    let mut t = opened(principal);
    t.trigger_id = id.into();
    t
}

/// Every record id of a principal's ascending listing, `page_size` at a time.
async fn list_ids(app: &mut TestApp, principal: &str, page_size: i32) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let page = app
            .records
            .list_records(ListRecordsRequest {
                principal: principal.into(),
                page_size,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .expect("list")
            .into_inner();
        ids.extend(page.records.into_iter().map(|r| r.record_id));
        if page.next_page_token.is_empty() {
            return ids;
        }
        token = page.next_page_token;
    }
}

/// Records written across at least three partitions: a listing paged 4 at a time returns each
/// exactly once in the order they were acknowledged; every trigger id delivered again, from
/// a later partition, is answered with its first record and writes nothing; the same new id
/// sent six times at once, round after round across the boundaries, is recorded once; an
/// erasure reaches every partition and takes the erased records' trigger ids with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_across_partitions_list_dedupe_and_erase_exactly_postgres() {
    let mut app = one_second_partitions(|_| {}).await;
    let mut acked: Vec<(String, String, String)> = Vec::new();
    let started = Instant::now();
    let mut i = 0;
    while started.elapsed() < Duration::from_millis(3300) {
        let who = if i % 2 == 0 { "alice" } else { "bob" };
        let id = format!("t-{i}");
        let r = deliver(&mut app, keyed(who, &id)).await;
        assert!(!r.duplicate);
        acked.push((who.into(), id, r.record_id));
        i += 1;
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let spanned = partitions_holding_records(&app.test_db).await;
    assert!(spanned >= 3, "the records span {spanned} partitions");

    for who in ["alice", "bob"] {
        let want: Vec<String> = acked
            .iter()
            .filter(|(w, _, _)| w == who)
            .map(|(_, _, r)| r.clone())
            .collect();
        assert_eq!(list_ids(&mut app, who, 4).await, want, "{who}'s listing");
    }

    let before = app.count("records").await;
    for (who, id, record_id) in &acked {
        let again = deliver(&mut app, keyed(who, id)).await;
        assert!(again.duplicate, "{id} delivered again is a duplicate");
        assert_eq!(
            &again.record_id, record_id,
            "{id} is answered its first record"
        );
    }
    assert_eq!(app.count("records").await, before);

    for round in 0..12 {
        let id = format!("c-{round}");
        let mut sends = Vec::new();
        for k in 0..6u64 {
            let mut ingest = app.ingest.clone();
            let t = keyed("alice", &id);
            sends.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(k * 30)).await;
                ingest.deliver_trigger(t).await.map(|r| r.into_inner())
            }));
        }
        let mut ids = BTreeSet::new();
        for s in sends {
            let r = s.await.expect("task").expect("acknowledged");
            ids.insert(r.record_id);
        }
        assert_eq!(ids.len(), 1, "round {round}: one record for one trigger id");
    }
    assert_eq!(app.count("records").await, before + 12);
    assert_eq!(app.count("record_triggers").await, before + 12);

    app.records
        .erase_records(pb::EraseRecordsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await
        .expect("erase");
    assert!(list_ids(&mut app, "alice", 50).await.is_empty());
    let bobs = acked.iter().filter(|(w, _, _)| w == "bob").count() as i64;
    assert_eq!(app.count("records").await, bobs);
    assert_eq!(
        app.count("record_triggers").await,
        bobs,
        "an erased record's trigger id goes with it"
    );
    // An erased trigger id may be recorded again.
    let (_, id, old) = acked.iter().find(|(w, _, _)| w == "alice").expect("one");
    let anew = deliver(&mut app, keyed("alice", id)).await;
    assert!(!anew.duplicate);
    assert_ne!(&anew.record_id, old);
}

/// Retention of 3 s over one-second partitions: expired partitions are detached and dropped
/// whole (they do not accumulate, and no DEFAULT partition exists to block a concurrent
/// detach), records younger than the age stay, the count of records deleted covers the
/// dropped ones, and a trigger id whose record was dropped may be recorded anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_whole_partitions_postgres() {
    let mut app = one_second_partitions(|c| {
        c.record_retention = Some(Duration::from_secs(3));
    })
    .await;
    let mut old = Vec::new();
    for i in 0..12 {
        old.push(
            deliver(&mut app, keyed("alice", &format!("old-{i}")))
                .await
                .record_id,
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while app.count("records").await > 0 {
        assert!(
            Instant::now() < deadline,
            "expired records were not removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Writes go on while partitions come and go; none younger than the age is removed.
    let mut young = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        young.push(deliver(&mut app, opened("bob")).await.record_id);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let listed: BTreeSet<String> = list_ids(&mut app, "bob", 100).await.into_iter().collect();
        let first_kept = young.len().saturating_sub(20);
        for id in &young[first_kept..] {
            assert!(listed.contains(id), "a record younger than 2 s was removed");
        }
    }
    let db = &app.db;
    // Retention age 3 s, one partition of 1 s straddling the cutoff, now's and two ahead.
    let count = attached(db).await;
    assert!(
        count <= 8,
        "{count} partitions attached: expired ones are dropped"
    );
    let oldest_age_ms = scalar(
        db,
        "SELECT ((extract(epoch FROM clock_timestamp()) * 1000000)::bigint - min(lower)) / 1000 FROM ( \
           SELECT split_part(c.relname, '_', 2)::bigint AS lower FROM pg_inherits i \
           JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'records'::regclass) p",
    )
    .await;
    assert!(
        oldest_age_ms < 6000,
        "the oldest partition kept starts {oldest_age_ms} ms ago"
    );
    assert_eq!(
        scalar(
            db,
            "SELECT partdefid::bigint FROM pg_partitioned_table WHERE partrelid = 'records'::regclass"
        )
        .await,
        0,
        "no DEFAULT partition"
    );
    let metrics = http_get(&format!("http://{}/metrics", app.metrics_addr));
    let deleted: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("hcp_sense_records_deleted_total{cause=\"retention\"} "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(deleted >= 12, "records deleted by retention: {deleted}");
    // The ledger keeps no trigger id of a dropped record.
    let deadline = Instant::now() + Duration::from_secs(10);
    while app.count("record_triggers").await > 0 {
        assert!(
            Instant::now() < deadline,
            "dropped records' trigger ids stay in the ledger"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let anew = deliver(&mut app, keyed("alice", "old-0")).await;
    assert!(
        !anew.duplicate,
        "a dropped record's trigger id is recorded anew"
    );
    assert!(!old.contains(&anew.record_id));
}

/// The partitions for now and two days ahead are made at start. Every partition gone (an
/// operator's mistake, or partitions never made ahead): the next
/// write makes the one for now and is acknowledged with its record stored, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_finds_no_partition_has_one_made_postgres() {
    let mut app = spawn_app_with(StoreKind::Postgres, |_| {}).await;
    ready(&mut app, "alice").await;
    let first = deliver(&mut app, keyed("alice", "before")).await;
    // Retried, its first record is read and copied: the copy must not outlive the partition.
    crate::sense::retried(&mut app, &keyed("alice", "before"), &first.record_id, 2).await;
    // At start the server made today's partition and the two after it.
    assert_eq!(attached(&app.db).await, 1 + 2);
    app.db
        .execute_unprepared(
            "DO $$ DECLARE p text; BEGIN \
               FOR p IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                        WHERE i.inhparent = 'records'::regclass LOOP \
                 EXECUTE format('DROP TABLE %I', p); \
               END LOOP; END $$",
        )
        .await
        .expect("drop every partition");
    assert_eq!(attached(&app.db).await, 0);
    let r = deliver(&mut app, keyed("alice", "after")).await;
    assert!(!r.duplicate);
    assert_ne!(r.record_id, first.record_id);
    assert_eq!(
        list_ids(&mut app, "alice", 10).await,
        vec![r.record_id.clone()]
    );
    assert_eq!(attached(&app.db).await, 1);
    // The trigger id whose record went with the dropped partitions is recorded anew: at
    // most one UNAVAILABLE ("retry"), never a refusal for ever.
    let mut anew = None;
    for _ in 0..2 {
        match app.ingest.deliver_trigger(keyed("alice", "before")).await {
            Ok(r) => {
                anew = Some(r.into_inner());
                break;
            }
            Err(s) => assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}"),
        }
    }
    let anew = anew.expect("recorded on the retry");
    assert!(!anew.duplicate);
    assert_ne!(anew.record_id, first.record_id);
    assert_eq!(app.count("record_triggers").await, 2);
}

/// An unpartitioned table of records over three days, keyed and not, upgraded by
/// `hcp-sense migrate up`: every record kept in its day's partition, listed in the order it
/// had, and its trigger id still answered with its first record by the server after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_up_partitions_an_existing_table_postgres() {
    use hcp_sense_migration::{Migrator, MigratorTrait};
    let db = TestDb::create(StoreKind::Postgres).await;
    let store = db.store(2).await;
    let before_partitions = Migrator::migrations()
        .iter()
        .position(|m| m.name() == "m20261203_000001_partitioned_records")
        .expect("the partitioning migration") as u32;
    Migrator::up(store.connection(), Some(before_partitions))
        .await
        .expect("the migrations before partitions");
    store.close().await;
    let conn = db.connect().await;
    let day: i64 = 86_400_000_000;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    let mut ids = Vec::new();
    for i in 0..30i64 {
        let received = now - (2 - i / 10) * day - 1000 + i;
        let trigger = if i % 3 == 0 {
            format!("'old-{i}'")
        } else {
            "NULL".into()
        };
        conn.execute_unprepared(&format!(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, producer_trigger_id, received_time) \
             VALUES ('rec-{i:02}', 'alice', '', 'user', 'weather', 'storm.warning', '{{}}', 'inbox', {trigger}, {received})"
        ))
        .await
        .expect("an earlier record");
        ids.push(format!("rec-{i:02}"));
    }
    let out = std::process::Command::new(crate::support::served::BIN)
        .args(["migrate", "up", "--database-url", &db.url])
        .env_remove("DATABASE_URL")
        .output()
        .expect("run migrate up");
    assert!(
        out.status.success(),
        "migrate up: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        scalar(&conn, "SELECT count(*)::bigint FROM records").await,
        30
    );
    assert!(partitions_holding_records(&db).await >= 3);
    assert_eq!(
        scalar(&conn, "SELECT count(*)::bigint FROM record_triggers").await,
        10
    );
    assert_eq!(
        scalar(
            &conn,
            "SELECT count(*)::bigint FROM pg_class WHERE relname = 'records' AND relkind = 'p'"
        )
        .await,
        1,
        "records is a partitioned table"
    );

    let served = crate::support::served::Served::start(&db.url, &["--migrate", "false"]);
    let ch = crate::cli::connect(&served.addr).await;
    crate::cli::set_up_weather(&ch).await;
    let mut ingest = pb::ingest_service_client::IngestServiceClient::new(ch.clone());
    let again = ingest
        .deliver_trigger(crate::cli::storm_warning("old-3".into()))
        .await
        .expect("deliver")
        .into_inner();
    assert!(again.duplicate);
    assert_eq!(again.record_id, "rec-03");
    let new = ingest
        .deliver_trigger(crate::cli::storm_warning("new".into()))
        .await
        .expect("deliver")
        .into_inner();
    assert!(!new.duplicate);
    ids.push(new.record_id);
    assert_eq!(crate::position::list_all(&ch, 7, String::new()).await, ids);
    drop(served);

    // `migrate down` reverts that one step: one table again, every record in it, trigger ids
    // unique by index; and `migrate up` partitions it again.
    let cli = |action: &str| {
        let out = std::process::Command::new(crate::support::served::BIN)
            .args(["migrate", action, "--database-url", &db.url])
            .env_remove("DATABASE_URL")
            .output()
            .expect("run migrate");
        assert!(
            out.status.success(),
            "migrate {action}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Later migrations are reverted first, one step each.
    let later = hcp_sense_migration::Migrator::migrations()
        .iter()
        .map(|m| m.name().to_owned())
        .skip_while(|n| n != "m20261203_000001_partitioned_records")
        .count();
    let mut status = String::new();
    for _ in 0..later {
        status = cli("down");
    }
    assert!(
        status.contains("pending\tm20261203_000001_partitioned_records"),
        "{status}"
    );
    let plain = "SELECT count(*)::bigint FROM pg_class WHERE relname = 'records' AND relkind = 'r'";
    assert_eq!(scalar(&conn, plain).await, 1, "records is one table");
    assert_eq!(
        scalar(&conn, "SELECT count(*)::bigint FROM records").await,
        31
    );
    assert_eq!(
        scalar(
            &conn,
            "SELECT count(*)::bigint FROM pg_indexes WHERE indexname = 'uq_records_producer_trigger'"
        )
        .await,
        1
    );
    cli("up");
    assert_eq!(
        scalar(&conn, "SELECT count(*)::bigint FROM records").await,
        31
    );
    assert_eq!(
        scalar(&conn, "SELECT count(*)::bigint FROM record_triggers").await,
        11
    );
}

/// Retention's trim of the partition straddling its cutoff reads a few pages, never the whole
/// partition: when no record is below the cutoff (right after whole partitions were dropped,
/// the usual case) and when some are. The partition's reads are taken from PostgreSQL's own
/// statistics for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_reads_a_few_pages_of_a_large_partition_postgres() {
    use hcp_sense::store::Lands;
    let db = TestDb::create(StoreKind::Postgres).await;
    let store = db.store(1).await;
    store.migrate_up().await.expect("migrate");
    let conn = db.connect().await;
    // The filling on a connection of its own, closed after: a backend ending reports all it
    // read, where a live one reports in pieces when it goes idle.
    let filler = db.connect().await;
    // 100,000 records, half a second apart, in a day's partition of long ago.
    let (lower, upper) = (86_400_000_000i64, 2 * 86_400_000_000i64);
    let name = format!("records_{lower}_{upper}");
    for sql in [
        // Made as the store makes a partition: its stored-time index is summarized by passes.
        format!("CREATE TABLE {name} (LIKE records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"),
        format!("CREATE INDEX {name}_stored_time_idx ON {name} USING brin (stored_time) WITH (autosummarize = off)"),
        // Autovacuum's reads would count in the partition's statistics.
        format!("ALTER TABLE {name} SET (autovacuum_enabled = false)"),
        format!("ALTER TABLE records ATTACH PARTITION {name} FOR VALUES FROM ({lower}) TO ({upper})"),
        format!(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, received_time, commit_txid, seq, stored_time) \
             SELECT 'r-' || g, 'alice', 'b-alice', 'user', 'weather', 'storm.warning', '{{\"n\": ' || g || '}}', 'inbox', {lower} + g::bigint * 500000, 0, g, {lower} + g::bigint * 500000 \
             FROM generate_series(1, 100000) AS g"
        ),
        format!("ANALYZE {name}"),
    ] {
        filler.execute_unprepared(&sql).await.expect(&sql);
    }
    let _ = filler.close().await;
    // Nothing has summarized the index's ranges: retention's pass does, through a store of its
    // own (closed after, so its reads are reported with the filling's).
    let summarizer = db.store(1).await;
    let ranges = summarizer
        .summarize_stored_time()
        .await
        .expect("summarize")
        .ranges;
    summarizer.close().await;
    let pages = scalar(
        &conn,
        &format!("SELECT relpages::bigint FROM pg_class WHERE relname = '{name}'"),
    )
    .await;
    assert!(pages > 1000, "{pages} pages");
    // A summary for every 128 pages, the last partial range too (the first range may have
    // been summarized as it was written).
    let all = u64::try_from((pages + 127) / 128).expect("pages");
    assert!(
        (all - 1..=all).contains(&ranges),
        "{ranges} ranges summarized of {pages} pages"
    );
    // Heap blocks of the partition read so far (each fetch counts), once the store's backend
    // has reported them (it does within a second or so of going idle). Reading the partition
    // in position order to find nothing fetches the heap once per record (100,000 here); the
    // stored-time index finds the first range or two, and the delete fetches its 250 rows.
    let reads = || {
        let conn = conn.clone();
        let name = name.clone();
        async move {
            scalar(
                &conn,
                &format!(
                    "SELECT (coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0))::bigint \
                     FROM pg_statio_user_tables WHERE relname = '{name}'"
                ),
            )
            .await
        }
    };
    let deleted = || {
        let conn = conn.clone();
        let name = name.clone();
        async move {
            scalar(
                &conn,
                &format!("SELECT n_tup_del FROM pg_stat_user_tables WHERE relname = '{name}'"),
            )
            .await
        }
    };
    // The filling's, ANALYZE's and the summary's reads are reported first (the same flush as their counts).
    let reported = format!(
        "SELECT (n_tup_ins = 100000 AND analyze_count > 0)::int::bigint FROM pg_stat_user_tables WHERE relname = '{name}'"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while scalar(&conn, &reported).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the filling's statistics never came"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And its block reads: the count holds still for a second and a half.
    let mut before = reads().await;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = reads().await;
        if now == before {
            break;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(10),
            "the reads never settled"
        );
        before = now;
    }
    let records = store.record_tables();
    // Nothing below a cutoff just above the partition's lower bound.
    let none = records
        .prune_records(lower + 250_000, Lands::Except(&[]), 250)
        .await
        .expect("trim");
    assert_eq!(none, 0);
    // 250 of the 1,000 below this one.
    let some = records
        .prune_records(lower + 1_000 * 500_000 + 1, Lands::Except(&[]), 250)
        .await
        .expect("trim");
    assert_eq!(some, 250);
    let deadline = Instant::now() + Duration::from_secs(10);
    while deleted().await < 250 {
        assert!(Instant::now() < deadline, "the statistics never came");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let read = reads().await - before;
    assert!(
        read < pages,
        "two trims fetched {read} heap blocks of a partition of {pages} pages"
    );
    store.close().await;
}

/// The stored-time index of every records partition queues no autovacuum work item per full
/// range (`autosummarize` off): a flood fills more ranges than autovacuum's queue holds, and
/// PostgreSQL logs a line for each it drops. The partitions the store makes have it off from
/// the start; one made as PostgreSQL makes one by default (the option taken from the parent:
/// before this release, or by an older replica) has it set off by the pass, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_records_partition_s_stored_time_index_leaves_summaries_to_passes_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let store = db.store(1).await;
    store.migrate_up().await.expect("migrate");
    let conn = db.connect().await;
    conn.execute_unprepared(
        "CREATE TABLE records_0_1000000 PARTITION OF records FOR VALUES FROM (0) TO (1000000)",
    )
    .await
    .expect("a partition made by default");
    let leaves = |option: &'static str| {
        let conn = &conn;
        async move {
            scalar(
                conn,
                &format!(
                    "SELECT count(*)::bigint FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                     WHERE i.inhparent = 'idx_records_stored'::regclass \
                       AND coalesce('{option}' = ANY (c.reloptions), false)"
                ),
            )
            .await
        }
    };
    assert_eq!(leaves("autosummarize=on").await, 1);
    // Now's and two ahead, of records and of the decision log.
    let made = store.make_partitions_ahead().await.expect("partitions");
    assert_eq!(made, 6);
    let partitions = attached(&conn).await;
    assert_eq!(partitions, 4);
    assert_eq!(leaves("autosummarize=off").await, 3, "made with it off");
    let first = store.summarize_stored_time().await.expect("pass");
    assert_eq!((first.set_off, first.deferred), (1, 0), "{first:?}");
    assert_eq!(leaves("autosummarize=off").await, partitions);
    assert_eq!(leaves("autosummarize=on").await, 0);
    let again = store.summarize_stored_time().await.expect("pass");
    assert_eq!((again.set_off, again.deferred), (0, 0), "{again:?}");
    assert_eq!(
        scalar(
            &conn,
            "SELECT count(*)::bigint FROM pg_inherits WHERE inhparent = 'idx_records_stored'::regclass"
        )
        .await,
        partitions
    );
    store.close().await;
}

/// Retention's pass summarizes the stored-time ranges of pages records filled, within a pass
/// or two: a trim's index scan then skips their pages, where every page of a range not
/// summarized is read. (A partition's first range is summarized as it is written; those
/// after it are not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_pass_summarizes_the_pages_records_filled_postgres() {
    let app = one_second_partitions(|_| {}).await;
    let conn = app.db.clone();
    // 20,000 records in a partition of long ago, made as the store makes one, which no
    // vacuum visits.
    let (lower, upper) = (86_400_000_000i64, 2 * 86_400_000_000i64);
    let leaf = format!("records_{lower}_{upper}");
    for sql in [
        format!("CREATE TABLE {leaf} (LIKE records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"),
        format!("CREATE INDEX {leaf}_stored_time_idx ON {leaf} USING brin (stored_time) WITH (autosummarize = off)"),
        format!("ALTER TABLE {leaf} SET (autovacuum_enabled = false)"),
        format!("ALTER TABLE records ATTACH PARTITION {leaf} FOR VALUES FROM ({lower}) TO ({upper})"),
        format!(
            "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, received_time, commit_txid, seq, stored_time) \
             SELECT 'r-' || g, 'alice', 'b-alice', 'user', 'weather', 'storm.warning', '{{\"n\": ' || g || '}}', 'inbox', {lower} + g::bigint * 500000, 0, g, {lower} + g::bigint * 500000 \
             FROM generate_series(1, 20000) AS g"
        ),
    ] {
        conn.execute_unprepared(&sql).await.expect(&sql);
    }
    let pages = scalar(
        &conn,
        &format!("SELECT (pg_relation_size('{leaf}') / 8192)::bigint"),
    )
    .await;
    assert!(pages > 256, "{pages} pages");
    // A plan by the index alone, for rows below every one: pages of a range not summarized
    // are read (lossy); a summarized range is skipped.
    let lossy = || {
        let (conn, leaf) = (&conn, &leaf);
        async move {
            use sea_orm::TransactionTrait;
            let txn = conn.begin().await.expect("begin");
            txn.execute_unprepared("SET LOCAL enable_seqscan = off")
                .await
                .expect("set");
            let plan = txn
                .query_all_raw(Statement::from_string(
                    txn.get_database_backend(),
                    format!(
                        "EXPLAIN (ANALYZE, COSTS OFF) SELECT count(*) FROM {leaf} WHERE stored_time < {}",
                        lower + 1
                    ),
                ))
                .await
                .expect("explain")
                .iter()
                .map(|r| r.try_get_by_index::<String>(0).expect("a line"))
                .collect::<Vec<_>>()
                .join("\n");
            txn.commit().await.expect("commit");
            assert!(plan.contains("Bitmap Index Scan"), "{plan}");
            plan.contains("lossy=")
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while lossy().await {
        assert!(
            Instant::now() < deadline,
            "the ranges the records filled were never summarized"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Ledger rows a drop left (a process stopped between its drop and its sweep): the next
/// process sweeps them in its first pass, reading the ledger in page ranges, and keeps every
/// row above the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_pass_after_a_start_sweeps_what_a_drop_left_postgres() {
    use crate::support::served::Served;
    let db = TestDb::create(StoreKind::Postgres).await;
    drop(Served::start(&db.url, &["--prune-interval-secs", "3600"]));
    let conn = db.connect().await;
    for sql in [
        // 50,000 rows of records dropped (several sweep statements' worth of pages), then
        // 10 of records kept.
        "INSERT INTO record_triggers (pack_id, producer_trigger_id, record_id, stored_time) \
         SELECT 'weather', 'gone-' || g, 'r-gone-' || g, g FROM generate_series(1, 50000) AS g",
        "INSERT INTO record_triggers (pack_id, producer_trigger_id, record_id, stored_time) \
         SELECT 'weather', 'kept-' || g, 'r-kept-' || g, 200000 + g FROM generate_series(1, 10) AS g",
        "UPDATE record_floor SET floor_time = 100000",
    ] {
        conn.execute_unprepared(sql).await.expect(sql);
    }
    let pages = scalar(
        &conn,
        "SELECT (pg_relation_size('record_triggers') / current_setting('block_size')::bigint)::bigint",
    )
    .await;
    assert!(
        pages > hcp_sense::service::retention::LEDGER_SWEEP_PAGES,
        "{pages} pages"
    );
    let _served = Served::start(&db.url, &["--prune-interval-secs", "1"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let count = "SELECT count(*)::bigint FROM record_triggers";
    while scalar(&conn, count).await > 10 {
        assert!(Instant::now() < deadline, "the ledger was not swept");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        scalar(
            &conn,
            "SELECT count(*)::bigint FROM record_triggers WHERE producer_trigger_id LIKE 'kept-%'"
        )
        .await,
        10
    );
}
