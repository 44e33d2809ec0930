//! Payload schemas of declared triggers (JSON Schema 2020-12): the bounds a schema must keep to be registered, and the check of a payload against its ref's schema.
//!
//! A schema is pack input, so nothing in it may make validation slow: patterns run on the
//! `regex` crate (no backtracking; lookaround and backreferences do not compile), every `$ref`
//! stays within the document (nothing is fetched), and the work a schema can ask for at one
//! node of a payload is bounded before it is accepted (`cost`). Validation work is then at most
//! that bound per node, and a payload has no more nodes than bytes. A pack's schemas, compiled,
//! are its `TriggerTypes`.
pub mod cost;
mod trigger_types;

use jsonschema::{Draft, PatternOptions, Validator};
use serde_json::{json, Value};

use cost::{bounded, SchemaWork, PATTERN_SIZE_LIMIT};
pub use trigger_types::{TriggerType, TriggerTypes};

/// Most characters of a violation's description: the validator's words quote the failing
/// value, which may be the whole payload.
pub const MAX_DESCRIPTION_CHARS: usize = 200;
/// Most violations reported for one payload.
pub const MAX_VIOLATIONS: usize = 8;

/// The dialect every payload schema is read as.
pub const DIALECT: &str = "https://json-schema.org/draft/2020-12/schema";

/// Formats a payload's strings are checked against: each a single linear scan of the string.
pub const CHECKED_FORMATS: &[&str] = &[
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
    "uri-reference",
    "json-pointer",
    "relative-json-pointer",
];

/// Formats the validator knows but hcp-sense leaves as annotations: `regex` would parse a
/// payload's string as a pattern (a recursive parse of what a producer sends), `uri-template` as
/// a template; the IRI and IDN forms are not built into this validator. A format in neither
/// list is an annotation too.
pub const ANNOTATED_FORMATS: &[&str] = &[
    "regex",
    "uri-template",
    "iri",
    "iri-reference",
    "idn-email",
    "idn-hostname",
];

/// The hub's own payload schema of `binding.degraded` (s7_7_2), whatever a pack declares.
pub fn binding_degraded_schema() -> Value {
    let states = ["linked", "stale", "needs_reauth", "pending", "error"];
    json!({
        "$schema": DIALECT,
        "type": "object",
        "required": ["state"],
        "properties": {
            "state": { "enum": states },
            "previous_state": { "enum": states },
            "binding_id": { "type": "string" },
            "deleted": { "type": "boolean" }
        }
    })
}

/// The `stimulusTriggers` of a manifest as declared: each entry's ref, description and
/// payload schema (entries without a ref are lint's to report).
pub fn declared(raw: &Value) -> impl Iterator<Item = (&str, Option<&str>, Option<&Value>)> {
    raw.get("stimulusTriggers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let r = t.get("ref").and_then(Value::as_str)?;
            let description = t.get("description").and_then(Value::as_str);
            let schema = t.get("payloadSchema").filter(|s| !s.is_null());
            Some((r, description, schema))
        })
}

/// One thing wrong with a schema: the JSON pointer in the schema and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    pub pointer: String,
    pub message: String,
}

fn err(pointer: &str, message: impl Into<String>) -> SchemaError {
    SchemaError {
        pointer: pointer.to_owned(),
        message: message.into(),
    }
}

/// One way a payload fails its schema: the instance's JSON pointer, the failing keyword, and
/// the validator's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadViolation {
    pub pointer: String,
    pub keyword: String,
    pub message: String,
}

/// A schema that passed its bounds, compiled.
pub struct PayloadSchema {
    /// The schema as declared.
    pub raw: Value,
    /// The work it may ask for.
    pub work: SchemaWork,
    validator: Validator,
}

impl std::fmt::Debug for PayloadSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadSchema")
            .field("raw", &self.raw)
            .finish_non_exhaustive()
    }
}

