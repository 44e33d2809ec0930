//! Ingress routes (§7.6): a route's rules, the signature checks of its kind, and its CEL mapping from a signed request to the fields of a trigger.
use std::collections::BTreeMap;
use std::sync::Arc;

use ::cel::common::ast::IdedExpr;
use ::cel::Value as Cel;
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

use super::cel;
#[cfg(test)]
use super::cel::MAX_EXPRESSION_DEPTH;
pub use super::cel::{MAX_EXPRESSION_BYTES, MAX_EXPRESSION_NODES, MAX_HEADER_BYTES};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// How a route's requests are signed and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngressKind {
    StandardWebhooks,
    Github,
    /// CloudEvents 1.0 over HTTP (binary or structured mode), signed as Standard Webhooks.
    CloudEvents,
    /// Messages of a NATS JetStream stream, taken by a durable pull consumer: in the
    /// CloudEvents NATS binding, or with `hcp-*` headers. The NATS connection authenticates.
    Nats,
}

impl IngressKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IngressKind::StandardWebhooks => "standard_webhooks",
            IngressKind::Github => "github",
            IngressKind::CloudEvents => "cloudevents",
            IngressKind::Nats => "nats",
        }
    }

    /// The headers a request of this kind carries under its signature, or `None` when the
    /// kind is not signed (a NATS message is authenticated by its connection, headers and
    /// all). A signed route's mapping reads no other header: one the signature does not cover
    /// could be changed in a replay of a captured request and make it another trigger.
    pub fn signed_headers(self) -> Option<&'static [&'static str]> {
        match self {
            IngressKind::StandardWebhooks | IngressKind::CloudEvents => {
                Some(&["webhook-id", "webhook-timestamp"])
            }
            // GitHub signs the body alone: X-GitHub-Event and X-GitHub-Delivery are not covered.
            IngressKind::Github => Some(&[]),
            IngressKind::Nats => None,
        }
    }

    pub fn parse(s: &str) -> Option<IngressKind> {
        match s {
            "standard_webhooks" => Some(IngressKind::StandardWebhooks),
            "github" => Some(IngressKind::Github),
            "cloudevents" => Some(IngressKind::CloudEvents),
            "nats" => Some(IngressKind::Nats),
            _ => None,
        }
    }
}

/// A route's mapping: a CEL expression per trigger field; empty means not given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Mapping {
    #[serde(rename = "ref")]
    pub r#ref: String,
    pub principal: String,
    pub binding_id: String,
    pub project: String,
    pub trigger_id: String,
    pub land: String,
}

/// A route as stored: what a request to it must carry and what it maps to.
#[derive(Clone, PartialEq, Eq)]
pub struct Route {
    pub route_id: String,
    pub pack_id: String,
    pub kind: IngressKind,
    pub mapping: Mapping,
    pub secrets: Vec<String>,
    pub fan_out: bool,
    /// CloudEvents: stripped from an event's `type` to make the default ref.
    pub type_prefix: String,
    /// NATS: the JetStream stream, and the subject filter of the route's consumer.
    pub nats_stream: String,
    pub nats_subject: String,
}

impl std::fmt::Debug for Route {
    // The secrets are credentials: never printed, never logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("route_id", &self.route_id)
            .field("pack_id", &self.pack_id)
            .field("kind", &self.kind)
            .field("mapping", &self.mapping)
            .field(
                "secrets",
                &format_args!("[{} REDACTED]", self.secrets.len()),
            )
            .field("fan_out", &self.fan_out)
            .field("type_prefix", &self.type_prefix)
            .field("nats_stream", &self.nats_stream)
            .field("nats_subject", &self.nats_subject)
            .finish()
    }
}

/// Most signing secrets a route holds at once (old and new, during a rotation, and spares).
pub const MAX_SECRETS: usize = 8;
/// Longest value a mapping may yield, in bytes (ids and refs are far shorter; this only stops
/// an expression that concatenates a large body from making a large string).
const MAX_MAPPED_BYTES: usize = 4096;
/// How far a Standard Webhooks timestamp may be from now, either way, in seconds.
pub const TIMESTAMP_TOLERANCE_SECS: i64 = 300;

