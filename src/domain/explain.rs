//! ExplainTrigger's account of a decision: every check of `decide`, in its order, with what it read and whether it passed.
use super::decide::{admitted, applied, routed, Decision, DropReason, Trigger, PUBLIC_BINDING};
use super::filter::Filtered;
use super::pack::{BindingMode, BINDING_DEGRADED};
use super::policy::{Activation, PolicyView};

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

fn check(
    name: &'static str,
    reason: DropReason,
    pass: Option<bool>,
    facts: Vec<(&'static str, String)>,
    detail: String,
) -> Check {
    Check {
        name,
        verdict: match pass {
            Some(true) => Verdict::Pass,
            Some(false) => Verdict::Fail,
            None => Verdict::NotReached,
        },
        reason,
        facts,
        detail,
    }
}

fn yes(b: bool) -> String {
    if b { "true" } else { "false" }.to_owned()
}

/// Explains `decide(view, t)`: every check that can be made is made, so an operator sees all
/// that stands in the way, not only the first; the decision is the first failure's drop, as
/// `decide`'s. Reads the same helpers `decide` does.
pub fn explain(view: &PolicyView, t: &Trigger) -> Explanation {
    let mut checks = Vec::with_capacity(7);
    let pack = view.pack(&t.pack_id);
    checks.push(check(
        "pack",
        DropReason::UnknownPack,
        Some(pack.is_some()),
        vec![
            ("pack_id", t.pack_id.clone()),
            ("registered", yes(pack.is_some())),
        ],
        match pack {
            Some(_) => format!("pack `{}` is registered", t.pack_id),
            None => format!(
                "pack `{}` is not registered (s7_3_4: fail closed)",
                t.pack_id
            ),
        },
    ));
    let Some(pack) = pack else {
        for (name, reason) in [
            ("ref", DropReason::UndeclaredRef),
            ("grant", DropReason::NoGrant),
            ("binding", DropReason::NoConnectedBinding),
            ("land", DropReason::LandMismatch),
            ("activation", DropReason::ActivationOff),
            ("filter", DropReason::Filtered),
        ] {
            checks.push(check(
                name,
                reason,
                None,
                vec![],
                "no pack, no policy to read".into(),
            ));
        }
        return Explanation {
            checks,
            decision: Decision::Drop(DropReason::UnknownPack),
        };
    };
    let policy_land = pack.lands.get(&t.r#ref);
    let mut facts = vec![
        ("ref", t.r#ref.clone()),
        ("declared", yes(policy_land.is_some())),
    ];
    if let Some(l) = policy_land {
        facts.push(("policy_land", l.clone()));
    }
    checks.push(check(
        "ref",
        DropReason::UndeclaredRef,
        Some(policy_land.is_some()),
        facts,
        match policy_land {
            Some(l) => format!("`{}` is declared, with Policy land `{l}`", t.r#ref),
            None => format!(
                "`{}` is not a trigger the pack declares with a Policy entry (s7_3_3)",
                t.r#ref
            ),
        },
    ));
    let principal = pack.principals.get(&t.principal);
    let granted = principal.is_some_and(|p| p.granted);
    checks.push(check(
        "grant",
        DropReason::NoGrant,
        Some(granted),
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
    ));
    let binding = principal.and_then(|p| p.binding.as_ref());
    let public = pack.binding_mode == BindingMode::Public;
    let mut facts = vec![("binding_mode", pack.binding_mode.as_str().to_owned())];
    let (connected, detail) = if public {
        facts.push(("binding_id", PUBLIC_BINDING.to_owned()));
        (true, "the pack is public: no Binding is needed".to_owned())
    } else {
        match binding {
            Some(b) => {
                facts.push(("binding_id", b.binding_id.clone()));
                facts.push(("binding_state", b.state.as_str().to_owned()));
                let linked = b.state == super::policy::BindingState::Linked;
                (
                    linked,
                    format!(
                        "Binding `{}` is {}{}",
                        b.binding_id,
                        b.state,
                        if linked {
                            ""
                        } else {
                            "; only linked is connected (s7_3_4)"
                        }
                    ),
                )
            }
            None => (
                false,
                "the principal has no Binding to the pack (s7_3_4)".to_owned(),
            ),
        }
    };
    checks.push(check(
        "binding",
        DropReason::NoConnectedBinding,
        Some(connected),
        facts,
        detail,
    ));
    checks.push(match policy_land {
        Some(l) => check(
            "land",
            DropReason::LandMismatch,
            Some(*l == t.land),
            vec![("land", t.land.clone()), ("policy_land", l.clone())],
            if *l == t.land {
                format!("land `{}` is the Policy entry's", t.land)
            } else {
                format!("land `{}` is not the Policy entry's `{l}` (s7_3_4)", t.land)
            },
        ),
        None => check(
            "land",
            DropReason::LandMismatch,
            None,
            vec![("land", t.land.clone())],
            "an undeclared ref has no Policy land".into(),
        ),
    });
    let own = principal.and_then(|p| p.activation.as_ref());
    let source = match (own, &pack.activation) {
        (Some(_), _) => "principal",
        (None, Some(_)) => "pack_default",
        (None, None) => "none",
    };
    let activation = pack.activation_for(principal);
    let mut facts = vec![("source", source.to_owned())];
    let on = match activation {
        Activation::On(route, filter) => {
            facts.push(("enabled", yes(true)));
            facts.push(("route", route.as_str().to_owned()));
            facts.push((
                "filter",
                filter
                    .as_ref()
                    .map(|f| f.source().to_owned())
                    .unwrap_or_default(),
            ));
            true
        }
        Activation::Off => {
            facts.push(("enabled", yes(false)));
            false
        }
    };
    let whose = match source {
        "principal" => "the principal's own activation",
        "pack_default" => "the pack-wide activation",
        _ => "no activation (absent is off)",
    };
    checks.push(check(
        "activation",
        DropReason::ActivationOff,
        Some(on),
        facts,
        format!(
            "Sense is {} by {whose} (s7_4_2)",
            if on { "on" } else { "off" }
        ),
    ));
    // The filter is evaluated once, when Sense is on for a declared ref: its outcome is both
    // this check's and, when every check passes, the decision's route.
    let mut route_if_passed = None;
    checks.push(match (routed(pack, principal), policy_land) {
        (Ok((route, filter)), Some(_)) => match applied(filter, t) {
            None => {
                route_if_passed = Some(route);
                check(
                    "filter",
                    DropReason::Filtered,
                    Some(true),
                    vec![("route", route.as_str().to_owned())],
                    match filter {
                        Some(_) => {
                            format!("`{BINDING_DEGRADED}` is never filtered: routed to {route}")
                        }
                        None => format!("no filter: routed to {route}"),
                    },
                )
            }
            Some(f) => {
                let (pass, reason, result, detail) = match f.apply(t, route) {
                    Filtered::Pass(r) => {
                        route_if_passed = Some(r);
                        (
                            true,
                            DropReason::Filtered,
                            r.as_str().to_owned(),
                            format!("the filter routes it to {r}"),
                        )
                    }
                    Filtered::Drop => (
                        false,
                        DropReason::Filtered,
                        "drop".to_owned(),
                        "the filter drops it".to_owned(),
                    ),
                    Filtered::Error(e) => (
                        false,
                        DropReason::FilterError,
                        "error".to_owned(),
                        format!("the filter {e}"),
                    ),
                };
                check(
                    "filter",
                    reason,
                    Some(pass),
                    vec![("filter", f.source().to_owned()), ("result", result)],
                    detail,
                )
            }
        },
        _ => check(
            "filter",
            DropReason::Filtered,
            None,
            vec![],
            "a filter is evaluated only on a declared ref with Sense on".into(),
        ),
    });
    let decision = match (
        checks.iter().find(|c| c.verdict == Verdict::Fail),
        admitted(pack, principal),
        route_if_passed,
    ) {
        (Some(c), _, _) => Decision::Drop(c.reason),
        // Every check passed: the Binding identity as `decide` gives it, the filter's route.
        (None, Ok(binding_id), Some(route)) => Decision::Record { route, binding_id },
        (None, Err(reason), _) => Decision::Drop(reason),
        (None, Ok(_), None) => Decision::Drop(DropReason::ActivationOff),
    };
    Explanation { checks, decision }
}
