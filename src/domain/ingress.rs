//! Ingress routes (§7.6) as the store keeps them: their kinds, mappings and secrets, and the rules a route must meet.
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::{Deserialize, Serialize};

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
