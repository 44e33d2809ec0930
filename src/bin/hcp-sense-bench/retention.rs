//! The retention phase (SQLite, the single writer): deliveries while the server prunes expired records.
use serde_json::json;

use crate::load::{closed, Load};
use crate::report::{header, result, row};
use crate::seed::{now_micros, prepare};
use crate::server::Server;
use crate::{bin, seed, Options};

/// Deliveries while the server prunes expired records (SQLite, the single writer).
pub async fn retention(o: &Options) -> anyhow::Result<()> {
    println!(
        "retention (sqlite): deliveries while {} expired records are pruned",
        o.retention_records
    );
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "sqlite", "retention", pop, &[]).await?;
    seeded.stop();
    let conn = db.connect().await?;
    seed::records_bulk(
        &conn,
        pop,
        o.retention_records,
        now_micros() - 2 * 86_400_000_000,
    )
    .await?;
    let _ = conn.close().await;
    let server = Server::start(
        bin(o),
        &db.url,
        &[
            "--record-retention-secs",
            "86400",
            "--prune-interval-secs",
            "1",
        ],
    )?;
    header();
    let chs = server.channels(o.channels).await?;
    let base = closed(&chs, o.duration(), o.first(), pop, Load::Noop).await;
    row("sqlite", "baseline (no-op)", &base, None);
    let rec = closed(&chs, o.duration(), o.first(), pop, Load::Recorded).await;
    row("sqlite", "recorded while pruning", &rec, Some(&base));
    server.stop();
    let conn = db.connect().await?;
    let left = seed::count_before(&conn, now_micros() - 86_400_000_000).await?;
    let _ = conn.close().await;
    println!(
        "expired records left after the phase: {left} of {}",
        o.retention_records
    );
    result(
        json!({ "phase": "retention", "expired_left": left, "expired_seeded": o.retention_records }),
    );
    db.drop_db().await;
    Ok(())
}
