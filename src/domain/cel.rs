//! CEL as the service runs it, for ingress mappings and activation filters alike: one standard environment, expressions checked for size, depth, names and loops before they are kept.
use std::sync::{Arc, LazyLock};

use cel::common::ast::{operators, EntryExpr, Expr, IdedExpr, LiteralValue, MapExpr};
use cel::objects::{Key, Map};
use cel::{Context, Value};

/// Longest expression, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 1024;
/// Deepest nesting of terms: trees this shallow evaluate and drop on any thread's stack.
pub const MAX_EXPRESSION_DEPTH: usize = 24;
/// Most terms in one expression. With no loops, an evaluation visits each term at most once.
pub const MAX_EXPRESSION_NODES: usize = 256;

/// Most bytes one evaluation may build by concatenation (`+` of strings, bytes or lists) and
/// list and map literals, reckoned with every variable read at the most its value may hold
/// (the size `check` is given for it). Each `+` copies both sides into a new value, so a chain
/// of them over the payload copies quadratically more than it reads, and a literal copies
/// every value it holds: with no loop, this is what keeps an evaluation's cost in proportion
/// to its input.
pub const MAX_BUILT_BYTES: usize = 1 << 20;
/// What a trigger's payload or a request's body is reckoned to hold when MAX_BUILT_BYTES is
/// checked: the default bound of a payload.
pub const VARIABLE_BYTES: usize = 64 << 10;
/// Most bytes of headers an ingress request may carry: an HTTP request's head (request line
/// and header lines) on the ingress listener, which answers a larger one 431, and a message's
/// headers, name and value, on every ingress path. A mapping's `headers` (all of them, or one
/// value) holds at most this, and so does its `event` (a binary-mode event's attributes are
/// headers; a structured-mode event's are held to the same bound), so MAX_BUILT_BYTES counts a
/// read of either at this. Webhook senders send a few hundred bytes to a few KiB of headers.
pub const MAX_HEADER_BYTES: usize = 32 << 10;

/// CEL's type identifiers, which an expression may name besides its variables
/// (`type(payload.n) == double`).
pub const TYPES: &[&str] = &[
    "bool",
    "bytes",
    "double",
    "int",
    "list",
    "map",
    "null_type",
    "string",
    "type",
    "uint",
];
/// The longest text `string()` makes of a number: a double as Rust writes it out in full
/// (`string(5e-324)` is 326 characters).
const NUMBER_TEXT_BYTES: usize = 330;

/// The named functions this build provides (CEL's standard library without regular
/// expressions and time): a call of any other is refused when the expression is kept, rather
/// than failing on every evaluation. Operators (`_+_`, `!_`, `@in`, …) are not named this way.
pub const FUNCTIONS: &[&str] = &[
    "size",
    "contains",
    "startsWith",
    "endsWith",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "bool",
    "dyn",
    "type",
];

/// The stack of the thread that compiles expressions: virtual memory, touched only as deep as
/// an expression of MAX_EXPRESSION_BYTES makes the parser go.
const COMPILE_STACK: usize = 512 << 20;

/// CEL's standard environment, built once: building it is most of what a small expression's
/// evaluation would otherwise cost.
pub static STDLIB: LazyLock<Arc<cel::Env>> = LazyLock::new(|| Arc::new(cel::Env::stdlib()));

/// A context over the standard environment, for one evaluation.
pub fn context() -> Context<'static, 'static> {
    Context::with_env(STDLIB.clone())
}

/// Runs `f` on a thread of its own with COMPILE_STACK. The parser recurses per level of
/// nesting with large frames, and trees are built, walked and dropped recursively, so a
/// hostile expression could exhaust a normal thread's stack (in a debug build the parser ran
/// out of 2 MiB at 40 nested parentheses).
pub fn on_compile_thread<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, String> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("hcp-sense-cel".into())
            .stack_size(COMPILE_STACK)
            .spawn_scoped(scope, f)
            .map_err(|e| format!("cannot be compiled now: {e}"))?
            .join()
            .map_err(|_| "cannot be compiled".to_owned())
    })
}

