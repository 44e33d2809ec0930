//! The service's capabilities between the edges and the store — Delivery, Policy, Records — started together by `Hub::start`; admin writes keep the policy view in step with the store.
pub mod checks;
pub mod decisions;
pub mod deliver;
mod drops;
mod packs;
mod policy;
mod quota;
mod recent;
mod records;
mod replicas;
pub mod retention;
mod watch;

use std::sync::Arc;

use arc_swap::ArcSwap;

pub use decisions::DecisionLog;
pub use deliver::{decision_span, Delivery, Message};
pub use drops::DropLog;
pub use packs::Registered;
pub use policy::{PackState, Policy};
pub use quota::QuotaCheck;
pub use records::{read_as, reader_principal, Records, ERASE_BATCH};
pub use watch::{Watch, WatchEvent, WatchEvents, WatchLimits, MAX_PER_MESSAGE};

use crate::domain::model::Retention;
use crate::domain::names::{check_id, check_pack_id};
use crate::domain::policy::PolicyView;
use crate::domain::trigger::DropReason;
use crate::error::{Error, Result};
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::store::{Sink, Store};

/// How often, by default, the decision log and the drop counts write what they have taken:
/// what another replica's listing sees lags this replica's decisions by about this much.
pub const LOG_FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Limits on what a caller may send.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_payload_bytes: usize,
    /// How long records are kept, per land; older ones are deleted in the background.
    pub retention: Retention,
    /// How often the retention pruner runs.
    pub prune_every: std::time::Duration,
    /// How often the decision log and the drop counts write what they have taken.
    pub log_flush_every: std::time::Duration,
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
    /// How long a lone sink writer waits for more records before it commits (group commit at
    /// a steady rate; see `sink::Pace`); zero: at once.
    pub sink_commit_delay: std::time::Duration,
    /// Bounds on WatchRecords streams.
    pub watch: WatchLimits,
    /// The pool that runs payload checks and lint off the runtime's workers.
    pub checks: checks::CheckLimits,
    /// The decision log: kept at all, its bounds, and its fold rule.
    pub decision_log: bool,
    pub decision_bounds: retention::DecisionBounds,
    pub decision_fold: crate::domain::decision_log::FoldRule,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 64 * 1024,
            retention: Retention::default(),
            prune_every: std::time::Duration::from_secs(30),
            log_flush_every: LOG_FLUSH_EVERY,
            hash_principals: false,
            max_json_depth: 32,
            batch_timeout: std::time::Duration::from_secs(30),
            sink_writers: crate::config::DEFAULT_SINK_WRITERS,
            sink_commit_delay: std::time::Duration::ZERO,
            watch: WatchLimits::default(),
            checks: checks::CheckLimits::default(),
            decision_log: true,
            decision_bounds: retention::DecisionBounds {
                age: Some(std::time::Duration::from_secs(7 * 86_400)),
                max_entries: Some(10_000_000),
            },
            decision_fold: crate::domain::decision_log::FoldRule::default(),
        }
    }
}

/// The policy view decisions read, and the turn admin writers take to change it.
#[derive(Debug)]
struct PolicyState {
    view: ArcSwap<PolicyView>,
    /// Held across an admin write's commit and the view update, so the view
    /// changes in the same order as the store.
    writer: tokio::sync::Mutex<()>,
    /// False while this replica may have missed another's change (PostgreSQL).
    current: std::sync::atomic::AtomicBool,
    current_tx: tokio::sync::watch::Sender<bool>,
}

impl PolicyState {
    fn publish(&self, view: PolicyView) {
        self.view.store(Arc::new(view));
    }

