//! The writers phase (PostgreSQL): recorded throughput for each sink writer count of `--writers-compare`, through a proxy that delays every round trip as a network would.
use std::time::Duration;

use serde_json::json;

use crate::load::{closed, Load};
use crate::report::{header, result, row};
use crate::seed::prepare;
use crate::server::Server;
use crate::{bin, proxy, Options};

/// Recorded throughput at 256 callers (or the sweep's largest below that) for each sink writer
/// count, on PostgreSQL reached through a proxy that delays every round trip, as a network
/// between them would.
pub async fn writers_compare(o: &Options) -> anyhow::Result<()> {
    let c = o
        .concurrency
        .iter()
        .copied()
        .filter(|c| *c <= 256)
        .max()
        .unwrap_or(256)
        .max(1);
    println!(
        "sink writers (postgres through a proxy adding {} ms per round trip), C={c}",
        o.postgres_delay_ms
    );
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "postgres", "writers", pop, &[]).await?;
    seeded.stop();
    header();
    let (head, rest) = db
        .url
        .split_once('@')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no user"))?;
    let (upstream, tail) = rest
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no database"))?;
    let proxy = proxy::delay_proxy(
        upstream.to_owned(),
        Duration::from_secs_f64(o.postgres_delay_ms / 1000.0),
    )
    .await?;
    let url = format!("{head}@{proxy}/{tail}");
    let mut rates = Vec::new();
    for &w in &o.writers_compare {
        let n = w.to_string();
        let server = Server::start(bin(o), &url, &["--sink-writers", &n])?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), c, pop, Load::Recorded).await;
        row("postgres", &format!("recorded, {w} writers"), &rec, None);
        rates.push((w, rec.rate()));
        server.stop();
    }
    if let (Some(lo), Some(hi)) = (rates.first(), rates.last()) {
        println!(
            "{} writers / {} writer(s): {:.2}\n",
            hi.0,
            lo.0,
            hi.1 / lo.1
        );
        result(
            json!({ "phase": "writers compare", "delay_ms": o.postgres_delay_ms, "concurrency": c, "rates": rates }),
        );
    }
    db.drop_db().await;
    Ok(())
}
