//! The scale phase (PostgreSQL): records across 30 daily partitions, seeded through the bulk path; a retention pass that drops 9 of them under load, ListRecords pages, the trigger-id lookup against the unpartitioned table's, and the keyed insert's CPU.
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use serde_json::json;

use crate::load::{closed, Load, Phase, Population};
use crate::records::{list_page_latency, page_down};
use crate::report::{header, result, row};
use crate::seed::prepare;
use crate::server::Server;
use crate::{bin, cpu, Options};

const DAY: i64 = 86_400_000_000;
/// Days of records seeded, one partition each.
const DAYS: i64 = 30;
/// The oldest days retention expires in the measured pass.
const EXPIRED_DAYS: i64 = 9;

async fn scalar(db: &DatabaseConnection, sql: &str) -> anyhow::Result<i64> {
    let row = db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await?
        .ok_or_else(|| anyhow::anyhow!("no row: {sql}"))?;
    Ok(row.try_get_by_index::<i64>(0)?)
}

/// `n` records over the DAYS days before today (UTC, the database's clock), one partition a
/// day, a tenth of them with a trigger id in the ledger; and an unpartitioned copy with the
/// unique index the table had before partitions, for the lookup's comparison.
async fn seed(db: &DatabaseConnection, o: &Options, n: usize) -> anyhow::Result<i64> {
    let today = scalar(
        db,
        &format!(
            "SELECT (div((extract(epoch FROM clock_timestamp()) * 1000000)::bigint, {DAY}) * {DAY})::bigint"
        ),
    )
    .await?;
    let per_day = (n as i64 / DAYS).max(1);
    let (principals, packs) = (o.principals.max(1), o.packs.max(1));
    for d in 1..=DAYS {
        let lower = today - d * DAY;
        let name = format!("records_{lower}_{}", lower + DAY);
        db.execute_unprepared(&format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF records FOR VALUES FROM ({lower}) TO ({})",
            lower + DAY
        ))
        .await?;
        let step = DAY / per_day;
        let seq0 = (DAYS - d) * per_day;
        db.execute_unprepared(&format!(
            "INSERT INTO {name} (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, \
                 producer_trigger_id, received_time, commit_txid, seq, stored_time) \
             SELECT 'seed-{d}-' || g, 'principal-' || (g % {principals}), 'b-principal-' || (g % {principals}), 'user', \
                    'pack-' || ((g % {principals}) % {packs}), 'issue.opened', '{{\"issue\":' || g || '}}', 'inbox', NULL, \
                    CASE WHEN g % 10 = 0 THEN 'seed-{d}-' || g END, {lower} + g * {step}, 0, {seq0} + g + 1, {lower} + g * {step} \
             FROM generate_series(0::bigint, {per_day} - 1) AS g"
        ))
        .await?;
        db.execute_unprepared(&format!(
            "INSERT INTO record_triggers (pack_id, producer_trigger_id, record_id, stored_time) \
             SELECT pack_id, producer_trigger_id, record_id, stored_time FROM {name} WHERE producer_trigger_id IS NOT NULL"
        ))
        .await?;
    }
    db.execute_unprepared(
        "SELECT setval('records_seq', (SELECT max(seq) + 1 FROM records), false)",
    )
    .await?;
    // One statement a call: VACUUM cannot run in the implicit transaction of several.
    for sql in [
        "CREATE TABLE records_flat AS SELECT record_id, principal, binding_id, land, pack_id, ref, payload, route, \
             project, producer_trigger_id, received_time, commit_txid, seq FROM records",
        "CREATE UNIQUE INDEX ON records_flat (pack_id, producer_trigger_id)",
        "VACUUM ANALYZE records",
        "VACUUM ANALYZE record_triggers",
        "VACUUM ANALYZE records_flat",
    ] {
        db.execute_unprepared(sql).await?;
    }
    Ok(today)
}

/// Microseconds of `lookups` prepared lookups of trigger ids, each (pack, id) from `key`.
async fn lookups(
    db: &DatabaseConnection,
    sql: &str,
    then: Option<&str>,
    lookups: usize,
    key: impl Fn(usize) -> (String, String),
) -> anyhow::Result<Vec<u64>> {
    let mut lat = Vec::with_capacity(lookups);
    for i in 0..lookups {
        let (pack, id) = key(i);
        let t = Instant::now();
        let found = db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                sql,
                [pack.into(), id.into()],
            ))
            .await?;
        if let (Some(then), Some(row)) = (then, found) {
            let record_id: String = row.try_get("", "record_id")?;
            let stored_time: i64 = row.try_get("", "stored_time")?;
            db.query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                then,
                [record_id.into(), stored_time.into()],
            ))
            .await?;
        }
        lat.push(t.elapsed().as_micros() as u64);
    }
    lat.sort_unstable();
    Ok(lat)
}

