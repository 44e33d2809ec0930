//! The bounds a payload schema must keep and the work it can ask for at one value of a payload (steps, and pattern units per byte), reckoned from the document alone before it is compiled.
use std::collections::HashMap;

use serde_json::{Map, Value};

use super::{err, SchemaError, DIALECT};

/// Most bytes of a schema's JSON text.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;
/// Deepest a schema's JSON may nest.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// Most subschemas in one schema.
pub const MAX_SUBSCHEMAS: usize = 512;
/// Most values in all of a schema's `enum`s together.
pub const MAX_ENUM_VALUES: usize = 1_024;
/// Most bytes of one `pattern` (or `patternProperties` key).
pub const MAX_PATTERN_BYTES: usize = 512;
/// The compiled size a pattern may reach (the `regex` crate's size limit).
pub const PATTERN_SIZE_LIMIT: usize = 256 * 1024;
/// Most units of work a schema may ask for at one value of a payload: one per subschema
/// applied there, one per `enum` value compared (one more per 16 bytes of a value that is an
/// array or object), eight per pattern matched. A payload holds at most one value per two
/// bytes, so this bounds the work per byte of payload too.
pub const MAX_COST_PER_NODE: u64 = 256;
/// Units of work of one pattern match.
const PATTERN_COST: u64 = 8;
/// Units of work (about a nanosecond of one core each) a payload's patterns may cost at the
/// largest payload accepted (`--max-payload-bytes`): a pattern whose automaton determinizes
/// within DFA_TEST_BYTES costs one unit per byte of the string it meets (the lazy DFA never
/// thrashes); any other runs on the NFA simulation, NFA_UNITS_PER_STATE units per NFA state
/// per byte. Lint refuses a schema whose patterns could cost more at one payload.
pub const MAX_PATTERN_WORK: u64 = 1 << 25;
/// Units per NFA state per byte of a pattern that does not determinize within DFA_TEST_BYTES.
pub const NFA_UNITS_PER_STATE: u64 = 16;
/// Largest DFA (bytes of transition table) a pattern may need to count as one unit per byte:
/// a quarter of the lazy DFA's cache (PATTERN_SIZE_LIMIT), so its states stay cached.
pub const DFA_TEST_BYTES: usize = PATTERN_SIZE_LIMIT / 4;
/// Most patterns (`pattern` keywords and `patternProperties` keys) in all of a pack's payload
/// schemas.
pub const MAX_PACK_PATTERNS: usize = 256;
/// Most bytes a pack's compiled patterns may hold together (their NFAs, each compiled once
/// forward and once reversed by the matcher).
pub const MAX_PACK_PATTERN_BYTES: usize = 4 * 1024 * 1024;
/// How deep a payload the cost is reckoned for: the most nesting the service accepts.
pub const COST_DEPTH: usize = 64;
/// What one pattern costs to run and to hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternCost {
    /// Its JSON pointer in the schema.
    pub pointer: String,
    /// Units of work per byte of a string it is matched against.
    pub per_byte: u64,
    /// States of its NFA.
    pub nfa_states: usize,
    /// Bytes its compiled form holds (forward and reverse NFA).
    pub bytes: usize,
}

/// The work a schema may ask for, as reckoned before it is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SchemaWork {
    /// Most steps (subschemas applied, enum values compared) at one value of a payload.
    pub per_node: u64,
    /// Most pattern units per byte of one string of a payload: every pattern that may apply
    /// to one value (or key) at once.
    pub per_byte: u64,
    /// Every pattern, with its cost.
    pub patterns: Vec<PatternCost>,
}

impl SchemaWork {
    /// The most units the patterns could cost on a payload of `bytes` bytes of JSON.
    pub fn pattern_work(&self, bytes: usize) -> u64 {
        self.per_byte.saturating_mul(bytes as u64)
    }

    /// An estimate of the whole check's units on a payload of `bytes` bytes: its patterns,
    /// and its steps at every value (a value per two bytes, a step about 16 units).
    pub fn check_work(&self, bytes: usize) -> u64 {
        self.pattern_work(bytes)
            .saturating_add(self.per_node.saturating_mul(8).saturating_mul(bytes as u64))
    }

    /// The pattern that costs the most per byte, if any.
    pub fn costliest(&self) -> Option<&PatternCost> {
        self.patterns.iter().max_by_key(|p| p.per_byte)
    }

