//! Declared triggers: §7.1.1 (shape), §7.1.2 (syntax, duplicates), §7.1.4 and §7.8 (source).
use std::collections::HashSet;

use serde_json::{Map, Value};

use super::Linter;
use crate::domain::names::check_ref;
use crate::domain::pack::schema::cost::{
    MAX_PACK_PATTERNS, MAX_PACK_PATTERN_BYTES, MAX_PATTERN_WORK,
};
use crate::domain::pack::schema::PayloadSchema;
use crate::domain::pack::{DeclaredTrigger, TriggerSource, BINDING_DEGRADED};

/// The declared triggers, the field of each one's ref, and every valid ref declared.
pub(super) struct Declared {
    pub triggers: Vec<DeclaredTrigger>,
    pub fields: Vec<String>,
    pub seen: HashSet<String>,
}

pub(super) fn declared(l: &mut Linter, obj: &Map<String, Value>) -> Declared {
    // Declared triggers: s7_1_1 (shape), s7_1_2 (syntax, duplicates), s7_1_4 and s7_8 (source).
    let mut triggers = Vec::new();
    let mut trigger_fields = Vec::new();
    let mut seen = HashSet::new();
    for (i, t) in l
        .array(obj.get("stimulusTriggers"), "stimulusTriggers")
        .iter()
        .enumerate()
    {
        let path = format!("stimulusTriggers[{i}]");
        let Some(t) = t.as_object() else {
            l.error(
                "s7_1_1",
                path.clone(),
                format!("`{path}` must be an object `{{ ref }}`"),
            );
            continue;
        };
        let ref_path = format!("{path}.ref");
        let r = match t.get("ref") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) => {
                l.error("s7_1_2", ref_path.clone(), "ref must be non-empty");
                continue;
            }
            Some(_) => {
                l.error("s7_1_2", ref_path.clone(), "ref must be a string");
                continue;
            }
        };
        if let Err(e) = check_ref(&r) {
            l.error("s7_1_2", ref_path.clone(), e);
        } else if !seen.insert(r.clone()) {
            l.error(
                "s7_1_2",
                ref_path.clone(),
                format!("ref `{r}` is declared more than once"),
            );
        }
        let source_path = format!("{path}.source");
        let source = match l.opt_str(t, "source", &source_path) {
            None => TriggerSource::Push,
            Some(s) => match TriggerSource::parse(s) {
                Some(TriggerSource::Poll) => {
                    l.error(
                        "s7_1_4",
                        source_path,
                        format!("trigger `{r}` has source `poll`: a pack must not declare a trigger for a condition it can only obtain by polling"),
                    );
                    TriggerSource::Poll
                }
                Some(src @ (TriggerSource::Timer | TriggerSource::Monitor)) => {
                    l.error(
                        "s7_8",
                        source_path,
                        format!("trigger `{r}` has source `{src}`: timers and monitors are not pack triggers"),
                    );
                    src
                }
                Some(TriggerSource::Push) => TriggerSource::Push,
                None => {
                    l.error(
                        "s7_1_1",
                        source_path,
                        format!("source `{s}` must be `push` (the default); `poll`, `timer` and `monitor` are not triggers"),
                    );
                    TriggerSource::Push
                }
            },
        };
        let description = l
            .opt_str(t, "description", &format!("{path}.description"))
            .map(str::to_owned);
        let payload_schema = payload_schema(l, t, &path, &r);
        for key in t.keys() {
            if !["ref", "source", "description", "payloadSchema"].contains(&key.as_str()) {
                l.warn(
                    "s7_1_1",
                    format!("{path}.{key}"),
                    format!("unknown trigger field `{key}` is ignored"),
                );
            }
        }
        trigger_fields.push(ref_path);
        triggers.push(DeclaredTrigger {
            r#ref: r,
            source,
            description,
            payload_schema,
        });
    }

    Declared {
        triggers,
        fields: trigger_fields,
        seen,
    }
}

/// A trigger's `payloadSchema`, when it keeps every bound and compiles; each error names the
/// trigger and the JSON pointer in the schema (`stimulusTriggers[0].payloadSchema/properties/a`).
fn payload_schema(l: &mut Linter, t: &Map<String, Value>, path: &str, r: &str) -> Option<Value> {
    let field = format!("{path}.payloadSchema");
    let schema = t.get("payloadSchema").filter(|v| !v.is_null())?;
    if r == BINDING_DEGRADED {
        l.warn(
            "s7_7_2",
            field,
            "the payload schema of `binding.degraded` is the hub's own (a `state` of linked, stale, needs_reauth, pending or error); this one is ignored",
        );
        return None;
    }
    // Counted before anything is compiled: a pack's patterns are held in memory while it is
    // registered, on every replica.
    l.patterns = l.patterns.saturating_add(patterns_in(schema));
    if l.patterns > MAX_PACK_PATTERNS {
        l.error(
            "s7_1_1",
            field,
            format!(
                "payload schema of `{r}`: a pack's payload schemas may hold at most {MAX_PACK_PATTERNS} patterns (`pattern` and `patternProperties` keys) in all; with this one they hold {}",
                l.patterns
            ),
        );
        return None;
    }
    match PayloadSchema::compile(schema) {
        Ok(s) => {
            let max = l.bounds.max_payload_bytes;
            let worst = s.work.pattern_work(max);
            if let (true, Some(p)) = (worst > MAX_PATTERN_WORK, s.work.costliest()) {
                // The numbers first: a violation is cut at MAX_DESCRIPTION_CHARS.
                let how = if p.per_byte <= 1 {
                    "this one: 1 unit/byte".to_owned()
                } else {
                    format!(
                        "this one {}: its DFA passes {} bytes, an NFA of {} states × {}",
                        p.per_byte,
                        crate::domain::pack::schema::cost::DFA_TEST_BYTES,
                        p.nfa_states,
                        crate::domain::pack::schema::cost::NFA_UNITS_PER_STATE
                    )
                };
                l.error(
                    "s7_1_1",
                    format!("{field}{}", p.pointer),
                    format!(
                        "payload schema of `{r}`: patterns cost {} units/byte; at --max-payload-bytes {max} that is {worst}, over the budget of {MAX_PATTERN_WORK} ({how})",
                        s.work.per_byte
                    ),
                );
                return None;
            }
            l.pattern_bytes = l.pattern_bytes.saturating_add(s.work.pattern_bytes());
            if l.pattern_bytes > MAX_PACK_PATTERN_BYTES {
                l.error(
                    "s7_1_1",
                    field,
                    format!(
                        "payload schema of `{r}`: a pack's compiled patterns may hold at most {MAX_PACK_PATTERN_BYTES} bytes in all; with this schema's they hold {}",
                        l.pattern_bytes
                    ),
                );
                return None;
            }
            Some(schema.clone())
        }
        Err(errors) => {
            for e in errors {
                l.error(
                    "s7_1_1",
                    format!("{field}{}", e.pointer),
                    format!("payload schema of `{r}`: {}", e.message),
                );
            }
            None
        }
    }
}

/// The patterns a schema holds: every string `pattern` and every `patternProperties` key,
/// wherever they are (a count that may only be too high, never too low).
pub(crate) fn patterns_in(schema: &Value) -> usize {
    let mut n = 0usize;
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    match (k.as_str(), v) {
                        ("pattern", Value::String(_)) => n += 1,
                        ("patternProperties", Value::Object(p)) => n += p.len(),
                        _ => {}
                    }
                    stack.push(v);
                }
            }
            Value::Array(a) => stack.extend(a),
            _ => {}
        }
    }
    n
}
