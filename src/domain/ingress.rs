//! Ingress routes (§7.6): their kinds, mappings and secrets, the rules a route must meet, and how a route's message names its triggers.
use std::collections::BTreeMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::pack::BindingMode;
use super::policy::{Activation, PolicyView};
use super::trigger::RawTrigger;

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

    /// Headers outside the signature that a signed route's mapping may still read: the
    /// ingress ledger pins them with the delivery's content, so a replay that changes one is
    /// refused (409), never decided as something else. GitHub names its event in
    /// X-GitHub-Event alone (a `push` has no `action` in its body).
    pub fn pinned_headers(self) -> &'static [&'static str] {
        match self {
            IngressKind::Github => &["x-github-event"],
            _ => &[],
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

pub(crate) fn standard_webhooks_key(secret: &str) -> Option<Vec<u8>> {
    STANDARD.decode(secret.strip_prefix("whsec_")?).ok()
}

/// A route's rules that need nothing but the route: its id and pack id, its secrets, and
/// the fields that belong to one kind alone. Each broken rule as (field, description).
pub fn check_route(r: &Route) -> Vec<(String, String)> {
    let mut bad: Vec<(String, String)> = Vec::new();
    if let Err(e) = check_route_id(&r.route_id) {
        bad.push(("route.route_id".into(), e));
    }
    if let Err(e) = super::names::check_pack_id(&r.pack_id) {
        bad.push(("route.pack_id".into(), e));
    }
    let nats = r.kind == IngressKind::Nats;
    if nats {
        bad.extend(check_nats_route(r));
    } else if !r.nats_stream.is_empty() || !r.nats_subject.is_empty() {
        bad.push(("route.nats_stream".into(), "is for NATS routes only".into()));
    }
    if !nats && (r.secrets.is_empty() || r.secrets.len() > MAX_SECRETS) {
        bad.push((
            "secrets".into(),
            format!(
                "{} given; a route holds 1 to {MAX_SECRETS} signing secrets (the signature is the only credential of an ingress request)",
                r.secrets.len()
            ),
        ));
    }
    for (i, s) in r.secrets.iter().enumerate() {
        if let Err(e) = check_secret(r.kind, s) {
            bad.push((format!("secrets[{i}]"), e));
        }
    }
    if r.kind != IngressKind::CloudEvents && !r.type_prefix.is_empty() {
        bad.push((
            "route.cloudevents_type_prefix".into(),
            "is for CloudEvents routes only".into(),
        ));
    }
    bad
}

/// A NATS route's own rules: no secret, a stream name and a subject filter.
fn check_nats_route(r: &Route) -> Vec<(String, String)> {
    let mut bad = Vec::new();
    if !r.secrets.is_empty() {
        bad.push((
            "secrets".into(),
            "a NATS route takes no secret: the NATS connection (--nats-url) authenticates its messages".into(),
        ));
    }
    if let Err(e) = check_nats_name(&r.nats_stream) {
        bad.push(("route.nats_stream".into(), e));
    }
    if r.nats_subject.is_empty()
        || r.nats_subject.len() > 256
        || r.nats_subject
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        bad.push((
            "route.nats_subject".into(),
            "is required: a subject or wildcard filter (`orders.>`), at most 256 bytes, no whitespace".into(),
        ));
    }
    bad
}

/// A JetStream stream name: 1 to 64 of A-Z a-z 0-9 `-` `_`.
fn check_nats_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(
            "is required: a JetStream stream name, 1 to 64 of A-Z, a-z, 0-9, '-', '_'".into(),
        );
    }
    Ok(())
}

/// Why a route does not fit its pack as the policy view holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackMisfit {
    /// The pack is not registered.
    Unregistered,
    /// The route fans out, but only a public pack's event goes to every principal.
    NotPublic,
}

/// Whether a route fits its pack: registered, and public when the route fans out.
pub fn route_fits_pack(view: &PolicyView, r: &Route) -> Result<(), PackMisfit> {
    match view.pack(&r.pack_id) {
        None => Err(PackMisfit::Unregistered),
        Some(p) if r.fan_out && p.binding_mode != BindingMode::Public => Err(PackMisfit::NotPublic),
        Some(_) => Ok(()),
    }
}

/// What a message names, field by field, from its route's mapping and then (where the
/// mapping gives none) from the message itself; `None`: not named.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mapped {
    pub r#ref: Option<String>,
    pub principal: Option<String>,
    pub binding_id: Option<String>,
    pub project: Option<String>,
    pub trigger_id: Option<String>,
    pub land: Option<String>,
}

/// What a CloudEvent says of itself: its type, subject, and the trigger id its source and id
/// make.
#[derive(Debug, Clone)]
pub struct EventNames<'a> {
    pub r#type: &'a str,
    pub subject: &'a str,
    pub trigger_id: String,
}