/// Parses and checks one expression: at most MAX_EXPRESSION_BYTES, MAX_EXPRESSION_NODES terms
/// and MAX_EXPRESSION_DEPTH levels, no comprehension and no message, building at most
/// MAX_BUILT_BYTES, and reading no name but `variables` and CEL's TYPES. Each variable comes
/// with the most bytes its value may hold, which a read of it is counted at. `what` names the
/// kind of expression in messages ("a mapping", "a filter"). Run it on `on_compile_thread`.
pub fn check(src: &str, variables: &[(&str, usize)], what: &str) -> Result<IdedExpr, String> {
    if src.len() > MAX_EXPRESSION_BYTES {
        return Err(format!(
            "is {} bytes; an expression is at most {MAX_EXPRESSION_BYTES}",
            src.len()
        ));
    }
    // The standard macros are expanded here, so a comprehension shows as one below.
    let (root, info) = cel::parser::Parser::default()
        .max_recursion_depth(MAX_EXPRESSION_DEPTH as u16)
        .parse_with_source_info(src)
        .map_err(|e| parse_message(&e))?;
    let mut nodes = 0usize;
    if let Some((id, why)) = unsupported(&root, &mut nodes, 1, what) {
        let at = info
            .offset_for(id)
            .map(|(start, _)| position(src, start as usize))
            .unwrap_or_default();
        return Err(format!("{why}{at}"));
    }
    if nodes > MAX_EXPRESSION_NODES {
        return Err(format!(
            "has {nodes} terms; an expression has at most {MAX_EXPRESSION_NODES}"
        ));
    }
    if let Some(v) = root
        .references()
        .variables()
        .into_iter()
        .find(|v| !TYPES.contains(v) && !variables.iter().any(|(name, _)| name == v))
    {
        return Err(format!(
            "reads `{}`; {what} reads only {} (and CEL's type names)",
            v.escape_debug(),
            variables
                .iter()
                .map(|(v, _)| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut built = Built {
        variables,
        ..Built::default()
    };
    bytes_of(&root, &mut built);
    if let Some(id) = built.over {
        let at = info
            .offset_for(id)
            .map(|(start, _)| position(src, start as usize))
            .unwrap_or_default();
        let counted = variables
            .iter()
            .map(|(v, n)| format!("`{v}` as {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(format!(
            "may build {} bytes by concatenation (`+`) and list or map literals{at}, counting \
             each variable read at the most it holds ({counted} bytes); an evaluation builds \
             at most {MAX_BUILT_BYTES}",
            built.bytes
        ));
    }
    if let Some(f) = root
        .references()
        .functions()
        .into_iter()
        .find(|f| f.starts_with(|c: char| c.is_ascii_alphabetic()) && !FUNCTIONS.contains(f))
    {
        return Err(format!(
            "calls `{}`, which this server does not provide; the functions are {}",
            f.escape_debug(),
            FUNCTIONS.join(", ")
        ));
    }
    Ok(root)
}

/// The value of an expression that reads no variable (it may name types) — the same on every
/// evaluation, so it is checked once, when the expression is kept — or `None` when it reads one.
pub fn constant(e: &IdedExpr) -> Option<Result<Value, String>> {
    e.references()
        .variables()
        .iter()
        .all(|v| TYPES.contains(v))
        .then(|| Value::resolve(e, &context()).map_err(|e| e.to_string()))
}

/// A JSON value as CEL reads it: every number a double, as Kubernetes' CEL reads JSON, so a
/// field has one type whatever its value (`9`, `-3` and `6.5` are all doubles, and
/// `payload.n * 2.0` works on each). An integer past 2^53 in magnitude is the nearest double.
pub fn json(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        // Always a number: serde_json's arbitrary_precision, which could fail this, is off.
        J::Number(n) => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        J::String(s) => Value::String(Arc::new(s.clone())),
        J::Array(a) => Value::List(Arc::new(a.iter().map(json).collect())),
        J::Object(o) => json_object(o),
    }
}

/// A JSON object as CEL reads it (see `json`): a map with string keys.
pub fn json_object(o: &serde_json::Map<String, serde_json::Value>) -> Value {
    Value::Map(Map {
        map: Arc::new(
            o.iter()
                .map(|(k, v)| (Key::String(Arc::new(k.clone())), json(v)))
                .collect(),
        ),
    })
}

fn parse_message(e: &cel::ParseErrors) -> String {
    match e.errors.first() {
        Some(first) => format!(
            "does not parse at line {}, column {}: {}",
            first.pos.0.max(0),
            first.pos.1.max(0) + 1,
            first.msg
        ),
        None => "does not parse".into(),
    }
}

/// " at line L, column C" for a byte offset of `src`.
fn position(src: &str, offset: usize) -> String {
    let before = src.get(..offset.min(src.len())).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!(" at line {line}, column {column}")
}

/// The bytes an expression's concatenations and literals may build, and the first node that
/// passed MAX_BUILT_BYTES; `variables` holds what a read of each variable is counted at.
#[derive(Default)]
struct Built<'a> {
    bytes: usize,
    over: Option<u64>,
    variables: &'a [(&'a str, usize)],
}

