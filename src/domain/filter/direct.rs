//! The shapes most filters take, evaluated straight over the trigger without a CEL context: comparisons, `&&`, `||`, `!`, `?:`, `in` a list of literals, `startsWith`, `endsWith`, `contains`, and arithmetic on doubles, over `ref`, `land`, `project`, literals and lifted payload paths.
//!
//! An evaluation here allocates nothing and converts no value: it borrows the trigger's
//! strings and the payload's JSON. It answers only where it answers as CEL's interpreter
//! would (the filter's unit tests compare the two over generated filters and payloads); for
//! everything else — a missing field, a type error, a value it does not model — it answers
//! `None` and the interpreter decides, and says why.
use std::cmp::Ordering;

use ::cel::common::ast::{operators, Expr, IdedExpr};
use ::cel::Value as Cel;
use serde_json::{Map, Value};

use super::super::cel::Lifted;
use super::super::trigger::Trigger;

/// A filter in the shapes this module evaluates, laid out flat: its nodes in one buffer, each
/// after the nodes it reads (the last is the root), and every string they name end to end in
/// another. A decision on a cold cache touches a few lines of two allocations, not a tree of
/// boxes and strings scattered over the heap.
#[derive(Debug)]
pub(super) struct Direct {
    nodes: Vec<Node>,
    text: String,
}

/// A node's index in `Direct::nodes`: a filter has at most MAX_EXPRESSION_NODES terms.
type At = u16;

/// A string of `Direct::text`.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u32,
    len: u32,
}

#[derive(Debug, Clone, Copy)]
enum Node {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(Span),
    Ref,
    Land,
    Project,
    /// One key of a payload path; read only by the `Path` or `Has` that follows its keys.
    Key(Span),
    /// The value at the payload path of the `len` keys from `first` (a lifted path).
    Path {
        first: At,
        len: At,
    },
    /// Whether the object at that path holds `field` (a lifted `has(...)`).
    Has {
        first: At,
        len: At,
        field: Span,
    },
    Not(At),
    And(At, At),
    Or(At, At),
    Cond(At, At, At),
    Cmp(Cmp, At, At),
    Text(Text, At, At),
    /// `+`, `-`, `*`, `/` of two doubles (any other operands go to the interpreter).
    Arith(Arith, At, At),
    /// `-x` of a double.
    Neg(At),
    /// `x in [...]`: the `len` literal nodes from `first`.
    In {
        x: At,
        first: At,
        len: At,
    },
}

#[derive(Debug, Clone, Copy)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy)]
enum Arith {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Debug, Clone, Copy)]
enum Text {
    StartsWith,
    EndsWith,
    Contains,
}

/// A value during an evaluation, borrowed from the filter or the trigger. A payload's number is
/// a double, as CEL reads JSON; ints and uints come from literals.
#[derive(Debug, Clone, Copy)]
pub(super) enum V<'a> {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(&'a str),
}

impl Direct {
    /// The direct form of a (lifted) filter, or `None` when it uses anything else.
    pub(super) fn lower(e: &IdedExpr, lifted: &[Lifted]) -> Option<Direct> {
        let mut d = Direct {
            nodes: Vec::new(),
            text: String::new(),
        };
        d.lower_at(e, lifted)?;
        d.nodes.shrink_to_fit();
        d.text.shrink_to_fit();
        Some(d)
    }

    fn push(&mut self, n: Node) -> Option<At> {
        let at = At::try_from(self.nodes.len()).ok()?;
        self.nodes.push(n);
        Some(at)
    }

    fn span(&mut self, s: &str) -> Option<Span> {
        let span = Span {
            start: u32::try_from(self.text.len()).ok()?,
            len: u32::try_from(s.len()).ok()?,
        };
        self.text.push_str(s);
        Some(span)
    }

    /// The keys of `path`, pushed: (first, len).
    fn keys(&mut self, path: &[String]) -> Option<(At, At)> {
        let first = At::try_from(self.nodes.len()).ok()?;
        for k in path {
            let span = self.span(k)?;
            self.push(Node::Key(span))?;
        }
        Some((first, At::try_from(path.len()).ok()?))
    }

