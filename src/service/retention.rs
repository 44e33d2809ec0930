//! Retention: records older than the configured age are deleted in small batches in the background.
use std::sync::Weak;
use std::time::Duration;

use crate::store::{now_micros, Store};

/// Rows deleted per transaction: small, so a batch of deliveries never waits long behind it.
pub const PRUNE_BATCH: u64 = 250;

/// Deletes records older than `max_age` every `every`, in batches of PRUNE_BATCH,
/// yielding between batches. Stops when `alive` can no longer be upgraded.
pub fn start<T: Send + Sync + 'static>(
    store: Store,
    max_age: Duration,
    every: Duration,
    alive: Weak<T>,
) {
    tokio::spawn(async move {
        let age = i64::try_from(max_age.as_micros()).unwrap_or(i64::MAX);
        loop {
            tokio::time::sleep(every).await;
            if alive.upgrade().is_none() {
                return;
            }
            let cutoff = now_micros().saturating_sub(age);
            let mut total = 0;
            loop {
                match store.prune_records(cutoff, PRUNE_BATCH).await {
                    Ok(n) => {
                        total += n;
                        if n < PRUNE_BATCH {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pruning records failed; will retry");
                        break;
                    }
                }
            }
            if total > 0 {
                tracing::info!(deleted = total, "pruned records past retention");
            }
        }
    });
}