/// Checks a route's id: the last segment of its URL path.
pub fn check_route_id(id: &str) -> Result<(), String> {
    let ok_first = id
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = id
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    if id.is_empty() {
        return Err("is required".into());
    }
    if !(ok_first && ok_rest) || id.len() > 128 {
        return Err(format!(
            "`{}` is not a route id: 1 to 128 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit",
            id.escape_debug()
        ));
    }
    Ok(())
}

/// Checks one signing secret of a route of `kind`.
pub fn check_secret(kind: IngressKind, secret: &str) -> Result<(), String> {
    match kind {
        IngressKind::Nats => Err(
            "a NATS route takes no secret: the NATS connection (--nats-url) authenticates its messages"
                .into(),
        ),
        IngressKind::StandardWebhooks | IngressKind::CloudEvents => {
            let key = standard_webhooks_key(secret)
                .ok_or("is not `whsec_` followed by base64 (a Standard Webhooks secret)")?;
            if !(24..=64).contains(&key.len()) {
                return Err(format!(
                    "decodes to {} bytes; a Standard Webhooks secret is 24 to 64",
                    key.len()
                ));
            }
            Ok(())
        }
        IngressKind::Github => {
            if !(16..=256).contains(&secret.len()) || secret.chars().any(char::is_control) {
                return Err(
                    "a GitHub webhook secret is 16 to 256 bytes of text, with no control characters"
                        .into(),
                );
            }
            Ok(())
        }
    }
}

fn standard_webhooks_key(secret: &str) -> Option<Vec<u8>> {
    STANDARD.decode(secret.strip_prefix("whsec_")?).ok()
}

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
    let covered = if signed.is_empty() {
        format!(
            "a {} request's signature covers its body alone",
            kind.as_str()
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
    match names.into_iter().find(|n| !signed.contains(&n.as_str())) {
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

/// What a mapping yields for one request: the trigger's fields, each `None` when the mapping
/// does not give it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mapped {
    pub r#ref: Option<String>,
    pub principal: Option<String>,
    pub binding_id: Option<String>,
    pub project: Option<String>,
    pub trigger_id: Option<String>,
    pub land: Option<String>,
}

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

/// A CloudEvent read from an HTTP request: its context attributes (required and extensions,
/// as text) and its data.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudEvent {
    pub attributes: BTreeMap<String, String>,
    pub data: Value,
    /// Structured mode: the attributes came in the body. In binary mode they came in `ce-`
    /// headers, which a signature over the body does not cover.
    pub structured: bool,
}

impl CloudEvent {
    pub fn attr(&self, name: &str) -> &str {
        self.attributes.get(name).map_or("", String::as_str)
    }

    /// The trigger id an event gives: its `source` and `id`, which together identify it.
    pub fn trigger_id(&self) -> String {
        format!("{}#{}", self.attr("source"), self.attr("id"))
    }
}

/// Reads a CloudEvents 1.0 HTTP request: structured mode when the content type is
/// `application/cloudevents+json`, else binary mode (attributes in `ce-` headers, the body
/// the data). The data must be a JSON object (it becomes the trigger's payload). A missing or
/// bad attribute is a (field, description).
pub fn cloud_event(
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> Result<CloudEvent, (String, String)> {
    let bad = |f: &str, d: &str| (f.to_owned(), d.to_owned());
    let structured = headers.get("content-type").is_some_and(|c| {
        c.trim_start()
            .to_ascii_lowercase()
            .starts_with("application/cloudevents+json")
    });
    let (attributes, data) = if structured {
        let Ok(Value::Object(mut envelope)) = serde_json::from_slice::<Value>(body) else {
            return Err(bad(
                "body",
                "is not a JSON object (a structured-mode CloudEvent)",
            ));
        };
        if envelope.contains_key("data_base64") {
            return Err(bad(
                "data_base64",
                "binary data cannot be a trigger's payload; send JSON `data`",
            ));
        }
        let data = envelope
            .remove("data")
            .unwrap_or(Value::Object(Default::default()));
        let mut attributes = BTreeMap::new();
        for (k, v) in envelope {
            let text = match v {
                Value::String(s) => s,
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => {
                    return Err((
                        k,
                        "a context attribute is a string, number or boolean".into(),
                    ))
                }
            };
            attributes.insert(k, text);
        }
        (attributes, data)
    } else {
        let attributes: BTreeMap<String, String> = headers
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("ce-")?.to_owned(), v.clone())))
            .collect();
        let data = if body.is_empty() {
            Value::Object(Default::default())
        } else {
            serde_json::from_slice(body).map_err(|e| bad("data", &format!("is not JSON: {e}")))?
        };
        // The mode is what the signed body says, not only the unsigned Content-Type: a
        // structured event re-sent as binary mode would be read as other data.
        if data.get("specversion").is_some() {
            return Err(bad(
                "content-type",
                "the body is a structured-mode CloudEvent: send it as application/cloudevents+json",
            ));
        }
        (attributes, data)
    };
    for required in ["specversion", "id", "source", "type"] {
        if attributes.get(required).is_none_or(|v| v.is_empty()) {
            return Err((
                required.to_owned(),
                format!(
                    "is required: a CloudEvent has `{required}` (`ce-{required}` in binary mode)"
                ),
            ));
        }
    }
    if attributes.get("specversion").map(String::as_str) != Some("1.0") {
        return Err(bad("specversion", "must be 1.0"));
    }
    if !data.is_object() {
        return Err(bad(
            "data",
            "must be a JSON object (it becomes the trigger's payload)",
        ));
    }
    Ok(CloudEvent {
        attributes,
        data,
        structured,
    })
}

