//! Pack manifests: their shape (§7.1.1) and the lint of §7.1, §7.7.1, §7.8 and §7.9, as pure functions.
use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};

use super::names::{check_land, check_pack_id, check_ref};

/// The ref of the trigger that reports Binding health (§7.7).
pub const BINDING_DEGRADED: &str = "binding.degraded";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackKind {
    Standard,
    SenseOnly,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingMode {
    User,
    Local,
    Mothership,
    Public,
}

/// How the condition behind a trigger is obtained. Only `Push` is a pack trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TriggerSource {
    Push,
    Poll,
    Timer,
    Monitor,
}

str_enum!(PackKind { Standard = "standard", SenseOnly = "sense_only" });
str_enum!(BindingMode { User = "user", Local = "local", Mothership = "mothership", Public = "public" });
str_enum!(TriggerSource { Push = "push", Poll = "poll", Timer = "timer", Monitor = "monitor" });

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredTrigger {
    pub r#ref: String,
    pub source: TriggerSource,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stimulus {
    pub r#ref: String,
    pub operation: String,
    pub land: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    pub name: String,
    pub installs_webhook: bool,
}

/// A manifest that passed lint: what the service stores and decides on.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub pack_id: String,
    pub kind: PackKind,
    pub binding_mode: BindingMode,
    /// `None` when the manifest names no hub; `Some("none")` when it says so explicitly.
    pub binding_hub: Option<String>,
    pub triggers: Vec<DeclaredTrigger>,
    pub stimuli: Vec<Stimulus>,
    pub commands: Vec<Command>,
    pub upstream_requires_registration: bool,
    /// The manifest as given, kept for GetPack.
    pub raw: Value,
}

/// A pack as the store holds it: its manifest and its registration history.
#[derive(Debug, Clone, PartialEq)]
pub struct RegisteredPack {
    pub manifest: Manifest,
    /// 1 on first registration, one more on each re-registration.
    pub generation: i64,
    /// Microseconds since the Unix epoch.
    pub create_time: i64,
    pub update_time: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Warning,
}

/// One thing lint has to say about a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    /// The clause id enforced, e.g. `s7_1_2`; `s7_1_1` for the manifest's shape.
    pub rule: &'static str,
    /// Path in the manifest, e.g. `stimulusTriggers[0].ref`.
    pub field: String,
    pub message: String,
}

/// What lint found, and the manifest when there was no error.
#[derive(Debug, Clone)]
pub struct LintReport {
    pub findings: Vec<Finding>,
    pub pack_id: Option<String>,
    pub manifest: Option<Manifest>,
}

impl LintReport {
    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
    }
    pub fn warnings(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Warning)
    }
    pub fn is_valid(&self) -> bool {
        self.errors().next().is_none()
    }
}

/// Top-level keys of the manifest. Others draw a warning, not an error, so that
/// manifests written for newer HCP revisions still register.
const KNOWN_KEYS: &[&str] = &[
    "id",
    "packId",
    "name",
    "version",
    "description",
    "kind",
    "stimulusTriggers",
    "policy",
    "stimuli",
    "binding",
    "commands",
    "upstreamRequiresRegistration",
];

/// Parses manifest text as JSON, or failing that as YAML (s7_1_1).
pub fn parse_manifest_text(text: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(v) => Ok(v),
        Err(json_err) => match serde_yaml::from_str::<Value>(text) {
            Ok(v) => Ok(v),
            Err(yaml_err) => Err(format!(
                "manifest is neither JSON ({json_err}) nor YAML ({yaml_err})"
            )),
        },
    }
}