    fn lower_at(&mut self, e: &IdedExpr, lifted: &[Lifted]) -> Option<At> {
        let node = match &e.expr {
            Expr::Literal(_) => self.literal(e)?,
            Expr::Ident(name) => match name.as_str() {
                "ref" => Node::Ref,
                "land" => Node::Land,
                "project" => Node::Project,
                other => {
                    let l = lifted.iter().find(|l| l.var == other)?;
                    let (first, len) = self.keys(&l.path)?;
                    match &l.has {
                        Some(f) => Node::Has {
                            first,
                            len,
                            field: self.span(f)?,
                        },
                        None => Node::Path { first, len },
                    }
                }
            },
            Expr::Call(c) => {
                let (f, target, args) = (c.func_name.as_str(), &c.target, c.args.as_slice());
                match (f, target, args) {
                    (operators::LOGICAL_NOT, None, [a]) => Node::Not(self.lower_at(a, lifted)?),
                    (operators::NEGATE, None, [a]) => Node::Neg(self.lower_at(a, lifted)?),
                    (operators::CONDITIONAL, None, [a, b, c]) => Node::Cond(
                        self.lower_at(a, lifted)?,
                        self.lower_at(b, lifted)?,
                        self.lower_at(c, lifted)?,
                    ),
                    (operators::IN, None, [x, list]) => match &list.expr {
                        Expr::List(l) if l.optional_indices.is_empty() => {
                            let x = self.lower_at(x, lifted)?;
                            let first = At::try_from(self.nodes.len()).ok()?;
                            for el in &l.elements {
                                let lit = self.literal(el)?;
                                self.push(lit)?;
                            }
                            let len = At::try_from(l.elements.len()).ok()?;
                            Node::In { x, first, len }
                        }
                        _ => return None,
                    },
                    (f, Some(target), [a]) => {
                        let op = match f {
                            "startsWith" => Text::StartsWith,
                            "endsWith" => Text::EndsWith,
                            "contains" => Text::Contains,
                            _ => return None,
                        };
                        Node::Text(
                            op,
                            self.lower_at(target, lifted)?,
                            self.lower_at(a, lifted)?,
                        )
                    }
                    (f, None, [a, b]) => {
                        let two: fn(At, At) -> Node = match f {
                            operators::LOGICAL_AND => Node::And,
                            operators::LOGICAL_OR => Node::Or,
                            operators::EQUALS => |a, b| Node::Cmp(Cmp::Eq, a, b),
                            operators::NOT_EQUALS => |a, b| Node::Cmp(Cmp::Ne, a, b),
                            operators::LESS => |a, b| Node::Cmp(Cmp::Lt, a, b),
                            operators::LESS_EQUALS => |a, b| Node::Cmp(Cmp::Le, a, b),
                            operators::GREATER => |a, b| Node::Cmp(Cmp::Gt, a, b),
                            operators::GREATER_EQUALS => |a, b| Node::Cmp(Cmp::Ge, a, b),
                            operators::ADD => |a, b| Node::Arith(Arith::Add, a, b),
                            operators::SUBSTRACT => |a, b| Node::Arith(Arith::Sub, a, b),
                            operators::MULTIPLY => |a, b| Node::Arith(Arith::Mul, a, b),
                            operators::DIVIDE => |a, b| Node::Arith(Arith::Div, a, b),
                            _ => return None,
                        };
                        two(self.lower_at(a, lifted)?, self.lower_at(b, lifted)?)
                    }
                    _ => return None,
                }
            }
            _ => return None,
        };
        self.push(node)
    }

