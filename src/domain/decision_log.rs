//! The decision log's entries, what one decision leaves behind (never a dropped trigger's payload), and the rule that folds a flood of them into counts.
use std::collections::HashMap;

use super::explain::{Explanation, Verdict};
use super::policy::PolicyView;
use super::trigger::Route;
use super::trigger::{DropReason, Trigger};

/// How a decision came out, as the log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Logged {
    /// Recorded, surfaced in the principal's inbox.
    Inbox,
    /// Recorded, silent.
    Silent,
    /// Dropped, with its reason (§7.3.2).
    Dropped,
    /// Refused before the decision: over a quota, or a payload its schema refuses.
    Refused,
    /// A trigger id recorded before: answered with its first record.
    Duplicate,
}

str_enum!(Logged {
    Inbox = "inbox",
    Silent = "silent",
    Dropped = "dropped",
    Refused = "refused",
    Duplicate = "duplicate",
});

impl Logged {
    /// Whether an entry of this outcome stands beside a record of its own.
    pub fn is_recorded(self) -> bool {
        matches!(self, Logged::Inbox | Logged::Silent)
    }

    pub fn recorded(route: Route) -> Logged {
        match route {
            Route::Inbox => Logged::Inbox,
            Route::Silent => Logged::Silent,
        }
    }
}

/// One entry of the decision log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The store's order of entries; 0 until stored.
    pub seq: i64,
    /// Unix microseconds.
    pub decided_time: i64,
    pub pack_id: String,
    pub r#ref: String,
    pub principal: String,
    pub land: String,
    pub project: Option<String>,
    /// The Binding the record was routed by; empty when none was reached.
    pub binding_id: String,
    pub trigger_id: Option<String>,
    /// Where the trigger came from: `grpc:DeliverTrigger`, `grpc:DeliverTriggers`,
    /// `http:<route id>`, `nats:<route id>`, `hub`.
    pub source: String,
    pub outcome: Logged,
    pub drop_reason: Option<DropReason>,
    /// The check that decided it (`grant`, `filter`, `quota`, `schema`, `route`, …).
    pub check: String,
    /// What that check read and concluded, in ExplainTrigger's words.
    pub detail: String,
    /// The record: its own when recorded, the first one for a duplicate.
    pub record_id: Option<String>,
    /// The trace of the delivery, when one was sampled.
    pub trace_id: Option<String>,
    /// Decisions of the same fold key in the same second counted into this entry besides
    /// itself (see `FoldRule`).
    pub folded: i64,
}

impl Entry {
    /// The entry as read back: a recorded one is given the check and detail every recorded
    /// decision has, which its row does not store (see `Note`).
    pub fn told(mut self) -> Entry {
        let route = match self.outcome {
            Logged::Inbox => Route::Inbox,
            Logged::Silent => Route::Silent,
            _ => return self,
        };
        if self.check.is_empty() {
            self.check = RECORDED_CHECK.to_owned();
            self.detail = recorded_detail(route, &self.binding_id);
        }
        self
    }

    /// Decisions this entry stands for: itself and those folded into it.
    pub fn answers(&self) -> i64 {
        1 + self.folded
    }
}

/// What a recorded trigger's entry adds to its record, written in the record's commit. Its
/// check and detail are not stored: every recorded entry's are the same words, `route` and
/// `recorded_detail`, given back when it is read (`Entry::told`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub source: String,
    pub trace_id: Option<String>,
}

impl Note {
    /// The entry of `record`, stored with `record_id` at `decided_time`.
    pub fn entry(&self, r: &super::model::Record, decided_time: i64) -> Entry {
        Entry {
            seq: 0,
            decided_time,
            pack_id: r.pack_id.clone(),
            r#ref: r.r#ref.clone(),
            principal: r.principal.clone(),
            land: r.land.clone(),
            project: r.project.clone(),
            binding_id: r.binding_id.clone(),
            trigger_id: r.trigger_id.clone(),
            source: self.source.clone(),
            outcome: Logged::recorded(r.route),
            drop_reason: None,
            check: String::new(),
            detail: String::new(),
            record_id: Some(r.record_id.clone()),
            trace_id: self.trace_id.clone(),
            folded: 0,
        }
    }
}

/// The check that decided a drop, and what it read, from ExplainTrigger's account: the first
/// check that failed (or could not be made), in the decision order.
pub fn deciding_check(e: &Explanation) -> (String, String) {
    let failed = e
        .checks
        .iter()
        .find(|c| c.verdict == Verdict::Fail)
        .or_else(|| e.checks.iter().find(|c| c.verdict == Verdict::NotReached));
    match failed {
        Some(c) => told(c.name, &c.facts, &c.detail),
        None => (String::new(), String::new()),
    }
}

/// `deciding_check(&explain(view, t))` for a dropped `t`, with an account of the deciding
/// check alone: a kept drop's entry is written on the delivery's path.
pub fn drop_deciding_check(view: &PolicyView, t: &Trigger) -> (String, String) {
    match super::checks::deciding(view, t) {
        Some((def, account)) => told(def.name, &account.facts, &account.detail),
        None => (String::new(), String::new()),
    }
}