/// Why a request's signature was refused (answered 401; nothing is counted as a trigger).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsigned(pub String);

/// What a verified signature vouches for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The kind's signed delivery id: the default trigger id, and the ledger's key.
    pub delivery_id: String,
    /// The signed time (Unix seconds), for kinds that sign one: a replay verifies only
    /// within TIMESTAMP_TOLERANCE_SECS of it. `None`: a replay verifies for ever (GitHub).
    pub signed_at: Option<i64>,
}

impl Verified {
    /// The ledger's key for the delivery: a fixed-width digest of its id, however long.
    pub fn key(&self) -> String {
        use sha2::Digest as _;
        hex::encode(Sha256::digest(self.delivery_id.as_bytes()))
    }

    /// When (Unix seconds) a replay stops verifying anywhere, `margin` being the clock skew
    /// allowed between replicas; `None`: never.
    pub fn replayable_until(&self, margin: i64) -> Option<i64> {
        self.signed_at
            .map(|at| at.saturating_add(TIMESTAMP_TOLERANCE_SECS + margin))
    }
}

/// Checks a request's signature against any of a route's secrets, in constant time per
/// comparison; returns what it vouches for. `now` is Unix seconds.
pub fn verify(
    kind: IngressKind,
    secrets: &[String],
    headers: &BTreeMap<String, String>,
    body: &[u8],
    now: i64,
) -> Result<Verified, Unsigned> {
    let header = |name: &str| headers.get(name).map(String::as_str);
    match kind {
        // Not an HTTP route: its messages come over the NATS connection alone.
        IngressKind::Nats => Err(Unsigned("a NATS route takes no HTTP request".into())),
        IngressKind::StandardWebhooks | IngressKind::CloudEvents => {
            let id = header("webhook-id")
                .filter(|id| !id.is_empty())
                .ok_or_else(|| Unsigned("no webhook-id header".into()))?;
            let ts = header("webhook-timestamp")
                .ok_or_else(|| Unsigned("no webhook-timestamp header".into()))?;
            let sigs = header("webhook-signature")
                .ok_or_else(|| Unsigned("no webhook-signature header".into()))?;
            let at: i64 = ts
                .parse()
                .map_err(|_| Unsigned("webhook-timestamp is not Unix seconds".into()))?;
            if (now - at).abs() > TIMESTAMP_TOLERANCE_SECS {
                return Err(Unsigned(format!(
                    "webhook-timestamp is more than {TIMESTAMP_TOLERANCE_SECS} s from now"
                )));
            }
            let given: Vec<Vec<u8>> = sigs
                .split(' ')
                .filter_map(|s| s.strip_prefix("v1,"))
                .filter_map(|b| STANDARD.decode(b).ok())
                .collect();
            for secret in secrets {
                let Some(key) = standard_webhooks_key(secret) else {
                    continue;
                };
                let Ok(mut mac) = HmacSha256::new_from_slice(&key) else {
                    continue;
                };
                mac.update(id.as_bytes());
                mac.update(b".");
                mac.update(ts.as_bytes());
                mac.update(b".");
                mac.update(body);
                if given
                    .iter()
                    .any(|sig| mac.clone().verify_slice(sig).is_ok())
                {
                    return Ok(Verified {
                        delivery_id: id.to_owned(),
                        signed_at: Some(at),
                    });
                }
            }
            Err(Unsigned(
                "no webhook-signature matches a secret of this route".into(),
            ))
        }
        IngressKind::Github => {
            let sig = header("x-hub-signature-256")
                .ok_or_else(|| Unsigned("no X-Hub-Signature-256 header".into()))?;
            let given = sig
                .strip_prefix("sha256=")
                .and_then(|h| hex::decode(h).ok())
                .ok_or_else(|| Unsigned("X-Hub-Signature-256 is not sha256=<hex>".into()))?;
            for secret in secrets {
                let Ok(mut mac) = HmacSha256::new_from_slice(secret.as_bytes()) else {
                    continue;
                };
                mac.update(body);
                if mac.verify_slice(&given).is_ok() {
                    return Ok(Verified {
                        delivery_id: github_delivery_id(body),
                        signed_at: None,
                    });
                }
            }
            Err(Unsigned(
                "X-Hub-Signature-256 matches no secret of this route".into(),
            ))
        }
    }
}