    /// A literal node, when it is of a kind this module models.
    fn literal(&mut self, e: &IdedExpr) -> Option<Node> {
        if !matches!(e.expr, Expr::Literal(_)) {
            return None;
        }
        Some(match Cel::resolve(e, &super::super::cel::context()).ok()? {
            Cel::Null => Node::Null,
            Cel::Bool(b) => Node::Bool(b),
            Cel::Int(i) => Node::Int(i),
            Cel::UInt(u) => Node::UInt(u),
            Cel::Float(f) => Node::Double(f),
            Cel::String(s) => Node::Str(self.span(s.as_str())?),
            _ => return None,
        })
    }

    /// The filter's value for `t`, or `None` where the interpreter must say.
    pub(super) fn eval<'a>(&'a self, t: &'a Trigger) -> Option<V<'a>> {
        self.eval_at(At::try_from(self.nodes.len().checked_sub(1)?).ok()?, t)
    }

    fn str(&self, s: Span) -> Option<&str> {
        let start = s.start as usize;
        self.text.get(start..start + s.len as usize)
    }

    /// The object at the path of the `len` keys from `first`: the payload itself for none.
    fn object<'a>(&self, t: &'a Trigger, first: At, len: At) -> Option<&'a Map<String, Value>> {
        let keys = self
            .nodes
            .get(first as usize..first as usize + len as usize)?;
        keys.iter().try_fold(&t.payload, |at, k| match k {
            Node::Key(s) => at.get(self.str(*s)?).and_then(Value::as_object),
            _ => None,
        })
    }

    fn eval_at<'a>(&'a self, at: At, t: &'a Trigger) -> Option<V<'a>> {
        Some(match *self.nodes.get(at as usize)? {
            Node::Null => V::Null,
            Node::Bool(b) => V::Bool(b),
            Node::Int(i) => V::Int(i),
            Node::UInt(u) => V::UInt(u),
            Node::Double(f) => V::Double(f),
            Node::Str(s) => V::Str(self.str(s)?),
            Node::Key(_) => return None,
            Node::Ref => V::Str(&t.r#ref),
            Node::Land => V::Str(&t.land),
            Node::Project => V::Str(t.project.as_deref().unwrap_or("")),
            Node::Path { first, len } => {
                let last = len.checked_sub(1)?;
                let Node::Key(key) = *self.nodes.get((first + last) as usize)? else {
                    return None;
                };
                V::of(self.object(t, first, last)?.get(self.str(key)?)?)?
            }
            Node::Has { first, len, field } => {
                V::Bool(self.object(t, first, len)?.contains_key(self.str(field)?))
            }
            Node::Not(x) => V::Bool(!self.eval_at(x, t)?.bool()?),
            // CEL's `&&` and `||` forgive an error on one side that the other side decides;
            // here an error on either side is left to the interpreter, which knows that.
            Node::And(a, b) => V::Bool(self.eval_at(a, t)?.bool()? && self.eval_at(b, t)?.bool()?),
            Node::Or(a, b) => V::Bool(self.eval_at(a, t)?.bool()? || self.eval_at(b, t)?.bool()?),
            Node::Cond(c, a, b) => match self.eval_at(c, t)?.bool()? {
                true => self.eval_at(a, t)?,
                false => self.eval_at(b, t)?,
            },
            Node::Cmp(op, a, b) => {
                let (l, r) = (self.eval_at(a, t)?, self.eval_at(b, t)?);
                V::Bool(match op {
                    Cmp::Eq => l.equals(r),
                    Cmp::Ne => !l.equals(r),
                    Cmp::Lt => l.order(r)? == Ordering::Less,
                    Cmp::Le => l.order(r)? != Ordering::Greater,
                    Cmp::Gt => l.order(r)? == Ordering::Greater,
                    Cmp::Ge => l.order(r)? != Ordering::Less,
                })
            }
            Node::Text(op, a, b) => {
                let (V::Str(s), V::Str(a)) = (self.eval_at(a, t)?, self.eval_at(b, t)?) else {
                    return None;
                };
                V::Bool(match op {
                    Text::StartsWith => s.starts_with(a),
                    Text::EndsWith => s.ends_with(a),
                    Text::Contains => s.contains(a),
                })
            }
            // CEL's doubles are IEEE 754's, so their arithmetic never fails (`x / 0.0` is an
            // infinity); ints overflow, and strings and lists concatenate: the interpreter's.
            Node::Arith(op, a, b) => {
                let (V::Double(a), V::Double(b)) = (self.eval_at(a, t)?, self.eval_at(b, t)?)
                else {
                    return None;
                };
                V::Double(match op {
                    Arith::Add => a + b,
                    Arith::Sub => a - b,
                    Arith::Mul => a * b,
                    Arith::Div => a / b,
                })
            }
            Node::Neg(x) => match self.eval_at(x, t)? {
                V::Double(x) => V::Double(-x),
                _ => return None,
            },
            Node::In { x, first, len } => {
                let v = self.eval_at(x, t)?;
                let mut found = false;
                for i in first..first + len {
                    found |= self.eval_at(i, t)?.equals(v);
                }
                V::Bool(found)
            }
        })
    }
}

