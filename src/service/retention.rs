//! Retention: records older than their land's age are deleted in small batches in the background.
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::domain::model::Retention;
use crate::metrics::Metrics;
use crate::store::Lands;
use crate::store::{now_micros, Store};

/// Rows deleted per transaction: small, so a batch of deliveries never waits long behind it.
pub const PRUNE_BATCH: u64 = 250;
/// The pause between two batches, for the deliveries waiting on the writer's turn.
pub const BATCH_PAUSE: Duration = Duration::from_millis(20);

/// Deletes, every `every`, the records of each land older than its age (the lands listed by
/// their own, every other land by the default), in batches of PRUNE_BATCH with a pause
/// between. Stops when `alive` can no longer be upgraded.
pub fn start<T: Send + Sync + 'static>(
    store: Store,
    metrics: Arc<Metrics>,
    retention: Retention,
    every: Duration,
    alive: Weak<T>,
) {
    tokio::spawn(async move {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let listed: Vec<String> = retention.lands.keys().cloned().collect();
        loop {
            tokio::time::sleep(every).await;
            if alive.upgrade().is_none() {
                return;
            }
            let now = now_micros();
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
                let mut total = 0;
                loop {
                    match store.prune_records(cutoff, lands, PRUNE_BATCH).await {
                        Ok(n) => {
                            total += n;
                            metrics.records_deleted("retention", n);
                            if n < PRUNE_BATCH {
                                break;
                            }
                            tokio::time::sleep(BATCH_PAUSE).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "pruning records failed; will retry");
                            break;
                        }
                    }
                }
                if total > 0 {
                    tracing::info!(deleted = total, lands = %lands, "pruned records past retention");
                }
            }
        }
    });
}
