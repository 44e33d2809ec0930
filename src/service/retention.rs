//! Retention: records older than their land's age, decision log entries older than theirs, and ingress ledger rows past their expiry, are deleted in the background.
use std::sync::Arc;
use std::time::Duration;

use crate::domain::model::Retention;
use crate::lifecycle::{Lifecycle, Signal};
use crate::metrics::Metrics;
use crate::store::Lands;
use crate::store::{now_micros, IngressTables, RecordTables, Store};

/// Rows deleted per transaction: small, so a batch of deliveries never waits long behind it.
pub const PRUNE_BATCH: u64 = 250;
/// Ledger pages one sweep statement reads (about 30,000 narrow rows).
pub const LEDGER_SWEEP_PAGES: i64 = 256;
/// The pause between two batches, for the deliveries waiting on the writer's turn.
pub const BATCH_PAUSE: Duration = Duration::from_millis(20);

/// Deletes, every `every`, the records of each land older than its age (the lands listed by
/// their own, every other land by the default) and the expired rows of the ingress ledger,
/// in batches of PRUNE_BATCH with a pause between. A task of `life` that ends when stopping
/// begins, between two batches: a pass is work of its own, not an answer anyone waits for.
pub fn start(
    store: Store,
    metrics: Arc<Metrics>,
    (retention, decisions): (Retention, DecisionBounds),
    every: Duration,
    life: &Lifecycle,
) {
    let stopping = life.stopping();
    life.spawn(async move {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let listed: Vec<String> = retention.lands.keys().cloned().collect();
        let records = store.record_tables();
        let mut sweep_due = true;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stopping.wait() => return,
            }
            prune_ledger(&store.ingress_tables(), now_micros(), &stopping).await;
            prune_decisions(&store, decisions, &stopping).await;
            // Records' ages run on the clock that stamps them: the database's when they are
            // partitioned (every replica alike, whatever its own clock), else this one's.
            let now = if store.partitioned() {
                match partitions(&store, &records, &metrics, &retention, &mut sweep_due).await {
                    Ok(now) => now,
                    Err(e) => {
                        tracing::warn!(error = %e, "records partitions not kept; will retry");
                        continue;
                    }
                }
            } else {
                now_micros()
            };
            let mut passes: Vec<(Lands<'_>, i64)> = retention
                .lands
                .iter()
                .filter_map(|(land, age)| {
                    Some((Lands::Only(land), now.saturating_sub(micros((*age)?))))
                })
                .collect();
            if let Some(age) = retention.default {
                passes.push((Lands::Except(&listed), now.saturating_sub(micros(age))));
            }
            for (lands, cutoff) in passes {
                let (records, metrics) = (&records, &metrics);
                let total = in_batches("records", PRUNE_BATCH, &stopping, || async move {
                    let n = records.prune_records(cutoff, lands, PRUNE_BATCH).await?;
                    metrics.records_deleted("retention", n);
                    Ok(n)
                })
                .await;
                if total > 0 {
                    tracing::info!(deleted = total, lands = %lands, "pruned records past retention");
                }
            }
        }
    });
}

/// PostgreSQL's partitions: makes those ahead, drops those every land's retention has passed,
/// and sweeps the trigger ledger's rows they left: after a pass that dropped some, and once
/// after start (a sweep the last process did not finish). `sweep_due` says whether one is
/// owed and is cleared when one completes. Returns the database's clock.
async fn partitions(
    store: &Store,
    records: &RecordTables,
    metrics: &Metrics,
    retention: &Retention,
    sweep_due: &mut bool,
) -> crate::error::Result<i64> {
    store.make_partitions_ahead().await?;
    // Before the trims, which find the rows below their cutoffs by the summaries. A partition
    // under vacuum is summarized by it instead; the next pass tries again either way.
    match store.summarize_stored_time().await {
        Ok(done) => {
            if done.set_off > 0 {
                tracing::info!(
                    partitions = done.set_off,
                    "records partitions' stored-time index set to leave its summaries to passes"
                );
            }
            tracing::debug!(
                ranges = done.ranges,
                deferred = done.deferred,
                "records' stored-time ranges summarized"
            );
        }
        Err(e) => tracing::warn!(error = %e, "records' stored-time index not read; next pass"),
    }
    let now = store.db_now().await?;
    if let Some(age) = retention.longest() {
        let cutoff = now.saturating_sub(i64::try_from(age.as_micros()).unwrap_or(i64::MAX));
        let started = std::time::Instant::now();
        let dropped = records.drop_partitions_before(cutoff).await?;
        if dropped.partitions > 0 {
            *sweep_due = true;
            metrics.records_deleted("retention", dropped.records);
            tracing::info!(
                partitions = dropped.partitions,
                records = dropped.records,
                statements = dropped.statements,
                took_ms = started.elapsed().as_millis() as u64,
                "dropped records partitions past retention"
            );
        }
    }
    if *sweep_due {
        let swept = sweep_ledger(records).await?;
        *sweep_due = false;
        if swept > 0 {
            tracing::info!(swept, "swept trigger ids of dropped partitions");
        }
    }
    Ok(now)
}