    /// Bytes the compiled patterns hold together.
    pub fn pattern_bytes(&self) -> usize {
        self.patterns.iter().map(|p| p.bytes).sum()
    }
}

/// The keywords whose value is one subschema applied to the same instance.
const IN_PLACE_ONE: &[&str] = &["not", "if", "then", "else"];
/// ... an array of subschemas applied to the same instance.
const IN_PLACE_MANY: &[&str] = &["allOf", "anyOf", "oneOf"];
/// ... an object of subschemas applied to the same instance.
const IN_PLACE_MAP: &[&str] = &["dependentSchemas"];
/// ... one subschema applied to every item of an array instance.
const ITEMS_ONE: &[&str] = &["items", "contains", "unevaluatedItems"];
/// ... one subschema applied to every member (or key) of an object instance.
const MEMBERS_ONE: &[&str] = &[
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
];
/// ... subschemas applied to every member whose key matches: each may meet a given member.
const MEMBERS_MATCHING: &[&str] = &["patternProperties"];
/// ... subschemas kept for `$ref`, applied nowhere by themselves.
const DEFS: &[&str] = &["$defs", "definitions"];
/// Keywords refused: they resolve by the evaluation's path or change the base URI, so the
/// bound could not be reckoned from the document alone.
const REFUSED: &[&str] = &[
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
];

/// One subschema found in the walk.
struct Node {
    pointer: String,
    /// Own work at an instance: one, the `enum`'s values, the pattern.
    weight: u64,
    /// Own pattern units per byte of a string instance (or key).
    rate: u64,
    /// Subschemas applied to the same instance (including `$ref` targets, resolved later).
    in_place: Vec<usize>,
    refs: Vec<(String, String)>,
    /// By the kind of instance (array items, object members): subschemas applied to any
    /// child, and groups of which at most one applies to a child (`prefixItems`,
    /// `properties`). An instance is one kind or the other, never both.
    children: [Children; 2],
}

#[derive(Default)]
struct Children {
    all: Vec<usize>,
    one_of: Vec<Vec<usize>>,
}

const ITEMS: usize = 0;
const MEMBERS: usize = 1;

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

struct Walk {
    nodes: Vec<Node>,
    by_pointer: HashMap<String, usize>,
    anchors: HashMap<String, usize>,
    errors: Vec<SchemaError>,
    enum_values: usize,
    patterns: Vec<PatternCost>,
}

impl Walk {
    fn node(&mut self, value: &Value, pointer: String) -> usize {
        let at = self.nodes.len();
        self.by_pointer.insert(pointer.clone(), at);
        self.nodes.push(Node {
            pointer: pointer.clone(),
            weight: 1,
            rate: 0,
            in_place: Vec::new(),
            refs: Vec::new(),
            children: Default::default(),
        });
        if self.nodes.len() > MAX_SUBSCHEMAS {
            return at;
        }
        let Value::Object(o) = value else {
            if !value.is_boolean() {
                self.errors
                    .push(err(&pointer, "a schema must be an object or a boolean"));
            }
            return at;
        };
        self.keywords(at, o, &pointer);
        at
    }

