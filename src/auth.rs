//! Who is calling: static bearer tokens (stored as SHA-256 hashes) and JWTs, turned into an identity with a role; and which role may call which RPC.
use std::collections::HashMap;
use std::path::PathBuf;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::domain::names::check_id;

/// Shortest HS256 secret accepted: the hash's own size (RFC 7518 §3.2).
pub const MIN_HS256_SECRET: usize = 32;

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Packs, grants, activation, Bindings, Execute-state mirror, project membership, drop reports, audit.
    Admin,
    /// DeliverTrigger and ReportBindingHealth.
    Runtime,
    /// ListRecords for its own principal.
    Reader,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "runtime" => Some(Role::Runtime),
            "reader" => Some(Role::Reader),
            _ => None,
        }
    }
}

/// How a caller proved who it is. Names are only unique within a kind: a JWT whose
/// subject is `rt1` is not the static token named `rt1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CredentialKind {
    Token,
    Jwt,
    Certificate,
}

impl CredentialKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CredentialKind::Token => "token",
            CredentialKind::Jwt => "jwt",
            CredentialKind::Certificate => "certificate",
        }
    }
}

/// Seconds a JWT's `exp` and `nbf` are stretched by, for clocks a little apart.
const JWT_LEEWAY_SECS: u64 = 5;

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub kind: CredentialKind,
    /// Who, for logs, rate limits and the audit: a token's name, a JWT's subject or a
    /// certificate's identity. Never empty.
    pub subject: String,
    pub role: Role,
    /// The principal a reader reads as: a valid, non-empty id.
    pub principal: Option<String>,
    /// When the credential stops being accepted, in Unix seconds (a JWT's `exp` plus the
    /// leeway); `None` for tokens and certificates. A stream ends there.
    pub expires: Option<i64>,
}

impl Identity {
    /// The key of this caller's rate-limit bucket: kind and name together.
    pub fn bucket(&self) -> String {
        format!("{}:{}", self.kind.as_str(), self.subject)
    }
}

/// Why a call was refused authentication: for the debug log only. The caller is
/// told no more than that credentials are missing or were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No credentials were sent.
    Missing,
    /// Credentials were sent and refused, for this reason.
    Refused(String),
}

impl Refusal {
    /// What the caller is told.
    pub fn public_message(&self) -> &'static str {
        match self {
            Refusal::Missing => "credentials required: send `authorization: Bearer <token>`",
            Refusal::Refused(_) => "credentials refused",
        }
    }

    /// Why, for the debug log.
    pub fn detail(&self) -> &str {
        match self {
            Refusal::Missing => "no credentials",
            Refusal::Refused(why) => why,
        }
    }
}

/// What the authentication layer found on a call, kept in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Authentication is not configured: every RPC is open (loopback only unless told otherwise).
    Open,
    Known(Identity),
    /// No credentials, or credentials that were refused.
    Refused(Refusal),
}

/// Which part of a verified client certificate names the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CertIdentity {
    /// The subject's common name (exactly one).
    #[default]
    #[value(alias = "common_name")]
    CommonName,
    /// The one URI subject alternative name, such as a SPIFFE id.
    #[value(alias = "uri_san")]
    UriSan,
}

/// The `/package.Service/Method` path of the call, kept in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalledMethod(pub String);

/// A static bearer token as configured: only its SHA-256 is stored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// A name for logs and the audit.
    pub name: String,
    /// Hex SHA-256 of the token.
    pub sha256: String,
    pub role: Role,
    /// Required for readers: the principal whose records they read.
    pub principal: Option<String>,
}

/// JWT validation as configured.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// HS256 shared secret, read from this file.
    pub hs256_secret_file: Option<PathBuf>,
    /// RS256 / ES256 public keys as a JWKS document on disk.
    pub jwks_file: Option<PathBuf>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Claim holding the role [default: role].
    pub role_claim: Option<String>,
    /// Claim holding the principal [default: sub].
    pub principal_claim: Option<String>,
}

/// The `[auth]` table of the configuration file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
    pub jwt: Option<JwtConfig>,
}

impl AuthConfig {
    pub fn is_enabled(&self) -> bool {
        !self.tokens.is_empty() || self.jwt.is_some()
    }
}

#[derive(Debug)]
struct Jwt {
    keys: Vec<(Option<String>, DecodingKey, Algorithm)>,
    validation_by_alg: HashMap<Algorithm, Validation>,
    role_claim: String,
    principal_claim: String,
}

/// Checks credentials. Built once at start from the configuration.
#[derive(Debug, Default)]
pub struct Authenticator {
    enabled: bool,
    /// The role of callers known by a client certificate (mutual TLS), and what names them.
    mtls: Option<(Role, CertIdentity)>,
    tokens: HashMap<[u8; 32], Identity>,
    jwt: Option<Jwt>,
}

