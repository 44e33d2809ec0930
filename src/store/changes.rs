//! The policy changes other replicas announce, as a stream: LISTEN/NOTIFY on a connection of its own (PostgreSQL), proven live by heartbeats.
//!
//! Every admin write announces its pack with NOTIFY in its own transaction
//! (`WriteTxn::commit_announcing`). A connection lost without being closed (a partition, a
//! failover) never says so by itself, so the listener sends itself a notification every
//! `HEARTBEAT_EVERY` over the listening connection and reports the connection lost when one is
//! not back within `HEARTBEAT_TIMEOUT`.
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sea_orm::sqlx::{self, postgres::PgListener};
use tokio::sync::Notify;

use super::{Engine, PolicyTables, Store, POLICY_CHANNEL, RECORDS_CHANNEL};

/// How often the listener proves that its connection still carries notifications.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(250);
/// A heartbeat not back within this long means the connection is lost.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(750);
/// The pause before connecting again after a loss.
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

/// What a replica must do to keep its policy view in step with the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyChange {
    /// The listener has (again) subscribed: anything may have changed while it was not
    /// listening, so reload everything; changes from now on arrive as `Packs`.
    Resync,
    /// These packs' policy changed.
    Packs(BTreeSet<String>),
    /// The listener lost its connection, or cannot make one: changes may be missed until the
    /// next `Resync`.
    Lost(String),
}

/// Changes not yet taken, merged: memory is bounded by the number of packs, and a slow
/// consumer never holds up the heartbeats.
#[derive(Debug, Default)]
struct Pending {
    lost: Option<String>,
    resync: bool,
    packs: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    ready: Notify,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // A panic elsewhere cannot leave `Pending` half-updated: every update is one statement.
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, change: PolicyChange) {
        {
            let mut p = self.pending();
            match change {
                // A loss voids an earlier resync not yet taken: reloading then would mark the
                // view current while nothing is listening.
                PolicyChange::Lost(why) => {
                    p.lost = Some(why);
                    p.resync = false;
                    p.packs.clear();
                }
                PolicyChange::Resync => {
                    p.resync = true;
                    p.packs.clear();
                }
                PolicyChange::Packs(packs) if !p.resync => p.packs.extend(packs),
                // A full reload is already due.
                PolicyChange::Packs(_) => {}
            }
        }
        self.ready.notify_one();
    }

    /// Losses first, then a due reload, then packs.
    fn take(&self) -> Option<PolicyChange> {
        let mut p = self.pending();
        if let Some(why) = p.lost.take() {
            return Some(PolicyChange::Lost(why));
        }
        if std::mem::take(&mut p.resync) {
            return Some(PolicyChange::Resync);
        }
        if !p.packs.is_empty() {
            return Some(PolicyChange::Packs(std::mem::take(&mut p.packs)));
        }
        None
    }
}

/// The stream of policy changes of one store. Dropping it stops the listener.
#[derive(Debug)]
pub struct PolicyChanges {
    shared: Arc<Shared>,
}

impl PolicyChanges {
    /// The next change, waiting for one.
    pub async fn next(&mut self) -> PolicyChange {
        loop {
            if let Some(change) = self.shared.take() {
                return change;
            }
            self.shared.ready.notified().await;
        }
    }

    /// Whether a loss is waiting to be taken: a consumer retrying a reload stops and takes it.
    pub fn lost_pending(&self) -> bool {
        self.shared.pending().lost.is_some()
    }
}

impl PolicyTables {
    /// The policy changes announced through this store, on PostgreSQL, and the listener that
    /// hears them, to be run (it never ends by itself) alongside whatever takes the changes;
    /// `None` on SQLite, whose one process is the only writer.
    pub fn policy_changes(
        &self,
    ) -> Option<(
        PolicyChanges,
        impl std::future::Future<Output = ()> + Send + 'static,
    )> {
        if self.engine() != Engine::Postgres {
            return None;
        }
        let shared = Arc::new(Shared::default());
        let store = self.clone();
        let listen = {
            let shared = shared.clone();
            async move { store.listen(&shared).await }
        };
        Some((PolicyChanges { shared }, listen))
    }

