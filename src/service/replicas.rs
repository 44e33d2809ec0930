//! Replicas on one PostgreSQL: each follows the policy changes the others announce (the store's `PolicyChanges`) and reloads.
//!
//! A replica whose listener is lost fails closed — decisions refused, NOT_SERVING — until it
//! has listened again and reloaded all policy.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::Policy;
use crate::store::changes::{PolicyChange, PolicyChanges};

/// Longest a pack's reload may take before the replica fails closed and reloads everything:
/// the reloads wait on the store, and a view quietly behind is worse than a refusal.
const REFRESH_TIMEOUT: Duration = Duration::from_millis(750);
/// Longest one attempt to reload everything may take.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(3);
/// The pause between attempts to reload everything.
const RELOAD_PAUSE: Duration = Duration::from_millis(200);

impl Policy {
    fn set_current(&self, current: bool) {
        if self.policy.current.swap(current, Ordering::AcqRel) != current {
            if current {
                tracing::info!("policy listener connected; policy reloaded");
            } else {
                tracing::warn!(
                    "policy listener lost; refusing deliveries until policy is reloaded"
                );
            }
            let _ = self.policy.current_tx.send(current);
        }
    }

    /// Subscribes to a channel of freshness changes (true: current).
    pub fn watch_current(&self) -> tokio::sync::watch::Receiver<bool> {
        self.policy.current_tx.subscribe()
    }

    /// On PostgreSQL, starts following the store's policy changes, keeping this replica's
    /// view in step with the others': one task of `life` that runs the store's listener and
    /// follows what it hears, until stopping begins.
    pub(super) fn start_listener(&self, life: &crate::lifecycle::Lifecycle) {
        let Some((mut changes, listen)) = self.store.policy_changes() else {
            return;
        };
        let (svc, stopping) = (self.clone(), life.stopping());
        life.spawn(async move {
            tokio::select! {
                _ = listen => {}
                _ = svc.follow(&mut changes) => {}
                _ = stopping.wait() => {}
            }
        });
    }

    async fn follow(&self, changes: &mut PolicyChanges) {
        loop {
            match changes.next().await {
                PolicyChange::Lost(why) => {
                    self.set_current(false);
                    tracing::warn!(reason = %why, "policy listener stopped; reconnecting");
                }
                PolicyChange::Resync => self.reload_until_current(changes).await,
                PolicyChange::Packs(packs) => {
                    let refreshed = tokio::time::timeout(REFRESH_TIMEOUT, async {
                        let _turn = self.policy.writer.lock().await;
                        for pack in &packs {
                            self.refresh_pack(pack).await?;
                        }
                        Ok::<(), crate::error::Error>(())
                    })
                    .await;
                    let why = match refreshed {
                        Ok(Ok(())) => continue,
                        Ok(Err(e)) => format!("reloading packs {packs:?}: {e}"),
                        Err(_) => format!("reloading packs {packs:?} timed out"),
                    };
                    tracing::warn!(reason = %why, "policy view behind; reloading all");
                    self.set_current(false);
                    self.reload_until_current(changes).await;
                }
            }
        }
    }

    /// Reloads all policy, retrying while the store fails, and marks the view current once it
    /// has; gives up early when the listener is lost (its next resync comes after).
    async fn reload_until_current(&self, changes: &PolicyChanges) {
        let mut fresh = false;
        loop {
            // Bounded: a pooled connection may have gone silent (a failover), and a read on it
            // would never end. After one such attempt the reload reads on a connection of its
            // own, opened for it, which reaches whatever the store's address now leads to.
            let attempt = tokio::time::timeout(RELOAD_TIMEOUT, self.reload_all(fresh)).await;
            match attempt {
                Ok(Ok(())) => return self.set_current(true),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "policy reload failed");
                    self.set_current(false);
                }
                Err(_) => {
                    tracing::warn!(
                        fresh,
                        "policy reload timed out; retrying on a new connection"
                    );
                    self.set_current(false);
                    fresh = true;
                }
            }
            tokio::time::sleep(RELOAD_PAUSE).await;
            if changes.lost_pending() {
                return;
            }
        }
    }

    /// Reloads all policy, on the store's pool or (`fresh`) on a connection opened for it.
    async fn reload_all(&self, fresh: bool) -> crate::error::Result<()> {
        let _turn = self.policy.writer.lock().await;
        let view = if fresh {
            let own = self.store.dedicated().await?;
            let view = own.policy_tables().load_policy().await;
            own.close().await;
            view?
        } else {
            self.store.load_policy().await?
        };
        self.policy.view.store(Arc::new(view));
        Ok(())
    }
}