fn pct(lat: &[u64], q: f64) -> f64 {
    lat.get(((lat.len() as f64 - 1.0) * q) as usize)
        .copied()
        .unwrap_or(0) as f64
}

fn mean(lat: &[u64]) -> f64 {
    lat.iter().sum::<u64>() as f64 / lat.len().max(1) as f64
}

/// The lookup of a trigger id, partitioned (through the ledger) against the unpartitioned
/// table's unique index, missing ids (a dropped trigger's lookup) and present ones.
async fn lookup_cost(db: &DatabaseConnection, o: &Options) -> anyhow::Result<()> {
    const FLAT: &str = "SELECT * FROM records_flat WHERE pack_id = $1 AND producer_trigger_id = $2";
    // As the server reads it: the ledger's key, then the one partition it names.
    const LEDGER: &str = "SELECT record_id, stored_time FROM record_triggers \
         WHERE pack_id = $1 AND producer_trigger_id = $2";
    const RECORD: &str = "SELECT * FROM records WHERE record_id = $1 AND stored_time = $2";
    let packs = o.packs.max(1);
    let principals = o.principals.max(1);
    let missing = |i: usize| (format!("pack-{}", i % packs), format!("never-{i}"));
    let present = |i: usize| {
        let d = 1 + (i as i64 * 7) % DAYS;
        let g = (i * 7919 % 30_000) * 10;
        (
            format!("pack-{}", (g % principals) % packs),
            format!("seed-{d}-{g}"),
        )
    };
    println!("trigger-id lookups, 3 rounds of 2,000 each, µs (mean / p99):");
    for round in 0..3 {
        for (what, key) in [
            ("missing", &missing as &dyn Fn(usize) -> (String, String)),
            ("present", &present),
        ] {
            let flat = lookups(db, FLAT, None, 2000, key).await?;
            let ledger = lookups(db, LEDGER, Some(RECORD), 2000, key).await?;
            println!(
                "  round {round} {what:<8} unpartitioned {:>6.0} / {:>6.0}   partitioned via ledger {:>6.0} / {:>6.0}   ratio {:.2}",
                mean(&flat),
                pct(&flat, 0.99),
                mean(&ledger),
                pct(&ledger, 0.99),
                mean(&ledger) / mean(&flat)
            );
            result(json!({
                "phase": "scale lookup", "round": round, "keys": what,
                "flat_mean_us": mean(&flat), "flat_p99_us": pct(&flat, 0.99),
                "ledger_mean_us": mean(&ledger), "ledger_p99_us": pct(&ledger, 0.99),
            }));
        }
    }
    Ok(())
}

/// The partitions attached to `records`.
const ATTACHED: &str =
    "SELECT count(*)::bigint FROM pg_inherits WHERE inhparent = 'records'::regclass";

/// When the retention pass ran, seen from outside: from the floor's first move to the last
/// expired partition gone.
/// `before` is the partitions counted before the server started: on a loaded machine the pass
/// (16 s after the start) may have run before this watch begins.
async fn watch_pass(url: String, before: i64, expect: i64) -> anyhow::Result<(Duration, Duration)> {
    let db = sea_orm::Database::connect(url).await?;
    let start = Instant::now();
    let mut began = None;
    loop {
        if start.elapsed() > Duration::from_secs(120) {
            let now = scalar(&db, ATTACHED).await?;
            anyhow::bail!(
                "the retention pass did not drop {expect} partitions in 120 s: {} of {before} \
                 attached, floor {}; {}",
                now,
                scalar(&db, "SELECT floor_time FROM record_floor").await?,
                stuck(&db).await?
            );
        }
        if began.is_none() && scalar(&db, "SELECT floor_time FROM record_floor").await? > 0 {
            began = Some(start.elapsed());
        }
        if before - scalar(&db, ATTACHED).await? >= expect {
            let began = began.unwrap_or_default();
            return Ok((began, start.elapsed() - began));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// What a stalled pass leaves to read: partitions whose detach is pending, and the
/// database's sessions that are not idle, with what each waits on.
async fn stuck(db: &DatabaseConnection) -> anyhow::Result<String> {
    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT format('%s detach pending', count(*)) AS s FROM pg_inherits \
               WHERE inhparent = 'records'::regclass AND inhdetachpending \
             UNION ALL \
             SELECT format('%s %s/%s %ss: %s', state, wait_event_type, wait_event, \
                    round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1), \
                    left(query, 100)) FROM pg_stat_activity \
               WHERE datname = current_database() AND pid <> pg_backend_pid() \
                 AND state <> 'idle'",
        ))
        .await?;
    Ok(rows
        .iter()
        .filter_map(|r| r.try_get_by_index::<String>(0).ok())
        .collect::<Vec<_>>()
        .join("; "))
}

