//! The service's operations, between the gRPC edge and the store: admin writes keep the policy view in step with the store.
mod deliver;
mod drops;
pub mod ingress;
mod packs;
mod policy;
mod quota;
mod records;
mod replicas;
mod retention;
mod watch;

use std::sync::Arc;

use arc_swap::ArcSwap;

pub use deliver::decision_span;
pub use drops::DropLog;
pub use packs::Registered;
pub use policy::PackState;
pub use quota::QuotaCheck;
pub use records::ERASE_BATCH;
pub use watch::{Watch, WatchEvent, WatchLimits, MAX_PER_MESSAGE};

use crate::domain::model::Retention;
use crate::domain::names::{check_id, check_pack_id};
use crate::domain::policy::PolicyView;
use crate::domain::trigger::DropReason;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::store::{Sink, Store};

/// Limits on what a caller may send.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_payload_bytes: usize,
    /// How long records are kept, per land; older ones are deleted in the background.
    pub retention: Retention,
    /// How often the retention pruner runs.
    pub prune_every: std::time::Duration,
    /// Decision spans carry a hash of the principal instead of the principal.
    pub hash_principals: bool,
    /// Deepest JSON nesting accepted in a payload.
    pub max_json_depth: usize,
    /// Longest a batch of records may take to commit; past it the batch's callers are told
    /// UNAVAILABLE and the writer starts over on a new connection (a database gone silent).
    pub batch_timeout: std::time::Duration,
    /// Sink writers committing batches concurrently, each on a connection of its own
    /// (PostgreSQL; SQLite has one writer).
    pub sink_writers: usize,
    /// Bounds on WatchRecords streams.
    pub watch: WatchLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 64 * 1024,
            retention: Retention::default(),
            prune_every: std::time::Duration::from_secs(30),
            hash_principals: false,
            max_json_depth: 32,
            batch_timeout: std::time::Duration::from_secs(30),
            sink_writers: crate::config::DEFAULT_SINK_WRITERS,
            watch: WatchLimits::default(),
        }
    }
}

/// The policy view decisions read, and the turn admin writers take to change it.
#[derive(Debug)]
struct Policy {
    view: ArcSwap<PolicyView>,
    /// Held across an admin write's commit and the view update, so the view
    /// changes in the same order as the store.
    writer: tokio::sync::Mutex<()>,
    /// False while this replica may have missed another's change (PostgreSQL).
    current: std::sync::atomic::AtomicBool,
    current_tx: tokio::sync::watch::Sender<bool>,
}

/// Everything a request handler needs. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Service {
    pub store: Store,
    policy: Arc<Policy>,
    drops: Arc<DropLog>,
    sink: Sink,
    limits: Limits,
    pub metrics: Arc<Metrics>,
    tail: Arc<watch::Tail>,
    mappings: Arc<ingress::Mappings>,
    quotas: Arc<quota::Quotas>,
}

impl Service {
    /// Loads the policy view from the store and starts the drop log's flusher.
    pub async fn start(store: Store, limits: Limits, metrics: Arc<Metrics>) -> Result<Service> {
        let view = store.load_policy().await?;
        // On PostgreSQL another replica may change policy between this load and the moment
        // the listener subscribes; the view is current only once the listener has reloaded.
        let current = store.engine() != crate::store::Engine::Postgres;
        // Every stored key: at most MAX_KEYS, plus one overflow row per reason.
        let stored_keys = store
            .drop_report_keys((drops::MAX_KEYS + DropReason::ALL.len()) as u64)
            .await?;
        let drops = DropLog::start(store.clone(), metrics.clone(), stored_keys);
        let sink = Sink::start(
            store.clone(),
            metrics.clone(),
            limits.batch_timeout,
            limits.sink_writers,
        );
        // Always: the ingress ledger expires whatever the records' retention.
        retention::start(
            store.clone(),
            metrics.clone(),
            limits.retention.clone(),
            limits.prune_every,
            Arc::downgrade(&drops),
        );
        let quotas = Arc::new(quota::Quotas::new(store.engine()));
        Ok(Service {
            store,
            policy: Arc::new(Policy {
                view: ArcSwap::from_pointee(view),
                writer: tokio::sync::Mutex::new(()),
                current: std::sync::atomic::AtomicBool::new(current),
                current_tx: tokio::sync::watch::channel(current).0,
            }),
            drops,
            sink,
            tail: Arc::new(watch::Tail::new(limits.watch)),
            mappings: Arc::default(),
            quotas,
            limits,
            metrics,
        })
    }

    /// The current policy view.
    /// Longest a call may wait on the store (`--request-timeout-secs`); an ingress request or
    /// message that takes longer is answered as the store being unavailable.
    pub fn call_timeout(&self) -> std::time::Duration {
        self.limits.batch_timeout
    }

    /// Largest trigger payload accepted, in bytes (also the largest ingress request body).
    pub fn max_payload_bytes(&self) -> usize {
        self.limits.max_payload_bytes
    }

    pub fn view(&self) -> Arc<PolicyView> {
        self.policy.view.load_full()
    }

    /// Counts Bindings of registered packs by state, for the gauges.
    pub fn binding_states(&self) -> Vec<(&'static str, i64)> {
        use crate::domain::policy::BindingState;
        let view = self.policy.view.load();
        let mut counts: Vec<(&'static str, i64)> =
            BindingState::NAMES.iter().map(|n| (*n, 0)).collect();
        for id in view.pack_ids() {
            if let Some(p) = view.pack(id) {
                for b in p.principals.values().filter_map(|p| p.binding.as_ref()) {
                    if let Some(c) = counts.iter_mut().find(|(n, _)| *n == b.state.as_str()) {
                        c.1 += 1;
                    }
                }
            }
        }
        counts
    }

    /// Readiness: the policy view is current and the store answers. On PostgreSQL the policy
    /// listener's heartbeat already proves, every 250 ms and on a connection of its own, that
    /// the store answers, so no pool connection is taken (a busy pool is not an outage); SQLite
    /// is asked, with a second to answer.
    pub async fn ready(&self) -> bool {
        if !self.policy_current() {
            return false;
        }
        self.store.engine() == crate::store::Engine::Postgres
            || matches!(
                tokio::time::timeout(std::time::Duration::from_secs(1), self.store.ping()).await,
                Ok(Ok(()))
            )
    }

    /// Writes pending drop counts to the store.
    pub async fn flush_drops(&self) -> Result<()> {
        self.drops.flush().await
    }
}

/// Runs an admin operation to its end even if the caller goes away, so that a
/// commit is never separated from the view update that follows it.
pub async fn detached<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(op)
        .await
        .map_err(|e| Error::Internal(format!("admin operation failed: {e}")))?
}

pub fn valid_pack_id(pack_id: &str) -> Result<()> {
    check_pack_id(pack_id).map_err(|e| Error::invalid("pack_id", e))
}

pub fn valid_id(field: &'static str, id: &str) -> Result<()> {
    check_id(field, id).map_err(|e| Error::invalid(field, e))
}

fn unknown_pack(pack_id: &str) -> Error {
    Error::NotFound(format!("pack `{pack_id}` is not registered"))
}
