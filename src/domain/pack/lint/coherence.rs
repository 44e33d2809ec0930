//! Rules across fields: §7.7.1 (a Binding that can degrade declares `binding.degraded`) and
//! §7.9 (sense-only packs).
use super::commands::Commands;
use super::triggers::Declared;
use super::Linter;
use crate::domain::pack::{BindingMode, PackKind, BINDING_DEGRADED};

pub(super) fn coherence(
    l: &mut Linter,
    kind: Option<PackKind>,
    binding_mode: Option<BindingMode>,
    binding_hub: Option<&str>,
    declared: &Declared,
    commands: &Commands,
) {
    // s7_7_1: packs whose Binding can degrade should say so.
    if let Some(mode @ (BindingMode::User | BindingMode::Local | BindingMode::Mothership)) =
        binding_mode
    {
        if !declared.seen.contains(BINDING_DEGRADED) {
            l.warn(
                "s7_7_1",
                "stimulusTriggers",
                format!("a pack with Binding mode `{mode}` should declare the trigger `{BINDING_DEGRADED}`"),
            );
        }
    }

    // s7_9: sense-only packs.
    if kind == Some(PackKind::SenseOnly) {
        if declared.triggers.is_empty()
            && !l
                .findings
                .iter()
                .any(|f| f.field.starts_with("stimulusTriggers["))
        {
            l.error(
                "s7_9_1",
                "stimulusTriggers",
                "a `sense_only` pack must declare at least one trigger",
            );
        }
        let hub_none = binding_hub == Some("none");
        if let Some(mode) = binding_mode {
            if mode != BindingMode::Public && !hub_none {
                l.warn(
                    "s7_9_2",
                    "binding",
                    format!("a `sense_only` pack should have Binding mode `public` or hub `none`, not mode `{mode}`"),
                );
            }
        }
        if !commands.upstream_requires_registration {
            for (c, p) in commands.list.iter().zip(&commands.paths) {
                if c.installs_webhook {
                    l.error(
                        "s7_9_2",
                        p.clone(),
                        format!("command `{}` installs a webhook: a `sense_only` pack must not require a user command for that unless `upstreamRequiresRegistration` is true", c.name),
                    );
                }
            }
        }
    }
}