impl Built<'_> {
    /// Node `id` builds a value of `n` bytes: counted, and `n` returned.
    fn build(&mut self, id: u64, n: usize) -> usize {
        self.bytes = self.bytes.saturating_add(n);
        if self.bytes > MAX_BUILT_BYTES && self.over.is_none() {
            self.over = Some(id);
        }
        n
    }
}

/// An upper bound of the bytes `e`'s value holds, adding what each concatenation and literal in
/// it builds to `built`. Only `+` makes a value larger than its operands, and a list or map
/// literal copies the values it holds; a conditional holds one of its branches, an index, a
/// field or a conversion at most its operand (or a number's text); every other call yields a
/// bool or a number.
fn bytes_of(e: &IdedExpr, built: &mut Built) -> usize {
    let sum = |xs: &mut dyn Iterator<Item = &IdedExpr>, built: &mut Built| {
        xs.fold(0usize, |n, x| n.saturating_add(bytes_of(x, built)))
    };
    match &e.expr {
        Expr::Literal(LiteralValue::String(s)) => s.len(),
        Expr::Literal(LiteralValue::Bytes(b)) => b.len(),
        Expr::Literal(_) => 8,
        // A variable holds at most its size; a type name is a small value.
        Expr::Ident(name) => built
            .variables
            .iter()
            .find(|(v, _)| v == name)
            .map_or(8, |(_, n)| *n),
        Expr::Select(s) if s.test => 8,
        Expr::Select(s) => bytes_of(&s.operand, built),
        Expr::List(l) => {
            let n = sum(&mut l.elements.iter(), built);
            built.build(e.id, n)
        }
        Expr::Map(m) => {
            let n = sum(&mut entries(m), built);
            built.build(e.id, n)
        }
        Expr::Call(c) => {
            let args: Vec<usize> = c
                .target
                .iter()
                .map(|t| &**t)
                .chain(c.args.iter())
                .map(|x| bytes_of(x, built))
                .collect();
            match (c.func_name.as_str(), args.as_slice()) {
                (operators::ADD, _) => {
                    let n = args.iter().fold(0usize, |n, a| n.saturating_add(*a));
                    built.build(e.id, n)
                }
                (operators::CONDITIONAL, [_, a, b]) => (*a).max(*b),
                ("string", [a, ..]) => (*a).max(NUMBER_TEXT_BYTES),
                (operators::INDEX | "bytes" | "dyn", [a, ..]) => *a,
                _ => 8,
            }
        }
        Expr::Comprehension(_) | Expr::Struct(_) | Expr::Unspecified => 8,
    }
}

/// The first node an expression may not use (its id and why), counting nodes as it goes.
fn unsupported(e: &IdedExpr, nodes: &mut usize, depth: usize, what: &str) -> Option<(u64, String)> {
    *nodes += 1;
    if depth > MAX_EXPRESSION_DEPTH {
        return Some((
            e.id,
            format!("nests deeper than {MAX_EXPRESSION_DEPTH} terms"),
        ));
    }
    let mut each = |xs: &mut dyn Iterator<Item = &IdedExpr>| {
        for x in xs {
            if let Some(found) = unsupported(x, nodes, depth + 1, what) {
                return Some(found);
            }
        }
        None
    };
    match &e.expr {
        Expr::Comprehension(_) => Some((
            e.id,
            format!("uses a comprehension (map, filter, all, exists, exists_one); {what} may not loop (`x in list` tests membership)"),
        )),
        Expr::Struct(_) => Some((e.id, format!("builds a message; {what} may not"))),
        Expr::Call(c) => each(&mut c.target.iter().map(|t| &**t).chain(c.args.iter())),
        Expr::Select(s) => each(&mut std::iter::once(&*s.operand)),
        Expr::List(l) => each(&mut l.elements.iter()),
        Expr::Map(m) => each(&mut entries(m)),
        Expr::Unspecified | Expr::Ident(_) | Expr::Literal(_) => None,
    }
}

