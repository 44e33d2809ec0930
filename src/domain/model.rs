//! What the store keeps besides packs: grants, Bindings, activations, Execute state, records, drop reports.
use serde_json::{Map, Value};

use super::decide::DropReason;
use super::pack::BindingMode;
use super::policy::{BindingState, Route};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub principal: String,
    pub pack_id: String,
    pub create_time: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Binding {
    pub principal: String,
    pub pack_id: String,
    pub binding_id: String,
    pub mode: BindingMode,
    pub state: BindingState,
    pub update_time: i64,
}

/// A stored activation; an empty principal is the pack-wide one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ActivationRow {
    pub principal: String,
    pub pack_id: String,
    pub enabled: bool,
    pub route: Route,
    pub update_time: i64,
}

/// Execute-side state, owned by Execute (§7.4.1).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct ExecuteState {
    pub principal: String,
    pub pack_id: String,
    pub installed: bool,
    pub activated: bool,
    pub connected: bool,
    pub update_time: i64,
}

/// A sink record (§7.5.1).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub record_id: String,
    pub principal: String,
    pub binding_id: String,
    pub land: String,
    pub pack_id: String,
    pub r#ref: String,
    pub payload: Map<String, Value>,
    pub route: Route,
    pub project: Option<String>,
    pub trigger_id: Option<String>,
    /// When the service received it, by its clock: data, not order.
    pub received_time: i64,
    /// Where it sits in commit order; zero until the store has written it.
    pub position: Position,
}

/// A record's place in commit order, assigned by the store: the id of the transaction that
/// wrote it (0 where the store has one writer), then a number from the store's sequence.
/// Every record committed after a listing has read position `p` gets a position above `p`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub txid: i64,
    pub seq: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropReport {
    pub pack_id: String,
    pub r#ref: String,
    pub reason: DropReason,
    pub count: i64,
    pub first_seen: i64,
    pub last_seen: i64,
}

/// Filters of ListRecords; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct RecordFilter {
    /// Brain records are visible only to members of their project.
    pub viewer: Option<String>,
    pub principal: Option<String>,
    pub pack_id: Option<String>,
    pub r#ref: Option<String>,
    pub land: Option<String>,
    pub route: Option<Route>,
    /// Inclusive, microseconds.
    pub start_time: Option<i64>,
    /// Exclusive, microseconds.
    pub end_time: Option<i64>,
    pub descending: bool,
}

impl RecordFilter {
    /// Whether a record passes the equality filters (not the time bounds, nor visibility).
    pub fn matches(&self, r: &Record) -> bool {
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.principal, &r.principal)
            && eq(&self.pack_id, &r.pack_id)
            && eq(&self.r#ref, &r.r#ref)
            && eq(&self.land, &r.land)
            && self.route.is_none_or(|route| route == r.route)
    }

    /// §7.5.2: whether the viewer may read the record, given the projects it is a member of
    /// now. A brain record is read only by a member of its project; without a viewer, never.
    pub fn visible(
        &self,
        r: &Record,
        viewer_projects: &std::collections::BTreeSet<String>,
    ) -> bool {
        r.land != crate::domain::decide::BRAIN
            || (self.viewer.is_some()
                && r.project
                    .as_ref()
                    .is_some_and(|p| viewer_projects.contains(p)))
    }
}

/// A principal's membership of a project (§7.5.2: brain records are read by members).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub project: String,
    pub principal: String,
    pub create_time: i64,
}

/// One page of a listing keyed by two strings — (pack, principal) or (project, principal):
/// optional equality filters on each, the key the page starts after, and how many rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyPage<'a> {
    pub first: Option<&'a str>,
    pub second: Option<&'a str>,
    pub after: Option<(&'a str, &'a str)>,
    pub limit: u64,
}
