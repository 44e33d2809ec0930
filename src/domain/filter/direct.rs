//! The shapes most filters take, evaluated straight over the trigger without a CEL context: comparisons, `&&`, `||`, `!`, `?:`, `in` a list of literals, and `startsWith`, `endsWith`, `contains`, over `ref`, `land`, `project`, literals and lifted payload paths.
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
use super::super::decide::Trigger;

/// A filter in the shapes this module evaluates.
#[derive(Debug)]
pub(super) enum Direct {
    Lit(Lit),
    Ref,
    Land,
    Project,
    /// The value at a lifted payload path.
    Path(usize),
    /// A lifted `has(...)`.
    Has(usize),
    Not(Box<Direct>),
    And(Box<[Direct; 2]>),
    Or(Box<[Direct; 2]>),
    Cond(Box<[Direct; 3]>),
    Cmp(Cmp, Box<[Direct; 2]>),
    Text(Text, Box<[Direct; 2]>),
    In(Box<Direct>, Vec<Lit>),
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Text {
    StartsWith,
    EndsWith,
    Contains,
}

/// A literal of the kinds a JSON payload holds.
#[derive(Debug)]
pub(super) enum Lit {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(String),
}

/// A value during an evaluation, borrowed from the filter or the trigger. Numbers keep the
/// kinds CEL gives JSON's: a non-negative integer is a uint, a negative one an int.
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
        Some(match &e.expr {
            Expr::Literal(_) => Direct::Lit(Lit::of(e)?),
            Expr::Ident(name) => match name.as_str() {
                "ref" => Direct::Ref,
                "land" => Direct::Land,
                "project" => Direct::Project,
                other => {
                    let i = lifted.iter().position(|l| l.var == other)?;
                    match lifted[i].has {
                        Some(_) => Direct::Has(i),
                        None => Direct::Path(i),
                    }
                }
            },
            Expr::Call(c) => {
                let lower = |x: &IdedExpr| Direct::lower(x, lifted);
                let two = || Some(Box::new([lower(&c.args[0])?, lower(&c.args[1])?]));
                match (c.func_name.as_str(), &c.target, c.args.len()) {
                    (operators::LOGICAL_NOT, None, 1) => Direct::Not(Box::new(lower(&c.args[0])?)),
                    (operators::LOGICAL_AND, None, 2) => Direct::And(two()?),
                    (operators::LOGICAL_OR, None, 2) => Direct::Or(two()?),
                    (operators::CONDITIONAL, None, 3) => Direct::Cond(Box::new([
                        lower(&c.args[0])?,
                        lower(&c.args[1])?,
                        lower(&c.args[2])?,
                    ])),
                    (operators::EQUALS, None, 2) => Direct::Cmp(Cmp::Eq, two()?),
                    (operators::NOT_EQUALS, None, 2) => Direct::Cmp(Cmp::Ne, two()?),
                    (operators::LESS, None, 2) => Direct::Cmp(Cmp::Lt, two()?),
                    (operators::LESS_EQUALS, None, 2) => Direct::Cmp(Cmp::Le, two()?),
                    (operators::GREATER, None, 2) => Direct::Cmp(Cmp::Gt, two()?),
                    (operators::GREATER_EQUALS, None, 2) => Direct::Cmp(Cmp::Ge, two()?),
                    (operators::IN, None, 2) => match &c.args[1].expr {
                        Expr::List(l) if l.optional_indices.is_empty() => Direct::In(
                            Box::new(lower(&c.args[0])?),
                            l.elements.iter().map(Lit::of).collect::<Option<_>>()?,
                        ),
                        _ => return None,
                    },
                    (f, Some(target), 1) => {
                        let op = match f {
                            "startsWith" => Text::StartsWith,
                            "endsWith" => Text::EndsWith,
                            "contains" => Text::Contains,
                            _ => return None,
                        };
                        Direct::Text(op, Box::new([lower(target)?, lower(&c.args[0])?]))
                    }
                    _ => return None,
                }
            }
            _ => return None,
        })
    }

    /// The filter's value for `t`, or `None` where the interpreter must say.
    pub(super) fn eval<'a>(&'a self, t: &'a Trigger, lifted: &[Lifted]) -> Option<V<'a>> {
        Some(match self {
            Direct::Lit(l) => l.val(),
            Direct::Ref => V::Str(&t.r#ref),
            Direct::Land => V::Str(&t.land),
            Direct::Project => V::Str(t.project.as_deref().unwrap_or("")),
            Direct::Path(i) => V::of(value_at(&t.payload, &lifted[*i].path)?)?,
            Direct::Has(i) => {
                let l = &lifted[*i];
                V::Bool(object_at(&t.payload, &l.path)?.contains_key(l.has.as_deref()?))
            }
            Direct::Not(x) => V::Bool(!x.eval(t, lifted)?.bool()?),
            // CEL's `&&` and `||` forgive an error on one side that the other side decides;
            // here an error on either side is left to the interpreter, which knows that.
            Direct::And(x) => {
                V::Bool(x[0].eval(t, lifted)?.bool()? && x[1].eval(t, lifted)?.bool()?)
            }
            Direct::Or(x) => {
                V::Bool(x[0].eval(t, lifted)?.bool()? || x[1].eval(t, lifted)?.bool()?)
            }
            Direct::Cond(x) => match x[0].eval(t, lifted)?.bool()? {
                true => x[1].eval(t, lifted)?,
                false => x[2].eval(t, lifted)?,
            },
            Direct::Cmp(op, x) => {
                let (l, r) = (x[0].eval(t, lifted)?, x[1].eval(t, lifted)?);
                V::Bool(match op {
                    Cmp::Eq => l.equals(r),
                    Cmp::Ne => !l.equals(r),
                    Cmp::Lt => l.order(r)? == Ordering::Less,
                    Cmp::Le => l.order(r)? != Ordering::Greater,
                    Cmp::Gt => l.order(r)? == Ordering::Greater,
                    Cmp::Ge => l.order(r)? != Ordering::Less,
                })
            }
            Direct::Text(op, x) => {
                let (V::Str(s), V::Str(a)) = (x[0].eval(t, lifted)?, x[1].eval(t, lifted)?) else {
                    return None;
                };
                V::Bool(match op {
                    Text::StartsWith => s.starts_with(a),
                    Text::EndsWith => s.ends_with(a),
                    Text::Contains => s.contains(a),
                })
            }
            Direct::In(x, list) => {
                let v = x.eval(t, lifted)?;
                V::Bool(list.iter().any(|l| l.val().equals(v)))
            }
        })
    }
}