/// A check's name, and its detail followed by what it read.
fn told(name: &str, facts: &[(&'static str, String)], detail: &str) -> (String, String) {
    // One string written in place: a kept drop's entry is made on the delivery's path.
    let mut told = String::with_capacity(
        detail.len()
            + facts
                .iter()
                .map(|(k, v)| k.len() + v.len() + 3)
                .sum::<usize>()
            + 2,
    );
    told.push_str(detail);
    for (n, (k, v)) in facts.iter().enumerate() {
        told.push_str(if n == 0 { " (" } else { ", " });
        told.push_str(k);
        told.push('=');
        told.push_str(v);
    }
    if !facts.is_empty() {
        told.push(')');
    }
    (name.to_owned(), told)
}

/// The check a recorded decision's entry names: every check passed, and the route was taken.
pub const RECORDED_CHECK: &str = "route";

/// What a recorded decision's entry says: every check passed, and where it went.
pub fn recorded_detail(route: Route, binding_id: &str) -> String {
    format!(
        "every check passed: recorded {} by Binding `{binding_id}`",
        route.as_str()
    )
}

/// The rule that bounds the log's writes under a flood. Recorded entries are never folded:
/// each is written with its record. Every other entry counts against its key's allowance
/// (`per_key` a second, the key being pack, principal, outcome and drop reason) and the
/// log's (`in_all` a second); past either, it is folded: the first folded decision of its key
/// in that second is held, the rest are counted into it, and it is written once the second
/// is over with that count in `folded`. At most `keys` keys are followed at once; past it, a
/// new key's decisions fold under the pack and principal `*`. So the log writes at most
/// `in_all + keys + 1` entries a second that are not records, whatever the flood, and
/// entries plus their folded counts equal the decisions answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FoldRule {
    pub per_key: u32,
    pub in_all: u32,
    pub keys: usize,
}

impl Default for FoldRule {
    fn default() -> Self {
        FoldRule {
            per_key: 10,
            in_all: 1_000,
            keys: 1_000,
        }
    }
}

/// The pack and principal of decisions folded past the rule's keys.
pub const FOLDED_ANY: &str = "*";

type Key = (String, String, Logged, Option<DropReason>);

#[derive(Debug, Default)]
struct Allowance {
    /// The second (Unix) these counts are of.
    second: i64,
    written: u32,
    /// The first decision folded this second, and how many more were.
    held: Option<Entry>,
}

/// The fold rule applied to entries as they come; pure bookkeeping, no clock of its own.
#[derive(Debug, Default)]
pub struct Folder {
    rule: FoldRule,
    second: i64,
    written_in_all: u32,
    /// The second keys were last made room among: once a second, not once a decision.
    swept: i64,
    keys: HashMap<Key, Allowance>,
}

impl Folder {
    pub fn new(rule: FoldRule) -> Folder {
        Folder {
            rule,
            ..Default::default()
        }
    }

    /// Offers `e`, decided at `e.decided_time`: the entries to write now (`e` itself when its
    /// allowances admit it, and any held entry of an earlier second that it closes).
    pub fn offer(&mut self, e: Entry, out: &mut Vec<Entry>) {
        self.offer_with(e, |_| {}, out);
    }

    /// `offer`, with `fill` completing `e` only when it is kept (written, or held to stand
    /// for its key's folded decisions): what is costly to say about a decision is said only
    /// for entries that are kept.
    pub fn offer_with(
        &mut self,
        mut e: Entry,
        fill: impl FnOnce(&mut Entry),
        out: &mut Vec<Entry>,
    ) {
        let second = e.decided_time.div_euclid(1_000_000);
        if second != self.second {
            self.second = second;
            self.written_in_all = 0;
        }
        let mut key: Key = (
            e.pack_id.clone(),
            e.principal.clone(),
            e.outcome,
            e.drop_reason,
        );
        // Looked up only when the keys are full: the common case hashes the key once.
        if self.keys.len() >= self.rule.keys && !self.keys.contains_key(&key) {
            // Make room from keys whose second is over and that hold nothing.
            if self.swept != second {
                self.swept = second;
                self.keys
                    .retain(|_, a| a.second == second || a.held.is_some());
            }
            if self.keys.len() >= self.rule.keys {
                key = (
                    FOLDED_ANY.into(),
                    FOLDED_ANY.into(),
                    e.outcome,
                    e.drop_reason,
                );
                e.pack_id = FOLDED_ANY.into();
                e.principal = FOLDED_ANY.into();
                e.trigger_id = None;
                e.record_id = None;
            }
        }
        let a = self.keys.entry(key).or_default();
        if a.second != second {
            if let Some(h) = a.held.take() {
                out.push(h);
            }
            a.second = second;
            a.written = 0;
        }
        let overflow = e.pack_id == FOLDED_ANY;
        if !overflow && a.written < self.rule.per_key && self.written_in_all < self.rule.in_all {
            a.written += 1;
            self.written_in_all += 1;
            fill(&mut e);
            out.push(e);
            return;
        }
        match &mut a.held {
            Some(h) => h.folded += e.answers(),
            None => {
                if !overflow {
                    fill(&mut e);
                }
                a.held = Some(e);
            }
        }
    }

    /// Held entries whose second ended before `now` (Unix microseconds): written now.
    pub fn due(&mut self, now: i64, out: &mut Vec<Entry>) {
        let second = now.div_euclid(1_000_000);
        for a in self.keys.values_mut() {
            if a.second < second {
                if let Some(h) = a.held.take() {
                    out.push(h);
                }
            }
        }
        self.keys
            .retain(|_, a| a.second >= second || a.held.is_some());
    }

    /// Every held entry, whatever its second (the server is closing).
    pub fn drain(&mut self, out: &mut Vec<Entry>) {
        out.extend(self.keys.drain().filter_map(|(_, a)| a.held));
    }

    /// Keys followed now.
    pub fn keys(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check's detail, then what it read in parentheses, in the order it read them.
    #[test]
    fn a_deciding_check_is_told_with_what_it_read() {
        assert_eq!(
            told("grant", &[], "no grant"),
            ("grant".to_owned(), "no grant".to_owned())
        );
        assert_eq!(
            told("ref", &[("ref", "issue.closed".into())], "undeclared").1,
            "undeclared (ref=issue.closed)"
        );
        assert_eq!(
            told("land", &[("land", "user".into()), ("wants", "".into())], "").1,
            " (land=user, wants=)"
        );
    }

    fn entry(principal: &str, micros: i64, n: usize) -> Entry {
        Entry {
            seq: 0,
            decided_time: micros,
            pack_id: "github".into(),
            r#ref: "issue.opened".into(),
            principal: principal.into(),
            land: "user".into(),
            project: None,
            binding_id: String::new(),
            trigger_id: Some(format!("t-{n}")),
            source: "grpc:DeliverTrigger".into(),
            outcome: Logged::Dropped,
            drop_reason: Some(DropReason::NoGrant),
            check: "grant".into(),
            detail: String::new(),
            record_id: None,
            trace_id: None,
            folded: 0,
        }
    }

    fn answers(es: &[Entry]) -> i64 {
        es.iter().map(Entry::answers).sum()
    }

    #[test]
    fn a_keys_first_entries_a_second_are_written_and_the_rest_fold_into_the_first_folded() {
        let rule = FoldRule {
            per_key: 3,
            in_all: 100,
            keys: 10,
        };
        let mut f = Folder::new(rule);
        let mut out = Vec::new();
        for n in 0..10 {
            f.offer(entry("alice", 5_000_000 + n as i64, n), &mut out);
        }
        // n accepted at the boundary, n+1 folded.
        assert_eq!(out.len(), 3);
        f.due(5_999_999, &mut out);
        assert_eq!(out.len(), 3, "nothing is due within the second");
        f.due(6_000_000, &mut out);
        assert_eq!(out.len(), 4);
        let held = &out[3];
        assert_eq!(held.trigger_id.as_deref(), Some("t-3"));
        assert_eq!(held.folded, 6);
        assert_eq!(answers(&out), 10);
        // The next second starts afresh.
        f.offer(entry("alice", 6_100_000, 10), &mut out);
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn the_log_wide_allowance_folds_every_key_past_it_and_counts_stay_exact() {
        let rule = FoldRule {
            per_key: 10,
            in_all: 5,
            keys: 100,
        };
        let mut f = Folder::new(rule);
        let mut out = Vec::new();
        let mut offered = 0;
        for p in 0..20 {
            for n in 0..4 {
                f.offer(entry(&format!("p{p}"), 1_000_000 + n, n as usize), &mut out);
                offered += 1;
            }
        }
        assert_eq!(out.len(), 5);
        f.due(2_000_000, &mut out);
        assert_eq!(answers(&out), offered);
        // Written: 5 in all, plus one held per key that folded.
        assert!(out.len() <= 5 + 20);
    }

    #[test]
    fn past_its_keys_a_flood_folds_under_star_and_writes_are_bounded() {
        let rule = FoldRule {
            per_key: 2,
            in_all: 50,
            keys: 8,
        };
        let mut f = Folder::new(rule);
        let mut out = Vec::new();
        for n in 0..10_000 {
            f.offer(entry(&format!("p{n}"), 1_000_000 + n as i64, n), &mut out);
        }
        f.due(2_000_000, &mut out);
        assert_eq!(answers(&out), 10_000);
        assert!(out.len() <= 50 + 8 + 1, "{} entries written", out.len());
        let star: Vec<&Entry> = out.iter().filter(|e| e.principal == FOLDED_ANY).collect();
        assert_eq!(star.len(), 1);
        assert!(star[0].trigger_id.is_none());
        assert!(f.keys() <= 8 + 1);
    }

    #[test]
    fn draining_writes_what_is_held() {
        let mut f = Folder::new(FoldRule {
            per_key: 0,
            in_all: 0,
            keys: 4,
        });
        let mut out = Vec::new();
        for n in 0..3 {
            f.offer(entry("alice", 1_000_000, n), &mut out);
        }
        assert!(out.is_empty());
        f.drain(&mut out);
        assert_eq!(answers(&out), 3);
    }
}
