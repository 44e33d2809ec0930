//! Activation filters: a CEL expression over a trigger's `ref`, `land`, `project` and `payload`, kept with an activation and evaluated after the policy checks pass.
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use ::cel::common::ast::IdedExpr;
use ::cel::Value as Cel;

use super::cel::{self, Lifted};
use super::trigger::{Route, Trigger};

use direct::{object_at, value_at, Direct, V};

mod direct;

/// The names a filter reads, each counted as the most a payload holds when what it may build is
/// bounded (`ref`, `land` and `project` hold far less).
const VARIABLES: &[(&str, usize)] = &[
    ("ref", cel::VARIABLE_BYTES),
    ("land", cel::VARIABLE_BYTES),
    ("project", cel::VARIABLE_BYTES),
    ("payload", cel::VARIABLE_BYTES),
];
/// What a filter's string may name besides a route: no record.
const DROP: &str = "drop";

/// A compiled filter. Two filters are the same when their text is.
pub struct Filter {
    source: String,
    /// `Err` holds why a stored filter no longer compiles: it fails every trigger.
    expr: Result<IdedExpr, String>,
    /// The payload's paths the filter reads, lifted into variables of their own, when it
    /// reads the payload only by field paths: only their values are converted for an
    /// evaluation, whatever the payload's size. `None`: the payload is bound whole.
    lifted: Option<Vec<Lifted>>,
    /// Which of `ref`, `land` and `project` the filter reads: only those are bound.
    reads: [bool; 3],
    /// The filter in the shapes evaluated without the interpreter, when it is written in them.
    direct: Option<Direct>,
}

impl PartialEq for Filter {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}
impl Eq for Filter {}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Filter").field(&self.source).finish()
    }
}

/// Filters compiled by this process and still held by a policy view, by text.
static COMPILED: LazyLock<Mutex<HashMap<String, Weak<Filter>>>> = LazyLock::new(Default::default);

fn compiled() -> std::sync::MutexGuard<'static, HashMap<String, Weak<Filter>>> {
    COMPILED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a filter made of one trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filtered {
    /// Record it, with this route.
    Pass(Route),
    /// Do not record it: the filter said `false` or `drop`.
    Drop,
    /// The evaluation failed or yielded something else: not recorded, and said why.
    Error(String),
}

impl Filter {
    /// Compiles and checks a filter's text: CEL as ingress mappings take it (size, depth and
    /// term bounds, no loops) reading only `ref`, `land`, `project` and `payload`. A filter
    /// that reads none of them is evaluated now and must yield a bool or a route name.
    /// The error describes the rule broken, with the position where there is one.
    pub fn compile(source: &str) -> Result<Arc<Filter>, String> {
        if source.trim().is_empty() {
            return Err("is blank; leave it empty for no filter".into());
        }
        cel::on_compile_thread(|| {
            let expr = cel::check(source, VARIABLES, "a filter")?;
            match cel::constant(&expr) {
                Some(Ok(v)) => {
                    if let Err(e) = outcome(v, Route::Inbox) {
                        return Err(format!("always {e}"));
                    }
                }
                Some(Err(e)) => return Err(format!("always fails: {e}")),
                None => {}
            }
            let reads = {
                let r = expr.references();
                let vars = r.variables();
                [
                    vars.contains(&"ref"),
                    vars.contains(&"land"),
                    vars.contains(&"project"),
                ]
            };
            let (expr, lifted) = match cel::lift_paths(&expr, "payload") {
                Some((rewritten, lifted)) => (rewritten, Some(lifted)),
                None => (expr, None),
            };
            let direct = lifted.as_ref().and_then(|l| Direct::lower(&expr, l));
            Ok(Filter {
                source: source.to_owned(),
                expr: Ok(expr),
                lifted,
                reads,
                direct,
            })
        })?
        .map(Arc::new)
    }