/// What a CloudEvent names itself, where the mapping does not say otherwise: its type (less
/// the route's prefix) is the ref, its subject the principal, its source and id the trigger id.
pub fn named_by_event(
    route: &Route,
    e: EventNames<'_>,
    mapped: &mut Mapped,
) -> Result<(), (String, String)> {
    mapped.r#ref.get_or_insert_with(|| {
        e.r#type
            .strip_prefix(route.type_prefix.as_str())
            .unwrap_or(e.r#type)
            .to_owned()
    });
    if mapped.binding_id.is_none() && !route.fan_out && mapped.principal.is_none() {
        if e.subject.is_empty() {
            return Err((
                "subject".into(),
                "is required: the route maps no principal, so the event's subject names it".into(),
            ));
        }
        mapped.principal = Some(e.subject.to_owned());
    }
    mapped.trigger_id.get_or_insert(e.trigger_id);
    Ok(())
}

/// A plain NATS message names its trigger in `hcp-*` headers, where the mapping does not.
pub fn named_by_headers(
    route: &Route,
    headers: &BTreeMap<String, String>,
    mapped: &mut Mapped,
) -> Result<(), (String, String)> {
    let header = |n: &str| headers.get(n).filter(|v| !v.is_empty()).cloned();
    if mapped.r#ref.is_none() {
        mapped.r#ref = Some(header("hcp-ref").ok_or_else(|| {
            (
                "hcp-ref".to_owned(),
                "is required: a message without a CloudEvent names its ref in the hcp-ref header"
                    .to_owned(),
            )
        })?);
    }
    if mapped.principal.is_none() && mapped.binding_id.is_none() && !route.fan_out {
        mapped.principal = header("hcp-principal");
        mapped.binding_id = header("hcp-binding-id");
        if mapped.principal.is_none() && mapped.binding_id.is_none() {
            return Err((
                "hcp-principal".into(),
                "is required (or hcp-binding-id): the route maps no principal".into(),
            ));
        }
    }
    for (slot, name) in [
        (&mut mapped.project, "hcp-project"),
        (&mut mapped.land, "hcp-land"),
    ] {
        if slot.is_none() {
            *slot = header(name);
        }
    }
    Ok(())
}

/// The principals a message goes to: the mapped principal, the holder of the mapped Binding
/// id, or (fanning out) every principal granted and activated for the pack, in name order.
pub fn principals_of(
    view: &PolicyView,
    route: &Route,
    m: &Mapped,
) -> Result<Vec<String>, (String, String)> {
    if let Some(p) = &m.principal {
        return Ok(vec![p.clone()]);
    }
    let pack = view.pack(&route.pack_id);
    if let Some(binding_id) = &m.binding_id {
        let holders: Vec<&String> = pack
            .map(|p| {
                p.principals
                    .iter()
                    .filter(|(_, pp)| {
                        pp.binding
                            .as_ref()
                            .is_some_and(|b| &b.binding_id == binding_id)
                    })
                    .map(|(name, _)| name)
                    .collect()
            })
            .unwrap_or_default();
        let field = || "mapping.binding_id".to_owned();
        return match holders.as_slice() {
            [one] => Ok(vec![(*one).clone()]),
            [] => Err((
                field(),
                format!(
                    "no Binding of pack `{}` has id `{}`",
                    route.pack_id,
                    binding_id.escape_debug()
                ),
            )),
            _ => Err((
                field(),
                format!(
                    "Binding id `{}` is held by more than one principal of pack `{}`",
                    binding_id.escape_debug(),
                    route.pack_id
                ),
            )),
        };
    }
    let Some(pack) = pack else {
        return Ok(Vec::new());
    };
    let mut all: Vec<String> = pack
        .principals
        .iter()
        .filter(|(_, pp)| pp.granted && !matches!(pack.activation_for(Some(pp)), Activation::Off))
        .map(|(name, _)| name.clone())
        .collect();
    all.sort();
    Ok(all)
}

/// The land a trigger takes when its mapping gives none and its ref has no Policy entry: such
/// a trigger is dropped as undeclared (or its pack as unknown) before any land is compared.
const LAND_OF_UNDECLARED: &str = "user";

