//! The drop log: every drop counted in memory on the hot path and added to the store's drop reports in the background.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain::model::DropReport;
use crate::domain::trigger::DropReason;
use crate::error::Result;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::store::{now_micros, DeliveryTables};

/// Distinct (pack, ref, reason) keys a drop log keeps, stored and pending together; beyond
/// this, drops are counted under the pack and ref `*`, so producers inventing pack ids or
/// refs grow neither memory nor the drop reports table, however many flushes go by.
pub const MAX_KEYS: usize = 10_000;
/// The pack and ref of counts that overflowed the pending keys.
pub const OVERFLOW: &str = "*";

type Key = (String, String, DropReason);

/// Counts not yet written, and the keys already in the store.
#[derive(Debug, Default)]
struct Pending {
    counts: HashMap<Key, (i64, i64, i64)>,
    /// Keys stored in the drop reports (as of the last flush), at most `MAX_KEYS`.
    stored: std::collections::HashSet<Key>,
    /// Pending keys not among `stored`.
    new_keys: usize,
}

#[derive(Debug)]
pub struct DropLog {
    store: DeliveryTables,
    metrics: Arc<Metrics>,
    pending: Mutex<Pending>,
    /// One flush at a time, so counts are added exactly once.
    flushing: tokio::sync::Mutex<()>,
}

impl DropLog {
    /// A drop log with a background flusher, upkeep of `life` that ends when closing begins
    /// (the last counts are then written by `Hub::close`). `stored` are the keys the store's
    /// drop reports already have.
    pub fn start(
        store: DeliveryTables,
        metrics: Arc<Metrics>,
        stored: Vec<Key>,
        every: Duration,
        life: &Lifecycle,
    ) -> Arc<DropLog> {
        let log = Arc::new(DropLog {
            store,
            metrics,
            pending: Mutex::new(Pending {
                stored: stored.into_iter().collect(),
                ..Default::default()
            }),
            flushing: tokio::sync::Mutex::new(()),
        });
        let (flushed, closing) = (log.clone(), life.closing());
        life.spawn_upkeep(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = closing.wait() => break,
                }
                if let Err(e) = flushed.flush().await {
                    tracing::warn!(error = %e, "drop reports not written yet; will retry");
                }
            }
        });
        log
    }

    /// Counts one drop. Never blocks on the store.
    pub fn count(&self, pack_id: &str, r#ref: &str, reason: DropReason) {
        let now = now_micros();
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        let p = &mut *pending;
        let key = (pack_id.to_owned(), r#ref.to_owned(), reason);
        if let Some(e) = p.counts.get_mut(&key) {
            e.0 += 1;
            e.2 = now;
            return;
        }
        let stored = p.stored.contains(&key);
        let key = if stored || p.stored.len() + p.new_keys < MAX_KEYS {
            key
        } else {
            // Still counted, under pack and ref `*`, so no drop goes uncounted.
            (OVERFLOW.to_owned(), OVERFLOW.to_owned(), reason)
        };
        let is_new = !p.counts.contains_key(&key) && !p.stored.contains(&key);
        let e = p.counts.entry(key).or_insert((0, now, now));
        e.0 += 1;
        e.2 = now;
        if is_new {
            p.new_keys += 1;
        }
    }

    /// Adds pending counts to the store; on failure they stay pending.
    ///
    /// The write runs to its end in a task of its own: the counts are taken out of `pending`
    /// before they are added, so a caller that goes away mid-write (a ListDropReports
    /// cancelled, shutdown's deadline) must not take them with it.
    pub async fn flush(self: &Arc<Self>) -> Result<()> {
        let log = self.clone();
        tokio::spawn(async move { log.write_pending().await })
            .await
            .map_err(|e| crate::error::Error::internal_from("drop counts write failed", e))?
    }

    async fn write_pending(&self) -> Result<()> {
        let _one = self.flushing.lock().await;
        let batch: Vec<(Key, (i64, i64, i64))> = match self.pending.lock() {
            Ok(mut p) if !p.counts.is_empty() => {
                p.new_keys = 0;
                p.counts.drain().collect()
            }
            _ => return Ok(()),
        };
        let deltas: Vec<DropReport> = batch
            .iter()
            .map(|((pack_id, r, reason), (count, first, last))| DropReport {
                pack_id: pack_id.clone(),
                r#ref: r.clone(),
                reason: *reason,
                count: *count,
                first_seen: *first,
                last_seen: *last,
            })
            .collect();
        if let Err(e) = self.store.add_drop_counts(&deltas).await {
            // Put the counts back, merged with any counted meanwhile.
            if let Ok(mut p) = self.pending.lock() {
                for (key, (count, first, last)) in batch {
                    if !p.counts.contains_key(&key) && !p.stored.contains(&key) {
                        p.new_keys += 1;
                    }
                    let e = p.counts.entry(key).or_insert((0, first, last));
                    e.0 += count;
                    e.1 = e.1.min(first);
                    e.2 = e.2.max(last);
                }
            }
            return Err(e);
        }
        if let Ok(mut p) = self.pending.lock() {
            for (key, _) in batch {
                if p.counts.contains_key(&key) && !p.stored.contains(&key) {
                    // Counted again meanwhile, as a new key; it is stored now.
                    p.new_keys = p.new_keys.saturating_sub(1);
                }
                p.stored.insert(key);
            }
        }
        self.metrics
            .drop_counts_written(deltas.iter().map(|d| d.count.unsigned_abs()).sum());
        Ok(())
    }
}
