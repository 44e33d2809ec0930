//! Who is calling: static bearer tokens (stored as SHA-256 hashes) and JWTs, turned into an identity with a role; and which role may call which RPC.
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::RwLock;
use std::time::{SystemTime, UNIX_EPOCH};

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
pub const JWT_LEEWAY_SECS: u64 = 5;

/// Verified JWTs remembered, so a caller's next calls cost a hash lookup, not a signature
/// check: at most this many, each forgotten when it expires.
pub const MAX_VERIFIED_JWTS: usize = 10_000;

/// Now, in Unix seconds.
fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

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
    /// When the credential stops being accepted, in Unix seconds: a JWT's `exp` plus the
    /// leeway, a client certificate's notAfter; `None` for static tokens. A stream opened
    /// with it ends there.
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

/// What a call's credentials come to before any signature is checked.
#[derive(Debug)]
pub enum Precheck {
    /// Decided without a signature check: no credentials, a static token, a JWT verified
    /// before, or credentials refused for what they are (malformed, no key for them, expired).
    Decided(Caller),
    /// A JWT whose signature must be checked, with `Authenticator::verify`.
    Signature(Unverified),
}

/// A JWT that passed the cheap checks; only its signature and claims are left.
#[derive(Debug)]
pub struct Unverified {
    token: String,
    /// Its SHA-256, the key it is remembered by once verified.
    hash: [u8; 32],
    /// The configured keys that may have signed it (by algorithm and `kid`), never empty.
    keys: Vec<usize>,
}

/// JWTs verified recently, by the SHA-256 of the token, until each expires.
#[derive(Debug, Default)]
struct Verified(RwLock<HashMap<[u8; 32], Identity>>);

impl Verified {
    fn get(&self, hash: &[u8; 32], now: i64) -> Option<Identity> {
        let map = self.0.read().ok()?;
        map.get(hash)
            .filter(|id| id.expires.is_some_and(|at| now < at))
            .cloned()
    }

    fn put(&self, hash: [u8; 32], id: &Identity, now: i64) {
        if id.expires.is_none() {
            return;
        }
        let Ok(mut map) = self.0.write() else {
            return;
        };
        if map.len() >= MAX_VERIFIED_JWTS {
            map.retain(|_, id| id.expires.is_some_and(|at| now < at));
        }
        if map.len() >= MAX_VERIFIED_JWTS {
            // Still full of live tokens: a tenth go (whichever the map yields first), so a
            // flood of new valid tokens pays this once per thousand, not once each. Those
            // that come back are verified again.
            let gone: Vec<[u8; 32]> = map.keys().take(MAX_VERIFIED_JWTS / 10).copied().collect();
            for k in gone {
                map.remove(&k);
            }
        }
        map.insert(hash, id.clone());
    }
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
    keys: Vec<JwtKey>,
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
    verified: Verified,
}