/// A GitHub request's default trigger id: a digest of its body. GitHub signs the body alone,
/// so its X-GitHub-Delivery header could be changed in a replay; the body cannot, and a
/// redelivery (GitHub sends the same body again) is the first record.
pub fn github_delivery_id(body: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(Sha256::digest(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(r: &str, principal: &str) -> Mapping {
        Mapping {
            r#ref: r.into(),
            principal: principal.into(),
            ..Default::default()
        }
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
            (Github, "headers['x-github-event']"),
            (Github, "headers['x-github-delivery']"),
            (Github, "body.user + headers['X-GitHub-Event']"),
            (StandardWebhooks, "headers['x-user']"),
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
            // A NATS message is authenticated by its connection, headers and all.
            (Nats, "headers['x-user']"),
            (Nats, "headers[body.which]"),
        ] {
            assert!(with(kind, expr).is_ok(), "{kind:?} {expr}");
        }
    }

    #[test]
    fn a_cloudevents_mode_is_what_its_signed_body_says() {
        let binary = BTreeMap::from([
            ("ce-specversion".to_owned(), "1.0".to_owned()),
            ("ce-id".to_owned(), "e1".to_owned()),
            ("ce-source".to_owned(), "/s".to_owned()),
            ("ce-type".to_owned(), "t".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ]);
        let e = cloud_event(&binary, br#"{"area": "north"}"#).expect("binary");
        assert!(!e.structured);
        let envelope =
            br#"{"specversion": "1.0", "id": "e1", "source": "/s", "type": "t", "data": {}}"#;
        let refused = cloud_event(&binary, envelope).expect_err("a structured body as binary");
        assert_eq!(refused.0, "content-type");
        let structured = BTreeMap::from([(
            "content-type".to_owned(),
            "application/cloudevents+json".to_owned(),
        )]);
        assert!(
            cloud_event(&structured, envelope)
                .expect("structured")
                .structured
        );
        assert!(cloud_event(&structured, br#"{"area": "north"}"#).is_err());
    }

    #[test]
    fn a_github_requests_trigger_id_is_its_bodys_digest_and_a_webhook_id_is_never_empty() {
        let mut mac = HmacSha256::new_from_slice(b"0123456789abcdef").expect("key");
        mac.update(b"{}");
        let sig = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
        let secrets = ["0123456789abcdef".to_owned()];
        let mut headers = BTreeMap::from([
            ("x-hub-signature-256".to_owned(), sig),
            ("x-github-delivery".to_owned(), "d-1".to_owned()),
        ]);
        let id = verify(IngressKind::Github, &secrets, &headers, b"{}", 0).expect("signed");
        assert_eq!(
            id.delivery_id,
            "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert_eq!(id.replayable_until(60), None, "GitHub signs no time");
        headers.insert("x-github-delivery".into(), "d-2".into());
        assert_eq!(
            verify(IngressKind::Github, &secrets, &headers, b"{}", 0),
            Ok(id)
        );
        let secret = format!("whsec_{}", STANDARD.encode([7u8; 32]));
        let mut mac = HmacSha256::new_from_slice(&[7u8; 32]).expect("key");
        mac.update(b".1000.{}");
        let sig = STANDARD.encode(mac.finalize().into_bytes());
        let headers = BTreeMap::from([
            ("webhook-id".to_owned(), String::new()),
            ("webhook-timestamp".to_owned(), "1000".to_owned()),
            ("webhook-signature".to_owned(), format!("v1,{sig}")),
        ]);
        assert!(verify(
            IngressKind::StandardWebhooks,
            &[secret],
            &headers,
            b"{}",
            1000
        )
        .is_err());
    }

    #[test]
    fn signatures_are_checked_against_every_secret() {
        let secret = format!("whsec_{}", STANDARD.encode([7u8; 32]));
        let mut mac = HmacSha256::new_from_slice(&[7u8; 32]).expect("key");
        mac.update(b"msg_1.1000.{}");
        let sig = STANDARD.encode(mac.finalize().into_bytes());
        let headers = BTreeMap::from([
            ("webhook-id".to_owned(), "msg_1".to_owned()),
            ("webhook-timestamp".to_owned(), "1000".to_owned()),
            ("webhook-signature".to_owned(), format!("v1,AAAA v1,{sig}")),
        ]);
        let other = format!("whsec_{}", STANDARD.encode([8u8; 32]));
        let both = [other.clone(), secret.clone()];
        assert_eq!(
            verify(IngressKind::StandardWebhooks, &both, &headers, b"{}", 1000),
            Ok(Verified {
                delivery_id: "msg_1".into(),
                signed_at: Some(1000)
            })
        );
        // A replay verifies until 1000 + 300 s; its ledger row outlives that by the margin.
        let v = at_ok(&both, &headers);
        assert_eq!(v.replayable_until(60), Some(1360));
        assert_eq!(v.key().len(), 64);
        assert!(verify(
            IngressKind::StandardWebhooks,
            &[other],
            &headers,
            b"{}",
            1000
        )
        .is_err());
        assert!(verify(IngressKind::StandardWebhooks, &both, &headers, b"{ }", 1000).is_err());
        // The tolerance, at its edge and one second past it, both ways.
        let at = |now| verify(IngressKind::StandardWebhooks, &both, &headers, b"{}", now);
        assert!(at(1300).is_ok() && at(700).is_ok());
        assert!(at(1301).is_err() && at(699).is_err());
    }

    fn at_ok(secrets: &[String], headers: &BTreeMap<String, String>) -> Verified {
        verify(IngressKind::StandardWebhooks, secrets, headers, b"{}", 1000).expect("signed")
    }
}
