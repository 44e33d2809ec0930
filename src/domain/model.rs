//! What the store keeps besides packs: grants, Bindings, activations, Execute state, records, drop reports.
use serde_json::{Map, Value};

use super::pack::BindingMode;
use super::policy::{BindingState, Route};
use super::trigger::{DropReason, Identity};

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
    /// The activation's filter (CEL); empty: none.
    pub filter: String,
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

impl Record {
    /// Whether this record, found under a trigger's id, was made for that trigger (a retry)
    /// rather than for another that reused the id.
    pub fn same_trigger(&self, t: Identity<'_>) -> bool {
        Identity {
            principal: &self.principal,
            r#ref: &self.r#ref,
            land: &self.land,
            payload: &self.payload,
        } == t
    }
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
    /// Only the record with this id.
    pub record_id: Option<String>,
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
            && eq(&self.record_id, &r.record_id)
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
        r.land != crate::domain::trigger::BRAIN
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

/// Records erased at a principal's request: theirs (of one pack, when set) at or below
/// `upto`. Watches apply it to what they hold in memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Erasure {
    pub principal: String,
    pub pack_id: Option<String>,
    pub upto_txid: i64,
    pub upto_seq: i64,
}

impl Erasure {
    pub fn upto(&self) -> Position {
        Position {
            txid: self.upto_txid,
            seq: self.upto_seq,
        }
    }

    /// Whether the erasure took this record.
    pub fn covers(&self, r: &Record) -> bool {
        r.principal == self.principal
            && self.pack_id.as_deref().is_none_or(|p| p == r.pack_id)
            && r.position <= self.upto()
    }
}

/// How long records are kept: a land listed keeps its own age (`None`: for ever), every
/// other land the default (`None`: for ever).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retention {
    pub default: Option<std::time::Duration>,
    pub lands: std::collections::BTreeMap<String, Option<std::time::Duration>>,
}

impl Retention {
    /// Whether any record is ever deleted.
    pub fn prunes(&self) -> bool {
        self.default.is_some() || self.lands.values().any(Option::is_some)
    }

    /// The longest any record is kept (`None`: some record is kept for ever).
    pub fn longest(&self) -> Option<std::time::Duration> {
        let mut ages = self.lands.values().copied().chain([self.default]);
        ages.try_fold(std::time::Duration::ZERO, |m, a| a.map(|a| m.max(a)))
    }

    /// Parses `land=age,…` (`user=30d,brain=365d`): an age is a whole number with its unit
    /// `s`, `m`, `h` or `d`; `0` keeps the land's records for ever. An empty entry (`user=30d,`)
    /// is refused: it is what a list cut short by a shell or a template looks like.
    pub fn parse_lands(
        text: &str,
    ) -> Result<std::collections::BTreeMap<String, Option<std::time::Duration>>, String> {
        let mut out = std::collections::BTreeMap::new();
        if text.trim().is_empty() {
            return Ok(out);
        }
        for entry in text.split(',').map(str::trim) {
            if entry.is_empty() {
                return Err(format!(
                    "`{text}` has an empty entry: give land=age entries separated by commas"
                ));
            }
            let (land, age) = entry
                .split_once('=')
                .ok_or_else(|| format!("`{entry}` must be land=age, as user=30d"))?;
            let land = land.trim();
            super::names::check_land(land).map_err(|e| format!("`{entry}`: {e}"))?;
            let age = parse_age(age.trim()).map_err(|e| format!("`{entry}`: {e}"))?;
            if out.insert(land.to_owned(), age).is_some() {
                return Err(format!("land `{land}` is given twice"));
            }
        }
        Ok(out)
    }
}

/// `30d`, `12h`, `90m` or `3600s`; `0` is `None` (for ever). A number without a unit is
/// refused: `user=30` meant as days would delete a month of records in 30 s. `humantime` reads the
/// number and its unit; of its units an age takes only these four, whose length is fixed
/// (`humantime`'s month and year are fractions of days) and which a reader cannot confuse
/// (`m` is minutes here, never months).
pub fn parse_age(s: &str) -> Result<Option<std::time::Duration>, String> {
    let bad = || format!("the age `{s}` must be a whole number with s, m, h or d (30d)");
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let unit = &s[digits..];
    if digits == 0 || !matches!(unit, "" | "s" | "m" | "h" | "d") {
        return Err(bad());
    }
    if unit.is_empty() {
        if s.bytes().all(|b| b == b'0') {
            return Ok(None);
        }
        return Err(format!(
            "the age `{s}` needs a unit: s, m, h or d ({s}d for days, {s}s for seconds)"
        ));
    }
    let age = humantime::parse_duration(s).map_err(|e| match e {
        humantime::DurationError::NumberOverflow => format!("the age `{s}` is too long"),
        _ => bad(),
    })?;
    if age.as_secs() > i64::MAX as u64 / 1_000_000 {
        return Err(format!("the age `{s}` is too long"));
    }
    Ok((!age.is_zero()).then_some(age))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_longest_retention_is_none_when_any_record_is_kept_for_ever() {
        let day = Duration::from_secs(86_400);
        let mut r = Retention {
            default: Some(day),
            lands: [("brain".to_owned(), Some(day * 30))].into(),
        };
        assert_eq!(r.longest(), Some(day * 30));
        r.lands.insert("user".into(), None);
        assert_eq!(r.longest(), None, "a land kept for ever");
        r.lands.clear();
        assert_eq!(r.longest(), Some(day));
        r.default = None;
        assert_eq!(r.longest(), None, "every other land kept for ever");
    }

    #[test]
    fn land_retention_parses_ages_and_refuses_what_it_cannot_read() {
        let r = Retention::parse_lands("user=30d, brain=365d,project=12h,x=0,y=90s,z=00")
            .expect("parses");
        assert_eq!(r["user"], Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(r["brain"], Some(Duration::from_secs(365 * 86_400)));
        assert_eq!(r["project"], Some(Duration::from_secs(12 * 3600)));
        assert_eq!(r["x"], None, "0 keeps for ever");
        assert_eq!(r["z"], None, "so does 00");
        assert_eq!(r["y"], Some(Duration::from_secs(90)));
        assert!(Retention::parse_lands("").expect("empty").is_empty());
        assert!(Retention::parse_lands("  ").expect("blank").is_empty());
        for (bad, says) in [
            ("user", "land=age"),
            ("user=30w", "s, m, h or d"),
            ("user=-1d", "s, m, h or d"),
            ("user=d", "s, m, h or d"),
            ("User=1d", "lower-case"),
            ("=1d", "non-empty"),
            ("user=1d,user=2d", "twice"),
            ("user=99999999999999999d", "too long"),
            ("user=99999999999999999999999s", "too long"),
            ("user=1h30m", "s, m, h or d"),
            ("user=1h 30m", "s, m, h or d"),
            ("user=1month", "s, m, h or d"),
            ("user=30 d", "s, m, h or d"),
            ("user=1y", "s, m, h or d"),
            // A bare number is no age: 30 meant as days must not delete after 30 s.
            ("user=30", "needs a unit"),
            ("user=1", "needs a unit"),
            ("user=30d,", "empty entry"),
            (",user=30d", "empty entry"),
            ("user=30d,,brain=1d", "empty entry"),
        ] {
            let e = Retention::parse_lands(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