impl PartialEq for PayloadSchema {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

impl Eq for PayloadSchema {}

impl PayloadSchema {
    /// Checks the bounds, then compiles; every error found, with its pointer in the schema.
    pub fn compile(raw: &Value) -> Result<PayloadSchema, Vec<SchemaError>> {
        let work = bounded(raw)?;
        let options = jsonschema::options()
            .with_draft(Draft::Draft202012)
            .with_pattern_options(
                PatternOptions::regex()
                    .size_limit(PATTERN_SIZE_LIMIT)
                    .dfa_size_limit(PATTERN_SIZE_LIMIT),
            )
            .should_validate_formats(true);
        // Checked by no one: every string conforms, as to an annotation.
        let validator = ANNOTATED_FORMATS
            .iter()
            .fold(options, |o, f| o.with_format(*f, |_: &str| true))
            .build(raw)
            .map_err(|e| {
                vec![err(
                    &e.instance_path().to_string(),
                    format!("is not a valid JSON Schema 2020-12: {e}"),
                )]
            })?;
        Ok(PayloadSchema {
            raw: raw.clone(),
            work,
            validator,
        })
    }

    /// The ways `payload` fails this schema (at most MAX_VIOLATIONS); empty when it conforms.
    pub fn check(&self, payload: &Value) -> Vec<PayloadViolation> {
        if self.validator.is_valid(payload) {
            return Vec::new();
        }
        self.validator
            .iter_errors(payload)
            .take(MAX_VIOLATIONS)
            .map(|e| PayloadViolation {
                pointer: e.instance_path().to_string(),
                keyword: e.kind().keyword().to_owned(),
                message: bounded_text(&e.to_string()),
            })
            .collect()
    }
}

/// `text`, cut to MAX_DESCRIPTION_CHARS characters.
fn bounded_text(text: &str) -> String {
    match text.char_indices().nth(MAX_DESCRIPTION_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::cost::{cost, MAX_COST_PER_NODE};
    use super::*;

    pub(super) fn refused(schema: Value) -> Vec<SchemaError> {
        match PayloadSchema::compile(&schema) {
            Ok(_) => panic!("accepted: {schema}"),
            Err(e) => e,
        }
    }

    pub(super) fn tracker() -> Value {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/tracker.pack.yaml"
        ))
        .expect("example");
        let m = crate::domain::pack::parse_manifest_text(&text).expect("parses");
        m["stimulusTriggers"][0]["payloadSchema"].clone()
    }

