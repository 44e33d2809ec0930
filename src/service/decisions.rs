//! The decision log: entries taken on the hot path without waiting, folded by the fold rule, written in batches in the background; and its reads, by the viewer rules of records.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{read_as, valid_id};
use crate::auth::Caller;
use crate::domain::decision_log::{Entry, FoldRule, Folder};
use crate::error::{Error, Result};
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::store::decisions::DecisionFilter;
use crate::store::{now_micros, DecisionTables};

/// Most entries one statement writes.
const MAX_WRITE: usize = 2_048;
/// Entries kept for writing while the store does not take them; past it the oldest are
/// given up and counted (`hcp_sense_decision_log_lost_total`): a store outage may cost the
/// log its entries, never a delivery its answer.
pub const MAX_PENDING: usize = 100_000;

#[derive(Debug, Default)]
struct Taken {
    folder: Folder,
    pending: Vec<Entry>,
}

/// The decision log of this server. Off (`--decision-log false`), it takes nothing.
#[derive(Debug)]
pub struct DecisionLog {
    store: DecisionTables,
    metrics: Arc<Metrics>,
    on: bool,
    taken: Mutex<Taken>,
    /// One write at a time, so entries are written once and in order.
    writing: tokio::sync::Mutex<()>,
}

impl DecisionLog {
    /// A decision log with a background writer, upkeep of `life` that ends when closing
    /// begins (what is left is then written by `Hub::close`).
    pub fn start(
        store: DecisionTables,
        metrics: Arc<Metrics>,
        on: bool,
        rule: FoldRule,
        every: Duration,
        life: &Lifecycle,
    ) -> Arc<DecisionLog> {
        let log = Arc::new(DecisionLog {
            store,
            metrics,
            on,
            taken: Mutex::new(Taken {
                folder: Folder::new(rule),
                pending: Vec::new(),
            }),
            writing: tokio::sync::Mutex::new(()),
        });
        if on {
            let (written, closing) = (log.clone(), life.closing());
            life.spawn_upkeep(async move {
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        _ = closing.wait() => break,
                    }
                    if let Err(e) = written.flush(false).await {
                        tracing::warn!(error = %e, "decision log entries not written yet; will retry");
                    }
                }
            });
        }
        log
    }

    /// Whether entries are kept: a recorded trigger's entry is then written with its record.
    pub fn on(&self) -> bool {
        self.on
    }

    /// Takes an entry that is not a record's (those are written with their record): folded
    /// or queued, never waiting on the store.
    pub fn take(&self, e: Entry) {
        self.take_with(e, |_| {});
    }

    /// `take`, with `fill` completing the entry only when the fold rule keeps it.
    pub fn take_with(&self, e: Entry, fill: impl FnOnce(&mut Entry)) {
        if !self.on {
            return;
        }
        let Ok(mut t) = self.taken.lock() else {
            return;
        };
        let Taken { folder, pending } = &mut *t;
        let before = pending.len();
        folder.offer_with(e, fill, pending);
        let over = pending.len().saturating_sub(MAX_PENDING);
        if over > 0 {
            pending.drain(..over);
            self.metrics.decision_log_lost(over as u64);
        }
        self.metrics
            .decision_log_taken((pending.len() + over).saturating_sub(before) as u64);
    }

    /// Writes what is pending (and what the fold rule holds past its second; all it holds
    /// when `all`). On failure the entries stay for the next try.
    ///
    /// The write runs to its end in a task of its own: a batch is taken out of `pending`
    /// before it is written, so a caller that goes away mid-write (a ListDecisions cancelled,
    /// shutdown's deadline) must not take the batch with it.
    pub async fn flush(self: &Arc<Self>, all: bool) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let log = self.clone();
        tokio::spawn(async move { log.write_pending(all).await })
            .await
            .map_err(|e| Error::internal_from("decision log write failed", e))?
    }

    async fn write_pending(&self, all: bool) -> Result<()> {
        let _one = self.writing.lock().await;
        loop {
            let batch = {
                let Ok(mut t) = self.taken.lock() else {
                    return Ok(());
                };
                let Taken { folder, pending } = &mut *t;
                if all {
                    folder.drain(pending);
                } else {
                    folder.due(now_micros(), pending);
                }
                let n = pending.len().min(MAX_WRITE);
                pending.drain(..n).collect::<Vec<_>>()
            };
            if batch.is_empty() {
                return Ok(());
            }
            let batch = Arc::new(batch);
            if let Err(e) = self.store.insert_decisions(&batch).await {
                if let Ok(mut t) = self.taken.lock() {
                    let rest = std::mem::take(&mut t.pending);
                    t.pending = Arc::try_unwrap(batch).unwrap_or_else(|b| b.to_vec());
                    t.pending.extend(rest);
                    let over = t.pending.len().saturating_sub(MAX_PENDING);
                    if over > 0 {
                        t.pending.drain(..over);
                        self.metrics.decision_log_lost(over as u64);
                    }
                }
                return Err(e);
            }
            self.metrics.decision_log_written(batch.len() as u64);
        }
    }

    /// Entries matching `f` (checked here) after the cursor, at most `limit`, newest first,
    /// as `caller` may read them: a reader reads its own principal's, as its own viewer.
    pub async fn list(
        self: &Arc<Self>,
        caller: Option<&Caller>,
        mut f: DecisionFilter,
        after: Option<(i64, i64)>,
        limit: u64,
    ) -> Result<Vec<Entry>> {
        as_reader(caller, &mut f)?;
        check_filter(&f)?;
        // What this server has taken but not written yet is part of what it answers.
        if let Err(e) = self.flush(false).await {
            tracing::debug!(error = %e, "decision log entries not written before a listing");
        }
        self.store.list_decisions(&f, after, limit).await
    }

    /// EraseRecords: the principal's entries go with its records.
    pub async fn erase(self: &Arc<Self>, principal: &str, pack_id: Option<&str>) -> Result<u64> {
        // Entries taken before the erasure are written first, so none outlives it.
        self.flush(true).await?;
        self.store.erase_decisions(principal, pack_id).await
    }
}

