//! Replicas on one PostgreSQL: each LISTENs for the policy changes others announce and reloads.
//!
//! Every admin write announces itself with NOTIFY in its own transaction (see
//! `WriteTxn::commit_announcing`). A replica that cannot listen — its connection closed, or
//! silent past a heartbeat — fails closed until it has listened again and reloaded all policy.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sea_orm::sqlx::{self, postgres::PgListener};

/// How often a replica proves that its listening connection still carries notifications.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(250);
/// A heartbeat not back within this long means the connection is lost.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(750);

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
        // A channel of this replica's own, for the heartbeats it sends itself.
        let heartbeat = format!(
            "hcp_sense_hb_{:x}_{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        );
        loop {
            // A pool of its own, one connection, made anew after each loss: the lost
            // connection may be stuck on a silent socket and must not hold a slot of the
            // service's pool, nor be waited for.
            let options = self
                .store
                .connection()
                .get_postgres_connection_pool()
                .connect_options();
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(HEARTBEAT_TIMEOUT * 4)
                .connect_lazy_with((*options).clone());
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
            if let Err(e) = listener
                .listen_all([POLICY_CHANNEL, heartbeat.as_str()])
                .await
            {
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
            let why = self.follow(&mut listener, &heartbeat).await;
            self.set_current(false);
            tracing::warn!(reason = %why, "policy listener stopped; reconnecting");
            tokio::time::sleep(pause).await;
        }
    }

    /// Applies the changes other replicas announce, and proves every HEARTBEAT_EVERY that the
    /// connection still carries notifications: a connection lost without being closed (a
    /// partition, a failover) never says so by itself. Returns why it stopped.
    async fn follow(&self, listener: &mut PgListener, heartbeat: &str) -> String {
        loop {
            // Sent on the listening connection itself, so it comes back only over it.
            let sent = tokio::time::timeout(
                HEARTBEAT_TIMEOUT,
                sqlx::query("SELECT pg_notify($1, '')")
                    .bind(heartbeat)
                    .execute(&mut *listener),
            )
            .await;
            match sent {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return format!("heartbeat failed: {e}"),
                Err(_) => return "heartbeat not answered".into(),
            }
            let sent_at = tokio::time::Instant::now();
            let mut heard = false;
            loop {
                let until = sent_at
                    + if heard {
                        HEARTBEAT_EVERY
                    } else {
                        HEARTBEAT_TIMEOUT
                    };
                let first = match tokio::time::timeout_at(until, listener.try_recv()).await {
                    Err(_) if heard => break,
                    Err(_) => return "heartbeat not heard back".into(),
                    Ok(Ok(Some(n))) => n,
                    Ok(Ok(None)) => return "connection lost".into(),
                    Ok(Err(e)) => return e.to_string(),
                };
                // Anything arriving proves the connection carries notifications.
                heard = true;
                // Take whatever else has arrived already, so a burst of admin writes costs one
                // reload per pack rather than one per write.
                let mut packs = std::collections::BTreeSet::new();
                let mut next = Some(first);
                while let Some(n) = next.take() {
                    if n.channel() != heartbeat {
                        packs.insert(n.payload().to_owned());
                    }
                    match tokio::time::timeout(Duration::ZERO, listener.try_recv()).await {
                        Err(_) => {}
                        Ok(Ok(Some(n))) => next = Some(n),
                        Ok(Ok(None)) => return "connection lost".into(),
                        Ok(Err(e)) => return e.to_string(),
                    }
                }
                if packs.is_empty() {
                    continue;
                }
                // Bounded like a heartbeat: the writer's turn and the reloads wait on the
                // store, and a store gone silent must not hold off the next heartbeat. Too
                // slow, and the replica fails closed and reloads everything.
                let refreshed = tokio::time::timeout(HEARTBEAT_TIMEOUT, async {
                    let _turn = self.policy.writer.lock().await;
                    for pack in &packs {
                        self.refresh_pack(pack).await?;
                    }
                    Ok::<(), crate::error::Error>(())
                })
                .await;
                match refreshed {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return format!("reloading packs {packs:?}: {e}"),
                    Err(_) => return format!("reloading packs {packs:?} timed out"),
                }
            }
        }
    }

    async fn reload_all(&self) -> crate::error::Result<()> {
        let _turn = self.policy.writer.lock().await;
        let view = self.store.load_policy().await?;
        self.policy.view.store(Arc::new(view));
        Ok(())
    }
}
