//! The watch phase: how long after its acknowledgement a record reaches a watcher, at a fixed delivery rate, and what idle watchers cost the server in memory.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tonic::transport::Channel;

use crate::load::{trigger, Load, Population};
use crate::pb::{
    ingest_service_client::IngestServiceClient, record_service_client::RecordServiceClient,
    watch_records_request::Start, WatchRecordsRequest,
};
use crate::report::result;
use crate::seed::prepare;
use crate::server::Server;
use crate::Options;

fn from_now() -> WatchRecordsRequest {
    WatchRecordsRequest {
        start: Some(Start::FromNow(true)),
        ..Default::default()
    }
}

/// Ack-to-watcher latencies in microseconds (sorted), and how many acknowledged records the
/// watcher had not received 5 s after the last acknowledgement.
pub async fn latency(
    chs: &[Channel],
    duration: Duration,
    pop: Population,
    rate: f64,
) -> anyhow::Result<(Vec<u64>, usize)> {
    let arrived: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut stream = RecordServiceClient::new(chs[0].clone())
        .watch_records(from_now())
        .await?
        .into_inner();
    let reader = tokio::spawn({
        let arrived = arrived.clone();
        async move {
            while let Ok(Some(m)) = stream.message().await {
                let now = Instant::now();
                let mut a = arrived
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for r in m.records {
                    a.insert(r.record_id, now);
                }
            }
        }
    });
    let start = Instant::now();
    let total = (rate * duration.as_secs_f64()) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut calls = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + gap.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let ch = chs[i % chs.len()].clone();
        calls.push(tokio::spawn(async move {
            let r = IngestServiceClient::new(ch)
                .deliver_trigger(trigger(i, pop, Load::Recorded))
                .await
                .ok()?;
            Some((r.into_inner().record_id, Instant::now()))
        }));
    }
    let mut acked = Vec::with_capacity(total);
    for c in calls {
        if let Ok(Some(a)) = c.await {
            acked.push(a);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let have = {
            let a = arrived
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            acked.iter().filter(|(id, _)| a.contains_key(id)).count()
        };
        if have == acked.len() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reader.abort();
    let a = arrived
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut lat: Vec<u64> = acked
        .iter()
        .filter_map(|(id, at)| {
            a.get(id)
                .map(|got| got.saturating_duration_since(*at).as_micros() as u64)
        })
        .collect();
    lat.sort_unstable();
    let missing = acked.len() - lat.len();
    Ok((lat, missing))
}

/// The server's resident memory with `n` idle watches open, over its memory before them, in
/// MiB; the watches are closed after.
pub async fn idle_rss(server: &Server, chs: &[Channel], n: usize) -> anyhow::Result<f64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, _) = server.rss_kib();
    let mut open = Vec::with_capacity(n);
    for i in 0..n {
        let stream = RecordServiceClient::new(chs[i % chs.len()].clone())
            .watch_records(from_now())
            .await?
            .into_inner();
        open.push(stream);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (after, _) = server.rss_kib();
    drop(open);
    Ok(after.saturating_sub(before) as f64 / 1024.0)
}

/// WatchRecords on one store: ack-to-watcher latency at a fixed rate, then idle watchers' memory.
pub async fn watch_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    // One peer (this benchmark) opens every idle watch: its cap is raised so the measure is
    // their cost, not the refusal.
    let room = (o.watch_idle + 16).to_string();
    let (db, server) = prepare(o, kind, "watch", pop, &["--max-streams-per-peer", &room]).await?;
    let chs = server.channels(o.channels).await?;
    for &rate in &o.watch_rate {
        let (lat, missing) = latency(&chs, o.duration(), pop, rate).await?;
        let pct = |q: f64| {
            lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
                .map_or(f64::NAN, |us| *us as f64 / 1000.0)
        };
        let (p50, p99) = (pct(0.5), pct(0.99));
        println!(
            "{kind:<9} watch: ack to watcher p50 {p50:.2} ms, p99 {p99:.2} ms at {rate:.0} recorded/s ({} records, {missing} not received)",
            lat.len(),
        );
        result(json!({
            "store": kind, "phase": "watch", "rate": rate, "records": lat.len(),
            "missing": missing, "p50_ms": p50, "p99_ms": p99,
        }));
    }
    let mib = idle_rss(&server, &chs, o.watch_idle).await?;
    println!(
        "{kind:<9} watch: {} idle watches: +{mib:.1} MiB RSS",
        o.watch_idle
    );
    result(json!({
        "store": kind, "phase": "idle watchers", "idle_watchers": o.watch_idle, "idle_rss_mib": mib,
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}