impl Lit {
    /// A literal node's value, when it is of a kind this module models.
    fn of(e: &IdedExpr) -> Option<Lit> {
        if !matches!(e.expr, Expr::Literal(_)) {
            return None;
        }
        Some(match Cel::resolve(e, &super::super::cel::context()).ok()? {
            Cel::Null => Lit::Null,
            Cel::Bool(b) => Lit::Bool(b),
            Cel::Int(i) => Lit::Int(i),
            Cel::UInt(u) => Lit::UInt(u),
            Cel::Float(f) => Lit::Double(f),
            Cel::String(s) => Lit::Str(s.as_str().to_owned()),
            _ => return None,
        })
    }

    fn val(&self) -> V<'_> {
        match self {
            Lit::Null => V::Null,
            Lit::Bool(b) => V::Bool(*b),
            Lit::Int(i) => V::Int(*i),
            Lit::UInt(u) => V::UInt(*u),
            Lit::Double(f) => V::Double(*f),
            Lit::Str(s) => V::Str(s),
        }
    }
}

impl<'a> V<'a> {
    /// A JSON value as CEL converts it (`cel::to_value`), when it is not a list or an object.
    fn of(v: &'a Value) -> Option<V<'a>> {
        Some(match v {
            Value::Null => V::Null,
            Value::Bool(b) => V::Bool(*b),
            Value::String(s) => V::Str(s),
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => V::UInt(u),
                (None, Some(i)) => V::Int(i),
                (None, None) => V::Double(n.as_f64()?),
            },
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
