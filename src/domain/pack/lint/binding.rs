//! §7.1.1, the Binding spec: its mode and hub.
use serde_json::{Map, Value};

use super::Linter;
use crate::domain::pack::BindingMode;

/// The Binding's mode (`user` when no `binding` is given) and hub.
pub(super) fn binding(
    l: &mut Linter,
    obj: &Map<String, Value>,
) -> (Option<BindingMode>, Option<String>) {
    // Binding spec.
    let mut binding_mode = None;
    let mut binding_hub = None;
    match obj.get("binding") {
        None | Some(Value::Null) => {
            l.warn(
                "s7_1_1",
                "binding",
                "no `binding` given: mode `user` is assumed, so the pack senses only for principals with a linked Binding",
            );
            binding_mode = Some(BindingMode::User);
        }
        Some(Value::Object(b)) => {
            match l.opt_str(b, "mode", "binding.mode") {
                None => l.error(
                    "s7_1_1",
                    "binding.mode",
                    format!(
                        "binding.mode must be one of {}",
                        BindingMode::NAMES.join(", ")
                    ),
                ),
                Some(m) => match BindingMode::parse(m) {
                    Some(m) => binding_mode = Some(m),
                    None => l.error(
                        "s7_1_1",
                        "binding.mode",
                        format!(
                            "binding.mode `{m}` must be one of {}",
                            BindingMode::NAMES.join(", ")
                        ),
                    ),
                },
            }
            binding_hub = l.opt_str(b, "hub", "binding.hub").map(str::to_owned);
        }
        Some(_) => l.error(
            "s7_1_1",
            "binding",
            "`binding` must be an object with `mode` and `hub`",
        ),
    }

    (binding_mode, binding_hub)
}