impl Authenticator {
    pub fn from_config(cfg: &AuthConfig) -> anyhow::Result<Authenticator> {
        let mut tokens: HashMap<[u8; 32], Identity> = HashMap::new();
        let mut names = std::collections::HashSet::new();
        for t in &cfg.tokens {
            check_id("name", &t.name)
                .map_err(|e| anyhow::anyhow!("auth token `{}`: {e}", t.name))?;
            if !names.insert(t.name.as_str()) {
                anyhow::bail!(
                    "auth token `{}` is configured twice: names must be unique",
                    t.name
                );
            }
            let raw = hex::decode(t.sha256.trim())
                .map_err(|_| anyhow::anyhow!("auth token `{}`: sha256 must be hex", t.name))?;
            let hash: [u8; 32] = raw
                .try_into()
                .map_err(|_| anyhow::anyhow!("auth token `{}`: sha256 must be 32 bytes", t.name))?;
            if let Some(p) = &t.principal {
                check_id("principal", p)
                    .map_err(|e| anyhow::anyhow!("auth token `{}`: {e}", t.name))?;
            }
            if t.role == Role::Reader && t.principal.is_none() {
                anyhow::bail!("auth token `{}`: a reader needs a principal", t.name);
            }
            if let Some(other) = tokens.get(&hash) {
                // One secret cannot stand for two callers: which would it be?
                anyhow::bail!(
                    "auth tokens `{}` and `{}` have the same sha256: each token must be distinct",
                    other.subject,
                    t.name
                );
            }
            tokens.insert(
                hash,
                Identity {
                    kind: CredentialKind::Token,
                    subject: t.name.clone(),
                    role: t.role,
                    principal: t.principal.clone(),
                    expires: None,
                },
            );
        }
        let jwt = match &cfg.jwt {
            None => None,
            Some(j) => {
                let mut keys = Vec::new();
                if let Some(path) = &j.hs256_secret_file {
                    // The file's bytes, exactly: a secret is not text to be cleaned up.
                    let secret = std::fs::read(path)
                        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
                    if secret.len() < MIN_HS256_SECRET {
                        anyhow::bail!(
                            "{}: an HS256 secret must be at least {MIN_HS256_SECRET} bytes, not {}",
                            path.display(),
                            secret.len()
                        );
                    }
                    keys.push((None, DecodingKey::from_secret(&secret)?, Algorithm::HS256));
                }
                if let Some(path) = &j.jwks_file {
                    let text = std::fs::read_to_string(path)
                        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
                    let set: JwkSet = serde_json::from_str(&text)
                        .map_err(|e| anyhow::anyhow!("{}: not a JWKS: {e}", path.display()))?;
                    for k in &set.keys {
                        let alg = match &k.algorithm {
                            jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                            jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => {
                                Algorithm::ES256
                            }
                            _ => anyhow::bail!(
                                "{}: only RSA (RS256) and EC (ES256) keys are supported",
                                path.display()
                            ),
                        };
                        keys.push((k.common.key_id.clone(), DecodingKey::from_jwk(k)?, alg));
                    }
                }
                if keys.is_empty() {
                    anyhow::bail!("[auth.jwt] needs hs256_secret_file or jwks_file");
                }
                let mut validation_by_alg = HashMap::new();
                for alg in [Algorithm::HS256, Algorithm::RS256, Algorithm::ES256] {
                    let mut v = Validation::new(alg);
                    v.validate_nbf = true;
                    v.leeway = JWT_LEEWAY_SECS;
                    // A configured issuer or audience is required, not merely checked when present.
                    let mut required = vec!["exp", "sub"];
                    if let Some(iss) = &j.issuer {
                        v.set_issuer(&[iss]);
                        required.push("iss");
                    }
                    match &j.audience {
                        Some(aud) => {
                            v.set_audience(&[aud]);
                            required.push("aud");
                        }
                        None => v.validate_aud = false,
                    }
                    v.set_required_spec_claims(&required);
                    validation_by_alg.insert(alg, v);
                }
                Some(Jwt {
                    keys,
                    validation_by_alg,
                    role_claim: j.role_claim.clone().unwrap_or_else(|| "role".into()),
                    principal_claim: j.principal_claim.clone().unwrap_or_else(|| "sub".into()),
                })
            }
        };
        Ok(Authenticator {
            enabled: cfg.is_enabled(),
            mtls: None,
            tokens,
            jwt,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Also accept callers by a verified client certificate, with this role, named by
    /// the certificate's subject common name or its URI SAN.
    pub fn with_client_certificates(mut self, role: Role, by: CertIdentity) -> Authenticator {
        self.mtls = Some((role, by));
        self.enabled = true;
        self
    }

    /// The identity of a caller who sent no bearer credentials but a client certificate
    /// (DER) that TLS has verified against the client CA. The certificate is parsed as
    /// X.509; only its subject's one common name (or its one URI SAN) names the caller.
    pub fn check_certificate(&self, der: &[u8]) -> Caller {
        let Some((role, by)) = self.mtls else {
            return Caller::Refused(Refusal::Missing);
        };
        match certificate_identity(der, by) {
            Ok(name) => Caller::Known(Identity {
                kind: CredentialKind::Certificate,
                subject: name.clone(),
                role,
                principal: Some(name),
                expires: None,
            }),
            Err(why) => Caller::Refused(Refusal::Refused(format!("client certificate: {why}"))),
        }
    }

    /// What the `authorization` header value says about the caller.
    pub fn check(&self, authorization: Option<&str>) -> Caller {
        if !self.enabled {
            return Caller::Open;
        }
        let Some(value) = authorization else {
            return Caller::Refused(Refusal::Missing);
        };
        let refused = |why: &str| Caller::Refused(Refusal::Refused(why.to_owned()));
        let Some(token) = value.strip_prefix("Bearer ").map(str::trim) else {
            return refused("the authorization header must be `Bearer <token>`");
        };
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(id) = self.tokens.get(&hash) {
            return Caller::Known(id.clone());
        }
        match &self.jwt {
            Some(jwt) if token.matches('.').count() == 2 => match jwt.verify(token) {
                Ok(id) => Caller::Known(id),
                Err(why) => refused(&why),
            },
            _ => refused("unknown token"),
        }
    }
}

impl Jwt {
    fn verify(&self, token: &str) -> Result<Identity, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| "malformed JWT".to_string())?;
        let mut last = "no key matches the JWT".to_string();
        for (kid, key, alg) in &self.keys {
            if *alg != header.alg || (header.kid.is_some() && kid.is_some() && *kid != header.kid) {
                continue;
            }
            let Some(v) = self.validation_by_alg.get(alg) else {
                continue;
            };
            match jsonwebtoken::decode::<serde_json::Value>(token, key, v) {
                Ok(data) => {
                    let claims = data.claims;
                    let role = claims
                        .get(&self.role_claim)
                        .and_then(serde_json::Value::as_str)
                        .and_then(Role::parse)
                        .ok_or_else(|| {
                            format!(
                                "the JWT's `{}` claim is not admin, runtime or reader",
                                self.role_claim
                            )
                        })?;
                    // An empty or malformed principal is refused, never read as "no filter".
                    let principal = match claims.get(&self.principal_claim) {
                        None | Some(serde_json::Value::Null) => None,
                        Some(serde_json::Value::String(p)) => {
                            check_id("principal", p).map_err(|e| {
                                format!("the JWT's `{}` claim: {e}", self.principal_claim)
                            })?;
                            Some(p.clone())
                        }
                        Some(_) => {
                            return Err(format!(
                                "the JWT's `{}` claim must be a string",
                                self.principal_claim
                            ))
                        }
                    };
                    if role == Role::Reader && principal.is_none() {
                        return Err(format!(
                            "a reader's JWT needs a `{}` claim",
                            self.principal_claim
                        ));
                    }
                    let subject = claims
                        .get("sub")
                        .and_then(serde_json::Value::as_str)
                        .ok_or("the JWT's `sub` must be a string")?;
                    check_id("sub", subject).map_err(|e| format!("the JWT's {e}"))?;
                    // `exp` is required and was checked, so it is a number here.
                    let expires = claims
                        .get("exp")
                        .and_then(serde_json::Value::as_i64)
                        .map(|exp| exp.saturating_add(JWT_LEEWAY_SECS as i64));
                    return Ok(Identity {
                        kind: CredentialKind::Jwt,
                        subject: subject.to_owned(),
                        role,
                        principal,
                        expires,
                    });
                }
                Err(e) => {
                    use jsonwebtoken::errors::ErrorKind as K;
                    last = match e.kind() {
                        K::ExpiredSignature => "the JWT has expired".into(),
                        K::ImmatureSignature => "the JWT is not valid yet (nbf)".into(),
                        K::InvalidIssuer => "the JWT's issuer is not accepted".into(),
                        K::InvalidAudience => "the JWT's audience is not accepted".into(),
                        K::InvalidSignature => "the JWT's signature does not verify".into(),
                        K::MissingRequiredClaim(c) => format!("the JWT lacks `{c}`"),
                        _ => "the JWT is not valid".into(),
                    };
                }
            }
        }
        Err(last)
    }
}

/// The name a certificate gives its holder: the one common name of its subject, or its
/// one URI SAN. Anything else — a CN in an issuer, a SAN directory name, bytes inside
/// another attribute or extension — is never read. The name must be a valid id.
fn certificate_identity(der: &[u8], by: CertIdentity) -> Result<String, String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err("trailing bytes after the certificate".into());
    }
    let name = match by {
        CertIdentity::CommonName => {
            let mut cns = cert.subject().iter_common_name();
            let cn = cns.next().ok_or("the subject has no common name")?;
            if cns.next().is_some() {
                return Err("the subject has more than one common name".into());
            }
            cn.as_str()
                .map_err(|_| "the subject's common name is not a string".to_string())?
                .to_owned()
        }
        CertIdentity::UriSan => {
            let san = cert
                .subject_alternative_name()
                .map_err(|e| format!("bad subject alternative name: {e}"))?
                .ok_or("no subject alternative name")?;
            let mut uris = san.value.general_names.iter().filter_map(|n| match n {
                GeneralName::URI(u) => Some(*u),
                _ => None,
            });
            let uri = uris.next().ok_or("no URI subject alternative name")?;
            if uris.next().is_some() {
                return Err("more than one URI subject alternative name".into());
            }
            uri.to_owned()
        }
    };
    check_id("certificate identity", &name)?;
    Ok(name)
}