    /// The compiled filter of `source`: the one this process already holds for the same text,
    /// or a new one. Principals whose activations share a text share one compiled filter, so
    /// a decision reads one copy that stays in the CPU's caches, and a reload after another
    /// replica's change finds the filters it had compiled.
    pub fn shared(source: &str) -> Result<Arc<Filter>, String> {
        let held =
            |compiled: &HashMap<String, Weak<Filter>>| compiled.get(source).and_then(Weak::upgrade);
        if let Some(f) = held(&compiled()) {
            return Ok(f);
        }
        // Compiled without the lock held: compiling takes a thread of its own.
        let f = Filter::compile(source)?;
        let mut compiled = compiled();
        if let Some(f) = held(&compiled) {
            return Ok(f);
        }
        if compiled.len() >= 1024 && compiled.len().is_power_of_two() {
            compiled.retain(|_, w| w.strong_count() > 0);
        }
        compiled.insert(source.to_owned(), Arc::downgrade(&f));
        Ok(f)
    }

    /// A stored filter that does not compile: every evaluation is an error saying why.
    pub fn unusable(source: &str, why: String) -> Arc<Filter> {
        Arc::new(Filter {
            source: source.to_owned(),
            expr: Err(why),
            lifted: Some(Vec::new()),
            reads: [false; 3],
            direct: None,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates the filter on a trigger that passed the policy checks with `route`.
    /// `true` records with `route`; `false` or `"drop"` does not; `"inbox"` or `"silent"`
    /// records with that route. Anything else, or a failure, is an error, never a panic: the
    /// tree is at most MAX_EXPRESSION_DEPTH deep and has no loop.
    pub fn apply(&self, t: &Trigger, route: Route) -> Filtered {
        self.direct(t, route)
            .unwrap_or_else(|| self.interpret(t, route))
    }

    /// The outcome without the interpreter, where the filter's shape and the trigger's values
    /// allow it: a pass or a drop, never an error (the interpreter says what went wrong).
    fn direct(&self, t: &Trigger, route: Route) -> Option<Filtered> {
        match self.direct.as_ref()?.eval(t)? {
            V::Bool(true) => Some(Filtered::Pass(route)),
            V::Bool(false) => Some(Filtered::Drop),
            V::Str(DROP) => Some(Filtered::Drop),
            V::Str(s) => Route::parse(s).map(Filtered::Pass),
            _ => None,
        }
    }

    /// The outcome by CEL's interpreter.
    fn interpret(&self, t: &Trigger, route: Route) -> Filtered {
        let expr = match &self.expr {
            Ok(e) => e,
            Err(why) => return Filtered::Error(format!("does not compile: {why}")),
        };
        let mut ctx = cel::context();
        if self.reads[0] {
            ctx.add_variable_from_value("ref", t.r#ref.as_str());
        }
        if self.reads[1] {
            ctx.add_variable_from_value("land", t.land.as_str());
        }
        if self.reads[2] {
            ctx.add_variable_from_value("project", t.project.as_deref().unwrap_or(""));
        }
        match &self.lifted {
            Some(lifted) => {
                for l in lifted {
                    match &l.has {
                        // has(payload…x.f): the object must be there; it may lack `f`.
                        Some(f) => {
                            if let Some(o) = object_at(&t.payload, &l.path) {
                                ctx.add_variable_from_value(l.var.as_str(), o.contains_key(f));
                            }
                        }
                        None => {
                            if let Some(v) = value_at(&t.payload, &l.path) {
                                ctx.add_variable_from_value(l.var.as_str(), cel::json(v));
                            }
                        }
                    }
                    // Left unbound, the evaluation fails naming the variable; said as the path.
                }
            }
            None => ctx.add_variable_from_value("payload", cel::json_object(&t.payload)),
        }
        match Cel::resolve(expr, &ctx) {
            Ok(v) => outcome(v, route).unwrap_or_else(Filtered::Error),
            Err(e) => {
                let mut why = e.to_string();
                for l in self.lifted.iter().flatten() {
                    if why.contains(&l.var) {
                        why = format!(
                            "reads {}, which this payload does not have",
                            l.text("payload")
                        );
                    }
                }
                Filtered::Error(format!("failed: {why}"))
            }
        }
    }
}

/// A filter's value read as what to do.
fn outcome(v: Cel, route: Route) -> Result<Filtered, String> {
    match v {
        Cel::Bool(true) => Ok(Filtered::Pass(route)),
        Cel::Bool(false) => Ok(Filtered::Drop),
        Cel::String(s) if s.as_str() == DROP => Ok(Filtered::Drop),
        Cel::String(s) => Route::parse(&s).map(Filtered::Pass).ok_or_else(|| {
            format!(
                "yielded `{}`; a filter yields a bool or one of {}, {DROP}",
                s.chars().take(64).collect::<String>().escape_debug(),
                Route::NAMES.join(", ")
            )
        }),
        other => Err(format!(
            "yielded a {:?}; a filter yields a bool or a route name",
            other.type_of()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn trigger(r: &str, payload: serde_json::Value) -> Trigger {
        Trigger {
            pack_id: "p".into(),
            r#ref: r.into(),
            principal: "alice".into(),
            land: "user".into(),
            payload_bytes: crate::domain::trigger::json_len(&payload),
            payload: payload.as_object().cloned().unwrap_or_default(),
            project: None,
            trigger_id: None,
        }
    }

    #[test]
    fn filters_pass_drop_and_reroute() {
        let f = Filter::compile("payload.repository.private == false && ref.startsWith('issue.')")
            .expect("compiles");
        let public = json!({"repository": {"private": false}, "big": "x".repeat(10_000)});
        assert_eq!(
            f.apply(&trigger("issue.opened", public.clone()), Route::Silent),
            Filtered::Pass(Route::Silent)
        );
        assert_eq!(
            f.apply(&trigger("pr.opened", public), Route::Inbox),
            Filtered::Drop
        );
        let private = json!({"repository": {"private": true}});
        assert_eq!(
            f.apply(&trigger("issue.opened", private), Route::Inbox),
            Filtered::Drop
        );
        // A missing field is an error, not a pass; `has` tests for it.
        assert!(matches!(
            f.apply(&trigger("issue.opened", json!({})), Route::Inbox),
            Filtered::Error(_)
        ));
        let has = Filter::compile("has(payload.repository) && payload.repository.private")
            .expect("compiles");
        assert_eq!(
            has.apply(&trigger("x", json!({})), Route::Inbox),
            Filtered::Drop
        );
        let routes =
            Filter::compile("payload.urgent ? 'inbox' : (land == 'user' ? 'silent' : 'drop')")
                .expect("compiles");
        assert_eq!(
            routes.apply(&trigger("x", json!({"urgent": true})), Route::Silent),
            Filtered::Pass(Route::Inbox)
        );
        assert_eq!(
            routes.apply(&trigger("x", json!({"urgent": false})), Route::Inbox),
            Filtered::Pass(Route::Silent)
        );
        let whole = Filter::compile("size(payload) > 1 && payload['a'] == 1").expect("compiles");
        assert!(whole.lifted.is_none());
        let paths = Filter::compile(
            "has(payload.a) && has(payload.a.b) && payload.a.b.c == 1 && payload.a.b.c > 0",
        )
        .expect("compiles");
        assert_eq!(
            paths.lifted.as_ref().map(Vec::len),
            Some(3),
            "one variable per distinct read"
        );
        assert_eq!(
            paths.apply(&trigger("x", json!({"a": {"b": {"c": 1}}})), Route::Inbox),
            Filtered::Pass(Route::Inbox)
        );
        assert_eq!(
            paths.apply(&trigger("x", json!({"a": {}})), Route::Inbox),
            Filtered::Drop
        );
        assert_eq!(
            paths.apply(&trigger("x", json!({})), Route::Inbox),
            Filtered::Drop
        );
        // has() of a field of a missing object fails, as CEL has it.
        let nested_has = Filter::compile("has(payload.a.b)").expect("compiles");
        assert!(matches!(
            nested_has.apply(&trigger("x", json!({})), Route::Inbox),
            Filtered::Error(_)
        ));
        assert!(matches!(
            nested_has.apply(&trigger("x", json!({"a": 1})), Route::Inbox),
            Filtered::Error(_)
        ));
        let missing = Filter::compile("payload.a.b == 1").expect("compiles");
        match missing.apply(&trigger("x", json!({"a": {}})), Route::Inbox) {
            Filtered::Error(e) => assert!(e.contains("payload.a.b"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            whole.apply(&trigger("x", json!({"a": 1, "b": 2})), Route::Inbox),
            Filtered::Pass(Route::Inbox)
        );
        let bad = Filter::compile("payload.n + 1").expect("compiles");
        assert!(matches!(
            bad.apply(&trigger("x", json!({"n": 1})), Route::Inbox),
            Filtered::Error(_)
        ));
        let number = Filter::compile("size(payload.s) * 2").expect("compiles");
        assert!(
            matches!(number.apply(&trigger("x", json!({"s": "ab"})), Route::Inbox), Filtered::Error(e) if e.contains("bool"))
        );
        let typo = Filter::compile("payload.n == 'x' ? 'inbx' : 'drop'").expect("compiles");
        assert!(
            matches!(typo.apply(&trigger("x", json!({"n": "x"})), Route::Inbox), Filtered::Error(e) if e.contains("inbx"))
        );
        let mistyped = Filter::compile("ref + 1 == 2").expect("compiles");
        assert!(matches!(
            mistyped.apply(&trigger("x", json!({})), Route::Inbox),
            Filtered::Error(_)
        ));
    }

    /// Activations with the same text hold one compiled filter while any holds it.
    #[test]
    fn a_filter_text_is_compiled_once_while_held() {
        let src = "payload.shared_once == true";
        let a = Filter::shared(src).expect("compiles");
        let b = Filter::shared(src).expect("compiles");
        assert!(Arc::ptr_eq(&a, &b));
        let weak = Arc::downgrade(&a);
        drop((a, b));
        assert!(
            weak.upgrade().is_none(),
            "the cache does not keep a filter alive"
        );
        let c = Filter::shared(src).expect("compiles again");
        assert_eq!(c.source(), src);
        assert!(Filter::shared("payload.x.exists(v, v)").is_err());
    }

    /// Filters in the direct shapes are evaluated without the interpreter.
    #[test]
    fn common_filters_are_evaluated_directly() {
        let t = |r: &str, payload| Trigger {
            project: Some("web".into()),
            ..trigger(r, payload)
        };
        for (src, payload, want) in [
            (
                "payload.repository.private == false && ref.startsWith('issue.')",
                json!({"repository": {"private": false}}),
                Filtered::Pass(Route::Silent),
            ),
            (
                "payload.n >= 10 || land in ['brain', 'team']",
                json!({"n": 9}),
                Filtered::Drop,
            ),
            (
                "!has(payload.a.b) ? 'inbox' : (project.endsWith('b') ? 'drop' : 'silent')",
                json!({"a": {"b": 1}}),
                Filtered::Drop,
            ),
            (
                "payload.x == null",
                json!({"x": null}),
                Filtered::Pass(Route::Silent),
            ),
            (
                "payload.n * 2.0 > 10.0",
                json!({"n": 9}),
                Filtered::Pass(Route::Silent),
            ),
        ] {
            let f = Filter::compile(src).expect(src);
            assert_eq!(
                f.direct(&t("issue.opened", payload.clone()), Route::Silent),
                Some(want.clone()),
                "{src}"
            );
            assert_eq!(
                f.interpret(&t("issue.opened", payload), Route::Silent),
                want,
                "{src}"
            );
        }
        // What the direct form does not model goes to the interpreter, which says why.
        let f = Filter::compile("payload.a == 1").expect("compiles");
        assert_eq!(f.direct(&t("x", json!({})), Route::Inbox), None);
        assert_eq!(f.direct(&t("x", json!({"a": [1]})), Route::Inbox), None);
        assert!(
            matches!(f.apply(&t("x", json!({})), Route::Inbox), Filtered::Error(e) if e.contains("payload.a"))
        );
        for interpreted in [
            "size(payload.s) > 1",
            "payload.n % 2 == 1",
            "payload['a'] == 1",
        ] {
            assert!(
                Filter::compile(interpreted)
                    .expect(interpreted)
                    .direct
                    .is_none(),
                "{interpreted}"
            );
        }
    }

    /// A payload's numbers are doubles whatever their value, in both evaluators: the same
    /// filter decides 6.5, 9 and -3 alike, never failing on one kind of number and not another.
    #[test]
    fn json_numbers_are_doubles_in_both_evaluators() {
        let both = |src: &str, payload: serde_json::Value| {
            let f = Filter::compile(src).expect(src);
            let t = trigger("x", payload.clone());
            let interpreted = f.interpret(&t, Route::Inbox);
            if let Some(d) = f.direct(&t, Route::Inbox) {
                assert_eq!(d, interpreted, "{src} on {payload}");
            }
            interpreted
        };
        let pass = Filtered::Pass(Route::Inbox);
        for (n, want) in [
            (json!(6.5), &pass),
            (json!(9), &pass),
            (json!(-3), &Filtered::Drop),
            (json!(5), &Filtered::Drop),
            (json!(5.01), &pass),
        ] {
            assert_eq!(
                &both("payload.n * 2.0 > 10.0", json!({ "n": n })),
                want,
                "{n}"
            );
        }
        let arithmetic =
            Filter::compile("payload.n * 2.0 > 10.0 && -payload.n / 2.0 < 0.0").expect("compiles");
        assert!(arithmetic.direct.is_some(), "doubles' arithmetic is direct");
        for n in [json!(9), json!(6.5)] {
            assert_eq!(both("-payload.n + 3.0 < 0.0", json!({ "n": n })), pass);
        }
        // An int or uint literal equals a double of the same value and orders with it: CEL's
        // numbers compare across kinds.
        for (src, n) in [
            ("payload.n == 9", json!(9)),
            ("payload.n == 9", json!(9.0)),
            ("payload.n == 9u", json!(9)),
            ("payload.n in [1, 9]", json!(9)),
            ("payload.n < 10 && payload.n > -4", json!(-3)),
            ("payload.n != 9", json!(9.5)),
            ("int(payload.n) == 9", json!(9)),
            ("int(payload.n) == 9", json!(9.7)),
            ("uint(payload.n) == 9u", json!(9)),
            ("string(payload.n) == '6.5'", json!(6.5)),
            ("payload.n == 1.0 * 9.0", json!(9)),
        ] {
            assert_eq!(both(src, json!({ "n": n })), pass, "{src} on {n}");
        }
        // Arithmetic does not mix kinds: a double and an int literal is an error, as in CEL.
        for src in ["payload.n + 1 > 2.0", "payload.n * 2 > 10.0"] {
            match both(src, json!({ "n": 9 })) {
                Filtered::Error(e) => assert!(e.contains("failed"), "{src}: {e}"),
                other => panic!("{src}: {other:?}"),
            }
        }
        // Integers past 2^53 are the nearest double.
        assert_eq!(
            both(
                "payload.n == 9007199254740992.0",
                json!({ "n": 9_007_199_254_740_993u64 })
            ),
            pass
        );
        assert_eq!(both("payload.n > 1e19", json!({ "n": u64::MAX })), pass);
        assert_eq!(
            both(
                "payload.a.b == 2.5 && payload['a'].b == 2.5",
                json!({"a": {"b": 2.5}})
            ),
            pass
        );
        // Whole, the payload reads the same doubles.
        assert_eq!(both("payload['n'] * 2.0 > 10.0", json!({ "n": 9 })), pass);
    }

    /// CEL's type identifiers name types, not variables, in both evaluators: the direct form
    /// hands a filter naming one to the interpreter.
    #[test]
    fn type_identifiers_name_types() {
        let payload = json!({
            "s": "x", "n": 9, "f": 6.5, "b": true, "l": [1], "o": {"k": 1}, "z": null,
        });
        let every = "type(payload.s) == string && type(payload.n) == double \
            && type(payload.f) == double && type(payload.b) == bool && type(payload.l) == list \
            && type(payload.o) == map && type(payload.z) == null_type && type(1) == int \
            && type(1u) == uint && type(b'a') == bytes && type(string) == type \
            && type(payload.n) != int";
        for t in cel::TYPES {
            assert!(every.contains(&format!("== {t}")), "{t} is exercised");
        }
        let f = Filter::compile(every).expect("type identifiers are not variables");
        assert!(f.direct.is_none());
        assert_eq!(
            f.apply(&trigger("x", payload.clone()), Route::Inbox),
            Filtered::Pass(Route::Inbox)
        );
        let on_lifted =
            Filter::compile("type(payload.s) == string ? 'silent' : 'drop'").expect("compiles");
        assert!(on_lifted.lifted.is_some(), "payload paths are still lifted");
        assert_eq!(
            on_lifted.apply(&trigger("x", payload.clone()), Route::Inbox),
            Filtered::Pass(Route::Silent)
        );
        assert_eq!(
            on_lifted.apply(&trigger("x", json!({"s": 1})), Route::Inbox),
            Filtered::Drop
        );
        // A filter of types alone reads nothing: it is evaluated when set.
        assert!(Filter::compile("type(1) == int").is_ok());
        assert!(Filter::compile("type(1) == int ? 'inbx' : 'drop'")
            .expect_err("always `inbx`, checked when set")
            .contains("always"));
        // Names that are neither a variable nor a type are still refused.
        for name in ["str", "integer", "google"] {
            let e = Filter::compile(&format!("type(ref) == {name}")).expect_err(name);
            assert!(e.contains(&format!("`{name}`")), "{name}: {e}");
        }
    }

    mod agreement {
        use super::*;
        use proptest::prelude::*;

        /// Operands: the trigger's variables, payload paths and literals of every kind, at the
        /// edges of CEL's integer kinds among them.
        fn operand() -> impl Strategy<Value = String> {
            prop::sample::select(vec![
                "ref",
                "land",
                "project",
                "payload.a",
                "payload.a.b",
                "payload.n",
                "payload.s",
                "1",
                "-1",
                "0",
                "9",
                "0u",
                "7u",
                "2.5",
                "-0.5",
                "1.0",
                "10.0",
                "'issue.'",
                "'issue.opened'",
                "''",
                "'inbox'",
                "'silent'",
                "'drop'",
                "'web'",
                "true",
                "false",
                "null",
                "18446744073709551615u",
                "9223372036854775807",
                "-9223372036854775807",
            ])
            .prop_map(str::to_owned)
        }

        /// Numbers: payload paths that mostly hold one, literals of each kind, and arithmetic
        /// over them (which fails, as CEL's does, when it mixes kinds).
        fn number() -> impl Strategy<Value = String> {
            let atom = prop::sample::select(vec![
                "payload.n",
                "payload.n",
                "payload.a.b",
                "2.0",
                "9.0",
                "10.0",
                "-3.0",
                "0.0",
                "6.5",
                "9",
                "-3",
                "9u",
            ])
            .prop_map(str::to_owned);
            atom.prop_recursive(3, 8, 2, |inner| {
                prop_oneof![
                    (
                        inner.clone(),
                        inner.clone(),
                        prop::sample::select(vec!["+", "-", "*", "/"])
                    )
                        .prop_map(|(a, b, op)| format!("({a} {op} {b})")),
                    inner.prop_map(|a| format!("-({a})")),
                ]
            })
        }

        fn filter() -> impl Strategy<Value = String> {
            let cmp = || prop::sample::select(vec!["==", "!=", "<", "<=", ">", ">="]);
            let leaf = prop_oneof![
                operand(),
                Just("has(payload.a)".to_owned()),
                Just("has(payload.a.b)".to_owned()),
                (operand(), operand(), cmp()).prop_map(|(a, b, op)| format!("{a} {op} {b}")),
                (number(), number(), cmp()).prop_map(|(a, b, op)| format!("{a} {op} {b}")),
                (number(), operand(), cmp()).prop_map(|(a, b, op)| format!("{a} {op} {b}")),
                (
                    operand(),
                    operand(),
                    prop::sample::select(vec!["startsWith", "endsWith", "contains"])
                )
                    .prop_map(|(a, b, f)| format!("{a}.{f}({b})")),
                (operand(), operand(), operand())
                    .prop_map(|(a, b, c)| format!("{a} in [{b}, {c}]")),
                (number(), operand(), operand()).prop_map(|(a, b, c)| format!("{a} in [{b}, {c}]")),
            ];
            leaf.prop_recursive(4, 24, 3, |inner| {
                prop_oneof![
                    inner.clone().prop_map(|a| format!("!({a})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) && ({b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) || ({b})")),
                    (inner.clone(), inner.clone(), inner)
                        .prop_map(|(a, b, c)| format!("({a}) ? ({b}) : ({c})")),
                ]
            })
        }

        /// JSON numbers: integral, negative and fractional, at the edges of the integer kinds
        /// and of a double's exact integers.
        fn json_number() -> impl Strategy<Value = serde_json::Value> {
            prop_oneof![
                prop::sample::select(vec![
                    0i64,
                    1,
                    -1,
                    -3,
                    7,
                    9,
                    10,
                    1 << 53,
                    (1 << 53) + 1,
                    i64::MAX,
                    i64::MIN
                ])
                .prop_map(|n| json!(n)),
                Just(json!(u64::MAX)),
                prop::sample::select(vec![1.0f64, 2.5, -0.5, 6.5, -0.0, 9.0, 4.5, 1e300])
                    .prop_map(|f| json!(f)),
            ]
        }

        fn leaf() -> impl Strategy<Value = serde_json::Value> {
            prop_oneof![
                Just(json!(null)),
                any::<bool>().prop_map(|b| json!(b)),
                json_number(),
                prop::sample::select(vec!["", "issue.", "issue.opened", "inbox", "drop", "web"])
                    .prop_map(|s| json!(s)),
                Just(json!([1])),
            ]
        }

        fn payload() -> impl Strategy<Value = serde_json::Value> {
            let field = prop_oneof![
                Just(None),
                leaf().prop_map(Some),
                leaf().prop_map(|b| Some(json!({ "b": b }))),
                Just(Some(json!({}))),
            ];
            // `n` mostly a number, for the arithmetic.
            let n = prop_oneof![3 => json_number().prop_map(Some), 1 => field.clone()];
            (field.clone(), n, field).prop_map(|(a, n, s)| {
                let mut m = serde_json::Map::new();
                for (k, v) in [("a", a), ("n", n), ("s", s)] {
                    if let Some(v) = v {
                        m.insert(k.to_owned(), v);
                    }
                }
                serde_json::Value::Object(m)
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]
            /// Wherever the direct evaluation answers, the interpreter answers the same: over
            /// payloads of integral, negative and fractional JSON numbers (all doubles to CEL)
            /// beside literals of every kind and arithmetic on them.
            #[test]
            fn direct_evaluation_agrees_with_the_interpreter(
                src in filter(),
                cases in prop::collection::vec(
                    (payload(), prop::sample::select(vec!["issue.opened", "pr.opened", ""]), any::<bool>()),
                    8,
                ),
            ) {
                let Ok(f) = Filter::compile(&src) else { return Ok(()) };
                for (payload, r, project) in cases {
                    let t = Trigger {
                        project: project.then(|| "web".to_owned()),
                        ..trigger(r, payload)
                    };
                    if let Some(d) = f.direct(&t, Route::Silent) {
                        prop_assert_eq!(&d, &f.interpret(&t, Route::Silent), "{} on {:?}", src, t.payload);
                    }
                }
            }
        }
    }

    #[test]
    fn hostile_filters_are_refused_with_their_position() {
        for (src, says) in [
            ("payload.labels.exists(l, l == 'bug')", "comprehension"),
            ("[1,2,3].map(x, [1,2,3].map(y, x * y))", "comprehension"),
            ("secret == 1", "`secret`"),
            ("ref ==", "does not parse"),
            ("1 + 'a'", "always fails"),
            ("'inbx'", "always"),
            ("42", "always"),
            ("   ", "blank"),
            ("google.protobuf.Empty{}", "message"),
        ] {
            let e = Filter::compile(src).expect_err(src);
            assert!(e.contains(says), "{src}: {e}");
        }
        let e = Filter::compile("ref == 'a' &&\n  payload.x.all(v, v)").expect_err("loop");
        assert!(e.contains("line 2, column"), "{e}");
        let deep = format!("{}true{}", "(".repeat(500), ")".repeat(500));
        assert!(Filter::compile(&deep).is_err());
        let huge = format!("ref == '{}'", "x".repeat(cel::MAX_EXPRESSION_BYTES));
        assert!(Filter::compile(&huge)
            .expect_err("too long")
            .contains("bytes"));
        let at_limit = format!("ref == '{}'", "x".repeat(cel::MAX_EXPRESSION_BYTES - 9));
        assert_eq!(at_limit.len(), cel::MAX_EXPRESSION_BYTES);
        assert!(Filter::compile(&at_limit).is_ok());
        let over = format!("ref == '{}'", "x".repeat(cel::MAX_EXPRESSION_BYTES - 8));
        assert!(Filter::compile(&over).is_err());
        let terms = format!("size([{}1]) > 0", "1,".repeat(299));
        assert!(Filter::compile(&terms)
            .expect_err("too many terms")
            .contains("terms"));
        // Concatenation is bounded by what it may build, each variable read counted as
        // VARIABLE_BYTES: exactly MAX_BUILT_BYTES is kept, one byte more is refused.
        assert_eq!(cel::MAX_BUILT_BYTES, 16 * cel::VARIABLE_BYTES);
        let eight = "size((payload.a + payload.b) + (payload.c + payload.d)) > 0";
        let at_bound = format!("{eight} && {eight}");
        assert!(Filter::compile(&at_bound).is_ok(), "{at_bound}");
        let e = Filter::compile(&format!("{at_bound} && size('x' + '') > 0"))
            .expect_err("one byte over");
        assert!(
            e.contains(&format!("may build {} bytes", cel::MAX_BUILT_BYTES + 1))
                && e.contains("line 1, column"),
            "{e}"
        );
        let chain = |n: usize| {
            let parts: Vec<String> = (0..n).map(|i| format!("payload.f{i}")).collect();
            format!("size({}) > 0", parts.join(" + "))
        };
        assert!(Filter::compile(&chain(5)).is_ok());
        assert!(Filter::compile(&chain(6))
            .expect_err("six payload values concatenated")
            .contains("concatenation"));
        // A list or map literal copies what it holds: sixteen copies of the payload are the
        // bound, seventeen are over it.
        let list = |n: usize| format!("size([{}]) > 0", vec!["payload"; n].join(", "));
        assert!(Filter::compile(&list(16)).is_ok());
        assert!(Filter::compile(&list(17))
            .expect_err("seventeen copies of the payload")
            .contains(&format!("may build {} bytes", 17 * cel::VARIABLE_BYTES)));
        let map = |n: usize| {
            let entries: Vec<String> = (0..n).map(|i| format!("'k{i}': payload")).collect();
            format!("size({{{}}}) > 0", entries.join(", "))
        };
        assert!(Filter::compile(&map(15)).is_ok());
        assert!(Filter::compile(&map(17)).is_err());
        let long_chain = format!(
            "size({}payload.s{}) > 0",
            "(".repeat(20),
            " + payload.s)".repeat(20)
        );
        assert!(Filter::compile(&long_chain)
            .expect_err("a long chain of concatenations")
            .contains("concatenation"));
        for constant in ["true", "false", "'silent'", "'drop'"] {
            assert!(Filter::compile(constant).is_ok(), "{constant}");
        }
        // A function this build lacks is refused when the filter is set, not on every trigger.
        for missing in [
            "ref.matches('^issue')",
            "timestamp(payload.at) > 0",
            "ref.startswith('x')",
        ] {
            let e = Filter::compile(missing).expect_err(missing);
            assert!(e.contains("does not provide"), "{missing}: {e}");
        }
        // Every function the check lets through is there.
        let every = "size('ab') == 2 && 'ab'.size() == 2 && 'ab'.contains('a') && 'ab'.startsWith('a') \
            && 'ab'.endsWith('b') && int('1') == 1 && uint(1) == 1u && double(1) == 1.0 \
            && string(1) == '1' && bytes('a') == b'a' && bool('true') && dyn(1) == 1 && type(1) == type(2) \
            && ref != '' && 'a' in ['a'] && !false && -1 < 0 && 7 % 2 == 1 && [1][0] == 1";
        let all = Filter::compile(every).expect("compiles");
        assert_eq!(
            all.apply(&trigger("x", json!({})), Route::Inbox),
            Filtered::Pass(Route::Inbox)
        );
        for f in cel::FUNCTIONS {
            assert!(every.contains(&format!("{f}(")), "{f} is exercised");
        }
    }
}
