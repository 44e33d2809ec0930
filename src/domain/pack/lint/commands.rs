//! Commands, and whether each installs a webhook (read by §7.9.2).
use serde_json::{Map, Value};

use super::Linter;
use crate::domain::pack::Command;

/// The commands, the field of each, and `upstreamRequiresRegistration`.
pub(super) struct Commands {
    pub list: Vec<Command>,
    pub paths: Vec<String>,
    pub upstream_requires_registration: bool,
}

pub(super) fn commands(l: &mut Linter, obj: &Map<String, Value>) -> Commands {
    // Commands.
    let mut commands = Vec::new();
    let mut command_paths = Vec::new();
    for (i, c) in l.array(obj.get("commands"), "commands").iter().enumerate() {
        let path = format!("commands[{i}]");
        let cmd = match c {
            Value::String(name) => Command {
                name: name.clone(),
                installs_webhook: looks_like_webhook_install(name),
            },
            Value::Object(o) => {
                let name = l
                    .opt_str(o, "name", &format!("{path}.name"))
                    .unwrap_or("")
                    .to_owned();
                if name.is_empty() {
                    l.error(
                        "s7_1_1",
                        format!("{path}.name"),
                        "a command must have a non-empty name",
                    );
                }
                let flagged = l.opt_bool(o, "installsWebhook", &format!("{path}.installsWebhook"));
                let purpose = l.opt_str(o, "purpose", &format!("{path}.purpose"));
                let installs_webhook = flagged.unwrap_or_else(|| {
                    purpose.is_some_and(looks_like_webhook_install)
                        || looks_like_webhook_install(&name)
                });
                Command {
                    name,
                    installs_webhook,
                }
            }
            _ => {
                l.error(
                    "s7_1_1",
                    path.clone(),
                    "a command must be a name or an object with `name`",
                );
                continue;
            }
        };
        command_paths.push(path);
        commands.push(cmd);
    }
    let upstream_requires_registration = l
        .opt_bool(
            obj,
            "upstreamRequiresRegistration",
            "upstreamRequiresRegistration",
        )
        .unwrap_or(false);

    Commands {
        list: commands,
        paths: command_paths,
        upstream_requires_registration,
    }
}

/// A command counts as installing a webhook when its name (or purpose) says it
/// installs, registers, creates or subscribes a webhook.
fn looks_like_webhook_install(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    (n.contains("webhook") || n.contains("web_hook") || n.contains("web-hook"))
        && [
            "install",
            "register",
            "create",
            "setup",
            "set_up",
            "subscribe",
            "add",
            "enable",
        ]
        .iter()
        .any(|verb| n.contains(verb))
}
