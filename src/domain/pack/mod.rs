//! Pack manifests: their shape (§7.1.1) and the lint of §7.1, §7.7.1, §7.8 and §7.9, as pure functions.
use serde_json::Value;

mod lint;
pub mod schema;
pub use super::trigger::TriggerSource;
pub use lint::{lint, lint_within, Bounds};

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

str_enum!(PackKind { Standard = "standard", SenseOnly = "sense_only" });
str_enum!(BindingMode { User = "user", Local = "local", Mothership = "mothership", Public = "public" });

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredTrigger {
    pub r#ref: String,
    pub source: TriggerSource,
    pub description: Option<String>,
    /// The payload's JSON Schema 2020-12 as declared, once it passed its bounds (`schema`).
    pub payload_schema: Option<Value>,
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

/// Deepest manifest text may nest (mappings, sequences and flow collections), checked by a
/// linear scan before any parser reads it: a manifest nests 4 levels down to a payload schema,
/// which may nest `schema::cost::MAX_SCHEMA_DEPTH` (32) more.
pub const MAX_MANIFEST_DEPTH: usize = 64;

/// Parses manifest text as JSON, or failing that as YAML (s7_1_1). Text nested deeper than
/// MAX_MANIFEST_DEPTH is refused before either parser reads it: the YAML parser's work grows
/// faster than the text with nesting.
pub fn parse_manifest_text(text: &str) -> Result<Value, String> {
    let (depth, line) = nesting(text, MAX_MANIFEST_DEPTH);
    if depth > MAX_MANIFEST_DEPTH {
        return Err(format!(
            "manifest nests deeper than {MAX_MANIFEST_DEPTH} levels (line {line}): manifests may nest at most {MAX_MANIFEST_DEPTH} levels of mappings, sequences and flow collections"
        ));
    }
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

/// How deep YAML (or JSON) text nests, reckoned in one pass over its bytes, and the line
/// (from 1) where it first got that deep; the scan stops once the depth passes `stop`.
///
/// The depth is that of the value the text parses to (a mapping or sequence, or a flow
/// collection, is a level): block collections by their indentation and `- ` entries, flow
/// collections by their open `[` and `{`. Quoted scalars, comments and block scalars (`|`,
/// `>`) are text, as they are to the parser. Where it cannot tell it errs on the side of more:
/// a bracket opening a plain scalar's continuation line counts.
pub fn nesting(text: &str, stop: usize) -> (usize, usize) {
    let mut scan = Nesting::new();
    for (n, line) in text.lines().enumerate() {
        scan.line(n + 1, line);
        if scan.max.0 > stop {
            break;
        }
    }
    scan.max
}

/// A block collection open at a column: its depth, and whether it is a mapping whose last
/// key has its value on the lines below (where a `- ` at the same column is nested).
struct Open {
    col: usize,
    depth: usize,
    awaits: bool,
}

/// What `nesting` carries from one line to the next.
struct Nesting {
    /// The deepest depth seen and the line (from 1) where it was first reached.
    max: (usize, usize),
    open: Vec<Open>,
    /// How many flow collections are open.
    flow: usize,
    /// The depth a flow collection opened on.
    base: usize,
    /// The quote a scalar spanning lines is still inside.
    quote: Option<u8>,
    /// The indentation of the line that opened a block scalar still being read.
    block_scalar: Option<usize>,
    /// Whether the next token starts a value (where a quote or bracket is an indicator, not
    /// part of a plain scalar).
    value_start: bool,
}

impl Nesting {
    fn new() -> Self {
        Nesting {
            max: (0, 0),
            open: Vec::new(),
            flow: 0,
            base: 0,
            quote: None,
            block_scalar: None,
            value_start: true,
        }
    }

    fn note(&mut self, depth: usize, line_no: usize) {
        if depth > self.max.0 {
            self.max = (depth, line_no);
        }
    }

    /// Reads one line (numbered from 1).
    fn line(&mut self, line_no: usize, line: &str) {
        let b = line.as_bytes();
        let ind = b.iter().take_while(|&&c| c == b' ').count();
        // The depth of the block collection this line's content is in, where its content
        // starts, and where its key starts when it has one.
        let (depth, i, key_col) = if self.quote.is_none() && self.flow == 0 {
            match self.block_line(b, ind) {
                Some(start) => start,
                // Blank, a comment, or a block scalar's text: nothing nests.
                None => return,
            }
        } else {
            (self.base, ind, None)
        };
        self.note(depth + self.flow, line_no);
        self.tokens(line_no, line, depth, i, key_col);
        if self.quote.is_none() && self.flow == 0 && opens_block_scalar(line) {
            self.block_scalar = Some(ind);
        }
    }

    /// Starts a line outside any quote or flow collection: closes the block collections it
    /// is not inside, opens a sequence for each `- ` entry it begins with, and answers its
    /// depth, where its key starts and that column; `None` when the line holds no token.
    fn block_line(&mut self, b: &[u8], ind: usize) -> Option<(usize, usize, Option<usize>)> {
        let mut i = ind;
        let body = &b[ind..];
        if let Some(at) = self.block_scalar {
            if body.iter().all(u8::is_ascii_whitespace) || ind > at {
                return None;
            }
            self.block_scalar = None;
        }
        if body.is_empty() || body[0] == b'#' {
            return None;
        }
        if body.starts_with(b"---") || body.starts_with(b"...") {
            self.open.clear();
            i += 3;
        }
        let dash =
            |i: usize| b.get(i) == Some(&b'-') && matches!(b.get(i + 1), None | Some(b' ' | b'\t'));
        while let Some(top) = self.open.last() {
            if top.col < ind || (top.col == ind && top.awaits && dash(i)) {
                break;
            }
            self.open.pop();
        }
        let mut depth = self.open.last().map_or(0, |o| o.depth);
        // Entries: `- - x` opens two sequences on one line.
        loop {
            while b.get(i).is_some_and(|c| *c == b' ' || *c == b'\t') {
                i += 1;
            }
            if !dash(i) {
                break;
            }
            depth += 1;
            self.open.push(Open {
                col: i,
                depth,
                awaits: false,
            });
            i += 1;
        }
        self.base = depth;
        self.value_start = true;
        Some((depth, i, Some(i)))
    }

    /// Reads a line's tokens from `i`: quotes, flow brackets, block keys and comments.
    fn tokens(
        &mut self,
        line_no: usize,
        line: &str,
        mut depth: usize,
        mut i: usize,
        mut key_col: Option<usize>,
    ) {
        let b = line.as_bytes();
        let mut last = b' ';
        while i < b.len() {
            let c = b[i];
            i += 1;
            if let Some(q) = self.quote {
                if (c == b'\\' && q == b'"') || (c == q && q == b'\'' && b.get(i) == Some(&b'\'')) {
                    i += 1;
                } else if c == q {
                    self.quote = None;
                    self.value_start = false;
                }
                last = c;
                continue;
            }
            match c {
                b'#' if last == b' ' || last == b'\t' => break,
                b' ' | b'\t' => {}
                b'"' | b'\'' if self.value_start => self.quote = Some(c),
                b'[' | b'{' if self.value_start || self.flow > 0 => {
                    if self.flow == 0 {
                        self.base = depth;
                    }
                    self.flow += 1;
                    self.note(self.base + self.flow, line_no);
                    self.value_start = true;
                }
                b']' | b'}' if self.flow > 0 => {
                    self.flow -= 1;
                    self.value_start = false;
                }
                b',' if self.flow > 0 => self.value_start = true,
                b':' if matches!(b.get(i), None | Some(b' ' | b'\t')) => {
                    // A block key: a mapping, one deeper than what holds it.
                    if let Some(col) = key_col.take().filter(|_| self.flow == 0) {
                        depth += 1;
                        let rest = line[i..].trim_start();
                        self.open.push(Open {
                            col,
                            depth,
                            awaits: rest.is_empty() || rest.starts_with('#'),
                        });
                        self.note(depth, line_no);
                    }
                    self.value_start = true;
                }
                // An explicit key, or an anchor or tag before a value: the value follows.
                b'?' if self.value_start => {}
                b'&' | b'!' if self.value_start => {
                    while b.get(i).is_some_and(|c| *c != b' ' && *c != b'\t') {
                        i += 1;
                    }
                }
                _ => self.value_start = false,
            }
            last = c;
        }
    }
}

/// Whether a line ends in a block scalar's indicator (`key: |`, `- >-`): the lines below,
/// indented deeper, are the scalar's text.
fn opens_block_scalar(line: &str) -> bool {
    let t = line.split(" #").next().unwrap_or_default().trim_end();
    let t = t.trim_end_matches(|c: char| c == '+' || c == '-' || c.is_ascii_digit());
    [" |", " >", "\t|", "\t>"].iter().any(|e| t.ends_with(e)) || matches!(t.trim_start(), "|" | ">")
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

    fn value_depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(value_depth).max().unwrap_or(0),
            Value::Object(o) => 1 + o.values().map(value_depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    #[test]
    fn s7_1_1_the_nesting_scan_reckons_the_depth_the_parser_builds() {
        let mut texts: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples"))
                .expect("examples")
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "json"))
                .map(|p| std::fs::read_to_string(p).expect("read"))
                .collect();
        assert!(!texts.is_empty());
        texts.extend(
            [
                "a:\n- b:\n  - c:\n    - d: 1\n- e\nf: [1, {g: [2]}]\n",
                "- - - x\n- y\n",
                "k: &anchor [[1], {a: b}]\nl: !!seq [x]\n",
                "'q: [': \"[[[[\" # [[[[\nr: don't [stop]\n",
                "s: |\n  [[[[ text\n      - - - deeper text\nt:\n  u: >-\n    {{{{\n  v: 1\n",
                "{\"a\": {\"b\": [1, {\"c\": \"]]]\"}]}}",
                "---\nw:\n  x:\n    - 1\n",
                "a:\n  - b: 1\n    c:\n      d: [e]\n",
            ]
            .map(str::to_owned),
        );
        for t in &texts {
            let v = parse_manifest_text(t).unwrap_or_else(|e| panic!("{t}: {e}"));
            assert_eq!(nesting(t, usize::MAX).0, value_depth(&v), "{t}");
        }
    }

    #[test]
    fn s7_1_1_manifest_text_nests_at_most_its_bound_before_any_parser_reads_it() {
        let block = |n: usize| {
            (0..n)
                .map(|i| format!("{}a:", "  ".repeat(i)))
                .collect::<Vec<_>>()
                .join("\n")
                + " 1\n"
        };
        let flow = |n: usize| format!("{}1{}", "{\"a\": ".repeat(n), "}".repeat(n));
        let entries = |n: usize| format!("{}x\n", "- ".repeat(n));
        for (kind, text) in [
            ("block", &block as &dyn Fn(usize) -> String),
            ("flow", &flow),
            ("entries", &entries),
        ] {
            let ok = parse_manifest_text(&text(MAX_MANIFEST_DEPTH))
                .unwrap_or_else(|e| panic!("{kind}: n accepted: {e}"));
            assert_eq!(value_depth(&ok), MAX_MANIFEST_DEPTH, "{kind}");
            let e = parse_manifest_text(&text(MAX_MANIFEST_DEPTH + 1)).expect_err(kind);
            assert!(e.contains("nests deeper than 64 levels"), "{kind}: {e}");
        }
        // Deep: refused by the scan, which stops on the first line past the bound.
        let deep = block(1_000);
        assert_eq!(
            nesting(&deep, MAX_MANIFEST_DEPTH),
            (MAX_MANIFEST_DEPTH + 1, MAX_MANIFEST_DEPTH + 1)
        );
        assert!(parse_manifest_text(&deep)
            .expect_err("deep")
            .contains("line 65"));
        // 40,000 levels in 80 KB and 320 KB.
        let deep = entries(40_000);
        assert!(parse_manifest_text(&deep)
            .expect_err("deep")
            .contains("64 levels"));
        let deep = flow(40_000);
        assert!(parse_manifest_text(&deep)
            .expect_err("deep")
            .contains("64 levels"));
        // Schemas nested past their own bound inside a manifest that is not: lint names them.
        let mut schema = json!({"type": "string"});
        for _ in 0..40 {
            schema = json!({ "items": schema });
        }
        let mut m = valid();
        m["stimulusTriggers"][0]["payloadSchema"] = schema;
        let text = m.to_string();
        assert!(nesting(&text, usize::MAX).0 <= MAX_MANIFEST_DEPTH);
        let e = lint(&parse_manifest_text(&text).expect("parses"));
        assert!(e
            .errors()
            .any(|f| f.field == "stimulusTriggers[0].payloadSchema" && f.message.contains("nest")));
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