/// One trigger per principal of the message, each with an id of its own: idempotency is per
/// (pack, trigger id), so a redelivered fan-out records each principal's once. Without a
/// mapped land a trigger takes its ref's Policy land.
pub fn triggers_of(
    view: &PolicyView,
    route: &Route,
    mapped: &Mapped,
    principals: Vec<String>,
    trigger_id: &str,
    payload: &Value,
) -> Vec<RawTrigger> {
    let r#ref = mapped.r#ref.clone().unwrap_or_default();
    let land = mapped.land.clone().unwrap_or_else(|| {
        view.pack(&route.pack_id)
            .and_then(|p| p.lands.get(&r#ref).cloned())
            .unwrap_or_else(|| LAND_OF_UNDECLARED.to_owned())
    });
    principals
        .into_iter()
        .map(|principal| RawTrigger {
            pack_id: route.pack_id.clone(),
            r#ref: r#ref.clone(),
            land: land.clone(),
            payload: Some(payload.clone()),
            project: mapped.project.clone().unwrap_or_default(),
            trigger_id: match (trigger_id, route.fan_out) {
                ("", _) => String::new(),
                (id, true) => format!("{id}:{principal}"),
                (id, false) => id.to_owned(),
            },
            principal,
            source: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(kind: IngressKind) -> Route {
        Route {
            route_id: "gh".into(),
            pack_id: "github".into(),
            kind,
            mapping: Mapping::default(),
            secrets: Vec::new(),
            fan_out: false,
            type_prefix: String::new(),
            nats_stream: String::new(),
            nats_subject: String::new(),
        }
    }

    fn fields(bad: &[(String, String)]) -> Vec<&str> {
        bad.iter().map(|(f, _)| f.as_str()).collect()
    }

    #[test]
    fn a_route_names_each_rule_it_breaks() {
        let mut nats = route(IngressKind::Nats);
        nats.secrets = vec!["s".repeat(20)];
        nats.type_prefix = "com.example.".into();
        assert_eq!(
            fields(&check_route(&nats)),
            [
                "secrets",
                "route.nats_stream",
                "route.nats_subject",
                "secrets[0]",
                "route.cloudevents_type_prefix"
            ]
        );
        let mut github = route(IngressKind::Github);
        github.nats_subject = "orders.>".into();
        assert_eq!(
            fields(&check_route(&github)),
            ["route.nats_stream", "secrets"]
        );
        github.nats_subject.clear();
        github.secrets = vec!["a-github-secret-of-16+".into()];
        assert!(check_route(&github).is_empty());
        let mut stream = route(IngressKind::Nats);
        stream.nats_stream = "ORDERS".into();
        stream.nats_subject = "orders.>".into();
        assert!(check_route(&stream).is_empty());
        stream.nats_stream = "a".repeat(65);
        assert_eq!(fields(&check_route(&stream)), ["route.nats_stream"]);
    }

    #[test]
    fn a_plain_nats_message_names_its_trigger_in_hcp_headers() {
        let r = route(IngressKind::Nats);
        let headers: BTreeMap<String, String> = [
            ("hcp-ref", "issue.opened"),
            ("hcp-principal", "alice"),
            ("hcp-land", "brain"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let mut m = Mapped::default();
        named_by_headers(&r, &headers, &mut m).expect("the headers name a trigger");
        assert_eq!(m.r#ref.as_deref(), Some("issue.opened"));
        assert_eq!(m.principal.as_deref(), Some("alice"));
        assert_eq!(m.land.as_deref(), Some("brain"));
        // What the mapping gave stays.
        let mut m = Mapped {
            principal: Some("bob".into()),
            ..Mapped::default()
        };
        named_by_headers(&r, &headers, &mut m).expect("the headers name a trigger");
        assert_eq!(m.principal.as_deref(), Some("bob"));
        let (field, _) =
            named_by_headers(&r, &BTreeMap::new(), &mut Mapped::default()).expect_err("no ref");
        assert_eq!(field, "hcp-ref");
    }

    #[test]
    fn a_fan_out_gives_each_principal_a_trigger_id_of_its_own() {
        let mut r = route(IngressKind::StandardWebhooks);
        r.fan_out = true;
        let m = Mapped {
            r#ref: Some("storm.warning".into()),
            ..Mapped::default()
        };
        let view = PolicyView::default();
        let payload = serde_json::json!({"area": "north"});
        let ts = triggers_of(
            &view,
            &r,
            &m,
            vec!["alice".into(), "bob".into()],
            "msg-1",
            &payload,
        );
        let ids: Vec<&str> = ts.iter().map(|t| t.trigger_id.as_str()).collect();
        assert_eq!(ids, ["msg-1:alice", "msg-1:bob"]);
        // An undeclared ref takes no Policy land: it is dropped before lands are compared.
        assert!(ts.iter().all(|t| t.land == LAND_OF_UNDECLARED));
        r.fan_out = false;
        let one = triggers_of(&view, &r, &m, vec!["alice".into()], "msg-1", &payload);
        assert_eq!(one[0].trigger_id, "msg-1");
        // No pack: nobody to fan out to.
        assert_eq!(principals_of(&view, &r, &Mapped::default()), Ok(Vec::new()));
    }
}
