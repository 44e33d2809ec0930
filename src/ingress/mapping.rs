//! Route mappings: a route's CEL mapping compiled and checked, and evaluated over a message's headers, body and event to the fields of its triggers.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ::cel::common::ast::IdedExpr;
use ::cel::Value as Cel;
use serde_json::Value;

use super::cloudevents::CloudEvent;
use crate::domain::cel;
#[cfg(test)]
use crate::domain::cel::MAX_EXPRESSION_DEPTH;
pub use crate::domain::cel::{MAX_EXPRESSION_BYTES, MAX_EXPRESSION_NODES, MAX_HEADER_BYTES};
use crate::domain::ingress::{IngressKind, Mapping, Route};

/// Longest value a mapping may yield, in bytes (ids and refs are far shorter; this only stops
/// an expression that concatenates a large body from making a large string).
const MAX_MAPPED_BYTES: usize = 4096;

/// A mapping, compiled: one program per given field, with whether it reads `event`.
pub struct Compiled {
    fields: Vec<(&'static str, IdedExpr, bool)>,
}

impl Compiled {
    /// The first given field whose expression reads the event's attributes.
    pub fn reading_event(&self) -> Option<&'static str> {
        self.fields.iter().find(|f| f.2).map(|f| f.0)
    }

    /// Whether the mapping gives `field`.
    pub fn gives(&self, field: &str) -> bool {
        self.fields.iter().any(|f| f.0 == field)
    }
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.fields.iter().map(|(n, _, _)| n))
            .finish()
    }
}

