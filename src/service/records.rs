//! Reads of the sink, the drop log and the audit log — reading changes nothing (§7.5.3) — and the erasure of a principal's records.
use std::sync::Arc;

use super::drops::DropLog;
use super::watch::Tail;
use super::{valid_id, valid_pack_id};
use crate::domain::model::{DropReport, RecordFilter};
use crate::domain::names::{check_land, check_ref};
use crate::domain::trigger::DropReason;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::store::audit::Actor;
use crate::store::RecordTables;
use crate::store::{Listed, RecordCursor};

/// Records deleted per transaction of an erasure.
pub const ERASE_BATCH: u64 = super::retention::PRUNE_BATCH;
/// The pause between two batches of an erasure: deliveries waiting on the writer go first.
const ERASE_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// Records once written: listed in pages, watched as they commit, erased by principal; and
/// the drop reports. Owns the records' tail that watches read.
#[derive(Clone, Debug)]
pub struct Records {
    pub(super) store: RecordTables,
    pub(super) tail: Arc<Tail>,
    /// Pending drop counts are written before a report is read.
    pub(super) drops: Arc<DropLog>,
    pub(super) metrics: Arc<Metrics>,
}

impl Records {
    /// Whether a record read before an erasure was erased by it (WatchRecords checks each
    /// record as it goes out).
    pub fn erased(&self, r: &crate::domain::model::Record) -> bool {
        self.tail.erased(r)
    }

    /// EraseRecords: deletes every record of `principal` (of `pack_id` only, when given) in
    /// batches of ERASE_BATCH, audited with the count; this replica's watches drop the
    /// erased records they hold before the answer, other replicas' when the store tells them.
    /// The principal is required: an erasure never means everyone.
    pub async fn erase_records(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
    ) -> Result<u64> {
        if principal.is_empty() {
            return Err(Error::invalid(
                "principal",
                "is required: whose records to erase (an erasure never means everyone)",
            ));
        }
        valid_id("principal", principal)?;
        let pack = (!pack_id.is_empty()).then_some(pack_id);
        if let Some(p) = pack {
            valid_pack_id(p)?;
        }
        let (erased, erasure) = self
            .store
            .erase_records(actor, principal, pack, ERASE_BATCH, ERASE_PAUSE)
            .await?;
        self.tail.erase(vec![erasure]);
        self.metrics.records_deleted("erasure", erased);
        tracing::info!(principal, pack_id, erased, "records erased");
        Ok(erased)
    }

    /// Audit events, newest first, before the (time, id) position `before`; reading is not audited.
    pub async fn list_records(
        &self,
        f: &RecordFilter,
        after: Option<&RecordCursor>,
        limit: u64,
    ) -> Result<Listed> {
        self.check_record_filter(f)?;
        self.store.list_records(f, after, limit).await
    }

    /// The rules on a listing's or a watch's filters.
    pub(crate) fn check_record_filter(&self, f: &RecordFilter) -> Result<()> {
        if let Some(v) = &f.viewer {
            valid_id("viewer", v)?;
        }
        if let Some(v) = &f.principal {
            valid_id("principal", v)?;
        }
        if let Some(v) = &f.pack_id {
            valid_pack_id(v)?;
        }
        if let Some(v) = &f.r#ref {
            check_ref(v).map_err(|e| Error::invalid("ref", e))?;
        }
        if let Some(v) = &f.land {
            check_land(v).map_err(|e| Error::invalid("land", e))?;
        }
        if let (Some(s), Some(e)) = (f.start_time, f.end_time) {
            if e < s {
                return Err(Error::invalid("end_time", "must not be before start_time"));
            }
        }
        Ok(())
    }

    /// Drop reports, after writing the counts still pending so the caller sees every drop so far.
    pub async fn list_drop_reports(
        &self,
        pack_id: Option<&str>,
        reason: Option<DropReason>,
        after: Option<(&str, &str, &str)>,
        limit: u64,
    ) -> Result<Vec<DropReport>> {
        if let Some(p) = pack_id {
            valid_pack_id(p)?;
        }
        self.drops.flush().await?;
        self.store
            .list_drop_reports(pack_id, reason, after, limit)
            .await
    }
}
