//! Reads of the sink and the drop log — reading changes nothing (§7.5.3) — whom a reader reads as, and the erasure of a principal's records.
use std::sync::Arc;

use super::drops::DropLog;
use super::watch::Tail;
use super::{valid_id, valid_pack_id};
use crate::auth::{Caller, Role};
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

/// A request as a reader makes it: its principal and viewer become the reader's own, and
/// naming another for either is refused (`viewer` checked before it is echoed). Returns the
/// reader's principal; `None` for any other caller, whose request is left as it is.
pub fn read_as(
    caller: Option<&Caller>,
    principal: &mut String,
    viewer: &mut String,
) -> Result<Option<String>> {
    if !viewer.is_empty() {
        valid_id("viewer", viewer)?;
    }
    let reader = reader_principal(caller, principal)?;
    if let Some(own) = &reader {
        if !viewer.is_empty() && viewer != own {
            return Err(Error::PermissionDenied(format!(
                "a reader reads only as its own principal, not as viewer `{viewer}`"
            )));
        }
        principal.clone_from(own);
        viewer.clone_from(own);
    }
    Ok(reader)
}

/// Whom a read is for, the one rule for readers of every read (records, watches, trigger
/// types). A reader reads as its own principal, whatever it names, and may name no other:
/// `Some(own)`, which the caller puts in place of what was asked. Any other caller (an admin,
/// a producer, or anyone when authentication is off) reads as it asks: `None`.
pub fn reader_principal(caller: Option<&Caller>, asked: &str) -> Result<Option<String>> {
    let Some(Caller::Known(id)) = caller else {
        return Ok(None);
    };
    if id.role != Role::Reader {
        return Ok(None);
    }
    // Authentication refuses a reader without a principal; were one to come through, it
    // reads nothing rather than everyone's.
    let Some(own) = id.principal.clone().filter(|p| !p.is_empty()) else {
        return Err(Error::PermissionDenied(
            "a reader without a principal reads nothing".into(),
        ));
    };
    if !asked.is_empty() {
        // Checked first, so a refusal never echoes an invisible or control character.
        valid_id("principal", asked)?;
    }
    if !asked.is_empty() && asked != own {
        return Err(Error::PermissionDenied(format!(
            "a reader reads only as its own principal, not as `{asked}`"
        )));
    }
    Ok(Some(own))
}

/// Records once written: listed in pages, watched as they commit, erased by principal; and
/// the drop reports. Owns the records' tail that watches read.
#[derive(Clone, Debug)]
pub struct Records {
    pub(super) store: RecordTables,
    pub(super) tail: Arc<Tail>,
    /// Pending drop counts are written before a report is read.
    pub(super) drops: Arc<DropLog>,
    /// An erasure takes the principal's decision log entries with its records.
    pub(super) log: Arc<super::DecisionLog>,
    pub(super) metrics: Arc<Metrics>,
    /// The tail and erasures run to their end are tasks of this lifecycle.
    pub(super) life: crate::lifecycle::Lifecycle,
}

impl Records {
    /// The lifecycle an erasure run to its end is started through.
    pub fn lifecycle(&self) -> &crate::lifecycle::Lifecycle {
        &self.life
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
        let decisions = self.log.erase(principal, pack).await?;
        tracing::info!(principal, pack_id, decisions, "decision log entries erased");
        tracing::info!(principal, pack_id, erased, "records erased");
        Ok(erased)
    }

    /// Records matching `f` after the cursor `after`, at most `limit`, in `f`'s order.
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
        check_filter_fields(
            [f.viewer.as_deref(), f.principal.as_deref()],
            f.pack_id.as_deref(),
            f.r#ref.as_deref(),
            (f.start_time, f.end_time),
        )?;
        if let Some(v) = &f.land {
            check_land(v).map_err(|e| Error::invalid("land", e))?;
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

/// The fields a record filter and a decision filter share: viewer, principal, pack, ref and a
/// time span whose end is not before its start.
pub(crate) fn check_filter_fields(
    [viewer, principal]: [Option<&str>; 2],
    pack_id: Option<&str>,
    r#ref: Option<&str>,
    (start, end): (Option<i64>, Option<i64>),
) -> Result<()> {
    if let Some(v) = viewer {
        valid_id("viewer", v)?;
    }
    if let Some(v) = principal {
        valid_id("principal", v)?;
    }
    if let Some(v) = pack_id {
        valid_pack_id(v)?;
    }
    if let Some(v) = r#ref {
        check_ref(v).map_err(|e| Error::invalid("ref", e))?;
    }
    if let (Some(s), Some(e)) = (start, end) {
        if e < s {
            return Err(Error::invalid("end_time", "must not be before start_time"));
        }
    }
    Ok(())
}
