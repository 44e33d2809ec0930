//! The trigger catalog a harness reads: each declared ref with its land, description and payload schema, and whether a principal could receive it now.
use serde_json::{Map, Value};

use super::explain::{explain, Verdict};
use super::policy::PolicyView;
use super::trigger::{DropReason, Trigger};

/// One declared ref of a registered pack, as ListTriggerTypes shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct TriggerTypeView {
    pub pack_id: String,
    pub r#ref: String,
    /// The land of the pack's Policy entry for the ref, if it has one.
    pub land: Option<String>,
    pub description: Option<String>,
    pub schema: Option<Value>,
    /// For the principal asked about: whether a trigger of this ref would be recorded now.
    pub receivable: Option<Receivable>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receivable {
    pub principal: String,
    pub now: bool,
    /// The drop reasons of the grant, Binding and activation checks that fail, in order.
    pub reasons: Vec<DropReason>,
}

/// The checks of the decision that say whether a principal could receive a ref at all, apart
/// from what a payload holds (a filter) or the ref's land.
const RECEIVING: &[&str] = &["grant", "binding", "activation"];

/// Declared refs ordered by (pack id, ref) after `after`, at most `limit`, of `pack` only when
/// given; each with its receivability for `principal` when given.
pub fn trigger_types(
    view: &PolicyView,
    pack: Option<&str>,
    after: Option<(&str, &str)>,
    limit: usize,
    principal: Option<&str>,
) -> Vec<TriggerTypeView> {
    let mut keys: Vec<(&str, &str)> = view
        .pack_ids()
        .filter(|id| pack.is_none_or(|p| p == *id))
        .filter_map(|id| view.pack(id).map(|p| (id, p)))
        .flat_map(|(id, p)| p.trigger_types.refs().map(move |r| (id, r)))
        .filter(|k| after.is_none_or(|a| *k > a))
        .collect();
    keys.sort_unstable();
    keys.truncate(limit);
    keys.into_iter()
        .filter_map(|(id, r)| {
            let p = view.pack(id)?;
            let t = p.trigger_types.get(r)?;
            let land = p.lands.get(r).cloned();
            Some(TriggerTypeView {
                pack_id: id.to_owned(),
                r#ref: r.to_owned(),
                description: t.description.clone(),
                schema: t.schema.as_ref().map(|s| s.raw.clone()),
                receivable: principal.map(|who| receivable(view, id, r, land.as_deref(), who)),
                land,
            })
        })
        .collect()
}

/// What the decision's grant, Binding and activation checks make of a trigger of `ref` for
/// `principal` now.
fn receivable(
    view: &PolicyView,
    pack_id: &str,
    r#ref: &str,
    land: Option<&str>,
    principal: &str,
) -> Receivable {
    let t = Trigger {
        pack_id: pack_id.to_owned(),
        r#ref: r#ref.to_owned(),
        principal: principal.to_owned(),
        land: land.unwrap_or_default().to_owned(),
        payload: Map::new(),
        payload_bytes: 2,
        project: None,
        trigger_id: None,
    };
    let reasons: Vec<DropReason> = explain(view, &t)
        .checks
        .into_iter()
        .filter(|c| RECEIVING.contains(&c.name) && c.verdict != Verdict::Pass)
        .map(|c| c.reason)
        .collect();
    Receivable {
        principal: principal.to_owned(),
        now: reasons.is_empty(),
        reasons,
    }
}
