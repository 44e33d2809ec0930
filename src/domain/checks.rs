//! The decision's checks (§7.3–§7.4) as one ordered table: `decide` stops at the first that fails, `explain` runs them all.
//!
//! Each check is one function that judges the trigger and, when an account is asked for, says
//! what it read: adding a check is one entry here, and `decide` and `explain` cannot disagree
//! on what it does.
use super::filter::{Filter, Filtered};
use super::pack::{BindingMode, BINDING_DEGRADED};
use super::policy::{Activation, BindingState, PackPolicy, PolicyView, PrincipalPolicy, Route};
use super::trigger::{DropReason, Trigger, PUBLIC_BINDING};

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Judged {
    Pass,
    Fail(DropReason),
    /// It could not be made: what it reads is missing (no pack, an undeclared ref, Sense off).
    NotReached,
}

/// What a check read, as (name, value), and one sentence on the outcome: made only when the
/// decision is explained.
#[derive(Debug, Default)]
pub(super) struct Account {
    pub facts: Vec<(&'static str, String)>,
    pub detail: String,
}

/// What passing checks found that the record carries.
#[derive(Debug, Default)]
pub(super) struct Found {
    binding_id: Option<String>,
    route: Option<Route>,
}

/// What the checks read, looked up once.
pub(super) struct Reading<'a> {
    t: &'a Trigger,
    pack: Option<&'a PackPolicy>,
    policy_land: Option<&'a String>,
    principal: Option<&'a PrincipalPolicy>,
}

