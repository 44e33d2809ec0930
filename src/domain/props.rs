//! Property tests of lint and trigger validation over generated input.
use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::decide::validate;
use super::names::check_ref;
use super::pack::lint;
use super::trigger::RawTrigger;

fn segment() -> impl Strategy<Value = String> {
    "[a-z0-9_-]{1,8}"
}

fn valid_ref() -> impl Strategy<Value = String> {
    prop::collection::vec(segment(), 1..4).prop_map(|s| s.join("."))
}

/// Arbitrary JSON, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::hash_map("[a-zA-Z]{1,16}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

proptest! {
    #[test]
    fn s7_1_2_generated_refs_with_read_entries_lint_clean(refs in prop::collection::hash_set(valid_ref(), 1..6)) {
        let refs: Vec<String> = refs.into_iter().collect();
        let m = json!({
            "id": "gen",
            "stimulusTriggers": refs.iter().map(|r| json!({ "ref": r })).collect::<Vec<_>>(),
            "policy": { "stimuli": refs.iter().map(|r| json!({ "ref": r, "operation": "read", "land": "user" })).collect::<Vec<_>>() },
            "binding": { "mode": "public" }
        });
        let report = lint(&m);
        prop_assert!(report.is_valid(), "{:?}", report.findings);
        prop_assert_eq!(report.manifest.map(|m| m.triggers.len()), Some(refs.len()));
    }

    #[test]
    fn s7_1_2_any_upper_case_letter_fails_lint(r in valid_ref(), at in any::<prop::sample::Index>()) {
        let chars: Vec<char> = r.chars().collect();
        let i = at.index(chars.len());
        prop_assume!(chars[i].is_ascii_lowercase());
        let bad: String = chars.iter().enumerate().map(|(j, c)| if j == i { c.to_ascii_uppercase() } else { *c }).collect();
        prop_assert!(check_ref(&bad).is_err());
        let m = json!({
            "id": "gen",
            "stimulusTriggers": [{ "ref": bad }],
            "policy": { "stimuli": [{ "ref": bad, "operation": "read", "land": "user" }] },
            "binding": { "mode": "public" }
        });
        prop_assert!(lint(&m).findings.iter().any(|f| f.rule == "s7_1_2"));
    }

    #[test]
    fn lint_of_any_json_is_total_and_consistent(v in json_value()) {
        let report = lint(&v);
        prop_assert_eq!(report.manifest.is_some(), report.is_valid());
    }

    #[test]
    fn validate_of_any_strings_is_total_and_sound(
        pack_id in ".{0,20}", r in ".{0,20}", principal in ".{0,20}", land in ".{0,12}",
        project in ".{0,12}", trigger_id in ".{0,12}", payload in json_value(),
    ) {
        let raw = RawTrigger { pack_id, r#ref: r, principal, land, payload: Some(payload), project, trigger_id, source: None };
        if let Ok(t) = validate(raw, 64 * 1024, 32) {
            prop_assert!(check_ref(&t.r#ref).is_ok());
            prop_assert!(!t.principal.is_empty());
            prop_assert!(!t.principal.chars().any(char::is_control));
            prop_assert!(t.land != "brain" || t.project.is_some());
        }
    }
}