/// A recorded phase with CPU per call of the server and of PostgreSQL.
async fn recorded(
    server: &Server,
    chs: &[tonic::transport::Channel],
    o: &Options,
    secs: u64,
    load: Load,
) -> (Phase, cpu::Cpu) {
    let before = cpu::sample(server.pid());
    let p = closed(
        chs,
        Duration::from_secs(secs),
        o.first(),
        o.population(o.principals),
        load,
    )
    .await;
    let c = before.per_call(&cpu::sample(server.pid()), p.calls);
    (p, c)
}

pub async fn scale_phase(o: &Options, n: usize) -> anyhow::Result<()> {
    println!("scale (postgres): {n} records over {DAYS} daily partitions");
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "postgres", "scale", pop, &[]).await?;
    seeded.stop();
    let conn = db.connect().await?;
    let t0 = Instant::now();
    let today = seed(&conn, o, n).await?;
    println!(
        "postgres  seeded {n} records (and an unpartitioned copy) through the bulk path in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    lookup_cost(&conn, o).await?;
    let (base, without) = without_retention(o, &db.url, pop).await?;
    let cutoff = today - (DAYS - EXPIRED_DAYS) * DAY;
    let pass = with_retention(o, &db.url, &conn, cutoff, &base).await?;
    report_pass(&conn, n, cutoff, &pass, &without).await?;
    let _ = conn.close().await;
    db.drop_db().await;
    println!();
    Ok(())
}

/// Without retention: the baseline and the recorded phases the pass is compared with, the
/// ListRecords pages and the dropped phases; answers the baseline and the recorded rates.
async fn without_retention(
    o: &Options,
    url: &str,
    pop: Population,
) -> anyhow::Result<(Phase, Vec<f64>)> {
    let server = Server::start(bin(o), url, &[])?;
    let chs = server.channels(o.channels).await?;
    header();
    let base = closed(&chs, o.duration(), o.first(), pop, Load::Noop).await;
    row("postgres", "baseline (no-op)", &base, None);
    let mut without = Vec::new();
    for _ in 0..2 {
        let (p, c) = recorded(&server, &chs, o, 8, Load::RecordedKeyed).await;
        row("postgres", "recorded, keyed", &p, Some(&base));
        println!(
            "          CPU per recorded call: server {:.0} µs, PostgreSQL {:.0} µs",
            c.server, c.postgres
        );
        without.push(p.rate());
    }
    let deep = page_down(&chs[0], 1000, 1000).await?;
    for (name, token) in [("first page", String::new()), ("page 1,000,001", deep)] {
        let p = list_page_latency(&chs[0], &token).await;
        row("postgres", &format!("ListRecords {name}"), &p, None);
    }
    let dropped = closed(&chs, o.duration(), o.first(), pop, Load::Dropped).await;
    row("postgres", "dropped, no trigger id", &dropped, Some(&base));
    let dropped_keyed = closed(&chs, o.duration(), o.first(), pop, Load::DroppedKeyed).await;
    row(
        "postgres",
        "dropped, trigger id looked up",
        &dropped_keyed,
        Some(&base),
    );
    server.stop();
    Ok((base, without))
}

/// What the phase with retention measured of its pass.
struct Pass {
    /// Records stored before the cutoff when the server started.
    expired: i64,
    same_before: Phase,
    during: Phase,
    began: Duration,
    took: Duration,
    /// Autovacuum and autoanalyze runs before the pass's phase.
    vacuums_before: i64,
}