impl<'a> Reading<'a> {
    fn new(view: &'a PolicyView, t: &'a Trigger) -> Reading<'a> {
        let pack = view.pack(&t.pack_id);
        Reading {
            t,
            pack,
            policy_land: pack.and_then(|p| p.lands.get(&t.r#ref)),
            principal: pack.and_then(|p| p.principals.get(&t.principal)),
        }
    }
}

type Judge = fn(&Reading<'_>, &mut Found, Option<&mut Account>) -> Judged;

/// One check of the decision order.
pub(super) struct CheckDef {
    /// `pack`, `ref`, `grant`, `binding`, `land`, `activation`, `filter`.
    pub name: &'static str,
    /// The drop reason it gives when it fails (the filter's may be `filter_error` instead).
    pub reason: DropReason,
    judge: Judge,
}

/// The checks in the order of clauses.md.
pub(super) static CHECKS: [CheckDef; 7] = [
    CheckDef {
        name: "pack",
        reason: DropReason::UnknownPack,
        judge: pack,
    },
    CheckDef {
        name: "ref",
        reason: DropReason::UndeclaredRef,
        judge: declared_ref,
    },
    CheckDef {
        name: "grant",
        reason: DropReason::NoGrant,
        judge: grant,
    },
    CheckDef {
        name: "binding",
        reason: DropReason::NoConnectedBinding,
        judge: binding,
    },
    CheckDef {
        name: "land",
        reason: DropReason::LandMismatch,
        judge: land,
    },
    CheckDef {
        name: "activation",
        reason: DropReason::ActivationOff,
        judge: activation,
    },
    CheckDef {
        name: "filter",
        reason: DropReason::Filtered,
        judge: filter,
    },
];

/// The checks that depend on the principal alone, not on the trigger's ref, land or payload.
const PRINCIPAL_CHECKS: [&str; 3] = ["grant", "binding", "activation"];

/// Runs the checks on `t` in order. Without `accounts` it stops at the first that fails
/// (`decide`); with them it runs every check and pushes each one's outcome and account
/// (`explain`). Either way the result is the first failure's drop reason, or the Binding
/// identity and the route a record carries.
pub(super) fn run(
    view: &PolicyView,
    t: &Trigger,
    mut accounts: Option<&mut Vec<(&'static CheckDef, Judged, Account)>>,
) -> Result<(String, Route), DropReason> {
    let r = Reading::new(view, t);
    let mut found = Found::default();
    let mut failed = None;
    for def in &CHECKS {
        let mut account = accounts.is_some().then(Account::default);
        let judged = (def.judge)(&r, &mut found, account.as_mut());
        if let (Some(list), Some(account)) = (accounts.as_deref_mut(), account) {
            list.push((def, judged, account));
        }
        if let Judged::Fail(reason) = judged {
            failed.get_or_insert(reason);
            if accounts.is_none() {
                break;
            }
        }
    }
    match (failed, found.binding_id, found.route) {
        (Some(reason), _, _) => Err(reason),
        (None, Some(binding_id), Some(route)) => Ok((binding_id, route)),
        // Not reached while the checks above fail closed; if it were, nothing is recorded.
        (None, None, _) => Err(DropReason::NoConnectedBinding),
        (None, Some(_), None) => Err(DropReason::ActivationOff),
    }
}

/// The check that decides a drop of `t`, with its account: the first that fails, else the
/// first that could not be made — the check `explain` would name, without an account of every
/// other. Each check is judged without an account until one fails, and that one again with it;
/// the last (the filter, which runs a program) is judged once, with it. Judges read only the
/// trigger and the view, so a check judged again judges the same. None when every check passes.
pub(super) fn deciding(view: &PolicyView, t: &Trigger) -> Option<(&'static CheckDef, Account)> {
    let r = Reading::new(view, t);
    let mut found = Found::default();
    let mut not_reached = None;
    let told = |def: &'static CheckDef| {
        let mut account = Account::default();
        (def.judge)(&r, &mut Found::default(), Some(&mut account));
        (def, account)
    };
    for (i, def) in CHECKS.iter().enumerate() {
        if i + 1 == CHECKS.len() {
            let mut account = Account::default();
            match (def.judge)(&r, &mut found, Some(&mut account)) {
                Judged::Fail(_) => return Some((def, account)),
                Judged::NotReached if not_reached.is_none() => return Some((def, account)),
                _ => break,
            }
        }
        match (def.judge)(&r, &mut found, None) {
            Judged::Fail(_) => return Some(told(def)),
            Judged::NotReached if not_reached.is_none() => not_reached = Some(def),
            _ => {}
        }
    }
    not_reached.map(told)
}

/// Whether the principal checks (grant, Binding, activation) pass for `t`'s principal;
/// without the pack none is reached, so none passes.
pub(super) fn principal_admitted(view: &PolicyView, t: &Trigger) -> bool {
    let r = Reading::new(view, t);
    let mut found = Found::default();
    CHECKS
        .iter()
        .filter(|c| PRINCIPAL_CHECKS.contains(&c.name))
        .all(|c| (c.judge)(&r, &mut found, None) == Judged::Pass)
}

fn yes(b: bool) -> String {
    if b { "true" } else { "false" }.to_owned()
}

fn verdict(pass: bool, reason: DropReason) -> Judged {
    if pass {
        Judged::Pass
    } else {
        Judged::Fail(reason)
    }
}

/// Fills the account, when one is asked for.
fn tell(
    account: Option<&mut Account>,
    what: impl FnOnce() -> (Vec<(&'static str, String)>, String),
) {
    if let Some(a) = account {
        (a.facts, a.detail) = what();
    }
}

/// A check that reads the pack's policy, without a pack.
fn no_pack(account: Option<&mut Account>) -> Judged {
    tell(account, || (vec![], "no pack, no policy to read".into()));
    Judged::NotReached
}

/// Check 1, §7.3.4 (fail closed): an unknown pack has no policy to pass.
fn pack(r: &Reading<'_>, _: &mut Found, account: Option<&mut Account>) -> Judged {
    let t = r.t;
    let known = r.pack.is_some();
    tell(account, || {
        (
            vec![("pack_id", t.pack_id.clone()), ("registered", yes(known))],
            if known {
                format!("pack `{}` is registered", t.pack_id)
            } else {
                format!(
                    "pack `{}` is not registered (s7_3_4: fail closed)",
                    t.pack_id
                )
            },
        )
    });
    verdict(known, DropReason::UnknownPack)
}

/// Check 2, §7.3.3: the ref must be declared (with a Policy entry, which gives its land).
fn declared_ref(r: &Reading<'_>, _: &mut Found, account: Option<&mut Account>) -> Judged {
    if r.pack.is_none() {
        return no_pack(account);
    }
    let (t, policy_land) = (r.t, r.policy_land);
    tell(account, || {
        let mut facts = vec![
            ("ref", t.r#ref.clone()),
            ("declared", yes(policy_land.is_some())),
        ];
        if let Some(l) = policy_land {
            facts.push(("policy_land", l.clone()));
        }
        let detail = match policy_land {
            Some(l) => format!("`{}` is declared, with Policy land `{l}`", t.r#ref),
            None => format!(
                "`{}` is not a trigger the pack declares with a Policy entry (s7_3_3)",
                t.r#ref
            ),
        };
        (facts, detail)
    });
    verdict(policy_land.is_some(), DropReason::UndeclaredRef)
}

/// Check 3, §7.3.1: the principal must hold sense.enable for the pack.
fn grant(r: &Reading<'_>, _: &mut Found, account: Option<&mut Account>) -> Judged {
    if r.pack.is_none() {
        return no_pack(account);
    }
    let t = r.t;
    let granted = r.principal.is_some_and(|p| p.granted);
    tell(account, || {
        (
            vec![
                ("principal", t.principal.clone()),
                ("granted", yes(granted)),
            ],
            if granted {
                format!("`{}` holds sense.enable for the pack", t.principal)
            } else {
                format!(
                    "`{}` does not hold sense.enable for the pack (s7_3_1)",
                    t.principal
                )
            },
        )
    });
    verdict(granted, DropReason::NoGrant)
}

/// Check 4, §7.3.4, §7.2.2: a connected (linked) Binding, unless the pack is public. Finds the
/// Binding identity records carry.
fn binding(r: &Reading<'_>, found: &mut Found, account: Option<&mut Account>) -> Judged {
    let Some(pack) = r.pack else {
        return no_pack(account);
    };
    let public = pack.binding_mode == BindingMode::Public;
    let binding = r.principal.and_then(|p| p.binding.as_ref());
    let connected = public || binding.is_some_and(|b| b.state == BindingState::Linked);
    if connected {
        found.binding_id = Some(match binding {
            Some(b) if !public => b.binding_id.clone(),
            _ => PUBLIC_BINDING.to_owned(),
        });
    }
    tell(account, || {
        let mut facts = vec![("binding_mode", pack.binding_mode.as_str().to_owned())];
        let detail = match binding {
            _ if public => {
                facts.push(("binding_id", PUBLIC_BINDING.to_owned()));
                "the pack is public: no Binding is needed".to_owned()
            }
            Some(b) => {
                facts.push(("binding_id", b.binding_id.clone()));
                facts.push(("binding_state", b.state.as_str().to_owned()));
                let why = if connected {
                    ""
                } else {
                    "; only linked is connected (s7_3_4)"
                };
                format!("Binding `{}` is {}{why}", b.binding_id, b.state)
            }
            None => "the principal has no Binding to the pack (s7_3_4)".to_owned(),
        };
        (facts, detail)
    });
    verdict(connected, DropReason::NoConnectedBinding)
}

/// Check 5, §7.3.4: the trigger's land must be its Policy entry's.
fn land(r: &Reading<'_>, _: &mut Found, account: Option<&mut Account>) -> Judged {
    if r.pack.is_none() {
        return no_pack(account);
    }
    let t = r.t;
    let Some(l) = r.policy_land else {
        tell(account, || {
            (
                vec![("land", t.land.clone())],
                "an undeclared ref has no Policy land".into(),
            )
        });
        return Judged::NotReached;
    };
    let same = *l == t.land;
    tell(account, || {
        (
            vec![("land", t.land.clone()), ("policy_land", l.clone())],
            if same {
                format!("land `{}` is the Policy entry's", t.land)
            } else {
                format!("land `{}` is not the Policy entry's `{l}` (s7_3_4)", t.land)
            },
        )
    });
    verdict(same, DropReason::LandMismatch)
}

/// Check 6, §7.4.2: Sense must be on (the principal's own activation, else the pack-wide one);
/// off or never switched on drops.
fn activation(r: &Reading<'_>, _: &mut Found, account: Option<&mut Account>) -> Judged {
    let Some(pack) = r.pack else {
        return no_pack(account);
    };
    let activation = pack.activation_for(r.principal);
    let on = matches!(activation, Activation::On(..));
    tell(account, || {
        let own = r.principal.and_then(|p| p.activation.as_ref());
        let (source, whose) = match (own, &pack.activation) {
            (Some(_), _) => ("principal", "the principal's own activation"),
            (None, Some(_)) => ("pack_default", "the pack-wide activation"),
            (None, None) => ("none", "no activation (absent is off)"),
        };
        let mut facts = vec![("source", source.to_owned()), ("enabled", yes(on))];
        if let Activation::On(route, filter) = activation {
            facts.push(("route", route.as_str().to_owned()));
            let filter = filter.as_ref().map(|f| f.source().to_owned());
            facts.push(("filter", filter.unwrap_or_default()));
        }
        let state = if on { "on" } else { "off" };
        (facts, format!("Sense is {state} by {whose} (s7_4_2)"))
    });
    verdict(on, DropReason::ActivationOff)
}

/// The route and filter of the principal's activation; `None` when Sense is off.
fn routed<'a>(
    pack: &'a PackPolicy,
    principal: Option<&'a PrincipalPolicy>,
) -> Option<(Route, Option<&'a Filter>)> {
    match pack.activation_for(principal) {
        Activation::Off => None,
        Activation::On(route, filter) => Some((*route, filter.as_deref())),
    }
}

/// Check 7: the activation's filter, evaluated once, on a declared ref with Sense on; it is never
/// applied to `binding.degraded`: a filter chooses among the pack's world changes, and the
/// health of the principal's own Binding (§7.7.3) always reaches them as the activation
/// routes it. Finds the route the record takes.
fn filter(r: &Reading<'_>, found: &mut Found, account: Option<&mut Account>) -> Judged {
    let Some(pack) = r.pack else {
        return no_pack(account);
    };
    let t = r.t;
    let on = routed(pack, r.principal);
    let Some((route, filter)) = on.filter(|_| r.policy_land.is_some()) else {
        tell(account, || {
            (
                vec![],
                "a filter is evaluated only on a declared ref with Sense on".into(),
            )
        });
        return Judged::NotReached;
    };
    let Some(f) = filter.filter(|_| t.r#ref != BINDING_DEGRADED) else {
        found.route = Some(route);
        tell(account, || {
            let detail = match filter {
                Some(_) => format!("`{BINDING_DEGRADED}` is never filtered: routed to {route}"),
                None => format!("no filter: routed to {route}"),
            };
            (vec![("route", route.as_str().to_owned())], detail)
        });
        return Judged::Pass;
    };
    let applied = f.apply(t, route);
    tell(account, || {
        let (result, detail) = match &applied {
            Filtered::Pass(r) => (
                r.as_str().to_owned(),
                format!("the filter routes it to {r}"),
            ),
            Filtered::Drop => ("drop".to_owned(), "the filter drops it".to_owned()),
            Filtered::Error(e) => ("error".to_owned(), format!("the filter {e}")),
        };
        (
            vec![("filter", f.source().to_owned()), ("result", result)],
            detail,
        )
    });
    match applied {
        Filtered::Pass(route) => {
            found.route = Some(route);
            Judged::Pass
        }
        Filtered::Drop => Judged::Fail(DropReason::Filtered),
        Filtered::Error(_) => Judged::Fail(DropReason::FilterError),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table is the decision order of clauses.md, each check with the drop reason it
    /// gives: `decide` and `explain` both read it, so this order is theirs.
    #[test]
    fn s7_3_the_checks_are_the_decision_order_of_clauses_md() {
        let table: Vec<_> = CHECKS.iter().map(|c| (c.name, c.reason)).collect();
        assert_eq!(
            table,
            [
                ("pack", DropReason::UnknownPack),
                ("ref", DropReason::UndeclaredRef),
                ("grant", DropReason::NoGrant),
                ("binding", DropReason::NoConnectedBinding),
                ("land", DropReason::LandMismatch),
                ("activation", DropReason::ActivationOff),
                ("filter", DropReason::Filtered),
            ]
        );
        assert!(PRINCIPAL_CHECKS
            .iter()
            .all(|n| CHECKS.iter().any(|c| c.name == *n)));
    }
}