    #[test]
    fn a_typical_schema_compiles_and_names_what_a_payload_breaks() {
        let s = PayloadSchema::compile(&tracker()).expect("compiles");
        let ok = json!({"key": "OPS-12", "title": "t", "priority": "high", "reporter": "ann",
            "labels": ["a"], "links": [{"kind": "blocks", "key": "OPS-1"}]});
        assert!(s.check(&ok).is_empty());
        let bad = json!({"key": "ops-12", "title": "t", "priority": "urgent", "reporter": "ann",
            "labels": ["a", 5], "links": [{"kind": "blocks", "key": "x"}], "extra": 1});
        let mut got: Vec<(String, String)> = s
            .check(&bad)
            .into_iter()
            .map(|v| (v.pointer, v.keyword))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                ("".to_owned(), "additionalProperties".to_owned()),
                ("/key".into(), "pattern".into()),
                ("/labels/1".into(), "type".into()),
                ("/links/0/key".into(), "pattern".into()),
                ("/priority".into(), "enum".into()),
            ]
        );
        assert!(cost(&tracker()).expect("cost") <= MAX_COST_PER_NODE);
    }

    #[test]
    fn cheap_formats_are_checked_and_the_rest_are_annotations() {
        let formats: Vec<&str> = CHECKED_FORMATS
            .iter()
            .chain(ANNOTATED_FORMATS)
            .copied()
            .chain(["x-vendor"])
            .collect();
        let properties: serde_json::Map<String, Value> = formats
            .iter()
            .map(|f| (f.to_string(), json!({"type": "string", "format": f})))
            .collect();
        let s = PayloadSchema::compile(&json!({ "properties": properties })).expect("compiles");
        let good = json!({
            "date": "2026-12-03", "date-time": "2026-12-03T10:00:00Z", "time": "10:00:00Z",
            "duration": "P1DT2H", "email": "ann@example.com", "hostname": "api.example.com",
            "ipv4": "192.0.2.1", "ipv6": "2001:db8::1",
            "uuid": "0191e5a4-7b1c-7cc2-9a6e-3f1d2b4c5d6e", "uri": "https://example.com/a?b=c",
            "uri-reference": "/a/b", "json-pointer": "/a/0", "relative-json-pointer": "1/a",
        });
        assert_eq!(s.check(&good), Vec::new());
        let bad = json!({
            "date": "2026-13-03", "date-time": "yesterday", "time": "25:00:00Z",
            "duration": "1 day", "email": "not an address", "hostname": "-bad-.example",
            "ipv4": "999.0.0.1", "ipv6": "2001:db8:::1", "uuid": "0191e5a4",
            "uri": "no scheme", "uri-reference": "\\a b", "json-pointer": "a/0",
            "relative-json-pointer": "/a",
        });
        let mut refused: Vec<(String, String)> = s
            .check(&bad)
            .into_iter()
            .map(|v| (v.pointer, v.keyword))
            .collect();
        refused.sort();
        // At most MAX_VIOLATIONS are named; each checked format fails on its own.
        assert_eq!(refused.len(), MAX_VIOLATIONS, "{refused:?}");
        assert!(refused.iter().all(|(_, k)| k == "format"), "{refused:?}");
        for f in CHECKED_FORMATS {
            let one = json!({ *f: bad[*f].clone() });
            let v = s.check(&one);
            assert_eq!(v.len(), 1, "{f}: {:?}", bad[*f]);
            assert_eq!(v[0].pointer, format!("/{f}"));
        }
        // Annotations: anything goes, however a producer shapes it, and fast.
        let deep = "(".repeat(60_000);
        let odd: serde_json::Map<String, Value> = ANNOTATED_FORMATS
            .iter()
            .chain(&["x-vendor"])
            .map(|f| (f.to_string(), json!(deep)))
            .collect();
        assert_eq!(s.check(&Value::Object(odd)), Vec::new());
    }

    #[test]
    fn a_violation_quotes_at_most_a_bounded_part_of_the_payload() {
        let s =
            PayloadSchema::compile(&json!({"properties": {"a": {"pattern": "^c$"}}})).expect("ok");
        let v = s.check(&json!({ "a": "ab".repeat(30_000) }));
        assert_eq!(v[0].keyword, "pattern");
        assert!(
            v[0].message.chars().count() <= MAX_DESCRIPTION_CHARS + 1,
            "{}",
            v[0].message.len()
        );
        assert!(v[0].message.ends_with('…'));
        // `$schema` written with its empty fragment is the same dialect.
        PayloadSchema::compile(&json!({"$schema": format!("{DIALECT}#")})).expect("with #");
    }

    #[test]
    fn a_schema_that_is_not_json_schema_is_refused_where_it_is_wrong() {
        let e = refused(json!({"properties": {"a": {"type": "strin"}}}));
        assert!(e[0].pointer.starts_with("/properties/a"), "{e:?}");
        assert!(e[0].message.contains("JSON Schema"), "{e:?}");
    }

    #[test]
    fn lint_names_the_trigger_and_the_pointer_in_its_schema() {
        let mut m = crate::domain::pack::parse_manifest_text(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/tracker.pack.yaml"
            ))
            .expect("example"),
        )
        .expect("parses");
        assert!(crate::domain::pack::lint(&m).is_valid());
        m["stimulusTriggers"][0]["payloadSchema"]["properties"]["key"]["pattern"] = json!("(?=A)A");
        let report = crate::domain::pack::lint(&m);
        let e: Vec<_> = report.errors().collect();
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(
            e[0].field,
            "stimulusTriggers[0].payloadSchema/properties/key/pattern"
        );
        assert!(
            e[0].message
                .starts_with("payload schema of `ticket.created`"),
            "{}",
            e[0].message
        );
        let declared = crate::domain::pack::lint(&json!({"id": "p", "kind": "sense_only",
            "stimulusTriggers": [{"ref": "binding.degraded", "payloadSchema": {"type": "object"}}],
            "binding": {"mode": "public", "hub": "none"}}));
        assert!(declared
            .warnings()
            .any(|w| w.field == "stimulusTriggers[0].payloadSchema"));
    }
}