const VACUUMS: &str = "SELECT (coalesce(sum(autovacuum_count), 0) + coalesce(sum(autoanalyze_count), 0))::bigint FROM pg_stat_user_tables";

/// With retention: the age puts the cutoff at the start of the 21st day back, so the 9 days
/// before it expire whole (the partition after the cutoff is trimmed of the few records
/// stored in the seconds between this start and the pass).
async fn with_retention(
    o: &Options,
    url: &str,
    conn: &DatabaseConnection,
    cutoff: i64,
    base: &Phase,
) -> anyhow::Result<Pass> {
    let now = scalar(
        conn,
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
    )
    .await?;
    let age_secs = (now - cutoff) / 1_000_000;
    let attached = scalar(conn, ATTACHED).await?;
    let expired = scalar(
        conn,
        &format!("SELECT count(*)::bigint FROM records WHERE stored_time < {cutoff}"),
    )
    .await?;
    let age = age_secs.to_string();
    let server = Server::start(
        bin(o),
        url,
        &[
            "--record-retention-secs",
            &age,
            "--prune-interval-secs",
            "16",
        ],
    )?;
    let chs = server.channels(o.channels).await?;
    // Warmed up as the phases without it were (by the baseline before them), then measured
    // on this same server before its first pass (16 s after its start), which begins about
    // 5 s into the phase after.
    let _ = recorded(&server, &chs, o, 2, Load::RecordedKeyed).await;
    let (same_before, _) = recorded(&server, &chs, o, 8, Load::RecordedKeyed).await;
    row(
        "postgres",
        "recorded, keyed, before the pass",
        &same_before,
        Some(base),
    );
    let vacuums_before = scalar(conn, VACUUMS).await?;
    let watcher = tokio::spawn(watch_pass(url.to_owned(), attached, EXPIRED_DAYS));
    let (during, c) = recorded(&server, &chs, o, 10, Load::RecordedKeyed).await;
    row(
        "postgres",
        "recorded, keyed, pass under way",
        &during,
        Some(base),
    );
    println!(
        "          CPU per recorded call: server {:.0} µs, PostgreSQL {:.0} µs",
        c.server, c.postgres
    );
    let (began, took) = watcher.await??;
    let (after, _) = recorded(&server, &chs, o, 8, Load::RecordedKeyed).await;
    row(
        "postgres",
        "recorded, keyed, after the pass",
        &after,
        Some(base),
    );
    server.stop();
    Ok(Pass {
        expired,
        same_before,
        during,
        began,
        took,
        vacuums_before,
    })
}

/// What the pass left behind, and its line and result.
async fn report_pass(
    conn: &DatabaseConnection,
    n: usize,
    cutoff: i64,
    pass: &Pass,
    without: &[f64],
) -> anyhow::Result<()> {
    let Pass {
        expired,
        same_before,
        during,
        began,
        took,
        vacuums_before,
    } = pass;
    let left = scalar(
        conn,
        &format!("SELECT count(*)::bigint FROM records WHERE stored_time < {cutoff}"),
    )
    .await?;
    let ledger_left = scalar(
        conn,
        "SELECT count(*)::bigint FROM record_triggers WHERE stored_time < (SELECT floor_time FROM record_floor)",
    )
    .await?;
    let vacuums_during = scalar(conn, VACUUMS).await? - vacuums_before;
    let without_mean = without.iter().sum::<f64>() / without.len() as f64;
    println!(
        "retention pass: {EXPIRED_DAYS} partitions, {expired} records, began {:.1} s into the phase, took {:.2} s \
         ({} statements: 4 a partition); {left} expired records left; {ledger_left} ledger rows of theirs left to sweep; \
         recorded during the pass / on the same server before it: {:.3}; / the first server's phases: {:.3}; \
         autovacuum and autoanalyze runs from the pass's phase on: {vacuums_during}",
        began.as_secs_f64(),
        took.as_secs_f64(),
        4 * EXPIRED_DAYS,
        during.rate() / same_before.rate(),
        during.rate() / without_mean
    );
    result(json!({
        "phase": "scale retention", "records": n, "expired": expired, "expired_left": left,
        "partitions_dropped": EXPIRED_DAYS, "pass_secs": took.as_secs_f64(),
        "recorded_during_over_without": during.rate() / same_before.rate(),
        "recorded_during_over_first_server": during.rate() / without_mean,
        "ledger_rows_left": ledger_left,
    }));
    Ok(())
}
