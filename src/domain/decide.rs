//! The Sense decision (§7.3–§7.5): trigger validation and `decide`, a pure function in the spec's order.
use serde_json::{Map, Value};

use super::checks;
use super::names::{check_id, check_land, check_pack_id, check_ref};
use super::pack::{TriggerSource, BINDING_DEGRADED};
use super::policy::{BindingRef, BindingState, PolicyView};
use super::trigger::{Decision, DropReason, RawTrigger, Trigger, BRAIN};

/// Decides on a trigger, checking the clauses in the order of clauses.md (`checks::CHECKS`):
/// pack, ref, grant, Binding, land, activation, then the activation's filter; the first that
/// fails drops it, and a trigger every check passes is recorded with the route and the
/// Binding identity they found.
pub fn decide(view: &PolicyView, t: &Trigger) -> Decision {
    match checks::run(view, t, None) {
        Ok((binding_id, route)) => Decision::Record { route, binding_id },
        Err(reason) => Decision::Drop(reason),
    }
}

/// Whether a trigger of `pack_id` for `principal`, of a declared ref at its Policy land, would
/// be recorded now: `decide`'s own grant, Binding and activation checks (GetPackState's
/// `deliverable`).
pub fn deliverable(view: &PolicyView, pack_id: &str, principal: &str) -> bool {
    let t = Trigger {
        pack_id: pack_id.to_owned(),
        r#ref: String::new(),
        principal: principal.to_owned(),
        land: String::new(),
        payload: Map::new(),
        payload_bytes: 2,
        project: None,
        trigger_id: None,
    };
    checks::principal_admitted(view, &t)
}

/// §7.7.3: the `binding.degraded` trigger the service produces, as the runtime's hub, when a
/// principal's Binding leaves `linked` — by a state change (`after` is the new state) or by
/// its deletion (`after` is `None`; the payload says `pending` and `deleted`) — and the
/// decision on it. `None` when there is nothing to produce: the Binding was not linked, is
/// still linked, or the pack does not declare the trigger.
///
/// The trigger is decided on the view in which the Binding is still linked: the moment it
/// degrades is when the principal must hear of it. A `brain` Policy land can never be
/// recorded (a brain record needs a project, a Binding has none): that is `NoProject`.
pub fn binding_degraded(
    view: &PolicyView,
    pack_id: &str,
    principal: &str,
    before: Option<&BindingRef>,
    after: Option<BindingState>,
) -> Option<(Trigger, Decision)> {
    let before = before.filter(|b| b.state == BindingState::Linked)?;
    if after == Some(BindingState::Linked) {
        return None;
    }
    let land = view.pack(pack_id)?.lands.get(BINDING_DEGRADED)?.clone();
    let mut payload = Map::new();
    payload.insert(
        "state".into(),
        Value::from(after.unwrap_or(BindingState::Pending).as_str()),
    );
    payload.insert(
        "previous_state".into(),
        Value::from(BindingState::Linked.as_str()),
    );
    payload.insert("binding_id".into(), Value::from(before.binding_id.as_str()));
    if after.is_none() {
        payload.insert("deleted".into(), Value::Bool(true));
    }
    let t = Trigger {
        pack_id: pack_id.to_owned(),
        r#ref: BINDING_DEGRADED.to_owned(),
        principal: principal.to_owned(),
        land,
        payload_bytes: crate::domain::trigger::json_len(&payload),
        payload,
        project: None,
        trigger_id: None,
    };
    let decision = if t.land == BRAIN {
        Decision::Drop(DropReason::NoProject)
    } else {
        let linked = view.with_principal(pack_id, principal, |p| p.binding = Some(before.clone()));
        decide(&linked, &t)
    };
    Some((t, decision))
}

