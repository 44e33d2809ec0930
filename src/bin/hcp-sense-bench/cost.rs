//! The cost phase: CPU per call at a steady offered rate (open loop, --cost-rate a second), read from /proc for the server and for PostgreSQL's processes: Health/Check (the transport's floor), the benchmark's no-op DeliverTrigger (the same request decoded and answered without a decision: the floor of this message), recorded without and with trigger ids, the same trigger id every call (duplicates), dropped (an undeclared ref), and dropped with a new trigger id each call (a principal without a grant: idempotency comes first, so its id is looked up); beside the store's own floor in the same run: on PostgreSQL a prepared single-row insert transaction and a primary-key select run by the benchmark on the same PostgreSQL, on SQLite a prepared single-row insert, each its own durable transaction, on a file of its own.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tonic::transport::Channel;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

use crate::load::{noop, trigger, Load, Population};
use crate::pb::bench_service_client::BenchServiceClient;
use crate::pb::ingest_service_client::IngestServiceClient;
use crate::pb::DeliverTriggerRequest;
use crate::report::result;
use crate::seed::prepare;
use crate::{cpu, Options};

/// What one call of a phase is.
#[derive(Clone, Copy, PartialEq)]
enum Call {
    Health,
    Noop,
    Recorded,
    RecordedKeyed,
    Duplicate,
    DroppedUndeclared,
    DroppedKeyed,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Health => "Health/Check (the transport's floor)",
            Call::Noop => "no-op DeliverTrigger (the message's floor)",
            Call::Recorded => "recorded, no trigger id",
            Call::RecordedKeyed => "recorded, a new trigger id each call",
            Call::Duplicate => "the same trigger id every call",
            Call::DroppedUndeclared => "dropped (undeclared ref)",
            Call::DroppedKeyed => {
                "dropped, a new trigger id each call (no grant; its id looked up)"
            }
        }
    }

    fn request(self, i: usize, pop: Population, run: u128) -> DeliverTriggerRequest {
        match self {
            Call::Recorded | Call::Health | Call::Noop => trigger(i, pop, Load::Recorded),
            Call::RecordedKeyed => trigger(i, pop, Load::RecordedKeyed),
            Call::Duplicate => {
                let mut t = trigger(0, pop, Load::Recorded);
                t.trigger_id = format!("dup-{run:x}");
                t
            }
            Call::DroppedUndeclared => {
                let mut t = trigger(i, pop, Load::Recorded);
                t.r#ref = "undeclared.ref".into();
                t
            }
            // What a webhook or NATS message sends that policy drops: idempotency comes first,
            // so its id is looked up before it is answered.
            Call::DroppedKeyed => trigger(i, pop, Load::DroppedKeyed),
        }
    }
}

/// One phase's measure.
struct Measured {
    calls: usize,
    errors: usize,
    cpu: cpu::Cpu,
    p50_ms: f64,
    p99_ms: f64,
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// Offers `rate` calls a second for `secs` seconds, each started on its schedule whatever the
/// others do (open loop), and reads the CPU the processes used meanwhile.
async fn offered<F, Fut>(server_pid: u32, rate: f64, secs: f64, call: F) -> Measured
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let total = (rate * secs) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let errors = Arc::new(AtomicUsize::new(0));
    let before = cpu::sample(server_pid);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        tokio::time::sleep_until((start + gap.mul_f64(i as f64)).into()).await;
        let fut = call(i);
        let errors = errors.clone();
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            if !fut.await {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            t0.elapsed()
        }));
    }
    let mut took = Vec::with_capacity(total);
    for t in tasks {
        if let Ok(d) = t.await {
            took.push(d);
        }
    }
    let cpu = before.per_call(&cpu::sample(server_pid), total);
    took.sort();
    Measured {
        calls: total,
        errors: errors.load(Ordering::Relaxed),
        cpu,
        p50_ms: pct(&took, 0.5),
        p99_ms: pct(&took, 0.99),
    }
}

/// The floors a call's server CPU is read against: Health/Check's and the no-op's.
#[derive(Clone, Copy, Default)]
struct Floors {
    health: Option<f64>,
    noop: Option<f64>,
}

fn report(kind: &str, name: &str, m: &Measured, floor: Floors, pg: bool) {
    let ratio = match (floor.health, floor.noop) {
        (Some(h), Some(n)) => format!(
            "  ({:.1}x Health, {:.1}x no-op)",
            m.cpu.server / h,
            m.cpu.server / n
        ),
        (Some(h), None) => format!("  ({:.1}x Health)", m.cpu.server / h),
        _ => String::new(),
    };
    let pg_part = if pg {
        format!(", PostgreSQL {:>5.0} us", m.cpu.postgres)
    } else {
        String::new()
    };
    println!(
        "{kind:<9} cost {name:<40} server {:>5.0} us{pg_part}, client {:>4.0} us per call{ratio}; p50 {:.2} ms p99 {:.2} ms; {} calls, {} errors",
        m.cpu.server, m.cpu.client, m.p50_ms, m.p99_ms, m.calls, m.errors
    );
    result(serde_json::json!({
        "phase": "cost", "store": kind, "call": name, "calls": m.calls, "errors": m.errors,
        "server_us": m.cpu.server, "postgres_us": m.cpu.postgres, "client_us": m.cpu.client,
        "p50_ms": m.p50_ms, "p99_ms": m.p99_ms,
    }));
}