/// Methods every caller may call, authenticated or not: health and reflection.
pub fn is_open(method: &str) -> bool {
    let service = method
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or("");
    service == "grpc.health.v1.Health" || service.starts_with("grpc.reflection.")
}

/// The roles that may call a method (`/package.Service/Method`). Health and
/// reflection are open to all; anything unknown is closed.
pub fn allowed(method: &str, role: Role) -> bool {
    let Some((service, rpc)) = method.trim_start_matches('/').split_once('/') else {
        return false;
    };
    is_open(method)
        || matches!(
            (service, rpc, role),
            (
                "hcp.sense.v1.IngestService",
                "DeliverTrigger" | "DeliverTriggers",
                Role::Runtime
            ) | (
                "hcp.sense.v1.PolicyService",
                "ReportBindingHealth",
                Role::Runtime | Role::Admin
            ) | (
                "hcp.sense.v1.RecordService",
                "ListRecords" | "WatchRecords",
                Role::Reader
            ) | (
                "hcp.sense.v1.IngestService",
                "ExplainTrigger",
                Role::Runtime | Role::Admin
            ) | (
                "hcp.sense.v1.RecordService",
                "ListDropReports" | "EraseRecords",
                Role::Admin
            ) | (
                "hcp.sense.v1.PackService"
                    | "hcp.sense.v1.PolicyService"
                    | "hcp.sense.v1.IngressService"
                    | "hcp.sense.v1.AuditService"
                    | "hcp.sense.v1.BenchService",
                _,
                Role::Admin,
            )
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_by_hash_and_roles_by_method() {
        let token = "s3cret-admin";
        let cfg = AuthConfig {
            tokens: vec![TokenConfig {
                name: "ops".into(),
                sha256: hex::encode(Sha256::digest(token.as_bytes())),
                role: Role::Admin,
                principal: None,
            }],
            jwt: None,
        };
        let a = Authenticator::from_config(&cfg).expect("config");
        assert!(matches!(
            a.check(Some("Bearer s3cret-admin")),
            Caller::Known(Identity {
                role: Role::Admin,
                ..
            })
        ));
        assert!(matches!(a.check(Some("Bearer nope")), Caller::Refused(_)));
        assert!(matches!(a.check(None), Caller::Refused(_)));
        assert!(matches!(a.check(Some("Basic abc")), Caller::Refused(_)));
        assert_eq!(Authenticator::default().check(None), Caller::Open);
        assert!(allowed(
            "/hcp.sense.v1.PolicyService/GrantSenseEnable",
            Role::Admin
        ));
        assert!(!allowed(
            "/hcp.sense.v1.PolicyService/GrantSenseEnable",
            Role::Reader
        ));
        assert!(!allowed(
            "/hcp.sense.v1.RecordService/ListRecords",
            Role::Runtime
        ));
        assert!(allowed(
            "/hcp.sense.v1.IngestService/DeliverTrigger",
            Role::Runtime
        ));
        assert!(!allowed(
            "/hcp.sense.v1.IngestService/DeliverTrigger",
            Role::Admin
        ));
        assert!(allowed(
            "/hcp.sense.v1.IngestService/DeliverTriggers",
            Role::Runtime
        ));
        assert!(!allowed(
            "/hcp.sense.v1.IngestService/DeliverTriggers",
            Role::Reader
        ));
        assert!(allowed("/grpc.health.v1.Health/Check", Role::Reader));
        assert!(!allowed("/unknown.Service/X", Role::Admin));
    }
}