/// A reader reads as its own principal and viewer (`read_as`).
fn as_reader(caller: Option<&Caller>, f: &mut DecisionFilter) -> Result<()> {
    let (mut principal, mut viewer) = (
        f.principal.take().unwrap_or_default(),
        f.viewer.take().unwrap_or_default(),
    );
    read_as(caller, &mut principal, &mut viewer)?;
    f.principal = (!principal.is_empty()).then_some(principal);
    f.viewer = (!viewer.is_empty()).then_some(viewer);
    Ok(())
}

fn check_filter(f: &DecisionFilter) -> Result<()> {
    crate::service::records::check_filter_fields(
        [f.viewer.as_deref(), f.principal.as_deref()],
        f.pack_id.as_deref(),
        f.r#ref.as_deref(),
        (f.start_time, f.end_time),
    )?;
    if let Some(v) = &f.trigger_id {
        valid_id("trigger_id", v)?;
    }
    if let Some(s) = &f.source {
        if s.is_empty() || s.len() > 200 || s.chars().any(char::is_control) {
            return Err(Error::invalid(
                "source",
                "must be a door (grpc, http, nats, hub) or a source such as `http:<route id>`, at most 200 characters",
            ));
        }
    }
    Ok(())
}

/// The trace id of the current span, when a sampled trace carries it.
pub fn current_trace_id() -> Option<String> {
    // Asked of every decision's entry: without an exporter there is no trace to name.
    if !crate::telemetry::spans_exported() {
        return None;
    }
    let cx = tracing::Span::current().context();
    let sc = opentelemetry::trace::TraceContextExt::span(&cx)
        .span_context()
        .clone();
    (sc.is_valid() && sc.is_sampled()).then(|| sc.trace_id().to_string())
}