    /// Whether the view is known to be current. Decisions are refused while it is not.
    fn is_current(&self) -> bool {
        self.current.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Refused with UNAVAILABLE unless the view is current.
    fn current_or_unavailable(&self) -> Result<()> {
        if self.is_current() {
            Ok(())
        } else {
            // Fail closed: another replica's change may not have reached this one.
            Err(Error::Unavailable(
                "policy is being reloaded on this replica; retry".into(),
            ))
        }
    }
}

/// The service's capabilities behind the APIs, started together: each handle owns its part
/// of the store's surface and is cheap to clone. Ingress (`crate::ingress`) delivers through
/// `delivery`.
#[derive(Clone, Debug)]
pub struct Hub {
    /// DeliverTrigger(s) and ExplainTrigger: validate, decide, record or drop.
    pub delivery: Delivery,
    /// Packs, grants, activation, Bindings, members, quotas, the audit log, and keeping the
    /// view in step with other replicas.
    pub policy: Policy,
    /// Listing, watching and erasing records; drop reports.
    pub records: Records,
    /// The decision log: ListDecisions, GetDecision.
    pub decisions: Arc<DecisionLog>,
    pub metrics: Arc<Metrics>,
    store: Store,
    drops: Arc<DropLog>,
    /// Every task and thread the hub starts, and those the edges start through it.
    life: Lifecycle,
}

impl Hub {
    /// Loads the policy view and starts, through one `Lifecycle`, every background task and
    /// thread of the service: the drop log's flusher, the sink's writer threads, the check
    /// pool's threads, the retention pruner, the quota returns, the policy listener
    /// (PostgreSQL) and the records' tail. The edges (`crate::app`: the gRPC server, the HTTP
    /// listeners, NATS, readiness) start theirs through `lifecycle()`, and `close` stops them
    /// all in the lifecycle's order.
    pub async fn start(store: Store, limits: Limits, metrics: Arc<Metrics>) -> Result<Hub> {
        let life = Lifecycle::new();
        let view = store.policy_tables().load_policy().await?;
        // On PostgreSQL another replica may change policy between this load and the moment
        // the listener subscribes; the view is current only once the listener has reloaded.
        let current = store.engine() != crate::store::Engine::Postgres;
        // Every stored key: at most MAX_KEYS, plus one overflow row per reason.
        let stored_keys = store
            .delivery_tables()
            .drop_report_keys((drops::MAX_KEYS + DropReason::ALL.len()) as u64)
            .await?;
        let drops = DropLog::start(
            store.delivery_tables(),
            metrics.clone(),
            stored_keys,
            limits.log_flush_every,
            &life,
        );
        let decisions = DecisionLog::start(
            store.decision_tables(),
            metrics.clone(),
            limits.decision_log,
            limits.decision_fold,
            limits.log_flush_every,
            &life,
        );
        let sink = Sink::start(
            store.delivery_tables(),
            metrics.clone(),
            limits.batch_timeout,
            (limits.sink_writers, limits.sink_commit_delay),
            &life,
        );
        // Always: the ingress ledger expires whatever the records' retention.
        retention::start(
            store.clone(),
            metrics.clone(),
            (limits.retention.clone(), limits.decision_bounds),
            limits.prune_every,
            &life,
        );
        let state = Arc::new(PolicyState {
            view: ArcSwap::from_pointee(view),
            writer: tokio::sync::Mutex::new(()),
            current: std::sync::atomic::AtomicBool::new(current),
            current_tx: tokio::sync::watch::channel(current).0,
        });
        let checks = Arc::new(checks::Checks::start(limits.checks, &life));
        let limits = Arc::new(limits);
        let delivery = Delivery {
            checks,
            store: store.delivery_tables(),
            policy: state.clone(),
            drops: drops.clone(),
            log: decisions.clone(),
            sink,
            quotas: Arc::new(quota::Quotas::new(store.engine())),
            limits: limits.clone(),
            recent: Arc::default(),
            metrics: metrics.clone(),
            life: life.clone(),
        };
        quota::start_returns(delivery.quotas.clone(), store.delivery_tables(), &life);
        let policy = Policy {
            store: store.policy_tables(),
            policy: state,
            delivery: delivery.clone(),
        };
        let records = Records {
            store: store.record_tables(),
            drops: drops.clone(),
            log: decisions.clone(),
            tail: Arc::new(watch::Tail::new(limits.watch)),
            metrics: metrics.clone(),
            life: life.clone(),
        };
        // Replicas: follow other replicas' policy changes; report NOT_SERVING while behind.
        policy.start_listener(&life);
        // WatchRecords: one tail per replica; watches end (resumable) when stopping begins.
        records.start_tail(&life);
        Ok(Hub {
            delivery,
            policy,
            records,
            decisions,
            metrics,
            store,
            drops,
            life,
        })
    }

    /// Readiness: the policy view is current and the store answers. On PostgreSQL the policy
    /// listener's heartbeat already proves, every 250 ms and on a connection of its own, that
    /// the store answers, so no pool connection is taken (a busy pool is not an outage); SQLite
    /// is asked, with a second to answer.
    pub async fn ready(&self) -> bool {
        if !self.policy.current() {
            return false;
        }
        self.store.engine() == crate::store::Engine::Postgres
            || matches!(
                tokio::time::timeout(std::time::Duration::from_secs(1), self.store.ping()).await,
                Ok(Ok(()))
            )
    }

    /// The lifecycle every task and thread of the service is started through.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.life
    }

    /// Stopping begins (shutdown's step 1): the listeners take nothing new, the policy
    /// listener stops and open watches end (resumable).
    pub fn begin_stop(&self) {
        self.life.begin_stop();
    }

    /// Shuts down in the lifecycle's order, giving up on a step at `deadline` (an unreachable
    /// store must not keep the process from exiting): stop taking; answer what was taken
    /// (every task started with `Lifecycle::spawn` ends); flush the sink (its writers commit
    /// what is queued and end, as do the check pool and the upkeep tasks) and the drop log
    /// (its last counts written here); close the store.
    pub async fn close(self, deadline: tokio::time::Instant) {
        self.begin_stop();
        if tokio::time::timeout_at(deadline, self.life.answered())
            .await
            .is_err()
        {
            tracing::warn!(live = ?self.life.live(), "tasks still answering at shutdown's deadline; left to the exit");
        }
        if tokio::time::timeout_at(deadline, self.life.close())
            .await
            .is_err()
        {
            tracing::warn!(live = ?self.life.live(), "the sink or an upkeep task did not end by shutdown's deadline; left to the exit");
        }
        match tokio::time::timeout_at(deadline, self.drops.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "drop counts not written at shutdown"),
            Err(_) => {
                tracing::warn!("drop counts not written at shutdown: the store did not answer")
            }
        }
        match tokio::time::timeout_at(deadline, self.decisions.flush(true)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "decision log entries not written at shutdown")
            }
            Err(_) => tracing::warn!(
                "decision log entries not written at shutdown: the store did not answer"
            ),
        }
        let _ = tokio::time::timeout_at(deadline, self.store.close()).await;
    }
}

/// Runs an admin operation to its end even if the caller goes away, so that a
/// commit is never separated from the view update that follows it; shutdown waits for it
/// (a task of `life`'s, answered in step 2).
pub async fn detached<T: Send + 'static>(
    life: &Lifecycle,
    op: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    life.spawn(op)
        .await
        .map_err(|e| Error::internal_from("admin operation failed", e))?
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