/// Field violations of a malformed trigger: (field, rule).
pub type Violations = Vec<(&'static str, String)>;

/// Checks a received trigger and turns it into a `Trigger`, or lists every
/// field that is malformed. `max_payload_bytes` bounds the payload's JSON text.
pub fn validate(
    raw: RawTrigger,
    max_payload_bytes: usize,
    max_depth: usize,
) -> Result<Trigger, Violations> {
    let mut v: Violations = Vec::new();
    if let Err(e) = check_pack_id(&raw.pack_id) {
        v.push(("pack_id", e));
    }
    if let Err(e) = check_ref(&raw.r#ref) {
        v.push(("ref", format!("s7_1_2: {e}")));
    }
    if let Err(e) = check_id("principal", &raw.principal) {
        v.push(("principal", e));
    }
    if let Err(e) = check_land(&raw.land) {
        v.push(("land", e));
    }
    match raw.source {
        None | Some(Ok(TriggerSource::Push)) => {}
        Some(Ok(s)) => v.push((
            "source",
            format!("s7_8: a trigger obtained by `{s}` is not a pack trigger; only push sources are delivered"),
        )),
        Some(Err(n)) => v.push(("source", format!("unknown trigger source {n}"))),
    }
    let project = (!raw.project.is_empty()).then_some(raw.project);
    match &project {
        Some(p) => {
            if let Err(e) = check_id("project", p) {
                v.push(("project", e));
            }
        }
        None if raw.land == BRAIN => v.push((
            "project",
            "is required when land is `brain` (s7_5_2: brain records need project membership)"
                .into(),
        )),
        None => {}
    }
    let trigger_id = (!raw.trigger_id.is_empty()).then_some(raw.trigger_id);
    if let Some(id) = &trigger_id {
        if let Err(e) = check_id("trigger_id", id) {
            v.push(("trigger_id", e));
        }
    }
    let payload = match raw.payload {
        None => Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => {
            v.push(("payload", "must be a JSON object".into()));
            Map::new()
        }
    };
    if payload.values().map(depth).max().unwrap_or(0) + 1 > max_depth {
        v.push(("payload", format!("nests deeper than {max_depth} levels")));
    }
    let size = crate::domain::trigger::json_len(&payload);
    if size > max_payload_bytes {
        v.push((
            "payload",
            format!("must be at most {max_payload_bytes} bytes of JSON, not {size}"),
        ));
    }
    if raw.r#ref == BINDING_DEGRADED
        && payload
            .get("state")
            .and_then(Value::as_str)
            .and_then(BindingState::parse)
            .is_none()
    {
        v.push((
            "payload.state",
            format!(
                "s7_7_2: `binding.degraded` must carry a state, one of {}",
                BindingState::NAMES.join(", ")
            ),
        ));
    }
    if !v.is_empty() {
        return Err(v);
    }
    Ok(Trigger {
        pack_id: raw.pack_id,
        r#ref: raw.r#ref,
        principal: raw.principal,
        land: raw.land,
        payload,
        payload_bytes: size,
        project,
        trigger_id,
    })
}

/// How deeply a JSON value nests (a scalar is 0).
pub fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::pack::{lint, Manifest};
    use crate::domain::policy::{Activation, BindingRef, PackPolicy, PrincipalPolicy, Route};
    use crate::domain::trigger::PUBLIC_BINDING;
    use serde_json::json;

    fn manifest(mode: &str) -> Manifest {
        lint(&json!({
            "id": "p",
            "stimulusTriggers": [{ "ref": "x.happened" }, { "ref": "binding.degraded" }],
            "policy": { "stimuli": [
                { "ref": "x.happened", "operation": "read", "land": "user" },
                { "ref": "binding.degraded", "operation": "read", "land": "user" }
            ]},
            "binding": { "mode": mode, "hub": "h" }
        }))
        .manifest
        .expect("valid")
    }

    /// The conditions a trigger can fail, each independently switchable; by default none.
    #[derive(Clone, Copy, Debug, Default)]
    struct Fail {
        unknown_pack: bool,
        undeclared_ref: bool,
        no_grant: bool,
        no_binding: bool,
        land: bool,
        off: bool,
        /// 0: no filter; 1: one that routes to inbox; 2: one that drops; 3: one that fails.
        filter: u8,
    }

    fn case(f: Fail, route: Route) -> (PolicyView, Trigger) {
        let filter = match f.filter {
            0 => None,
            1 => Some("payload.kind == 'a' ? 'inbox' : 'drop'"),
            2 => Some("payload.kind != 'a'"),
            _ => Some("payload.missing == 1"),
        }
        .map(|src| crate::domain::filter::Filter::compile(src).expect("compiles"));
        let mut pack = PackPolicy::from_manifest(&manifest("user"));
        pack.principals.insert(
            "alice".into(),
            PrincipalPolicy {
                granted: !f.no_grant,
                binding: Some(BindingRef {
                    binding_id: "b-1".into(),
                    state: if f.no_binding {
                        BindingState::Stale
                    } else {
                        BindingState::Linked
                    },
                }),
                activation: Some(if f.off {
                    Activation::Off
                } else {
                    Activation::On(route, filter)
                }),
                quota: None,
            },
        );
        let view = PolicyView::from_packs([("p".to_owned(), pack)]);
        let t = Trigger {
            pack_id: if f.unknown_pack {
                "q".into()
            } else {
                "p".into()
            },
            r#ref: if f.undeclared_ref {
                "y.happened".into()
            } else {
                "x.happened".into()
            },
            principal: "alice".into(),
            land: if f.land {
                "project".into()
            } else {
                "user".into()
            },
            payload: json!({"kind": "a"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            payload_bytes: 12,
            project: None,
            trigger_id: None,
        };
        (view, t)
    }

    #[test]
    fn s7_3_decision_table_every_reason_and_the_first_failing_condition_wins() {
        let order = DropReason::ALL;
        // Every subset of the six failing conditions, with each kind of filter: 256 cases.
        for mask in 0u8..64 {
            for filter in 0u8..4 {
                let bit = |i: u8| mask & (1 << i) != 0;
                let f = Fail {
                    unknown_pack: bit(0),
                    undeclared_ref: bit(1),
                    no_grant: bit(2),
                    no_binding: bit(3),
                    land: bit(4),
                    off: bit(5),
                    filter,
                };
                let (view, t) = case(f, Route::Silent);
                let filter_drop = match filter {
                    2 => Some(DropReason::Filtered),
                    3 => Some(DropReason::FilterError),
                    _ => None,
                };
                let want = (0..6)
                    .find(|i| bit(*i))
                    .map(|i| order[usize::from(i)])
                    .or(filter_drop);
                let got = decide(&view, &t);
                let route = if filter == 1 {
                    Route::Inbox
                } else {
                    Route::Silent
                };
                match want {
                    Some(reason) => {
                        assert_eq!(
                            got,
                            Decision::Drop(reason),
                            "mask {mask:06b} filter {filter}"
                        )
                    }
                    None => assert_eq!(
                        got,
                        Decision::Record {
                            route,
                            binding_id: "b-1".into()
                        }
                    ),
                }
                // ExplainTrigger's account agrees, and its first failing check is the reason.
                let e = crate::domain::explain::explain(&view, &t);
                assert_eq!(e.decision, got, "mask {mask:06b} filter {filter}");
                let first = e
                    .checks
                    .iter()
                    .find(|c| c.verdict == crate::domain::explain::Verdict::Fail)
                    .map(|c| c.reason);
                assert_eq!(first, want, "mask {mask:06b} filter {filter}: {e:?}");
                // A drop's decision log entry names the check explain names first, with the
                // same account, though only that check is accounted for.
                if want.is_some() {
                    assert_eq!(
                        crate::domain::decision_log::drop_deciding_check(&view, &t),
                        crate::domain::decision_log::deciding_check(&e),
                        "mask {mask:06b} filter {filter}"
                    );
                }
                // Every condition that fails is shown failing, not only the first.
                let failing = e
                    .checks
                    .iter()
                    .filter(|c| c.verdict == crate::domain::explain::Verdict::Fail)
                    .count();
                if !bit(0) {
                    let expected = (1..6).filter(|i| bit(*i) && !(*i == 4 && bit(1))).count()
                        + usize::from(filter_drop.is_some() && !bit(1) && !bit(5));
                    assert_eq!(failing, expected, "mask {mask:06b} filter {filter}: {e:?}");
                }
            }
        }
    }

    #[test]
    fn s7_7_3_binding_degraded_is_never_filtered() {
        let (view, t) = case(Fail::default(), Route::Silent);
        let only_issues =
            crate::domain::filter::Filter::compile("ref.startsWith('issue.')").expect("compiles");
        let view = view.with_principal("p", "alice", |p| {
            p.activation = Some(Activation::On(Route::Silent, Some(only_issues)))
        });
        assert_eq!(decide(&view, &t), Decision::Drop(DropReason::Filtered));
        let degraded = Trigger {
            r#ref: BINDING_DEGRADED.into(),
            ..t
        };
        let recorded = Decision::Record {
            route: Route::Silent,
            binding_id: "b-1".into(),
        };
        assert_eq!(decide(&view, &degraded), recorded);
        assert_eq!(
            crate::domain::explain::explain(&view, &degraded).decision,
            recorded
        );
    }

    #[test]
    fn deliverable_is_decide_for_a_declared_trigger_at_its_land() {
        // Every subset of the conditions that belong to the principal, not the trigger.
        for mask in 0u8..8 {
            let bit = |i: u8| mask & (1 << i) != 0;
            let f = Fail {
                unknown_pack: false,
                undeclared_ref: false,
                no_grant: bit(0),
                no_binding: bit(1),
                land: false,
                off: bit(2),
                filter: 0,
            };
            let (view, t) = case(f, Route::Inbox);
            let recorded = matches!(decide(&view, &t), Decision::Record { .. });
            assert_eq!(
                deliverable(&view, "p", "alice"),
                recorded,
                "mask {mask:03b}"
            );
            assert_eq!(recorded, mask == 0);
        }
        let (view, _) = case(Fail::default(), Route::Inbox);
        assert!(!deliverable(&view, "q", "alice"), "an unknown pack");
        assert!(
            !deliverable(&view, "p", "bob"),
            "a principal with no policy"
        );
    }

    #[test]
    fn s7_3_4_only_a_linked_binding_is_connected_and_public_needs_none() {
        for state in [
            BindingState::Stale,
            BindingState::NeedsReauth,
            BindingState::Pending,
            BindingState::Error,
        ] {
            let (mut view, t) = case(Fail::default(), Route::Inbox);
            view = view.with_principal("p", "alice", |p| {
                p.binding = Some(BindingRef {
                    binding_id: "b-1".into(),
                    state,
                });
            });
            assert_eq!(
                decide(&view, &t),
                Decision::Drop(DropReason::NoConnectedBinding),
                "{state}"
            );
        }
        // No binding at all.
        let (view, t) = case(Fail::default(), Route::Inbox);
        let view = view.with_principal("p", "alice", |p| p.binding = None);
        assert_eq!(
            decide(&view, &t),
            Decision::Drop(DropReason::NoConnectedBinding)
        );
        // A public pack records with the binding identity `public`.
        let mut pack = PackPolicy::from_manifest(&manifest("public"));
        pack.principals.insert(
            "alice".into(),
            PrincipalPolicy {
                granted: true,
                binding: None,
                activation: None,
                quota: None,
            },
        );
        pack.activation = Some(Activation::On(Route::Inbox, None));
        let view = PolicyView::from_packs([("p".to_owned(), pack)]);
        assert_eq!(
            decide(&view, &t),
            Decision::Record {
                route: Route::Inbox,
                binding_id: PUBLIC_BINDING.into()
            }
        );
    }

    #[test]
    fn s7_4_2_pack_wide_activation_and_principal_override() {
        let mut pack = PackPolicy::from_manifest(&manifest("public"));
        pack.principals.insert(
            "alice".into(),
            PrincipalPolicy {
                granted: true,
                binding: None,
                activation: None,
                quota: None,
            },
        );
        let (_, t) = case(Fail::default(), Route::Inbox);
        let view = PolicyView::from_packs([("p".to_owned(), pack)]);
        assert_eq!(
            decide(&view, &t),
            Decision::Drop(DropReason::ActivationOff),
            "absent means off"
        );
        let view = view.with_pack_activation("p", Some(Activation::On(Route::Silent, None)));
        assert!(matches!(
            decide(&view, &t),
            Decision::Record {
                route: Route::Silent,
                ..
            }
        ));
        let view = view.with_principal("p", "alice", |p| p.activation = Some(Activation::Off));
        assert_eq!(
            decide(&view, &t),
            Decision::Drop(DropReason::ActivationOff),
            "own off wins"
        );
        let view = view.with_principal("p", "alice", |p| {
            p.activation = Some(Activation::On(Route::Inbox, None))
        });
        assert!(matches!(
            decide(&view, &t),
            Decision::Record {
                route: Route::Inbox,
                ..
            }
        ));
    }

    fn raw() -> RawTrigger {
        RawTrigger {
            pack_id: "p".into(),
            r#ref: "x.happened".into(),
            principal: "alice".into(),
            land: "user".into(),
            payload: Some(json!({ "n": 1 })),
            ..Default::default()
        }
    }

    fn fields(r: Result<Trigger, Violations>) -> Vec<&'static str> {
        r.err()
            .map(|v| v.into_iter().map(|(f, _)| f).collect())
            .unwrap_or_default()
    }

    #[test]
    fn validation_names_every_malformed_field() {
        assert!(validate(raw(), 1024, 32).is_ok());
        let all_bad = RawTrigger {
            pack_id: String::new(),
            r#ref: "Bad..Ref".into(),
            principal: "a\u{0}b".into(),
            land: "Brain".into(),
            payload: Some(json!([1])),
            project: String::new(),
            trigger_id: "x".repeat(300),
            source: Some(Err(42)),
        };
        assert_eq!(
            fields(validate(all_bad, 1024, 32)),
            [
                "pack_id",
                "ref",
                "principal",
                "land",
                "source",
                "trigger_id",
                "payload"
            ]
        );
        let big = RawTrigger {
            payload: Some(json!({ "s": "x".repeat(2000) })),
            ..raw()
        };
        assert_eq!(fields(validate(big, 1024, 32)), ["payload"]);
        let brain = RawTrigger {
            land: "brain".into(),
            ..raw()
        };
        assert_eq!(fields(validate(brain, 1024, 32)), ["project"]);
        let none = RawTrigger {
            payload: None,
            ..raw()
        };
        assert!(validate(none, 1024, 32).is_ok_and(|t| t.payload.is_empty()));
    }

    #[test]
    fn s7_8_polled_timer_and_monitor_sources_are_refused() {
        for s in [
            TriggerSource::Poll,
            TriggerSource::Timer,
            TriggerSource::Monitor,
        ] {
            let r = RawTrigger {
                source: Some(Ok(s)),
                ..raw()
            };
            assert_eq!(fields(validate(r, 1024, 32)), ["source"]);
        }
        let r = RawTrigger {
            source: Some(Ok(TriggerSource::Push)),
            ..raw()
        };
        assert!(validate(r, 1024, 32).is_ok());
    }

    #[test]
    fn s7_7_2_binding_degraded_state_must_be_one_of_five() {
        for ok in BindingState::NAMES {
            let r = RawTrigger {
                r#ref: BINDING_DEGRADED.into(),
                payload: Some(json!({ "state": ok })),
                ..raw()
            };
            assert!(validate(r, 1024, 32).is_ok(), "{ok}");
        }
        for bad in [json!("broken"), json!("LINKED"), json!(3), json!(null)] {
            let r = RawTrigger {
                r#ref: BINDING_DEGRADED.into(),
                payload: Some(json!({ "state": bad })),
                ..raw()
            };
            assert_eq!(fields(validate(r, 1024, 32)), ["payload.state"]);
        }
    }
}