    async fn listen(&self, out: &Shared) {
        // A channel of this listener's own, for the heartbeats it sends itself.
        let heartbeat = format!(
            "hcp_sense_hb_{:x}_{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        );
        loop {
            let why = match self.subscribe(&heartbeat).await {
                Ok(mut listener) => {
                    out.push(PolicyChange::Resync);
                    // Records announced while not listening are read now; erasures announced
                    // then are not known, so the watch tail starts afresh from the store.
                    self.commits()
                        .resync
                        .store(true, std::sync::atomic::Ordering::Release);
                    self.commits().remote.notify_one();
                    follow(&mut listener, &heartbeat, out, self).await
                }
                Err(why) => why,
            };
            out.push(PolicyChange::Lost(why));
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }

    /// A listening connection on a pool of its own, made anew after each loss: the lost
    /// connection may be stuck on a silent socket and must not hold a slot of the store's pool,
    /// nor be waited for.
    async fn subscribe(&self, heartbeat: &str) -> Result<PgListener, String> {
        let options = self
            .connection()
            .get_postgres_connection_pool()
            .connect_options();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(HEARTBEAT_TIMEOUT * 4)
            .connect_lazy_with((*options).clone());
        let mut listener = PgListener::connect_with(&pool)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        // Report a lost connection at once rather than first waiting out a reconnect (up to
        // the pool's acquire timeout while the store is down).
        listener.eager_reconnect(false);
        listener
            .listen_all([POLICY_CHANNEL, RECORDS_CHANNEL, heartbeat])
            .await
            .map_err(|e| format!("cannot subscribe: {e}"))?;
        Ok(listener)
    }
}

/// Passes on the packs announced, wakes the watch tail for records announced, and proves every HEARTBEAT_EVERY that the connection still
/// carries notifications. Returns why it stopped.
async fn follow(listener: &mut PgListener, heartbeat: &str, out: &Shared, store: &Store) -> String {
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
            let n = match tokio::time::timeout_at(until, listener.try_recv()).await {
                Err(_) if heard => break,
                Err(_) => return "heartbeat not heard back".into(),
                Ok(Ok(Some(n))) => n,
                Ok(Ok(None)) => return "connection lost".into(),
                Ok(Err(e)) => return e.to_string(),
            };
            // Anything arriving proves the connection carries notifications.
            heard = true;
            if n.channel() == RECORDS_CHANNEL {
                // A payload is an erasure (JSON); an empty one only says "read again".
                match serde_json::from_str::<crate::domain::model::Erasure>(n.payload()) {
                    Ok(e) => {
                        store.answers.forget_erased(&e);
                        store.commits().erased(e)
                    }
                    Err(_) => store.commits().remote.notify_one(),
                }
            } else if n.channel() != heartbeat {
                out.push(PolicyChange::Packs(BTreeSet::from([n
                    .payload()
                    .to_owned()])));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packs(names: &[&str]) -> PolicyChange {
        PolicyChange::Packs(names.iter().map(|s| (*s).to_owned()).collect())
    }

    #[test]
    fn changes_merge_and_a_loss_voids_the_resync_before_it() {
        let s = Shared::default();
        s.push(packs(&["a"]));
        s.push(packs(&["b"]));
        s.push(packs(&["a"]));
        assert_eq!(s.take(), Some(packs(&["a", "b"])), "merged, once per pack");
        assert_eq!(s.take(), None);

        s.push(PolicyChange::Resync);
        s.push(packs(&["a"]));
        assert_eq!(
            s.take(),
            Some(PolicyChange::Resync),
            "a reload covers the packs"
        );
        assert_eq!(s.take(), None);

        // Subscribed, then lost before anyone reloaded: reloading would mark the view current
        // with nothing listening.
        s.push(PolicyChange::Resync);
        s.push(PolicyChange::Lost("gone".into()));
        assert_eq!(s.take(), Some(PolicyChange::Lost("gone".into())));
        assert_eq!(s.take(), None);

        // Lost, then subscribed again: both, in that order.
        s.push(PolicyChange::Lost("gone".into()));
        s.push(PolicyChange::Resync);
        assert_eq!(s.take(), Some(PolicyChange::Lost("gone".into())));
        assert_eq!(s.take(), Some(PolicyChange::Resync));
    }

    #[tokio::test]
    async fn next_waits_for_a_change_pushed_later() {
        let shared = Arc::new(Shared::default());
        let mut changes = PolicyChanges {
            shared: shared.clone(),
        };
        let push = tokio::spawn({
            let shared = shared.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                shared.push(packs(&["late"]));
            }
        });
        let got = tokio::time::timeout(Duration::from_secs(5), changes.next())
            .await
            .expect("woken");
        assert_eq!(got, packs(&["late"]));
        push.await.expect("push");
    }
}
