//! ExplainTrigger's account of a decision: every check of `decide`, in its order, with what it read and whether it passed.
use super::checks::{self, Judged};
use super::policy::PolicyView;
use super::trigger::{Decision, DropReason, Trigger};

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// It could not be made: what it reads is missing (no pack, an undeclared ref, Sense off).
    NotReached,
}

/// One check of the decision order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// `pack`, `ref`, `grant`, `binding`, `land`, `activation`, `filter`.
    pub name: &'static str,
    pub verdict: Verdict,
    /// The drop reason this check gives when it fails.
    pub reason: DropReason,
    /// What it read, as (name, value).
    pub facts: Vec<(&'static str, String)>,
    /// One sentence on the outcome.
    pub detail: String,
}

/// The decision and how it was reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    pub checks: Vec<Check>,
    /// What `decide` makes of the trigger on the same view.
    pub decision: Decision,
}

/// Explains `decide(view, t)`: every check is run (`checks::CHECKS`), so an operator sees all
/// that stands in the way, not only the first; the decision is the first failure's drop, as
/// `decide`'s.
pub fn explain(view: &PolicyView, t: &Trigger) -> Explanation {
    let mut accounts = Vec::with_capacity(checks::CHECKS.len());
    let decision = match checks::run(view, t, Some(&mut accounts)) {
        Ok((binding_id, route)) => Decision::Record { route, binding_id },
        Err(reason) => Decision::Drop(reason),
    };
    let checks = accounts
        .into_iter()
        .map(|(def, judged, account)| {
            let (verdict, reason) = match judged {
                Judged::Pass => (Verdict::Pass, def.reason),
                Judged::Fail(reason) => (Verdict::Fail, reason),
                Judged::NotReached => (Verdict::NotReached, def.reason),
            };
            Check {
                name: def.name,
                verdict,
                reason,
                facts: account.facts,
                detail: account.detail,
            }
        })
        .collect();
    Explanation { checks, decision }
}