struct Linter {
    findings: Vec<Finding>,
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

/// Lints a manifest. Every error and warning is reported, not only the first;
/// the manifest is returned only when there is no error.
pub fn lint(raw: &Value) -> LintReport {
    let mut l = Linter {
        findings: Vec::new(),
    };
    let Some(obj) = raw.as_object() else {
        l.error("s7_1_1", "", "the manifest must be an object");
        return LintReport {
            findings: l.findings,
            pack_id: None,
            manifest: None,
        };
    };

    for key in obj.keys() {
        if !KNOWN_KEYS.contains(&key.as_str()) {
            l.warn(
                "s7_1_1",
                key.clone(),
                format!("unknown manifest field `{key}` is ignored"),
            );
        }
    }

    // Identity.
    let id_key = if obj.contains_key("id") {
        "id"
    } else {
        "packId"
    };
    let pack_id = l.opt_str(obj, id_key, id_key).map(str::to_owned);
    match &pack_id {
        None => l.error("s7_1_1", "id", "the manifest must name its pack in `id`"),
        Some(id) => {
            if let Err(e) = check_pack_id(id) {
                l.error("s7_1_1", id_key, e);
            }
        }
    }

    let kind = match l.opt_str(obj, "kind", "kind") {
        None => Some(PackKind::Standard),
        Some(k) => PackKind::parse(k).or_else(|| {
            l.error(
                "s7_1_1",
                "kind",
                format!("kind `{k}` must be one of {}", PackKind::NAMES.join(", ")),
            );
            None
        }),
    };

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
        for key in t.keys() {
            if key != "ref" && key != "source" && key != "description" {
                l.warn(
                    "s7_1_1",
                    format!("{path}.{key}"),
                    format!("unknown trigger field `{key}` is ignored"),
                );
            }
        }
        trigger_fields.push(ref_path);
        triggers.push(DeclaredTrigger { r#ref: r, source });
    }

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
        let r = l
            .opt_str(s, "ref", &format!("{path}.ref"))
            .unwrap_or("")
            .to_owned();
        let operation = l
            .opt_str(s, "operation", &format!("{path}.operation"))
            .unwrap_or("")
            .to_owned();
        let land = l
            .opt_str(s, "land", &format!("{path}.land"))
            .unwrap_or("")
            .to_owned();
        stimulus_paths.push(path);
        stimuli.push(Stimulus {
            r#ref: r,
            operation,
            land,
        });
    }
    let mut by_ref: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, s) in stimuli.iter().enumerate() {
        by_ref.entry(s.r#ref.as_str()).or_default().push(i);
    }
    for (t, t_path) in triggers.iter().zip(&trigger_fields) {
        let r = t.r#ref.as_str();
        match by_ref.get(r).map(Vec::as_slice) {
            None | Some([]) => l.error(
                "s7_1_3",
                t_path.clone(),
                format!("trigger `{r}` has no Policy stimuli entry with operation `read` and a land"),
            ),
            Some([i]) => {
                let s = &stimuli[*i];
                let p = &stimulus_paths[*i];
                if s.operation != "read" {
                    l.error(
                        "s7_1_3",
                        format!("{p}.operation"),
                        format!("the Policy entry for trigger `{r}` must have operation `read`, not `{}`", s.operation),
                    );
                }
                if s.land.is_empty() {
                    l.error("s7_1_3", format!("{p}.land"), format!("the Policy entry for trigger `{r}` must name a land"));
                } else if let Err(e) = check_land(&s.land) {
                    l.error("s7_1_3", format!("{p}.land"), e);
                } else if r == BINDING_DEGRADED && s.land == super::decide::BRAIN {
                    // The service produces this trigger for a Binding, which has no project.
                    l.warn(
                        "s7_7_3",
                        format!("{p}.land"),
                        format!("`{BINDING_DEGRADED}` with land `brain` can never be recorded: a brain record needs a project and a Binding has none, so each one is dropped as `no_project`"),
                    );
                }
            }
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
        if !seen.contains(s.r#ref.as_str()) {
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

    // s7_7_1: packs whose Binding can degrade should say so.
    if let Some(mode @ (BindingMode::User | BindingMode::Local | BindingMode::Mothership)) =
        binding_mode
    {
        if !seen.contains(BINDING_DEGRADED) {
            l.warn(
                "s7_7_1",
                "stimulusTriggers",
                format!("a pack with Binding mode `{mode}` should declare the trigger `{BINDING_DEGRADED}`"),
            );
        }
    }

    // s7_9: sense-only packs.
    if kind == Some(PackKind::SenseOnly) {
        if triggers.is_empty()
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
        let hub_none = binding_hub.as_deref() == Some("none");
        if let Some(mode) = binding_mode {
            if mode != BindingMode::Public && !hub_none {
                l.warn(
                    "s7_9_2",
                    "binding",
                    format!("a `sense_only` pack should have Binding mode `public` or hub `none`, not mode `{mode}`"),
                );
            }
        }
        if !upstream_requires_registration {
            for (c, p) in commands.iter().zip(&command_paths) {
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

    let manifest = match (&pack_id, kind, binding_mode) {
        (Some(id), Some(kind), Some(binding_mode))
            if !l.findings.iter().any(|f| f.severity == Severity::Error) =>
        {
            Some(Manifest {
                pack_id: id.clone(),
                kind,
                binding_mode,
                binding_hub,
                triggers,
                stimuli,
                commands,
                upstream_requires_registration,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn valid() -> Value {
        json!({
            "id": "github",
            "kind": "standard",
            "stimulusTriggers": [{ "ref": "issue.opened" }, { "ref": "binding.degraded" }],
            "policy": { "stimuli": [
                { "ref": "issue.opened", "operation": "read", "land": "user" },
                { "ref": "binding.degraded", "operation": "read", "land": "user" }
            ]},
            "binding": { "mode": "user", "hub": "github" },
            "commands": [{ "name": "issues.create" }]
        })
    }

    fn sense_only() -> Value {
        json!({
            "id": "weather",
            "kind": "sense_only",
            "stimulusTriggers": [{ "ref": "storm.warning" }],
            "policy": { "stimuli": [{ "ref": "storm.warning", "operation": "read", "land": "user" }]},
            "binding": { "mode": "public", "hub": "none" }
        })
    }

    fn rules(v: &Value, sev: Severity) -> Vec<(&'static str, String)> {
        lint(v)
            .findings
            .into_iter()
            .filter(|f| f.severity == sev)
            .map(|f| (f.rule, f.field))
            .collect()
    }

    fn errors(v: &Value) -> Vec<(&'static str, String)> {
        rules(v, Severity::Error)
    }

    #[test]
    fn s7_1_1_valid_manifest_passes_clean() {
        let r = lint(&valid());
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        let m = r.manifest.expect("manifest");
        assert_eq!(m.pack_id, "github");
        assert_eq!(m.triggers.len(), 2);
        assert_eq!(m.binding_mode, BindingMode::User);
        assert!(lint(&sense_only()).findings.is_empty());
    }

    #[test]
    fn s7_1_1_manifest_yaml_and_json_text_parse_alike() {
        let yaml = "id: github\nstimulusTriggers:\n  - ref: issue.opened\n  - ref: binding.degraded\npolicy:\n  stimuli:\n    - {ref: issue.opened, operation: read, land: user}\n    - {ref: binding.degraded, operation: read, land: user}\nbinding: {mode: user, hub: github}\ncommands: [{name: issues.create}]\nkind: standard\n";
        let v = parse_manifest_text(yaml).expect("yaml");
        assert_eq!(v, valid());
        let v = parse_manifest_text(&valid().to_string()).expect("json");
        assert_eq!(v, valid());
        assert!(parse_manifest_text("{ not: [json").is_err());
        let mut not_obj = json!([1, 2]);
        assert_eq!(errors(&not_obj), vec![("s7_1_1", String::new())]);
        not_obj =
            json!({"id": "x", "stimulusTriggers": ["issue.opened"], "binding": {"mode": "public"}});
        assert_eq!(
            errors(&not_obj),
            vec![("s7_1_1", "stimulusTriggers[0]".to_string())]
        );
    }

    #[test]
    fn s7_1_2_ref_must_be_non_empty_lower_case_dot_separated() {
        for bad in [
            "",
            "Issue.Opened",
            "issue..opened",
            ".issue",
            "issue.",
            "issue opened",
            "issue/opened",
        ] {
            let mut v = valid();
            v["stimulusTriggers"][0]["ref"] = json!(bad);
            v["policy"]["stimuli"][0]["ref"] = json!(bad);
            let e = errors(&v);
            assert!(
                e.contains(&("s7_1_2", "stimulusTriggers[0].ref".into())),
                "{bad:?}: {e:?}"
            );
            assert!(lint(&v).manifest.is_none());
        }
        let mut v = valid();
        v["stimulusTriggers"][0] = json!({});
        assert!(errors(&v).contains(&("s7_1_2", "stimulusTriggers[0].ref".into())));
    }

    #[test]
    fn s7_1_2_duplicate_refs_are_an_error() {
        let mut v = valid();
        v["stimulusTriggers"] = json!([{ "ref": "issue.opened" }, { "ref": "binding.degraded" }, { "ref": "issue.opened" }]);
        assert!(errors(&v).contains(&("s7_1_2", "stimulusTriggers[2].ref".into())));
    }

    #[test]
    fn s7_1_3_every_ref_needs_a_read_policy_entry_with_a_land() {
        // Missing entry.
        let mut v = valid();
        v["policy"]["stimuli"] =
            json!([{ "ref": "binding.degraded", "operation": "read", "land": "user" }]);
        assert_eq!(
            errors(&v),
            vec![("s7_1_3", "stimulusTriggers[0].ref".into())]
        );
        let msg = lint(&v)
            .findings
            .into_iter()
            .find(|f| f.rule == "s7_1_3")
            .map(|f| f.message);
        assert!(msg.is_some_and(|m| m.contains("issue.opened")));
        // Operation other than read.
        let mut v = valid();
        v["policy"]["stimuli"][0]["operation"] = json!("write");
        assert_eq!(
            errors(&v),
            vec![("s7_1_3", "policy.stimuli[0].operation".into())]
        );
        // Missing and empty land.
        for land in [Value::Null, json!("")] {
            let mut v = valid();
            v["policy"]["stimuli"][0]["land"] = land;
            assert_eq!(
                errors(&v),
                vec![("s7_1_3", "policy.stimuli[0].land".into())]
            );
        }
        // No policy at all.
        let mut v = valid();
        v.as_object_mut().map(|o| o.remove("policy"));
        assert_eq!(errors(&v).len(), 2);
        assert!(errors(&v).iter().all(|(r, _)| *r == "s7_1_3"));
        // Two entries for one ref: the land would be ambiguous.
        let mut v = valid();
        v["policy"]["stimuli"] = json!([
            { "ref": "issue.opened", "operation": "read", "land": "user" },
            { "ref": "issue.opened", "operation": "read", "land": "brain" },
            { "ref": "binding.degraded", "operation": "read", "land": "user" }
        ]);
        assert_eq!(
            errors(&v),
            vec![("s7_1_3", "stimulusTriggers[0].ref".into())]
        );
    }

    #[test]
    fn s7_1_4_polled_triggers_fail_lint() {
        let mut v = valid();
        v["stimulusTriggers"][0]["source"] = json!("poll");
        assert_eq!(
            errors(&v),
            vec![("s7_1_4", "stimulusTriggers[0].source".into())]
        );
        v["stimulusTriggers"][0]["source"] = json!("push");
        assert!(errors(&v).is_empty());
    }

    #[test]
    fn s7_8_timers_and_monitors_are_not_triggers() {
        for src in ["timer", "monitor"] {
            let mut v = valid();
            v["stimulusTriggers"][0]["source"] = json!(src);
            assert_eq!(
                errors(&v),
                vec![("s7_8", "stimulusTriggers[0].source".into())]
            );
        }
    }

    #[test]
    fn s7_7_3_binding_degraded_in_brain_draws_a_warning() {
        let mut v = valid();
        v["policy"]["stimuli"][1]["land"] = json!("brain");
        let r = lint(&v);
        assert!(r.is_valid(), "a warning, not an error");
        assert_eq!(
            rules(&v, Severity::Warning),
            vec![("s7_7_3", "policy.stimuli[1].land".into())]
        );
        v["policy"]["stimuli"][1]["land"] = json!("user");
        assert!(rules(&v, Severity::Warning).is_empty());
    }

    #[test]
    fn s7_7_1_bound_packs_should_declare_binding_degraded() {
        for mode in ["user", "local", "mothership"] {
            let mut v = valid();
            v["binding"]["mode"] = json!(mode);
            v["stimulusTriggers"] = json!([{ "ref": "issue.opened" }]);
            v["policy"]["stimuli"] =
                json!([{ "ref": "issue.opened", "operation": "read", "land": "user" }]);
            let r = lint(&v);
            assert!(r.is_valid(), "a warning, not an error");
            assert_eq!(
                rules(&v, Severity::Warning),
                vec![("s7_7_1", "stimulusTriggers".into())]
            );
        }
        let mut v = valid();
        v["binding"]["mode"] = json!("public");
        v["stimulusTriggers"] = json!([{ "ref": "issue.opened" }]);
        v["policy"]["stimuli"] =
            json!([{ "ref": "issue.opened", "operation": "read", "land": "user" }]);
        assert!(rules(&v, Severity::Warning).is_empty());
    }

    #[test]
    fn s7_9_1_sense_only_declares_at_least_one_trigger() {
        let mut v = sense_only();
        v["stimulusTriggers"] = json!([]);
        v["policy"]["stimuli"] = json!([]);
        assert_eq!(errors(&v), vec![("s7_9_1", "stimulusTriggers".into())]);
        v.as_object_mut().map(|o| o.remove("stimulusTriggers"));
        assert_eq!(errors(&v), vec![("s7_9_1", "stimulusTriggers".into())]);
        // No commands is fine.
        assert!(lint(&sense_only()).is_valid());
        // A standard pack may have no trigger.
        let mut v = sense_only();
        v["kind"] = json!("standard");
        v["stimulusTriggers"] = json!([]);
        v["policy"]["stimuli"] = json!([]);
        assert!(errors(&v).is_empty());
    }

    #[test]
    fn s7_9_2_sense_only_should_be_public_or_hubless() {
        let mut v = sense_only();
        v["binding"] = json!({ "mode": "user", "hub": "weather-hub" });
        v["stimulusTriggers"] = json!([{ "ref": "storm.warning" }, { "ref": "binding.degraded" }]);
        v["policy"]["stimuli"] = json!([
            { "ref": "storm.warning", "operation": "read", "land": "user" },
            { "ref": "binding.degraded", "operation": "read", "land": "user" }
        ]);
        assert!(lint(&v).is_valid());
        assert_eq!(
            rules(&v, Severity::Warning),
            vec![("s7_9_2", "binding".into())]
        );
        v["binding"]["hub"] = json!("none");
        assert!(rules(&v, Severity::Warning).is_empty());
    }

    #[test]
    fn s7_9_2_sense_only_must_not_require_a_webhook_install_command() {
        for cmd in [
            json!({ "name": "setup", "installsWebhook": true }),
            json!({ "name": "install_webhook" }),
            json!("register-webhook"),
        ] {
            let mut v = sense_only();
            v["commands"] = json!([{ "name": "forecast.get" }, cmd]);
            assert_eq!(errors(&v), vec![("s7_9_2", "commands[1]".into())], "{v}");
            v["upstreamRequiresRegistration"] = json!(true);
            assert!(errors(&v).is_empty());
        }
        // An explicit false overrides the name.
        let mut v = sense_only();
        v["commands"] = json!([{ "name": "install_webhook", "installsWebhook": false }]);
        assert!(errors(&v).is_empty());
        // Standard packs may install webhooks.
        let mut v = valid();
        v["commands"] = json!(["install_webhook"]);
        assert!(errors(&v).is_empty());
    }

    #[test]
    fn shape_errors_are_all_reported() {
        let v = json!({
            "kind": "weird",
            "binding": { "mode": "cloud" },
            "stimulusTriggers": [{ "ref": "A" }],
        });
        let e = errors(&v);
        for want in ["id", "kind", "binding.mode", "stimulusTriggers[0].ref"] {
            assert!(
                e.iter().any(|(_, f)| f == want),
                "{want} missing from {e:?}"
            );
        }
    }
}