/// The fields of a mapping by name, as `mapping.<name>` in messages.
fn fields(m: &Mapping) -> [(&'static str, &str); 6] {
    [
        ("ref", &m.r#ref),
        ("principal", &m.principal),
        ("binding_id", &m.binding_id),
        ("project", &m.project),
        ("trigger_id", &m.trigger_id),
        ("land", &m.land),
    ]
}

/// Compiles and checks a mapping: each expression parses, reads only `headers` and `body`,
/// has no comprehension and stays within the size bounds; `ref` is given; a route names its
/// principal one way (principal or binding_id) unless it fans out, and then neither.
/// Violations come as (field, description), the description with the position.
///
/// Compiling runs on `cel::on_compile_thread`, and a tree deeper than MAX_EXPRESSION_DEPTH is
/// refused there, so the trees that come out evaluate (and drop) within any thread's stack.
pub fn compile(
    kind: IngressKind,
    m: &Mapping,
    fan_out: bool,
) -> Result<Compiled, Vec<(String, String)>> {
    cel::on_compile_thread(|| compile_here(kind, m, fan_out))
        .unwrap_or_else(|e| Err(vec![("mapping".to_owned(), e)]))
}

fn compile_here(
    kind: IngressKind,
    m: &Mapping,
    fan_out: bool,
) -> Result<Compiled, Vec<(String, String)>> {
    let mut bad = Vec::new();
    let mut out = Vec::new();
    // Each with the most its value holds: what a read of it may add to what is built.
    let variables: &[(&str, usize)] = match kind {
        IngressKind::CloudEvents | IngressKind::Nats => &[
            ("headers", MAX_HEADER_BYTES),
            ("body", cel::VARIABLE_BYTES),
            ("event", MAX_HEADER_BYTES),
        ],
        _ => &[("headers", MAX_HEADER_BYTES), ("body", cel::VARIABLE_BYTES)],
    };
    for (name, src) in fields(m) {
        if src.trim().is_empty() {
            continue;
        }
        match compile_one(src, variables).and_then(|p| {
            check_header_reads(kind, &p)?;
            let event = p.references().variables().contains(&"event");
            Ok((p, event))
        }) {
            Ok((p, event)) => out.push((name, p, event)),
            Err(e) => bad.push((format!("mapping.{name}"), e)),
        }
    }
    // A CloudEvent names its ref (`type`), principal (`subject`) and id itself.
    let defaults = matches!(kind, IngressKind::CloudEvents | IngressKind::Nats);
    if m.r#ref.trim().is_empty() && !defaults {
        bad.push((
            "mapping.ref".into(),
            "is required: a CEL expression yielding the trigger's ref".into(),
        ));
    }
    let named = [
        !m.principal.trim().is_empty(),
        !m.binding_id.trim().is_empty(),
    ];
    match (fan_out, named) {
        (false, [true, true]) => bad.push((
            "mapping.binding_id".into(),
            "give either principal or binding_id, not both".into(),
        )),
        (false, [false, false]) if !defaults => bad.push((
            "mapping.principal".into(),
            "one of principal or binding_id is required unless the route fans out".into(),
        )),
        (true, [p, b]) if p || b => bad.push((
            if p {
                "mapping.principal"
            } else {
                "mapping.binding_id"
            }
            .into(),
            "a route that fans out goes to every principal activated for its pack: it names none"
                .into(),
        )),
        _ => {}
    }
    if bad.is_empty() {
        Ok(Compiled { fields: out })
    } else {
        Err(bad)
    }
}

/// Refuses a signed route's expression that reads a header its kind does not sign, or reads
/// `headers` other than by a literal name (`headers[body.name]`, `size(headers)`): what a
/// mapping makes of a request must come from what its signature covers.
fn check_header_reads(kind: IngressKind, e: &IdedExpr) -> Result<(), String> {
    let Some(signed) = kind.signed_headers() else {
        return Ok(());
    };
    let pinned = kind.pinned_headers();
    let covered = if signed.is_empty() {
        format!(
            "a {} request's signature covers its body alone{}",
            kind.as_str(),
            pinned
                .iter()
                .map(|h| format!("; `{h}` is pinned with it by the ingress ledger"))
                .collect::<String>()
        )
    } else {
        format!(
            "a {} request's signature covers its body and {} alone",
            kind.as_str(),
            signed
                .iter()
                .map(|h| format!("`{h}`"))
                .collect::<Vec<_>>()
                .join(" and ")
        )
    };
    let mut names = Vec::new();
    if !header_names(e, &mut names) {
        return Err(format!(
            "reads `headers` other than by a literal name ({covered}): a replayed request could choose what it yields"
        ));
    }
    match names
        .into_iter()
        .find(|n| !signed.contains(&n.as_str()) && !pinned.contains(&n.as_str()))
    {
        Some(n) => Err(format!(
            "reads header `{}`, which the signature does not cover ({covered}): a replay of a \
             captured request could change it and become another trigger; map it from `body`",
            n.escape_debug()
        )),
        None => Ok(()),
    }
}

/// Collects the header names `e` reads as `headers['name']`, `headers.name` or
/// `has(headers.name)`, lower-cased as the request's are; false when it reads `headers` any
/// other way.
fn header_names(e: &IdedExpr, out: &mut Vec<String>) -> bool {
    use ::cel::common::ast::{operators, EntryExpr, Expr, LiteralValue};
    let is_headers = |x: &IdedExpr| matches!(&x.expr, Expr::Ident(i) if i == "headers");
    match &e.expr {
        Expr::Ident(i) => i != "headers",
        Expr::Select(s) if is_headers(&s.operand) => {
            out.push(s.field.to_ascii_lowercase());
            true
        }
        Expr::Select(s) => header_names(&s.operand, out),
        Expr::Call(c)
            if c.func_name == operators::INDEX && c.args.len() == 2 && is_headers(&c.args[0]) =>
        {
            match &c.args[1].expr {
                Expr::Literal(LiteralValue::String(name)) => {
                    out.push(name.to_ascii_lowercase());
                    true
                }
                _ => false,
            }
        }
        Expr::Call(c) => c
            .target
            .iter()
            .map(|t| &**t)
            .chain(c.args.iter())
            .all(|x| header_names(x, out)),
        Expr::List(l) => l.elements.iter().all(|x| header_names(x, out)),
        Expr::Map(m) => m.entries.iter().all(|en| match &en.expr {
            EntryExpr::MapEntry(me) => header_names(&me.key, out) && header_names(&me.value, out),
            EntryExpr::StructField(f) => header_names(&f.value, out),
        }),
        Expr::Comprehension(_) | Expr::Struct(_) | Expr::Literal(_) | Expr::Unspecified => true,
    }
}

fn compile_one(src: &str, variables: &[(&str, usize)]) -> Result<IdedExpr, String> {
    let root = cel::check(src, variables, "a mapping")?;
    // An expression that reads nothing is the same for every request: its value is checked
    // now, so `1 + 'a'` or `true` is refused here rather than on every request.
    match cel::constant(&root) {
        Some(Ok(v)) => {
            text_of(v).map_err(|e| format!("always {e}"))?;
        }
        Some(Err(e)) => return Err(format!("always fails: {e}")),
        None => {}
    }
    Ok(root)
}

/// The largest integer a double holds exactly, with every integer below it: a JSON number
/// (read as a double) of at most this magnitude is the integer its text wrote.
const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_991.0; // 2^53 - 1

/// A mapped value as text: a string, or an integer as its decimal digits — an int, a uint, or
/// a double that is an integer of at most 2^53 - 1 in magnitude (`body.installation.id`, 42 in
/// the JSON, is "42"). Another double is refused: its text would not be the number sent.
fn text_of(v: Cel) -> Result<String, String> {
    match v {
        Cel::String(s) => Ok(s.as_str().to_owned()),
        Cel::Int(i) => Ok(i.to_string()),
        Cel::UInt(u) => Ok(u.to_string()),
        // In range, the cast is exact.
        Cel::Float(f) if f.fract() == 0.0 && f.abs() <= MAX_EXACT_INTEGER => {
            Ok((f as i64).to_string())
        }
        Cel::Float(f) => Err(format!(
            "yields the number {f}, which is not an integer of at most 2^53 - 1 in magnitude \
             (JSON numbers are read as doubles); a mapping field yields a string or such an \
             integer — send a larger id as a string"
        )),
        other => Err(format!(
            "yields a {:?}; a mapping field yields a string",
            other.type_of()
        )),
    }
}

pub use crate::domain::ingress::Mapped;

/// Evaluates a compiled mapping over a request's headers (lower-case names) and JSON body.
/// A failed evaluation, or a value that is not a string (or an integer, read as its
/// decimal text), is a (field, description) for a 400 answer; so are headers, or an event's
/// attributes, of more than MAX_HEADER_BYTES (names and values), which is what a mapping's
/// bound on what it builds counts them at.
pub fn evaluate(
    c: &Compiled,
    headers: &BTreeMap<String, String>,
    body: &Value,
    event: Option<&CloudEvent>,
) -> Result<Mapped, (String, String)> {
    let held = |m: &BTreeMap<String, String>| m.iter().map(|(k, v)| k.len() + v.len()).sum();
    for (name, n) in [
        ("headers", held(headers)),
        ("event", event.map_or(0, |e| held(&e.attributes))),
    ] {
        if n > MAX_HEADER_BYTES {
            return Err((
                name.to_owned(),
                format!("hold {n} bytes (names and values); at most {MAX_HEADER_BYTES}"),
            ));
        }
    }
    if c.fields.is_empty() {
        // Nothing to evaluate (the kind's defaults apply): no context to build.
        return Ok(Mapped::default());
    }
    let mut ctx = cel::context();
    ctx.add_variable_from_value("headers", to_cel_headers(headers));
    if let Some(e) = event {
        ctx.add_variable_from_value("event", to_cel_headers(&e.attributes));
    }
    ctx.add_variable_from_value("body", cel::json(body));
    let mut out = Mapped::default();
    for (name, program, _) in &c.fields {
        let field = format!("mapping.{name}");
        let v = Cel::resolve(program, &ctx)
            .map_err(|e| (field.clone(), format!("failed on this request: {e}")))?;
        let text = text_of(v).map_err(|e| (field.clone(), format!("on this request {e}")))?;
        if text.len() > MAX_MAPPED_BYTES {
            return Err((
                field,
                format!("yielded {} bytes; at most {MAX_MAPPED_BYTES}", text.len()),
            ));
        }
        let slot = match *name {
            "ref" => &mut out.r#ref,
            "principal" => &mut out.principal,
            "binding_id" => &mut out.binding_id,
            "project" => &mut out.project,
            "trigger_id" => &mut out.trigger_id,
            _ => &mut out.land,
        };
        *slot = Some(text);
    }
    Ok(out)
}

fn to_cel_headers(headers: &BTreeMap<String, String>) -> Cel {
    let map: std::collections::HashMap<::cel::objects::Key, Cel> = headers
        .iter()
        .map(|(k, v)| {
            (
                ::cel::objects::Key::String(Arc::new(k.clone())),
                Cel::String(Arc::new(v.clone())),
            )
        })
        .collect();
    Cel::Map(::cel::objects::Map { map: Arc::new(map) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cel::{MAX_BUILT_BYTES, VARIABLE_BYTES};
    use crate::ingress::cloudevents::cloud_event;
    use serde_json::json;

    fn mapping(r: &str, principal: &str) -> Mapping {
        Mapping {
            r#ref: r.into(),
            principal: principal.into(),
            ..Default::default()
        }
    }

    fn alice(r: &str) -> Mapping {
        mapping(r, "'alice'")
    }

    #[test]
    fn mappings_are_checked_with_the_field_and_position() {
        let e = compile(
            IngressKind::StandardWebhooks,
            &mapping("body.x +", "'alice'"),
            false,
        )
        .expect_err("refused");
        assert_eq!(e[0].0, "mapping.ref");
        assert!(e[0].1.contains("line 1"), "{e:?}");
        let e = compile(
            IngressKind::StandardWebhooks,
            &mapping("body.items.map(x, x)[0]", "'a'"),
            false,
        )
        .expect_err("refused");
        assert!(
            e[0].1.contains("comprehension") && e[0].1.contains("column 15"),
            "{e:?}"
        );
        let e = compile(
            IngressKind::StandardWebhooks,
            &mapping("secret", "'a'"),
            false,
        )
        .expect_err("refused");
        assert!(e[0].1.contains("`secret`"), "{e:?}");
        for constant in ["1 + 'a'", "true", "1 / 0"] {
            let e = compile(
                IngressKind::StandardWebhooks,
                &mapping(constant, "'a'"),
                false,
            )
            .expect_err("a constant of the wrong type, or one that fails");
            assert!(e[0].1.starts_with("always"), "{constant}: {e:?}");
        }
        let constant = mapping("'storm.' + 'warning'", "'a'");
        assert!(compile(IngressKind::StandardWebhooks, &constant, false).is_ok());
        let e = compile(IngressKind::StandardWebhooks, &mapping("'x'", ""), false)
            .expect_err("refused");
        assert_eq!(e[0].0, "mapping.principal");
        let e = compile(IngressKind::StandardWebhooks, &mapping("'x'", "'a'"), true)
            .expect_err("refused");
        assert!(e[0].1.contains("fans out"), "{e:?}");
        // Hostile shapes, as long as an expression may be: never a crash.
        let deep_parens = format!("{}1{}", "(".repeat(100), ")".repeat(100));
        let e = compile(
            IngressKind::StandardWebhooks,
            &mapping(&deep_parens, "'a'"),
            false,
        )
        .expect_err("refused");
        assert!(
            e[0].1.contains("deeper") || e[0].1.contains("ecursion"),
            "{e:?}"
        );
        let half = MAX_EXPRESSION_BYTES / 2 - 1;
        for deep in [
            format!("{}1{}", "(".repeat(half), ")".repeat(half)),
            format!("{}true", "!".repeat(MAX_EXPRESSION_BYTES - 4)),
            format!("{}1", "-".repeat(MAX_EXPRESSION_BYTES - 1)),
            vec!["'a'"; 250].join("+"),
            format!("{}1{}", "[".repeat(half), "]".repeat(half)),
            format!("{}'x'", "true ? 'a' : ".repeat(MAX_EXPRESSION_BYTES / 13)),
            format!("body{}", ".a".repeat(MAX_EXPRESSION_BYTES / 2 - 3)),
        ] {
            assert!(deep.len() <= MAX_EXPRESSION_BYTES, "{}", deep.len());
            // Refused, or (when the parser folds it flat, as `!!…!true`) harmless to run.
            if let Ok(c) = compile(IngressKind::StandardWebhooks, &mapping(&deep, "'a'"), false) {
                let _ = evaluate(&c, &BTreeMap::new(), &serde_json::json!({}), None);
            }
        }
        // At the depth limit an expression compiles and evaluates on a normal stack.
        let at_depth = vec!["'a'"; MAX_EXPRESSION_DEPTH].join("+");
        let c = compile(
            IngressKind::StandardWebhooks,
            &mapping(&at_depth, "'a'"),
            false,
        )
        .expect("at the depth limit");
        let m = evaluate(&c, &BTreeMap::new(), &serde_json::json!({}), None).expect("evaluates");
        assert_eq!(m.r#ref.map(|r| r.len()), Some(MAX_EXPRESSION_DEPTH));
        let at_limit = format!("'{}'", "x".repeat(MAX_EXPRESSION_BYTES - 2));
        assert!(compile(
            IngressKind::StandardWebhooks,
            &mapping(&at_limit, "'a'"),
            false
        )
        .is_ok());
        let over = format!("'{}'", "x".repeat(MAX_EXPRESSION_BYTES - 1));
        assert!(compile(IngressKind::StandardWebhooks, &mapping(&over, "'a'"), false).is_err());
    }

    #[test]
    fn mappings_yield_strings_from_signed_headers_and_body() {
        let c = compile(
            IngressKind::StandardWebhooks,
            &Mapping {
                r#ref: "'issue.' + body.action".into(),
                binding_id: "body.installation.id".into(),
                trigger_id: "headers['webhook-id'] + ':' + headers['webhook-timestamp']".into(),
                ..Default::default()
            },
            false,
        )
        .expect("compiles");
        let headers = BTreeMap::from([
            ("webhook-id".to_owned(), "msg_1".to_owned()),
            ("webhook-timestamp".to_owned(), "1000".to_owned()),
        ]);
        let body = serde_json::json!({"action": "opened", "installation": {"id": 42}});
        let m = evaluate(&c, &headers, &body, None).expect("evaluates");
        assert_eq!(m.r#ref.as_deref(), Some("issue.opened"));
        assert_eq!(m.binding_id.as_deref(), Some("42"));
        assert_eq!(m.trigger_id.as_deref(), Some("msg_1:1000"));
        let e =
            evaluate(&c, &headers, &serde_json::json!({"action": 1}), None).expect_err("refused");
        assert_eq!(e.0, "mapping.ref");
    }

    #[test]
    fn a_signed_routes_mapping_reads_no_header_its_signature_does_not_cover() {
        let with = |kind, expr: &str| {
            compile(
                kind,
                &Mapping {
                    r#ref: "'issue.opened'".into(),
                    principal: expr.into(),
                    ..Default::default()
                },
                false,
            )
        };
        use IngressKind::{CloudEvents, Github, Nats, StandardWebhooks};
        for (kind, expr) in [
            (Github, "headers['x-github-delivery']"),
            (Github, "headers['x-hub-signature-256']"),
            (StandardWebhooks, "headers['x-user']"),
            (StandardWebhooks, "headers['x-github-event']"),
            (StandardWebhooks, "has(headers.user) ? 'a' : 'b'"),
            (StandardWebhooks, "headers.user"),
            (CloudEvents, "headers['ce-subject']"),
            (CloudEvents, "headers['content-type']"),
        ] {
            let e = with(kind, expr).expect_err(expr);
            assert_eq!(e[0].0, "mapping.principal", "{expr}: {e:?}");
            assert!(
                e[0].1.contains("does not cover") && e[0].1.contains("map it from `body`"),
                "{expr}: {e:?}"
            );
        }
        for (kind, expr) in [
            (StandardWebhooks, "headers[body.which]"),
            (StandardWebhooks, "string(size(headers))"),
            (
                StandardWebhooks,
                "headers['webhook-id'] in headers ? 'a' : 'b'",
            ),
            (Github, "'x' in headers ? 'a' : 'b'"),
        ] {
            let e = with(kind, expr).expect_err(expr);
            assert!(e[0].1.contains("literal name"), "{expr}: {e:?}");
        }
        for (kind, expr) in [
            (StandardWebhooks, "body.user + headers['webhook-id']"),
            (StandardWebhooks, "headers['Webhook-Timestamp']"),
            (CloudEvents, "headers['webhook-id']"),
            (CloudEvents, "event.subject"),
            (Github, "body.sender.login"),
            // Outside GitHub's signature, but pinned by the ledger with the body.
            (Github, "headers['x-github-event']"),
            (Github, "body.user + headers['X-GitHub-Event']"),
            // A NATS message is authenticated by its connection, headers and all.
            (Nats, "headers['x-user']"),
            (Nats, "headers[body.which]"),
        ] {
            assert!(with(kind, expr).is_ok(), "{kind:?} {expr}");
        }
    }

    /// A read of `headers` or `event` is counted at MAX_HEADER_BYTES and one of `body` at
    /// VARIABLE_BYTES: as many reads as fill MAX_BUILT_BYTES are kept, one byte more is not.
    #[test]
    fn a_mapping_counts_each_variable_at_the_most_it_holds() {
        assert_eq!(MAX_BUILT_BYTES % MAX_HEADER_BYTES, 0);
        let fits = MAX_BUILT_BYTES / MAX_HEADER_BYTES;
        let list = |read: &str, n: usize, extra: &str| {
            format!(
                "size([{}]) > 0{extra} ? 'a' : 'b'",
                vec![read; n].join(", ")
            )
        };
        for (kind, read, fits) in [
            // NATS: a signed kind's mapping reads no header its signature does not cover.
            (IngressKind::Nats, "headers['x']", fits),
            (IngressKind::Nats, "headers", fits),
            (IngressKind::StandardWebhooks, "headers['webhook-id']", fits),
            (IngressKind::CloudEvents, "event.subject", fits),
            (IngressKind::Nats, "event", fits),
            (
                IngressKind::StandardWebhooks,
                "body.a",
                MAX_BUILT_BYTES / VARIABLE_BYTES,
            ),
        ] {
            let at = list(read, fits, "");
            assert!(compile(kind, &alice(&at), false).is_ok(), "{at}");
            let over = list(read, fits, " && size('x' + '') > 0");
            let e = compile(kind, &alice(&over), false).expect_err("one byte over");
            assert!(
                e[0].1
                    .contains(&format!("may build {} bytes", MAX_BUILT_BYTES + 1)),
                "{over}: {e:?}"
            );
            let more = list(read, fits + 1, "");
            assert!(compile(kind, &alice(&more), false).is_err(), "{more}");
        }
        // Two header values and the body, joined: what a mapping of a webhook does.
        let joined = "headers['x-github-event'] + '.' + body.action + '.' + headers['x']";
        assert!(compile(IngressKind::Nats, &alice(joined), false).is_ok());
    }

    /// What the bound counts a header read at is what a request may hold: headers (or an
    /// event's attributes) of MAX_HEADER_BYTES in all are evaluated, one byte more is refused
    /// naming them.
    #[test]
    fn headers_and_event_attributes_are_held_to_max_header_bytes() {
        let c = compile(
            IngressKind::Nats,
            &alice("string(size(headers['x'] + event.ext))"),
            false,
        )
        .expect("compiles");
        let body = json!({});
        let headers = |n: usize| BTreeMap::from([("x".to_owned(), "v".repeat(n - 1))]);
        let m = evaluate(&c, &headers(MAX_HEADER_BYTES), &body, None);
        assert!(
            m.is_err_and(|(f, _)| f == "mapping.ref"),
            "no event: the mapping fails"
        );
        let event = |n: usize| {
            let mut h = BTreeMap::from([
                ("ce-specversion".to_owned(), "1.0".to_owned()),
                ("ce-id".to_owned(), "1".to_owned()),
                ("ce-source".to_owned(), "s".to_owned()),
                ("ce-type".to_owned(), "t".to_owned()),
            ]);
            let fixed: usize = h.iter().map(|(k, v)| k.len() - 3 + v.len()).sum();
            h.insert("ce-ext".to_owned(), "e".repeat(n - fixed - 3));
            cloud_event(&h, b"{}").expect("an event")
        };
        let at = event(MAX_HEADER_BYTES);
        let mapped = evaluate(&c, &headers(MAX_HEADER_BYTES), &body, Some(&at)).expect("at");
        assert_eq!(
            mapped.r#ref,
            Some((MAX_HEADER_BYTES - 1 + at.attr("ext").len()).to_string())
        );
        let (field, why) =
            evaluate(&c, &headers(MAX_HEADER_BYTES + 1), &body, Some(&at)).expect_err("over");
        assert_eq!(field, "headers");
        assert!(
            why.contains(&format!("hold {} bytes", MAX_HEADER_BYTES + 1)),
            "{why}"
        );
        let over = event(MAX_HEADER_BYTES + 1);
        let (field, _) =
            evaluate(&c, &headers(10), &body, Some(&over)).expect_err("attributes over");
        assert_eq!(field, "event");
        // A route that maps nothing is held to the same bound.
        let none = compile(IngressKind::CloudEvents, &Mapping::default(), false).expect("none");
        assert!(evaluate(&none, &headers(MAX_HEADER_BYTES + 1), &body, Some(&at)).is_err());
        assert!(evaluate(&none, &headers(MAX_HEADER_BYTES), &body, Some(&at)).is_ok());
    }

    /// A mapping reads JSON numbers as doubles, as filters do; one that is an integer of at
    /// most 2^53 - 1 in magnitude yields its decimal text, any other is refused naming the
    /// field.
    #[test]
    fn mapped_numbers_are_doubles_and_exact_integers_are_their_digits() {
        let c = compile(
            IngressKind::StandardWebhooks,
            &Mapping {
                r#ref: "'issue.opened'".into(),
                binding_id: "body.id".into(),
                ..Default::default()
            },
            false,
        )
        .expect("compiles");
        let map = |id: serde_json::Value| {
            evaluate(&c, &BTreeMap::new(), &json!({ "id": id }), None).map(|m| m.binding_id)
        };
        for (id, text) in [
            (json!(42), "42"),
            (json!(42.0), "42"),
            (json!(-3), "-3"),
            (json!(0), "0"),
            (json!(-0.0), "0"),
            (json!(9_007_199_254_740_991u64), "9007199254740991"),
            (json!(-9_007_199_254_740_991i64), "-9007199254740991"),
            (json!("gh-42"), "gh-42"),
        ] {
            assert_eq!(map(id.clone()), Ok(Some(text.to_owned())), "{id}");
        }
        for id in [
            json!(9_007_199_254_740_992u64),
            json!(9_007_199_254_740_993u64),
            json!(u64::MAX),
            json!(6.5),
            json!(1e300),
            json!(true),
        ] {
            let (field, why) = map(id.clone()).expect_err("refused");
            assert_eq!(field, "mapping.binding_id", "{id}");
            assert!(why.contains("on this request"), "{id}: {why}");
        }
        // The conversions say what they make of a double.
        let conv = compile(
            IngressKind::StandardWebhooks,
            &Mapping {
                r#ref: "string(body.n) + '.' + string(int(body.n)) + '.' + \
                        (type(body.n) == double ? 'double' : 'other') + '.' + \
                        (body.n == 6 ? 'six' : 'not')"
                    .into(),
                principal: "type(body.p) == string ? body.p : 'none'".into(),
                ..Default::default()
            },
            false,
        )
        .expect("compiles");
        let m =
            evaluate(&conv, &BTreeMap::new(), &json!({"n": 6.5, "p": 1}), None).expect("evaluates");
        assert_eq!(m.r#ref.as_deref(), Some("6.5.6.double.not"));
        assert_eq!(m.principal.as_deref(), Some("none"));
        let m = evaluate(&conv, &BTreeMap::new(), &json!({"n": 6, "p": "bob"}), None)
            .expect("evaluates");
        assert_eq!(m.r#ref.as_deref(), Some("6.6.double.six"));
        assert_eq!(m.principal.as_deref(), Some("bob"));
        // A constant double is checked when the route is put, by the same rule.
        assert!(compile(
            IngressKind::StandardWebhooks,
            &alice("string(42.0 + 0.5)"),
            false
        )
        .is_ok());
        for constant in ["6.5", "1e300"] {
            let e = compile(IngressKind::StandardWebhooks, &alice(constant), false)
                .expect_err(constant);
            assert!(e[0].1.starts_with("always"), "{constant}: {e:?}");
        }
    }
}

/// Most compiled mappings kept; past it the cache starts afresh.
const MAX_COMPILED: usize = 4096;

/// Compiled mappings by route id, each with the mapping it was compiled from: a route is read
/// from the store on every request (so every replica sees a change at once), and compiled
/// again only when what is stored differs from what was compiled.
#[derive(Debug, Default)]
pub struct Mappings(std::sync::Mutex<HashMap<String, CompiledFrom>>);

/// A compiled mapping, with the mapping and fan-out it was compiled from.
type CompiledFrom = (Mapping, (IngressKind, bool), Arc<Compiled>);

impl Mappings {
    /// The compiled mapping of `route`, compiled again only when the route changed; a
    /// mapping that does not compile: its (field, description) pairs.
    pub fn compiled(&self, route: &Route) -> Result<Arc<Compiled>, Vec<(String, String)>> {
        let lock = || {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some((m, f, c)) = lock().get(&route.route_id) {
            if *m == route.mapping && *f == (route.kind, route.fan_out) {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(compile(route.kind, &route.mapping, route.fan_out)?);
        let mut cache = lock();
        if cache.len() >= MAX_COMPILED {
            cache.clear();
        }
        cache.insert(
            route.route_id.clone(),
            (
                route.mapping.clone(),
                (route.kind, route.fan_out),
                c.clone(),
            ),
        );
        Ok(c)
    }
}