impl<'a> V<'a> {
    /// A JSON value as CEL reads it (`cel::json`), when it is not a list or an object.
    fn of(v: &'a Value) -> Option<V<'a>> {
        Some(match v {
            Value::Null => V::Null,
            Value::Bool(b) => V::Bool(*b),
            Value::String(s) => V::Str(s),
            Value::Number(n) => V::Double(n.as_f64()?),
            Value::Array(_) | Value::Object(_) => return None,
        })
    }

    fn bool(self) -> Option<bool> {
        match self {
            V::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// CEL's `==`: numbers compare across kinds; values of different kinds are unequal.
    fn equals(self, other: V<'_>) -> bool {
        match (self, other) {
            (V::Null, V::Null) => true,
            (V::Bool(a), V::Bool(b)) => a == b,
            (V::Str(a), V::Str(b)) => a == b,
            _ => numbers(self, other) == Some(Ordering::Equal),
        }
    }

    /// CEL's ordering: numbers across kinds, strings, bools; `None` for anything CEL refuses.
    fn order(self, other: V<'_>) -> Option<Ordering> {
        match (self, other) {
            (V::Bool(a), V::Bool(b)) => Some(a.cmp(&b)),
            (V::Str(a), V::Str(b)) => Some(a.cmp(b)),
            _ => numbers(self, other),
        }
    }
}

/// Two numbers compared as CEL compares an int, a uint and a double; `None` when either is not
/// a number, or is NaN.
fn numbers(a: V<'_>, b: V<'_>) -> Option<Ordering> {
    match (a, b) {
        (V::Int(a), V::Int(b)) => Some(a.cmp(&b)),
        (V::UInt(a), V::UInt(b)) => Some(a.cmp(&b)),
        (V::Int(a), V::UInt(b)) => Some(u64::try_from(a).map_or(Ordering::Less, |a| a.cmp(&b))),
        (V::UInt(a), V::Int(b)) => Some(i64::try_from(a).map_or(Ordering::Greater, |a| a.cmp(&b))),
        (V::Double(a), V::Double(b)) => a.partial_cmp(&b),
        (V::Double(a), V::Int(b)) => a.partial_cmp(&(b as f64)),
        (V::Double(a), V::UInt(b)) => a.partial_cmp(&(b as f64)),
        (V::Int(a), V::Double(b)) => (a as f64).partial_cmp(&b),
        (V::UInt(a), V::Double(b)) => (a as f64).partial_cmp(&b),
        _ => None,
    }
}

/// The value at `path` of a payload (objects all the way).
pub(super) fn value_at<'a>(payload: &'a Map<String, Value>, path: &[String]) -> Option<&'a Value> {
    let (last, before) = path.split_last()?;
    object_at(payload, before)?.get(last)
}

/// The object at `path` of a payload: the payload itself for an empty path.
pub(super) fn object_at<'a>(
    payload: &'a Map<String, Value>,
    path: &[String],
) -> Option<&'a Map<String, Value>> {
    path.iter()
        .try_fold(payload, |at, key| at.get(key).and_then(Value::as_object))
}