    fn keywords(&mut self, at: usize, o: &Map<String, Value>, pointer: &str) {
        for (k, v) in o {
            let here = format!("{pointer}/{}", escape(k));
            let k = k.as_str();
            if REFUSED.contains(&k) {
                self.errors.push(err(
                    &here,
                    format!(
                        "`{k}` is not supported in payload schemas; use `$ref` within the document"
                    ),
                ));
            } else if k == "$id" && !pointer.is_empty() {
                self.errors.push(err(
                    &here,
                    "`$id` is allowed only at the schema's root: a nested `$id` changes what `$ref` resolves against",
                ));
            } else if k == "$schema" {
                if v.as_str().map(|d| d.trim_end_matches('#')) != Some(DIALECT) {
                    self.errors.push(err(
                        &here,
                        format!("payload schemas are JSON Schema 2020-12: `$schema` must be `{DIALECT}` or absent"),
                    ));
                }
            } else if k == "$anchor" {
                if let Some(a) = v.as_str() {
                    self.anchors.insert(a.to_owned(), at);
                }
            } else if k == "$ref" {
                match v.as_str() {
                    Some(r) if r.starts_with('#') => {
                        self.nodes[at].refs.push((r.to_owned(), here));
                    }
                    _ => self.errors.push(err(
                        &here,
                        "`$ref` must point within this schema (`#`, `#/…` or `#anchor`): nothing is fetched",
                    )),
                }
            } else if k == "enum" {
                self.enumerated(at, v);
            } else if k == "pattern" {
                self.pattern(at, v.as_str().unwrap_or_default(), &here);
            } else if IN_PLACE_ONE.contains(&k) {
                let c = self.node(v, here);
                self.nodes[at].in_place.push(c);
            } else if IN_PLACE_MANY.contains(&k) {
                for (i, s) in v.as_array().into_iter().flatten().enumerate() {
                    let c = self.node(s, format!("{here}/{i}"));
                    self.nodes[at].in_place.push(c);
                }
            } else if IN_PLACE_MAP.contains(&k) {
                for (name, s) in v.as_object().into_iter().flatten() {
                    let c = self.node(s, format!("{here}/{}", escape(name)));
                    self.nodes[at].in_place.push(c);
                }
            } else if ITEMS_ONE.contains(&k) || MEMBERS_ONE.contains(&k) {
                let kind = if ITEMS_ONE.contains(&k) {
                    ITEMS
                } else {
                    MEMBERS
                };
                let c = self.node(v, here);
                self.nodes[at].children[kind].all.push(c);
            } else if k == "prefixItems" || k == "properties" {
                let group = self.group(v, &here);
                let kind = if k == "prefixItems" { ITEMS } else { MEMBERS };
                self.nodes[at].children[kind].one_of.push(group);
            } else if MEMBERS_MATCHING.contains(&k) {
                for (p, s) in v.as_object().into_iter().flatten() {
                    let pointer = format!("{here}/{}", escape(p));
                    self.pattern(at, p, &pointer);
                    let c = self.node(s, pointer);
                    self.nodes[at].children[MEMBERS].all.push(c);
                }
            } else if DEFS.contains(&k) {
                for (name, s) in v.as_object().into_iter().flatten() {
                    self.node(s, format!("{here}/{}", escape(name)));
                }
            }
        }
    }

    /// An `enum`'s values: one unit of work each to compare, one more per 16 bytes of a value
    /// that is an array or object.
    fn enumerated(&mut self, at: usize, v: &Value) {
        let values = v.as_array().map(Vec::as_slice).unwrap_or_default();
        self.enum_values += values.len();
        for e in values {
            let deep = match e {
                Value::Array(_) | Value::Object(_) => {
                    serde_json::to_vec(e).map_or(0, |b| b.len() as u64 / 16)
                }
                _ => 0,
            };
            self.nodes[at].weight += 1 + deep;
        }
    }

