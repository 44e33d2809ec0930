//! The sweep: the no-op and recorded phases at each concurrency on each store, with where the CPU went, the sink's batches and the store's own limit.
use std::time::Duration;

use serde_json::json;
use tonic::transport::Channel;

use crate::load::{closed, open, stream, Load, Phase, Population};
use crate::report::{header, result, row, Writer};
use crate::seed::{prepare, BenchDb};
use crate::server::Server;
use crate::{bin, cpu, seed, server, Options};

/// The server's threads that write records: the sink's writers and SQLite's worker threads
/// (names as the kernel keeps them, 15 bytes).
pub const SINK_THREADS: &[&str] = &["hcp-sense-sink", "sqlx-sqlite-wor"];

/// The store's own limit: the same rows inserted into the migrated schema from this process,
/// as microseconds and CPU microseconds per row.
pub async fn store_limit(o: &Options, kind: &str, pop: Population) -> anyhow::Result<(f64, f64)> {
    let db = BenchDb::create(kind, &o.postgres_url, "limit").await?;
    server::migrate(bin(o), &db.url)?;
    let conn = db.connect().await?;
    let cpu0 = (cpu::client(), cpu::postgres());
    let (rows, secs) = seed::store_limit(&conn, pop, o.duration()).await?;
    let cpu1 = (cpu::client(), cpu::postgres());
    let _ = conn.close().await;
    db.drop_db().await;
    // This process did nothing else meanwhile: its CPU and PostgreSQL's are the insert's.
    let cpu_us = ((cpu1.0 - cpu0.0) + (cpu1.1 - cpu0.1)) * 1e6 / rows.max(1) as f64;
    let rate = rows as f64 / secs;
    println!(
        "{kind:<9} store limit: {rate:.0} rows/s, {:.1} us per row, {cpu_us:.1} us CPU per row (multi-row INSERT of 256 with bound values, one per transaction)",
        1e6 / rate
    );
    result(
        json!({ "store": kind, "phase": "store limit", "rows_per_sec": rate, "us_per_row": 1e6 / rate, "cpu_us_per_row": cpu_us }),
    );
    Ok((1e6 / rate, cpu_us))
}

/// One concurrency of the sweep: the no-op and recorded phases at `c` callers, where the
/// CPU went, and the sink's batches; the two phases' results.
pub async fn sweep_point(
    o: &Options,
    kind: &str,
    server: &Server,
    chs: &[Channel],
    c: usize,
    limit: Option<(f64, f64)>,
) -> (Phase, Phase) {
    let pop = o.population(o.principals);
    let cpu0 = cpu::sample(server.pid());
    let base = closed(chs, o.duration(), c, pop, Load::Noop).await;
    let cpu1 = cpu::sample(server.pid());
    row(kind, &format!("baseline (no-op), C={c}"), &base, None);
    let before = server.scrape().await;
    let cpu2 = cpu::sample(server.pid());
    let sink0 = cpu::threads(server.pid(), SINK_THREADS);
    let load = if o.keyed {
        Load::RecordedKeyed
    } else {
        Load::Recorded
    };
    let rec = closed(chs, o.duration(), c, pop, load).await;
    let sink1 = cpu::threads(server.pid(), SINK_THREADS);
    let cpu3 = cpu::sample(server.pid());
    let after = server.scrape().await;
    row(kind, &format!("recorded, C={c}"), &rec, Some(&base));
    let (nb, nr) = (
        cpu0.per_call(&cpu1, base.calls),
        cpu2.per_call(&cpu3, rec.calls),
    );
    println!(
        "{kind:<9}   CPU us per call at C={c}: no-op server {:.1} client {:.1} postgres {:.1}; recorded server {:.1} client {:.1} postgres {:.1}",
        nb.server, nb.client, nb.postgres, nr.server, nr.client, nr.postgres
    );
    result(json!({
        "store": kind, "phase": "cpu", "concurrency": c,
        "noop_us_per_call": { "server": nb.server, "client": nb.client, "postgres": nb.postgres },
        "recorded_us_per_call": { "server": nr.server, "client": nr.client, "postgres": nr.postgres },
    }));
    let w = Writer::between(&before, &after);
    // The writer's CPU: its threads, SQLite's worker threads, and PostgreSQL's processes
    // (the server sends PostgreSQL nothing else while it delivers).
    let writer_cpu = ((sink1 - sink0) * 1e6 + nr.postgres * rec.calls as f64) / w.records.max(1.0);
    println!(
        "{kind:<9}   sink at C={c}: {:.0} records per batch, batch commit p99 {:.2} ms, writer {:.1} us per record{}, {writer_cpu:.1} us CPU per record{}",
        w.per_batch,
        w.commit_p99_ms,
        w.us_per_record,
        limit.map_or(String::new(), |(l, _)| format!(" ({:.2} x the raw insert's {l:.1} us)", w.us_per_record / l)),
        limit.map_or(String::new(), |(_, c)| format!(" ({:.2} x the raw insert's {c:.1} us)", writer_cpu / c)),
    );
    let bound = 2.0 * (w.commit_p99_ms + base.pct(0.99));
    println!(
        "{kind:<9}   p99 bound at C={c}: {bound:.2} ms (2 x (commit p99 + no-op p99)); recorded p99 {:.2} ms",
        rec.pct(0.99)
    );
    result(json!({
        "store": kind, "phase": "sink", "concurrency": c,
        "records_per_batch": w.per_batch, "commit_p99_ms": w.commit_p99_ms,
        "writer_us_per_record": w.us_per_record,
        "writer_over_raw_insert": limit.map(|(l, _)| w.us_per_record / l),
        "writer_cpu_us_per_record": writer_cpu,
        "writer_cpu_over_raw_insert": limit.map(|(_, c)| writer_cpu / c),
        "p99_bound_ms": bound,
    }));
    (base, rec)
}