impl Authenticator {
    pub fn from_config(cfg: &AuthConfig) -> anyhow::Result<Authenticator> {
        Ok(Authenticator {
            enabled: cfg.is_enabled(),
            mtls: None,
            tokens: tokens(&cfg.tokens)?,
            jwt: cfg.jwt.as_ref().map(Jwt::from_config).transpose()?,
            verified: Verified::default(),
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
            // TLS checked the dates at the handshake; a connection may outlive the certificate.
            Ok((_, not_after)) if unix_now() >= not_after => Caller::Refused(Refusal::Refused(
                "client certificate: expired since the connection opened".into(),
            )),
            Ok((name, not_after)) => Caller::Known(Identity {
                kind: CredentialKind::Certificate,
                subject: name.clone(),
                role,
                principal: Some(name),
                expires: Some(not_after),
            }),
            Err(why) => Caller::Refused(Refusal::Refused(format!("client certificate: {why}"))),
        }
    }

    /// What the `authorization` header value says about the caller, signature checked.
    pub fn check(&self, authorization: Option<&str>) -> Caller {
        match self.precheck(authorization) {
            Precheck::Decided(caller) => caller,
            Precheck::Signature(jwt) => self.verify(jwt),
        }
    }

    /// What the `authorization` header value says about the caller as far as it can be told
    /// without checking a signature: static tokens and JWTs verified before are known by a
    /// hash lookup, and a malformed JWT, one no configured key could have signed or one
    /// already expired is refused.
    pub fn precheck(&self, authorization: Option<&str>) -> Precheck {
        let decided = Precheck::Decided;
        if !self.enabled {
            return decided(Caller::Open);
        }
        let Some(value) = authorization else {
            return decided(Caller::Refused(Refusal::Missing));
        };
        let refused = |why: &str| decided(Caller::Refused(Refusal::Refused(why.to_owned())));
        let Some(token) = value.strip_prefix("Bearer ").map(str::trim) else {
            return refused("the authorization header must be `Bearer <token>`");
        };
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(id) = self.tokens.get(&hash) {
            return decided(Caller::Known(id.clone()));
        }
        let Some(jwt) = self
            .jwt
            .as_ref()
            .filter(|_| token.matches('.').count() == 2)
        else {
            return refused("unknown token");
        };
        let now = unix_now();
        if let Some(id) = self.verified.get(&hash, now) {
            return decided(Caller::Known(id));
        }
        match jwt.candidates(token, now) {
            Ok(keys) => Precheck::Signature(Unverified {
                token: token.to_owned(),
                hash,
                keys,
            }),
            Err(why) => refused(&why),
        }
    }

    /// Checks a JWT's signature and claims; one that verifies is remembered until it expires.
    pub fn verify(&self, u: Unverified) -> Caller {
        let Some(jwt) = &self.jwt else {
            return Caller::Refused(Refusal::Refused("unknown token".into()));
        };
        let now = unix_now();
        match jwt.verify(&u.token, &u.keys) {
            // Accepted until `exp` plus the leeway, exclusive: the instant its streams end.
            Ok(id) if id.expires.is_some_and(|at| now >= at) => {
                Caller::Refused(Refusal::Refused("the JWT has expired".into()))
            }
            Ok(id) => {
                self.verified.put(u.hash, &id, now);
                Caller::Known(id)
            }
            Err(why) => Caller::Refused(Refusal::Refused(why)),
        }
    }
}

impl Jwt {
    /// The keys that may have signed `token`, found without any cryptography: refused when
    /// the token is malformed, no configured key has its algorithm and `kid`, or its
    /// (unverified) `exp` has passed — none of which a signature could make acceptable.
    fn candidates(&self, token: &str, now: i64) -> Result<Vec<usize>, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| "malformed JWT".to_string())?;
        let keys: Vec<usize> = self
            .keys
            .iter()
            .enumerate()
            .filter(|(_, (kid, _, alg))| {
                *alg == header.alg && !(header.kid.is_some() && kid.is_some() && *kid != header.kid)
            })
            .map(|(i, _)| i)
            .collect();
        if keys.is_empty() {
            return Err("no key matches the JWT".into());
        }
        let claims: serde_json::Value = jsonwebtoken::dangerous::insecure_decode_claims(token)
            .map_err(|_| "malformed JWT".to_string())?;
        match exp_of(&claims) {
            None => Err("the JWT lacks a numeric `exp`".into()),
            Some(exp) if now >= exp.saturating_add(JWT_LEEWAY_SECS as i64) => {
                Err("the JWT has expired".into())
            }
            Some(_) => Ok(keys),
        }
    }

    fn verify(&self, token: &str, candidates: &[usize]) -> Result<Identity, String> {
        let mut last = "no key matches the JWT".to_string();
        for (_, key, alg) in candidates.iter().filter_map(|i| self.keys.get(*i)) {
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
                    // `exp` is required and was checked, so it is a number here; without one
                    // the credential would have no end, so it is refused rather than assumed.
                    let expires = exp_of(&claims)
                        .map(|exp| exp.saturating_add(JWT_LEEWAY_SECS as i64))
                        .ok_or("the JWT lacks a numeric `exp`")?;
                    return Ok(Identity {
                        kind: CredentialKind::Jwt,
                        subject: subject.to_owned(),
                        role,
                        principal,
                        expires: Some(expires),
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

/// A JWT's `exp` in whole seconds, read as jsonwebtoken reads it (an integer, or a finite
/// non-negative number truncated).
fn exp_of(claims: &serde_json::Value) -> Option<i64> {
    let exp = claims.get("exp")?;
    exp.as_u64()
        .or_else(|| {
            exp.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && *f < u64::MAX as f64)
                .map(|f| f as u64)
        })
        .map(|n| i64::try_from(n).unwrap_or(i64::MAX))
}

/// The name a certificate gives its holder: the one common name of its subject, or its
/// one URI SAN. Anything else — a CN in an issuer, a SAN directory name, bytes inside
/// another attribute or extension — is never read. The name must be a valid id. With it,
/// the certificate's notAfter in Unix seconds.
fn certificate_identity(der: &[u8], by: CertIdentity) -> Result<(String, i64), String> {
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
    Ok((name, cert.validity().not_after.timestamp()))
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
            ("hcp.sense.v1.CallerService", "GetCaller", _)
                | (
                    "hcp.sense.v1.IngestService",
                    "DeliverTrigger" | "DeliverTriggers",
                    Role::Runtime
                )
                | (
                    "hcp.sense.v1.PolicyService",
                    "ReportBindingHealth",
                    Role::Runtime | Role::Admin
                )
                | (
                    "hcp.sense.v1.RecordService",
                    "ListRecords" | "GetRecord" | "WatchRecords",
                    Role::Reader | Role::Admin
                )
                | (
                    "hcp.sense.v1.IngestService",
                    "ExplainTrigger",
                    Role::Runtime | Role::Admin
                )
                | (
                    "hcp.sense.v1.PackService",
                    "ListTriggerTypes",
                    Role::Runtime | Role::Reader
                )
                | (
                    "hcp.sense.v1.RecordService",
                    "ListDropReports" | "EraseRecords",
                    Role::Admin
                )
                | (
                    "hcp.sense.v1.DecisionService",
                    "ListDecisions" | "GetDecision",
                    Role::Reader | Role::Admin
                )
                | (
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

/// The configured tokens by their SHA-256: each with a unique valid name, a reader's with a
/// principal, no two with one hash (which caller would it be?).
fn tokens(configured: &[TokenConfig]) -> anyhow::Result<HashMap<[u8; 32], Identity>> {
    let mut tokens: HashMap<[u8; 32], Identity> = HashMap::new();
    let mut names = std::collections::HashSet::new();
    for t in configured {
        check_id("name", &t.name).map_err(|e| anyhow::anyhow!("auth token `{}`: {e}", t.name))?;
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
    Ok(tokens)
}

impl Jwt {
    fn from_config(j: &JwtConfig) -> anyhow::Result<Jwt> {
        let mut keys = Vec::new();
        if let Some(path) = &j.hs256_secret_file {
            keys.push(hs256_key(path)?);
        }
        if let Some(path) = &j.jwks_file {
            keys.extend(jwks_keys(path)?);
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
        Ok(Jwt {
            keys,
            validation_by_alg,
            role_claim: j.role_claim.clone().unwrap_or_else(|| "role".into()),
            principal_claim: j.principal_claim.clone().unwrap_or_else(|| "sub".into()),
        })
    }
}

type JwtKey = (Option<String>, DecodingKey, Algorithm);

/// The HS256 key of a secret file: the file's bytes, exactly (a secret is not text to be
/// cleaned up), at least MIN_HS256_SECRET of them.
fn hs256_key(path: &std::path::Path) -> anyhow::Result<JwtKey> {
    let secret =
        std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    if secret.len() < MIN_HS256_SECRET {
        anyhow::bail!(
            "{}: an HS256 secret must be at least {MIN_HS256_SECRET} bytes, not {}",
            path.display(),
            secret.len()
        );
    }
    Ok((None, DecodingKey::from_secret(&secret)?, Algorithm::HS256))
}

/// The keys of a JWKS file: RSA (RS256) and EC (ES256) keys, by their key ids.
fn jwks_keys(path: &std::path::Path) -> anyhow::Result<Vec<JwtKey>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let set: JwkSet = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: not a JWKS: {e}", path.display()))?;
    set.keys
        .iter()
        .map(|k| {
            let alg = match &k.algorithm {
                jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
                _ => anyhow::bail!(
                    "{}: only RSA (RS256) and EC (ES256) keys are supported",
                    path.display()
                ),
            };
            Ok((k.common.key_id.clone(), DecodingKey::from_jwk(k)?, alg))
        })
        .collect()
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
        // An operator reads a principal's inbox to answer "why didn't alice get it?".
        assert!(allowed(
            "/hcp.sense.v1.RecordService/WatchRecords",
            Role::Admin
        ));
        assert!(!allowed(
            "/hcp.sense.v1.RecordService/WatchRecords",
            Role::Runtime
        ));
    }

    fn hs256(secret: &[u8], alg: Algorithm, exp: i64) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(alg),
            &serde_json::json!({ "sub": "ops", "role": "admin", "exp": exp }),
            &jsonwebtoken::EncodingKey::from_secret(secret).expect("key"),
        )
        .expect("jwt")
    }

    #[test]
    fn cheap_refusals_need_no_signature_and_verified_jwts_are_remembered_until_they_expire() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret");
        std::fs::write(&path, secret).expect("secret");
        let a = Authenticator::from_config(&AuthConfig {
            tokens: vec![],
            jwt: Some(JwtConfig {
                hs256_secret_file: Some(path),
                ..Default::default()
            }),
        })
        .expect("config");
        let now = unix_now();
        let bearer = |t: &str| format!("Bearer {t}");
        let leeway = JWT_LEEWAY_SECS as i64;
        for (why, t) in [
            ("malformed", "a.b.c".to_owned()),
            (
                "no key for HS384",
                hs256(secret, Algorithm::HS384, now + 600),
            ),
            ("expired", hs256(secret, Algorithm::HS256, now - leeway - 1)),
            (
                "expired to the second",
                hs256(secret, Algorithm::HS256, now - leeway),
            ),
        ] {
            assert!(
                matches!(
                    a.precheck(Some(&bearer(&t))),
                    Precheck::Decided(Caller::Refused(_))
                ),
                "{why}"
            );
        }
        let good = bearer(&hs256(secret, Algorithm::HS256, now + 600));
        let Precheck::Signature(unverified) = a.precheck(Some(&good)) else {
            panic!("a plausible JWT needs its signature checked");
        };
        let Caller::Known(id) = a.verify(unverified) else {
            panic!("it verifies");
        };
        assert_eq!(id.expires, Some(now + 600 + leeway));
        assert!(
            matches!(a.precheck(Some(&good)), Precheck::Decided(Caller::Known(ref k)) if *k == id),
            "the second call is a lookup"
        );
        let forged = bearer(&hs256(
            b"another-secret-another-secret-32",
            Algorithm::HS256,
            now + 600,
        ));
        let Precheck::Signature(unverified) = a.precheck(Some(&forged)) else {
            panic!("a forged JWT looks plausible");
        };
        assert!(matches!(a.verify(unverified), Caller::Refused(_)));
        assert!(
            matches!(a.precheck(Some(&forged)), Precheck::Signature(_)),
            "a refused JWT is not remembered"
        );
    }

    #[test]
    fn remembered_jwts_are_bounded_and_forgotten_at_expiry() {
        let v = Verified::default();
        let id = |expires: i64| Identity {
            kind: CredentialKind::Jwt,
            subject: "s".into(),
            role: Role::Admin,
            principal: None,
            expires: Some(expires),
        };
        let key = |i: usize| -> [u8; 32] { Sha256::digest(i.to_le_bytes()).into() };
        let len = |v: &Verified| v.0.read().map(|m| m.len()).unwrap_or(0);
        for i in 0..MAX_VERIFIED_JWTS {
            v.put(key(i), &id(200), 100);
        }
        assert_eq!(len(&v), MAX_VERIFIED_JWTS);
        assert!(v.get(&key(0), 199).is_some());
        assert!(v.get(&key(0), 200).is_none(), "forgotten at its expiry");
        // Full of live tokens: a tenth make room for the next.
        v.put(key(MAX_VERIFIED_JWTS), &id(200), 100);
        assert_eq!(len(&v), MAX_VERIFIED_JWTS - MAX_VERIFIED_JWTS / 10 + 1);
        assert!(
            v.get(&key(MAX_VERIFIED_JWTS), 100).is_some(),
            "the newest is kept"
        );
        // Full of expired tokens: they all make room.
        let v = Verified::default();
        for i in 0..MAX_VERIFIED_JWTS {
            v.put(key(i), &id(200), 100);
        }
        v.put(key(usize::MAX), &id(400), 300);
        assert_eq!(len(&v), 1);
    }
}