    /// The subschemas of `properties` (by name) or `prefixItems` (by place): one of them
    /// meets a given member or item.
    fn group(&mut self, v: &Value, here: &str) -> Vec<usize> {
        match v {
            Value::Object(m) => m
                .iter()
                .map(|(name, s)| self.node(s, format!("{here}/{}", escape(name))))
                .collect(),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .map(|(i, s)| self.node(s, format!("{here}/{i}")))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// A pattern must compile on the `regex` crate within its size limit: linear-time matching.
    /// Its cost per byte is charged to the node it applies at.
    fn pattern(&mut self, at: usize, p: &str, pointer: &str) {
        self.nodes[at].weight += PATTERN_COST;
        if p.len() > MAX_PATTERN_BYTES {
            self.errors.push(err(
                pointer,
                format!(
                    "a pattern may be at most {MAX_PATTERN_BYTES} bytes, not {}",
                    p.len()
                ),
            ));
            return;
        }
        if let Err(e) = regex::RegexBuilder::new(p)
            .size_limit(PATTERN_SIZE_LIMIT)
            .dfa_size_limit(PATTERN_SIZE_LIMIT)
            .build()
        {
            let why = match e {
                regex::Error::CompiledTooBig(_) => format!(
                    "pattern `{p}` compiles larger than {PATTERN_SIZE_LIMIT} bytes"
                ),
                _ => format!("pattern `{p}` must be a regular expression without lookaround or backreferences (patterns run in linear time): {e}"),
            };
            self.errors.push(err(pointer, why));
            return;
        }
        match pattern_cost(p, pointer) {
            Ok(c) => {
                self.nodes[at].rate = self.nodes[at].rate.saturating_add(c.per_byte);
                self.patterns.push(c);
            }
            Err(why) => self.errors.push(err(pointer, why)),
        }
    }

    /// The subschema a `$ref` names, if it is one.
    fn resolve(&self, r: &str) -> Option<usize> {
        let frag = &r[1..];
        if frag.is_empty() {
            return Some(0);
        }
        if let Some(p) = frag.strip_prefix('/') {
            let decoded = percent_decode(p)?;
            return self.by_pointer.get(&format!("/{decoded}")).copied();
        }
        self.anchors.get(frag).copied()
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// What matching `pattern` costs per byte, and what its compiled form holds, reckoned on the
/// form the validator compiles (its ECMA-262 translation, with counts at an edge collapsed).
pub fn pattern_cost(pattern: &str, pointer: &str) -> Result<PatternCost, String> {
    use jsonschema_regex::Search;
    use regex_automata::dfa::{dense, StartKind};
    use regex_automata::nfa::thompson::{self, NFA};

    let translated = jsonschema_regex::to_rust_regex(pattern)
        .map_err(|()| format!("pattern `{pattern}` is not an ECMA-262 regular expression"))?;
    let form = match jsonschema_regex::search_form(pattern, &translated) {
        // A class repeated: matched by counting characters, one unit per byte.
        Some(Search::RepeatedClass(_)) => {
            return Ok(PatternCost {
                pointer: pointer.to_owned(),
                per_byte: 1,
                nfa_states: 0,
                bytes: 0,
            })
        }
        Some(Search::Collapsed(c)) => c,
        None => translated.into_owned(),
    };
    let nfa = |reverse: bool| {
        NFA::compiler()
            .configure(
                thompson::Config::new()
                    .nfa_size_limit(Some(PATTERN_SIZE_LIMIT))
                    .which_captures(if reverse {
                        thompson::WhichCaptures::None
                    } else {
                        thompson::WhichCaptures::All
                    })
                    .reverse(reverse),
            )
            .build(&form)
            .map_err(|e| {
                format!(
                    "pattern `{pattern}` does not compile within {PATTERN_SIZE_LIMIT} bytes: {e}"
                )
            })
    };
    let forward = nfa(false)?;
    let reverse = nfa(true)?;
    // A DFA this small fits the lazy DFA's cache whatever the string: about a unit per byte.
    // Larger, a string can make the lazy DFA give up, and the NFA simulation costs per state.
    let small_dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                .start_kind(StartKind::Unanchored)
                .minimize(false)
                .determinize_size_limit(Some(DFA_TEST_BYTES))
                .dfa_size_limit(Some(DFA_TEST_BYTES)),
        )
        .build_from_nfa(&forward)
        .is_ok();
    let states = forward.states().len();
    Ok(PatternCost {
        pointer: pointer.to_owned(),
        per_byte: if small_dfa {
            1
        } else {
            (states as u64).saturating_mul(NFA_UNITS_PER_STATE)
        },
        nfa_states: states,
        bytes: forward.memory_usage() + reverse.memory_usage(),
    })
}

fn json_depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(json_depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(json_depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// The most work `raw` can ask for at one node of a payload nested at most COST_DEPTH deep,
/// or the errors that keep it from being reckoned.
pub fn cost(raw: &Value) -> Result<u64, Vec<SchemaError>> {
    work(raw).map(|w| w.per_node)
}

/// The work `raw` can ask for at one node of a payload nested at most COST_DEPTH deep (steps,
/// and pattern units per byte), or the errors that keep it from being reckoned.
pub fn work(raw: &Value) -> Result<SchemaWork, Vec<SchemaError>> {
    let mut w = Walk {
        nodes: Vec::new(),
        by_pointer: HashMap::new(),
        anchors: HashMap::new(),
        errors: Vec::new(),
        enum_values: 0,
        patterns: Vec::new(),
    };
    w.node(raw, String::new());
    if w.nodes.len() > MAX_SUBSCHEMAS {
        return Err(vec![err(
            "",
            format!("a payload schema may hold at most {MAX_SUBSCHEMAS} subschemas"),
        )]);
    }
    if w.enum_values > MAX_ENUM_VALUES {
        w.errors.push(err(
            "",
            format!(
                "a payload schema's enums may hold at most {MAX_ENUM_VALUES} values in all, not {}",
                w.enum_values
            ),
        ));
    }
    for at in 0..w.nodes.len() {
        let refs = std::mem::take(&mut w.nodes[at].refs);
        for (r, pointer) in refs {
            match w.resolve(&r) {
                Some(t) => w.nodes[at].in_place.push(t),
                None => w.errors.push(err(
                    &pointer,
                    format!("`$ref` `{r}` names no subschema of this schema"),
                )),
            }
        }
    }
    if !w.errors.is_empty() {
        return Err(w.errors);
    }
    // Subschemas applied to one instance must not lead back to themselves without descending
    // into the payload: that evaluation would never end.
    let order = in_place_order(&w.nodes)?;
    Ok(SchemaWork {
        per_node: worst_at_one_value(&w.nodes, &order, |n| n.weight, MAX_COST_PER_NODE),
        per_byte: worst_at_one_value(&w.nodes, &order, |n| n.rate, u64::MAX),
        patterns: w.patterns,
    })
}

/// The most `weight` that the subschemas applied at one instance add up to, over instances
/// at every depth up to COST_DEPTH (reckoning stops once it passes `enough`).
fn worst_at_one_value(
    nodes: &[Node],
    order: &[usize],
    weight: impl Fn(&Node) -> u64,
    enough: u64,
) -> u64 {
    // at[k][n]: the work of node n's applications at an instance k levels below where n is
    // applied, worst case over which child. Children are reckoned before parents (`order`).
    let n = nodes.len();
    // Below the instance, every subschema applied in place meets the same child, which is an
    // item (the instance is an array) or a member (an object): each kind is reckoned apart,
    // `by_kind`, and the worst of the two is the node's.
    let mut worst = 0u64;
    let mut below = vec![0u64; n];
    for k in 0..=COST_DEPTH {
        let mut here = vec![0u64; n];
        let mut by_kind = vec![[0u64; 2]; n];
        for &i in order {
            let node = &nodes[i];
            if k == 0 {
                let mut c = weight(node);
                for &t in &node.in_place {
                    c = c.saturating_add(here[t]);
                }
                here[i] = c;
                continue;
            }
            let mut c = [0u64; 2];
            for (kind, sum) in c.iter_mut().enumerate() {
                for &t in &node.in_place {
                    *sum = sum.saturating_add(by_kind[t][kind]);
                }
                let children = &node.children[kind];
                for &t in &children.all {
                    *sum = sum.saturating_add(below[t]);
                }
                for group in &children.one_of {
                    *sum = sum.saturating_add(group.iter().map(|&t| below[t]).max().unwrap_or(0));
                }
            }
            by_kind[i] = c;
            here[i] = c[ITEMS].max(c[MEMBERS]);
        }
        worst = worst.max(here[0]);
        if worst > enough {
            break;
        }
        below = here;
    }
    worst
}

/// Nodes ordered so that every in-place target comes before what applies it; an in-place
/// cycle is an error at the `$ref` (or applicator) that closes it.
fn in_place_order(nodes: &[Node]) -> Result<Vec<usize>, Vec<SchemaError>> {
    // 0: not seen, 1: on the path, 2: done. Iterative, so a long chain cannot overflow.
    let mut state = vec![0u8; nodes.len()];
    let mut order = Vec::with_capacity(nodes.len());
    for start in 0..nodes.len() {
        if state[start] != 0 {
            continue;
        }
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        state[start] = 1;
        while let Some(&mut (i, ref mut next)) = stack.last_mut() {
            if let Some(&t) = nodes[i].in_place.get(*next) {
                *next += 1;
                match state[t] {
                    0 => {
                        state[t] = 1;
                        stack.push((t, 0));
                    }
                    1 => {
                        return Err(vec![err(
                            &nodes[i].pointer,
                            format!(
                                "applies `{}` to the same payload value it is applied to, through a cycle that never descends into the payload",
                                if nodes[t].pointer.is_empty() { "#" } else { &nodes[t].pointer }
                            ),
                        )])
                    }
                    _ => {}
                }
            } else {
                state[i] = 2;
                order.push(i);
                stack.pop();
            }
        }
    }
    Ok(order)
}

/// Every bound a payload schema must keep, checked before it is compiled.
pub fn bounded(raw: &Value) -> Result<SchemaWork, Vec<SchemaError>> {
    let size = serde_json::to_vec(raw).map_or(usize::MAX, |b| b.len());
    if size > MAX_SCHEMA_BYTES {
        return Err(vec![err(
            "",
            format!("a payload schema may be at most {MAX_SCHEMA_BYTES} bytes of JSON, not {size}"),
        )]);
    }
    if json_depth(raw) > MAX_SCHEMA_DEPTH {
        return Err(vec![err(
            "",
            format!("a payload schema may nest at most {MAX_SCHEMA_DEPTH} levels"),
        )]);
    }
    if !raw.is_object() {
        return Err(vec![err("", "a payload schema must be a JSON object")]);
    }
    let w = work(raw)?;
    if w.per_node > MAX_COST_PER_NODE {
        return Err(vec![err(
            "",
            format!("validating one payload value against this schema could take more than {MAX_COST_PER_NODE} steps (a step per subschema applied and enum value compared, {PATTERN_COST} per pattern matched) at some depth up to {COST_DEPTH}: simplify it"),
        )]);
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::pack::schema::tests::{refused, tracker};
    use crate::domain::pack::schema::PayloadSchema;
    use serde_json::json;

    #[test]
    fn patterns_run_without_backtracking_and_those_that_need_it_are_refused() {
        // Catastrophic for a backtracking engine; linear on this one, so it is accepted.
        let s = PayloadSchema::compile(&json!({"properties": {"a": {"pattern": "^(a+)+$"}}}))
            .expect("accepted");
        let evil = format!("{}!", "a".repeat(50_000));
        assert_eq!(s.check(&json!({ "a": evil }))[0].keyword, "pattern");
        for (p, at) in [
            (
                json!({"properties": {"a": {"pattern": "^(a+)\\1$"}}}),
                "/properties/a/pattern",
            ),
            (
                json!({"properties": {"a": {"pattern": "(?=a)a"}}}),
                "/properties/a/pattern",
            ),
            (
                json!({"patternProperties": {"(?<!x)y": true}}),
                "/patternProperties/(?<!x)y",
            ),
            (json!({"pattern": "a{1000}{1000}"}), "/pattern"),
            (
                json!({"pattern": "a".repeat(MAX_PATTERN_BYTES + 1)}),
                "/pattern",
            ),
        ] {
            let e = refused(p.clone());
            assert_eq!(e[0].pointer, at, "{p}: {e:?}");
        }
    }

    #[test]
    fn refs_stay_in_the_document_and_never_cycle_in_place() {
        for (s, at) in [
            (json!({"$ref": "https://example.com/s.json"}), "/$ref"),
            (json!({"$ref": "s.json"}), "/$ref"),
            (json!({"$ref": "#/$defs/missing"}), "/$ref"),
            (
                json!({"$defs": {"a": {"$dynamicAnchor": "a"}}}),
                "/$defs/a/$dynamicAnchor",
            ),
            (
                json!({"items": {"$dynamicRef": "#a"}}),
                "/items/$dynamicRef",
            ),
            (
                json!({"properties": {"a": {"$id": "https://x/y"}}}),
                "/properties/a/$id",
            ),
            (
                json!({"$schema": "http://json-schema.org/draft-07/schema#"}),
                "/$schema",
            ),
        ] {
            assert_eq!(refused(s.clone())[0].pointer, at, "{s}");
        }
        // In place, to the same value: evaluation would never end.
        refused(json!({"$ref": "#"}));
        refused(json!({"$ref": "#/$defs/a", "$defs": {
            "a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}}));
        refused(json!({"$defs": {"a": {"$anchor": "top", "not": {"$ref": "#top"}}}}));
        // Descending into the payload at each turn: a tree, accepted.
        let tree = json!({"type": "object", "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}}}});
        let s = PayloadSchema::compile(&tree).expect("a recursive tree");
        assert!(s
            .check(&json!({"children": [{"children": [{"name": "x"}]}]}))
            .is_empty());
        assert_eq!(
            s.check(&json!({"children": [{"children": [{"name": 1}]}]}))[0].pointer,
            "/children/0/children/0/name"
        );
    }

    #[test]
    fn a_schema_whose_work_multiplies_with_depth_is_refused() {
        // Two branches, each applying the whole schema to every child: 2^depth applications.
        let e = refused(json!({"anyOf": [
            {"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]}));
        assert!(e[0].message.contains("steps"), "{e:?}");
        // One branch: the same work at every depth, accepted.
        PayloadSchema::compile(&json!({"anyOf": [{"items": {"$ref": "#"}}, {"type": "string"}]}))
            .expect("linear");
        // Wide in place: 600 subschemas.
        let wide: Vec<Value> = (0..600).map(|i| json!({"minimum": i})).collect();
        assert!(refused(json!({ "allOf": wide }))[0]
            .message
            .contains("subschemas"));
        // Nested allOf deeper than the schema may nest.
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({ "allOf": [deep] });
        }
        assert!(refused(deep)[0].message.contains("nest"));
    }

    #[test]
    fn schemas_whose_work_per_value_is_large_are_refused() {
        // 500 patterns tried on every item of an array.
        let patterns: Vec<Value> = (0..500)
            .map(|i| json!({ "pattern": format!("^q{i}z") }))
            .collect();
        let e =
            refused(json!({"properties": {"a": {"type": "array", "items": {"anyOf": patterns}}}}));
        assert!(e[0].message.contains("steps"), "{e:?}");
        // 300 patternProperties: each key meets every pattern.
        let pp: Map<String, Value> = (0..300).map(|i| (format!("^k{i}$"), json!(true))).collect();
        refused(json!({ "patternProperties": pp }));
        // 1,024 objects compared with every item.
        let objects: Vec<Value> = (0..1024).map(|i| json!({"k": [i, {"z": i}]})).collect();
        refused(json!({"items": {"not": {"enum": objects}}}));
        // A country-code enum on every item, with a pattern beside it: accepted.
        let codes: Vec<Value> = (0..250).map(|i| json!(format!("C{i}"))).collect();
        PayloadSchema::compile(
            &json!({"items": {"enum": codes}, "properties": {"a": {"pattern": "^x"}}}),
        )
        .expect("a typical large enum");
    }

    #[test]
    fn enums_and_size_are_bounded_at_their_limit() {
        let values = |n: usize| (0..n).map(|i| json!(i)).collect::<Vec<_>>();
        // Split over properties, so that no one value meets more than the work bound.
        let spread = |n: usize| {
            let per = n.div_ceil(8);
            let props: Map<String, Value> = (0..8)
                .map(|p| {
                    (
                        format!("p{p}"),
                        json!({ "enum": values(per.min(n - (p * per).min(n))) }),
                    )
                })
                .collect();
            json!({ "properties": props })
        };
        PayloadSchema::compile(&spread(MAX_ENUM_VALUES)).expect("n accepted");
        let e = refused(spread(MAX_ENUM_VALUES + 1));
        assert!(e[0].message.contains("enums"), "{e:?}");
        let padding = "x".repeat(MAX_SCHEMA_BYTES);
        assert!(refused(json!({ "description": padding }))[0]
            .message
            .contains("bytes"));
        assert!(refused(json!(true))[0].message.contains("object"));
    }

    fn manifest_with(schemas: &[Value]) -> Value {
        let triggers: Vec<Value> = schemas
            .iter()
            .enumerate()
            .map(|(i, s)| json!({"ref": format!("t.n{i}"), "payloadSchema": s}))
            .collect();
        let stimuli: Vec<Value> = (0..schemas.len())
            .map(|i| json!({"ref": format!("t.n{i}"), "operation": "read", "land": "user"}))
            .collect();
        json!({"id": "p", "kind": "sense_only", "stimulusTriggers": triggers,
            "policy": {"stimuli": stimuli}, "binding": {"mode": "public", "hub": "none"}})
    }

    fn lint_at(m: &Value, max_payload_bytes: usize) -> Vec<crate::domain::pack::Finding> {
        crate::domain::pack::lint_within(m, crate::domain::pack::Bounds { max_payload_bytes })
            .errors()
            .cloned()
            .collect()
    }

    #[test]
    fn realistic_patterns_cost_a_unit_per_byte() {
        for p in [
            "^[a-z0-9-]{1,64}$",
            "^[A-Z]+-[0-9]+$",
            "^[^@\\s]+@[^@\\s]+\\.[^@\\s]+$",
            "^[a-zA-Z0-9.!#$%&'*+/=?^_`{|}~-]+@[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?(?:\\.[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*$",
            "^\\d{4}-\\d{2}-\\d{2}$",
            "^[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)*$",
            "^\\w+$",
        ] {
            let c = pattern_cost(p, "/pattern").expect(p);
            assert_eq!(c.per_byte, 1, "{p}: {c:?}");
            let m = manifest_with(&[json!({"properties": {"a": {"pattern": p}}})]);
            assert_eq!(lint_at(&m, 64 * 1024), Vec::new(), "{p}");
        }
        // The tracker's schema, at a payload limit of 1 MiB.
        assert_eq!(lint_at(&manifest_with(&[tracker()]), 1 << 20), Vec::new());
    }

    #[test]
    fn a_pattern_whose_dfa_blows_up_is_charged_by_its_nfa_at_the_payload_limit() {
        // Unanchored, a class counted n times before a literal: a DFA of 2^n states.
        let big = pattern_cost("a[ab]{3637}c", "").expect("compiles");
        assert!(big.nfa_states > 3637, "{big:?}");
        assert_eq!(
            big.per_byte,
            big.nfa_states as u64 * NFA_UNITS_PER_STATE,
            "{big:?}"
        );
        let m = manifest_with(&[json!({"properties": {"a": {"pattern": "a[ab]{3637}c"}}})]);
        let e = lint_at(&m, 64 * 1024);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(
            e[0].field,
            "stimulusTriggers[0].payloadSchema/properties/a/pattern"
        );
        assert!(e[0].message.contains("65536 bytes"), "{}", e[0].message);
        assert!(
            e[0].message.contains(&MAX_PATTERN_WORK.to_string()),
            "{}",
            e[0].message
        );
        // At the boundary: the budget over the payload limit, n bytes accepted, n + 1 refused.
        let p = "a[ab]{20}c";
        let rate = pattern_cost(p, "").expect("compiles").per_byte;
        assert!(rate > 1);
        let schema = json!({"properties": {"a": {"pattern": p}}});
        let at = (MAX_PATTERN_WORK / rate) as usize;
        let m = manifest_with(std::slice::from_ref(&schema));
        assert_eq!(lint_at(&m, at), Vec::new());
        let e = lint_at(&m, at + 1);
        assert_eq!(
            e[0].field,
            "stimulusTriggers[0].payloadSchema/properties/a/pattern"
        );
        // Patterns that may meet one value add up: two at the same value, double the rate.
        let both = json!({"properties": {"a": {"pattern": p, "allOf": [{"pattern": p}]}}});
        let w = PayloadSchema::compile(&both).expect("compiles").work;
        assert_eq!(w.per_byte, 2 * rate);
        // Under different members, only one meets a given value.
        let apart = json!({"properties": {"a": {"pattern": p}, "b": {"pattern": p}}});
        assert_eq!(
            PayloadSchema::compile(&apart)
                .expect("compiles")
                .work
                .per_byte,
            rate
        );
    }

    #[test]
    fn a_packs_patterns_are_bounded_in_count_and_compiled_bytes() {
        let schema = |n: usize, p: &str| {
            let props: Map<String, Value> = (0..n)
                .map(|i| (format!("p{i}"), json!({ "pattern": p })))
                .collect();
            json!({ "properties": props })
        };
        // Count: spread over two triggers, n accepted, n + 1 refused at the schema that passes it.
        let half = MAX_PACK_PATTERNS / 2;
        let ok = manifest_with(&[schema(half, "^x"), schema(MAX_PACK_PATTERNS - half, "^y")]);
        assert_eq!(lint_at(&ok, 64 * 1024), Vec::new());
        let over = manifest_with(&[
            schema(half, "^x"),
            schema(MAX_PACK_PATTERNS - half + 1, "^y"),
        ]);
        let e = lint_at(&over, 64 * 1024);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].field, "stimulusTriggers[1].payloadSchema");
        assert!(
            e[0].message.contains(&MAX_PACK_PATTERNS.to_string()),
            "{}",
            e[0].message
        );
        // Compiled bytes: patterns cheap to run but large to hold.
        let p = "^(?:[a-z]{2}[0-9]{3}){150}$";
        let one = pattern_cost(p, "").expect("compiles");
        assert_eq!(one.per_byte, 1, "{one:?}");
        let fit = MAX_PACK_PATTERN_BYTES / one.bytes;
        assert!(fit < MAX_PACK_PATTERNS, "{one:?}");
        let per = fit.div_ceil(2);
        assert_eq!(
            lint_at(
                &manifest_with(&[schema(per, p), schema(fit - per, p)]),
                64 * 1024
            ),
            Vec::new()
        );
        let e = lint_at(
            &manifest_with(&[schema(per, p), schema(fit - per + 1, p)]),
            64 * 1024,
        );
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].field, "stimulusTriggers[1].payloadSchema");
        assert!(
            e[0].message.contains(&MAX_PACK_PATTERN_BYTES.to_string()),
            "{}",
            e[0].message
        );
    }
}