/// Reads the whole ledger once, LEDGER_SWEEP_PAGES at a time with BATCH_PAUSE between,
/// deleting the rows below the floor. A failure ends it; the next pass sweeps again.
async fn sweep_ledger(records: &RecordTables) -> crate::error::Result<u64> {
    let pages = records.ledger_pages().await?;
    let mut swept = 0;
    let mut from = 0;
    // The last page too: it may hold rows and still be filling.
    while from <= pages {
        let to = from.saturating_add(LEDGER_SWEEP_PAGES);
        swept += records.sweep_ledger_pages(from, to).await?;
        from = to;
        tokio::time::sleep(BATCH_PAUSE).await;
    }
    Ok(swept)
}

/// How long the decision log keeps entries, and how many at most (`None`: no bound).
#[derive(Debug, Clone, Copy, Default)]
pub struct DecisionBounds {
    pub age: Option<Duration>,
    pub max_entries: Option<u64>,
}

/// The decision log's entries past its bounds: older than its age, and the oldest past its
/// most entries. PostgreSQL drops whole partitions (on the database's clock; the bound by the
/// planner's count), SQLite deletes a batch at a time.
async fn prune_decisions(store: &Store, bounds: DecisionBounds, stopping: &Signal) {
    let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    let log = store.decision_tables();
    if store.partitioned() {
        let dropped = async {
            let now = store.db_now().await?;
            let cutoff = bounds.age.map(|a| now.saturating_sub(micros(a)));
            store
                .record_tables()
                .drop_decision_partitions(cutoff, bounds.max_entries, now)
                .await
        };
        match dropped.await {
            Ok(d) if d.partitions > 0 => tracing::info!(
                partitions = d.partitions,
                entries = d.records,
                "dropped decision log partitions past its bounds"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "decision log partitions not dropped; will retry"),
        }
        return;
    }
    let mut total = 0;
    if let Some(age) = bounds.age {
        let cutoff = now_micros().saturating_sub(micros(age));
        total += in_batches("the decision log", PRUNE_BATCH, stopping, || {
            log.prune_decisions(cutoff, PRUNE_BATCH)
        })
        .await;
    }
    if let Some(max) = bounds.max_entries {
        total += in_batches("the decision log", PRUNE_BATCH, stopping, || {
            log.prune_decisions_over(max, PRUNE_BATCH)
        })
        .await;
    }
    if total > 0 {
        tracing::info!(
            deleted = total,
            "pruned decision log entries past its bounds"
        );
    }
}

/// Deletes the ingress ledger's rows expired at `now`, a batch at a time.
async fn prune_ledger(store: &IngressTables, now: i64, stopping: &Signal) {
    let total = in_batches("the ingress ledger", PRUNE_BATCH, stopping, || {
        store.prune_ingress_ledger(now, PRUNE_BATCH)
    })
    .await;
    if total > 0 {
        tracing::debug!(deleted = total, "pruned expired ingress deliveries");
    }
}

/// Runs `batch` (which deletes at most `size` rows) until it deletes fewer, pausing
/// BATCH_PAUSE between; a failure, or stopping, ends the pass (the next retries). Returns rows
/// deleted.
async fn in_batches<F>(
    what: &str,
    size: u64,
    stopping: &Signal,
    mut batch: impl FnMut() -> F,
) -> u64
where
    F: std::future::Future<Output = crate::error::Result<u64>>,
{
    let mut total = 0;
    loop {
        match batch().await {
            Ok(n) => {
                total += n;
                if n < size || stopping.is_given() {
                    return total;
                }
                tokio::time::sleep(BATCH_PAUSE).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "pruning {what} failed; will retry");
                return total;
            }
        }
    }
}
