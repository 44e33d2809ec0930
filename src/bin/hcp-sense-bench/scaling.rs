//! The scaling phase (SQLite): deliveries and server memory at each principal count of `--scaling`.
use std::time::Duration;

use serde_json::json;

use crate::load::{closed, Load};
use crate::report::{header, result, row};
use crate::seed::prepare;
use crate::server::Server;
use crate::{bin, Options};

/// Deliveries and server memory at each principal count of --scaling (SQLite).
pub async fn scaling(o: &Options) -> anyhow::Result<()> {
    let counts: Vec<usize> = o.scaling.iter().copied().filter(|n| *n > 0).collect();
    if counts.is_empty() {
        return Ok(());
    }
    println!("principal scaling (sqlite): deliveries and server memory");
    let first = o.first();
    let mut rows = Vec::new();
    for &n in &counts {
        let pop = o.population(n);
        let (db, server) = prepare(o, "sqlite", &format!("scale{n}"), pop, &[]).await?;
        // The idle size of a server that loaded this policy at start.
        server.stop();
        let server = Server::start(bin(o), &db.url, &[])?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss, _) = server.rss_kib();
        header();
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), first, pop, Load::Recorded).await;
        row("sqlite", &format!("recorded, {n} principals"), &rec, None);
        let dropped = closed(&chs, o.duration(), first, pop, Load::Dropped).await;
        row(
            "sqlite",
            &format!("dropped, {n} principals"),
            &dropped,
            None,
        );
        rows.push((n, rss, rec.rate(), dropped.rate()));
        server.stop();
        db.drop_db().await;
    }
    if let (Some(lo), Some(hi)) = (rows.first(), rows.last()) {
        println!(
            "recorded at {} / at {} principals: {:.2}; dropped: {:.2}",
            hi.0,
            lo.0,
            hi.2 / lo.2,
            hi.3 / lo.3
        );
        if hi.0 > lo.0 {
            let per = (hi.1 as f64 - lo.1 as f64) * 1024.0 / (hi.0 - lo.0) as f64;
            println!("server idle RSS grows by {per:.0} bytes per (principal, pack) entry ({} KiB at {}, {} KiB at {}; includes SQLite page caches and allocator slack)", lo.1, lo.0, hi.1, hi.0);
            result(
                json!({ "phase": "scaling", "rss_bytes_per_principal": per, "recorded_ratio": hi.2 / lo.2, "dropped_ratio": hi.3 / lo.3 }),
            );
        }
    }
    println!();
    Ok(())
}
