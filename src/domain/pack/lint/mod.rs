//! The lint of §7.1, §7.7.1, §7.8 and §7.9: one module per rule family, run in the order of
//! the manifest's fields, every finding reported.
mod binding;
mod coherence;
mod commands;
mod identity;
mod stimuli;
mod triggers;

use serde_json::{Map, Value};

use super::{Finding, LintReport, Manifest, Severity};

/// What lint reckons a manifest's work against: the service's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Largest payload the service accepts (`--max-payload-bytes`): a schema's patterns are
    /// reckoned at a payload this large.
    pub max_payload_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_payload_bytes: 64 * 1024,
        }
    }
}

struct Linter {
    findings: Vec<Finding>,
    bounds: Bounds,
    /// Patterns in the payload schemas seen so far, and the bytes they compile to.
    patterns: usize,
    pattern_bytes: usize,
}

impl Linter {
    fn error(&mut self, rule: &'static str, field: impl Into<String>, message: impl Into<String>) {
        self.push(Severity::Error, rule, field, message);
    }
    fn warn(&mut self, rule: &'static str, field: impl Into<String>, message: impl Into<String>) {
        self.push(Severity::Warning, rule, field, message);
    }
    fn push(
        &mut self,
        severity: Severity,
        rule: &'static str,
        field: impl Into<String>,
        message: impl Into<String>,
    ) {
        self.findings.push(Finding {
            severity,
            rule,
            field: field.into(),
            message: message.into(),
        });
    }

    /// A string field that may be absent; a present non-string is a shape error.
    fn opt_str<'a>(
        &mut self,
        obj: &'a Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Option<&'a str> {
        match obj.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => {
                self.error("s7_1_1", path, format!("`{path}` must be a string"));
                None
            }
        }
    }

    fn opt_bool(&mut self, obj: &Map<String, Value>, key: &str, path: &str) -> Option<bool> {
        match obj.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => {
                self.error("s7_1_1", path, format!("`{path}` must be true or false"));
                None
            }
        }
    }

    fn array<'a>(&mut self, v: Option<&'a Value>, path: &str) -> &'a [Value] {
        match v {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(_) => {
                self.error("s7_1_1", path, format!("`{path}` must be a list"));
                &[]
            }
        }
    }
}

/// Lints a manifest against the default bounds (a payload limit of 64 KiB).
pub fn lint(raw: &Value) -> LintReport {
    lint_within(raw, Bounds::default())
}

/// Lints a manifest. Every error and warning is reported, not only the first;
/// the manifest is returned only when there is no error.
pub fn lint_within(raw: &Value, bounds: Bounds) -> LintReport {
    let mut l = Linter {
        findings: Vec::new(),
        bounds,
        patterns: 0,
        pattern_bytes: 0,
    };
    let Some(obj) = raw.as_object() else {
        l.error("s7_1_1", "", "the manifest must be an object");
        return LintReport {
            findings: l.findings,
            pack_id: None,
            manifest: None,
        };
    };

    let (pack_id, kind) = identity::identity(&mut l, obj);
    let (binding_mode, binding_hub) = binding::binding(&mut l, obj);
    let declared = triggers::declared(&mut l, obj);
    let stimuli = stimuli::stimuli(&mut l, obj, &declared);
    let commands = commands::commands(&mut l, obj);
    coherence::coherence(
        &mut l,
        kind,
        binding_mode,
        binding_hub.as_deref(),
        &declared,
        &commands,
    );

    let manifest = match (&pack_id, kind, binding_mode) {
        (Some(id), Some(kind), Some(binding_mode))
            if !l.findings.iter().any(|f| f.severity == Severity::Error) =>
        {
            Some(Manifest {
                pack_id: id.clone(),
                kind,
                binding_mode,
                binding_hub,
                triggers: declared.triggers,
                stimuli,
                upstream_requires_registration: commands.upstream_requires_registration,
                commands: commands.list,
                raw: raw.clone(),
            })
        }
        _ => None,
    };
    LintReport {
        findings: l.findings,
        pack_id,
        manifest,
    }
}
