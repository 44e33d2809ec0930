//! §7.1.1, identity: known top-level fields, the pack's id and its kind.
use serde_json::{Map, Value};

use super::Linter;
use crate::domain::names::check_pack_id;
use crate::domain::pack::PackKind;

/// Top-level keys of the manifest. Others draw a warning, not an error, so that
/// manifests written for newer HCP revisions still register.
const KNOWN_KEYS: &[&str] = &[
    "id",
    "packId",
    "name",
    "version",
    "description",
    "kind",
    "stimulusTriggers",
    "policy",
    "stimuli",
    "binding",
    "commands",
    "upstreamRequiresRegistration",
];

/// The pack's id and kind, each `None` when missing or invalid.
pub(super) fn identity(
    l: &mut Linter,
    obj: &Map<String, Value>,
) -> (Option<String>, Option<PackKind>) {
    for key in obj.keys() {
        if !KNOWN_KEYS.contains(&key.as_str()) {
            l.warn(
                "s7_1_1",
                key.clone(),
                format!("unknown manifest field `{key}` is ignored"),
            );
        }
    }

    // Identity.
    let id_key = if obj.contains_key("id") {
        "id"
    } else {
        "packId"
    };
    let pack_id = l.opt_str(obj, id_key, id_key).map(str::to_owned);
    match &pack_id {
        None => l.error("s7_1_1", "id", "the manifest must name its pack in `id`"),
        Some(id) => {
            if let Err(e) = check_pack_id(id) {
                l.error("s7_1_1", id_key, e);
            }
        }
    }

    let kind = match l.opt_str(obj, "kind", "kind") {
        None => Some(PackKind::Standard),
        Some(k) => PackKind::parse(k).or_else(|| {
            l.error(
                "s7_1_1",
                "kind",
                format!("kind `{k}` must be one of {}", PackKind::NAMES.join(", ")),
            );
            None
        }),
    };

    (pack_id, kind)
}
