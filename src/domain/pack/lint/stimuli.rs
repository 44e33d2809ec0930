//! §7.1.3, Policy stimuli: one `read` entry with a land for each declared trigger.
use std::collections::HashMap;

use serde_json::{Map, Value};

use super::triggers::Declared;
use super::Linter;
use crate::domain::names::check_land;
use crate::domain::pack::{Stimulus, BINDING_DEGRADED};
use crate::domain::trigger::BRAIN;

pub(super) fn stimuli(
    l: &mut Linter,
    obj: &Map<String, Value>,
    declared: &Declared,
) -> Vec<Stimulus> {
    let (stimuli, stimulus_paths) = read(l, obj);
    let mut by_ref: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, s) in stimuli.iter().enumerate() {
        by_ref.entry(s.r#ref.as_str()).or_default().push(i);
    }
    for (t, t_path) in declared.triggers.iter().zip(&declared.fields) {
        let r = t.r#ref.as_str();
        match by_ref.get(r).map(Vec::as_slice) {
            None | Some([]) => l.error(
                "s7_1_3",
                t_path.clone(),
                format!("trigger `{r}` has no Policy stimuli entry with operation `read` and a land"),
            ),
            Some([i]) => the_entry(l, r, &stimuli[*i], &stimulus_paths[*i]),
            Some(many) => l.error(
                "s7_1_3",
                t_path.clone(),
                format!(
                    "trigger `{r}` has {} Policy stimuli entries ({}); it needs exactly one, so that its land is unambiguous",
                    many.len(),
                    many.iter().map(|i| stimulus_paths[*i].as_str()).collect::<Vec<_>>().join(", ")
                ),
            ),
        }
    }
    for (s, p) in stimuli.iter().zip(&stimulus_paths) {
        if !declared.seen.contains(s.r#ref.as_str()) {
            l.warn(
                "s7_1_3",
                format!("{p}.ref"),
                format!(
                    "Policy stimuli entry for `{}` matches no declared trigger",
                    s.r#ref
                ),
            );
        }
    }

    stimuli
}

/// The Policy stimuli as written (`policy.stimuli`, or a top-level `stimuli`), each with its
/// path in the manifest.
fn read(l: &mut Linter, obj: &Map<String, Value>) -> (Vec<Stimulus>, Vec<String>) {
    // Policy stimuli: s7_1_3.
    let (stimuli_value, stimuli_path) = match obj.get("policy") {
        Some(Value::Object(p)) => (p.get("stimuli"), "policy.stimuli"),
        Some(Value::Null) | None => (obj.get("stimuli"), "stimuli"),
        Some(_) => {
            l.error(
                "s7_1_1",
                "policy",
                "`policy` must be an object with `stimuli`",
            );
            (None, "policy.stimuli")
        }
    };
    let mut stimuli = Vec::new();
    let mut stimulus_paths = Vec::new();
    for (i, s) in l.array(stimuli_value, stimuli_path).iter().enumerate() {
        let path = format!("{stimuli_path}[{i}]");
        let Some(s) = s.as_object() else {
            l.error(
                "s7_1_3",
                path.clone(),
                format!("`{path}` must be an object `{{ ref, operation, land }}`"),
            );
            continue;
        };
        let mut field = |name: &str| {
            l.opt_str(s, name, &format!("{path}.{name}"))
                .unwrap_or("")
                .to_owned()
        };
        let (r#ref, operation, land) = (field("ref"), field("operation"), field("land"));
        stimulus_paths.push(path);
        stimuli.push(Stimulus {
            r#ref,
            operation,
            land,
        });
    }
    (stimuli, stimulus_paths)
}

/// The one Policy entry of declared trigger `r`, at path `p`: operation `read` and a valid
/// land (`brain` for `binding.degraded` can never be recorded).
fn the_entry(l: &mut Linter, r: &str, s: &Stimulus, p: &str) {
    if s.operation != "read" {
        l.error(
            "s7_1_3",
            format!("{p}.operation"),
            format!(
                "the Policy entry for trigger `{r}` must have operation `read`, not `{}`",
                s.operation
            ),
        );
    }
    if s.land.is_empty() {
        l.error(
            "s7_1_3",
            format!("{p}.land"),
            format!("the Policy entry for trigger `{r}` must name a land"),
        );
    } else if let Err(e) = check_land(&s.land) {
        l.error("s7_1_3", format!("{p}.land"), e);
    } else if r == BINDING_DEGRADED && s.land == BRAIN {
        // The service produces this trigger for a Binding, which has no project.
        l.warn(
            "s7_7_3",
            format!("{p}.land"),
            format!("`{BINDING_DEGRADED}` with land `brain` can never be recorded: a brain record needs a project and a Binding has none, so each one is dropped as `no_project`"),
        );
    }
}
