//! Replicas on one PostgreSQL: each LISTENs for the policy changes others announce and reloads.
//!
//! Every admin write announces itself with NOTIFY in its own transaction (see
//! `WriteTxn::commit_announcing`). A replica that cannot listen fails closed until it has
//! listened again and reloaded all policy.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sea_orm::sqlx::postgres::PgListener;

use super::Service;
use crate::store::{Engine, POLICY_CHANNEL};

impl Service {
    /// Whether the policy view is known to be current. Decisions are refused while it is not.
    pub fn policy_current(&self) -> bool {
        self.policy.current.load(Ordering::Acquire)
    }

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

    /// On PostgreSQL, starts the listener that keeps this replica's view in step
    /// with the others'. It stops when `stop` completes.
    pub fn start_listener(&self, mut stop: tokio::sync::watch::Receiver<bool>) {
        if self.store.engine() != Engine::Postgres {
            return;
        }
        let svc = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = svc.listen() => {}
                _ = stop.wait_for(|s| *s) => {}
            }
        });
    }

    async fn listen(&self) {
        let pause = Duration::from_millis(200);
        loop {
            let pool = self
                .store
                .connection()
                .get_postgres_connection_pool()
                .clone();
            let mut listener = match PgListener::connect_with(&pool).await {
                Ok(mut l) => {
                    // Report a lost connection at once rather than first waiting out a
                    // reconnect (up to the pool's acquire timeout while the store is down).
                    l.eager_reconnect(false);
                    l
                }
                Err(e) => {
                    tracing::warn!(error = %e, "policy listener cannot connect");
                    self.set_current(false);
                    tokio::time::sleep(pause).await;
                    continue;
                }
            };
            if let Err(e) = listener.listen(POLICY_CHANNEL).await {
                tracing::warn!(error = %e, "policy listener cannot subscribe");
                self.set_current(false);
                tokio::time::sleep(pause).await;
                continue;
            }
            // Subscribed: whatever changed while not listening is in the store.
            if let Err(e) = self.reload_all().await {
                tracing::warn!(error = %e, "policy reload failed");
                self.set_current(false);
                tokio::time::sleep(pause).await;
                continue;
            }
            self.set_current(true);
            loop {
                match listener.try_recv().await {
                    Ok(Some(n)) => {
                        let _turn = self.policy.writer.lock().await;
                        if let Err(e) = self.refresh_pack(n.payload()).await {
                            tracing::warn!(error = %e, pack_id = n.payload(), "pack reload failed");
                            self.set_current(false);
                            break;
                        }
                    }
                    Ok(None) | Err(_) => {
                        self.set_current(false);
                        break;
                    }
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    async fn reload_all(&self) -> crate::error::Result<()> {
        let _turn = self.policy.writer.lock().await;
        let view = self.store.load_policy().await?;
        self.policy.view.store(Arc::new(view));
        Ok(())
    }
}