/// The keys and values of a map literal.
fn entries(m: &MapExpr) -> impl Iterator<Item = &IdedExpr> {
    m.entries
        .iter()
        .filter_map(|en| match &en.expr {
            EntryExpr::MapEntry(me) => Some([&me.key, &me.value]),
            EntryExpr::StructField(_) => None,
        })
        .flatten()
}

/// A read of a JSON variable's field path lifted out of an expression: the expression reads the
/// variable `var` instead, bound per evaluation to the value at `path` (or, for `has`, to
/// whether the object at `path` holds `has`), so an evaluation converts only the values it
/// reads, whatever the size of the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifted {
    pub var: String,
    pub path: Vec<String>,
    pub has: Option<String>,
}

impl Lifted {
    /// The path as the expression spelt it, for messages.
    pub fn text(&self, name: &str) -> String {
        let mut t = std::iter::once(name)
            .chain(self.path.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(".");
        if let Some(f) = &self.has {
            t = format!("has({t}.{f})");
        }
        t
    }
}

/// Rewrites every `name.a.b…` (and `has(name.a.b…)`) of `e` into a variable of its own. `None`
/// when `name` is also read otherwise (`name["x"]`, `size(name)`, `name` itself): then it is
/// bound whole, and `e` is left as it was.
pub fn lift_paths(e: &IdedExpr, name: &str) -> Option<(IdedExpr, Vec<Lifted>)> {
    fn chain(e: &IdedExpr, name: &str) -> Option<Vec<String>> {
        match &e.expr {
            Expr::Ident(i) if i == name => Some(Vec::new()),
            Expr::Select(s) if !s.test => chain(&s.operand, name).map(|mut p| {
                p.push(s.field.clone());
                p
            }),
            _ => None,
        }
    }
    fn var(out: &mut Vec<Lifted>, path: Vec<String>, has: Option<String>) -> String {
        if let Some(l) = out.iter().find(|l| l.path == path && l.has == has) {
            return l.var.clone();
        }
        let var = format!("__lifted{}", out.len());
        out.push(Lifted {
            var: var.clone(),
            path,
            has,
        });
        var
    }
    fn lift(e: &mut IdedExpr, name: &str, out: &mut Vec<Lifted>) {
        if let Expr::Select(s) = &e.expr {
            let lifted = if s.test {
                chain(&s.operand, name).map(|p| var(out, p, Some(s.field.clone())))
            } else {
                chain(e, name).map(|p| var(out, p, None))
            };
            if let Some(v) = lifted {
                e.expr = Expr::Ident(v);
                return;
            }
        }
        match &mut e.expr {
            Expr::Select(s) => lift(&mut s.operand, name, out),
            Expr::Call(c) => {
                if let Some(t) = &mut c.target {
                    lift(t, name, out);
                }
                for a in &mut c.args {
                    lift(a, name, out);
                }
            }
            Expr::List(l) => {
                for x in &mut l.elements {
                    lift(x, name, out);
                }
            }
            Expr::Map(m) => {
                for en in &mut m.entries {
                    if let EntryExpr::MapEntry(me) = &mut en.expr {
                        lift(&mut me.key, name, out);
                        lift(&mut me.value, name, out);
                    }
                }
            }
            _ => {}
        }
    }
    let mut rewritten = e.clone();
    let mut out = Vec::new();
    lift(&mut rewritten, name, &mut out);
    let whole = rewritten.references().variables().contains(&name);
    (!whole).then_some((rewritten, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type identifier is one the standard environment knows.
    #[test]
    fn the_type_names_are_cels() {
        for t in TYPES {
            let v = Value::resolve(&check(t, &[], "a test").expect(t), &context())
                .unwrap_or_else(|e| panic!("{t}: {e}"));
            let named = Value::resolve(
                &check(&format!("type({t}) == type"), &[], "a test").expect(t),
                &context(),
            );
            assert_eq!(named, Ok(Value::Bool(true)), "{t} is a type: {v:?}");
        }
    }
}