/// CPU per call of each kind of call at `o.cost_rate`, on one store.
pub async fn cost_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let rate = o.cost_rate;
    let secs = o.duration().as_secs_f64();
    println!("cost ({kind}): CPU per call at {rate:.0} calls/s offered, {secs:.0} s each");
    let (db, server) = prepare(o, kind, "cost", pop, &[]).await?;
    let chs: Vec<Channel> = server.channels(o.channels).await?;
    let pid = server.pid();
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    let pg = kind == "postgres";
    let mut floor = Floors::default();
    for call in [
        Call::Health,
        Call::Noop,
        Call::Recorded,
        Call::RecordedKeyed,
        Call::Duplicate,
        Call::DroppedUndeclared,
        Call::DroppedKeyed,
    ] {
        let chs = chs.clone();
        let m = offered(pid, rate, secs, move |i| {
            let ch = chs[i % chs.len()].clone();
            let req = call.request(i, pop, run);
            async move {
                if call == Call::Health {
                    HealthClient::new(ch)
                        .check(HealthCheckRequest::default())
                        .await
                        .is_ok()
                } else if call == Call::Noop {
                    BenchServiceClient::new(ch)
                        .deliver_trigger_noop(noop(req))
                        .await
                        .is_ok()
                } else {
                    IngestServiceClient::new(ch)
                        .deliver_trigger(req)
                        .await
                        .is_ok()
                }
            }
        })
        .await;
        // A floor is known once its own call has run: Health is read against none, the no-op
        // against Health alone.
        report(kind, call.name(), &m, floor, pg);
        match call {
            Call::Health => floor.health = Some(m.cpu.server.max(f64::MIN_POSITIVE)),
            Call::Noop => floor.noop = Some(m.cpu.server.max(f64::MIN_POSITIVE)),
            _ => {}
        }
    }
    if pg {
        plain_postgres(&db.connect().await?, pid, rate, secs, kind).await?;
    } else {
        // On a thread of its own, whose CPU is the floor.
        let m = tokio::task::spawn_blocking(move || plain_sqlite(rate, secs)).await??;
        report(
            kind,
            "prepared single-row insert (SQLite alone)",
            &m,
            Floors::default(),
            false,
        );
    }
    server.stop();
    db.drop_db().await;
    println!();
    Ok(())
}

/// PostgreSQL's own floor in the same run: a prepared single-row insert, each its own
/// transaction, and a primary-key select, at the same offered rate over a small pool.
async fn plain_postgres(
    db: &DatabaseConnection,
    pid: u32,
    rate: f64,
    secs: f64,
    kind: &str,
) -> anyhow::Result<()> {
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS bench_cost_probe (id bigint PRIMARY KEY, v text NOT NULL)",
    )
    .await?;
    let db = Arc::new(db.clone());
    let m = offered(pid, rate, secs, {
        let db = db.clone();
        move |i| {
            let db = db.clone();
            async move {
                db.execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "INSERT INTO bench_cost_probe (id, v) VALUES ($1, $2)",
                    [(i as i64).into(), "benchmark".into()],
                ))
                .await
                .is_ok()
            }
        }
    })
    .await;
    report(
        kind,
        "prepared single-row insert (PostgreSQL alone)",
        &m,
        Floors::default(),
        true,
    );
    let inserted = m.calls.max(1) as i64;
    let m = offered(pid, rate, secs, move |i| {
        let db = db.clone();
        async move {
            db.query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT v FROM bench_cost_probe WHERE id = $1",
                [((i as i64) % inserted).into()],
            ))
            .await
            .is_ok_and(|r| r.is_some())
        }
    })
    .await;
    report(
        kind,
        "prepared primary-key select (PostgreSQL alone)",
        &m,
        Floors::default(),
        true,
    );
    Ok(())
}

/// CPU seconds of the calling thread (utime + stime), from /proc/thread-self.
fn thread_seconds() -> f64 {
    std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|s| cpu::seconds(&s))
        .unwrap_or(0.0)
}

/// SQLite's own floor in the same run: a prepared single-row insert, each its own durable
/// transaction with the server's settings (WAL, synchronous = FULL), at the same offered rate,
/// on the calling thread, whose CPU is the floor: what one commit costs the process that makes
/// it, before any request, decision or answer.
fn plain_sqlite(rate: f64, secs: f64) -> anyhow::Result<Measured> {
    let dir = std::env::temp_dir().join(format!("hcp_sense_bench_{}_floor", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let measured = sqlite_inserts(&dir.join("floor.db"), rate, secs);
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

fn sqlite_inserts(path: &std::path::Path, rate: f64, secs: f64) -> anyhow::Result<Measured> {
    let conn = rusqlite::Connection::open(path)?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
         CREATE TABLE bench_cost_probe (id INTEGER PRIMARY KEY, v TEXT NOT NULL);",
    )?;
    let total = (rate * secs) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut took = Vec::with_capacity(total);
    let mut errors = 0;
    let before = thread_seconds();
    let start = Instant::now();
    for i in 0..total {
        if let Some(wait) = (start + gap.mul_f64(i as f64)).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let t0 = Instant::now();
        let done = conn.execute_batch("BEGIN IMMEDIATE").and_then(|()| {
            conn.prepare_cached("INSERT INTO bench_cost_probe (id, v) VALUES (?1, ?2)")?
                .execute(rusqlite::params![i as i64, "benchmark"])?;
            conn.execute_batch("COMMIT")
        });
        if done.is_err() {
            errors += 1;
        }
        took.push(t0.elapsed());
    }
    let used = thread_seconds() - before;
    took.sort();
    Ok(Measured {
        calls: total,
        errors,
        cpu: cpu::Cpu {
            server: 0.0,
            postgres: 0.0,
            client: used * 1e6 / total.max(1) as f64,
        },
        p50_ms: pct(&took, 0.5),
        p99_ms: pct(&took, 0.99),
    })
}