/// The store limit, then no-op and recorded over the concurrency sweep, dropped, the open loop
/// at half the recorded rate, and the DeliverTriggers streams, on one store.
pub async fn sweep(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let limit = if o.store_limit {
        Some(store_limit(o, kind, pop).await?)
    } else {
        None
    };
    let writers = o.sink_writers.map(|n| n.to_string());
    let mut extra: Vec<&str> = Vec::new();
    if let Some(n) = &writers {
        extra.extend(["--sink-writers", n.as_str()]);
    }
    let (db, server) = prepare(o, kind, "deliver", pop, &extra).await?;
    header();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (idle_rss, _) = server.rss_kib();
    let chs = server.channels(o.channels).await?;
    let (mut peak_base, mut peak_rec) = (0f64, 0f64);
    for &c in &o.concurrency {
        let (base, rec) = sweep_point(o, kind, &server, &chs, c.max(1), limit).await;
        peak_base = peak_base.max(base.rate());
        peak_rec = peak_rec.max(rec.rate());
    }
    println!(
        "{kind:<9} peak recorded {peak_rec:.0}/s over peak no-op {peak_base:.0}/s: {:.2}",
        peak_rec / peak_base
    );
    result(
        json!({ "store": kind, "phase": "peak", "recorded_per_sec": peak_rec, "noop_per_sec": peak_base, "ratio": peak_rec / peak_base }),
    );
    let first = o.first();
    let dropped = closed(&chs, o.duration(), first, pop, Load::Dropped).await;
    row(kind, &format!("dropped, C={first}"), &dropped, None);
    let rec = closed(&chs, o.duration(), first, pop, Load::Recorded).await;
    let half = rec.rate() * 0.5;
    let base_half = open(&chs, o.duration(), pop, Load::Noop, half).await;
    row(kind, &format!("baseline @ {half:.0}/s"), &base_half, None);
    let rec_half = open(&chs, o.duration(), pop, Load::Recorded, half).await;
    row(
        kind,
        &format!("recorded @ {half:.0}/s"),
        &rec_half,
        Some(&base_half),
    );
    println!(
        "{kind:<9} p99 at half of the recorded rate: {:.2} x the baseline's p99",
        rec_half.pct(0.99) / base_half.pct(0.99)
    );
    if o.stream {
        let streamed = stream(&chs, o.duration(), pop, o.stream_in_flight).await;
        row(
            kind,
            &format!("DeliverTriggers, {} streams", chs.len()),
            &streamed,
            None,
        );
        if let Some((l, _)) = limit {
            println!(
                "{kind:<9} DeliverTriggers {:.0}/s over the raw insert's {:.0} rows/s: {:.2}",
                streamed.rate(),
                1e6 / l,
                streamed.rate() * l / 1e6
            );
            result(
                json!({ "store": kind, "phase": "stream over store limit", "ratio": streamed.rate() * l / 1e6 }),
            );
        }
    }
    let (_, peak) = server.rss_kib();
    println!(
        "{kind:<9} server RSS: idle {:.1} MiB, peak {:.1} MiB\n",
        idle_rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    server.stop();
    db.drop_db().await;
    Ok(())
}
