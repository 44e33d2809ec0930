//! Who is calling: static bearer tokens (stored as SHA-256 hashes) and JWTs, turned into an identity with a role; and which role may call which RPC.
use std::collections::HashMap;
use std::path::PathBuf;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
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

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Who, for logs, rate limits and the audit: a token's name or a JWT's subject.
    pub subject: String,
    pub role: Role,
    /// The principal a reader reads as.
    pub principal: Option<String>,
}

/// What the authentication layer found on a call, kept in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Authentication is not configured: every RPC is open (loopback only unless told otherwise).
    Open,
    Known(Identity),
    /// No credentials, or credentials that were refused; the reason is for the status message.
    Refused(String),
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
    /// The role of callers known by a client certificate (mutual TLS).
    mtls_role: Option<Role>,
    tokens: HashMap<[u8; 32], Identity>,
    jwt: Option<Jwt>,
}

impl Authenticator {
    pub fn from_config(cfg: &AuthConfig) -> anyhow::Result<Authenticator> {
        let mut tokens = HashMap::new();
        for t in &cfg.tokens {
            let raw = hex::decode(t.sha256.trim())
                .map_err(|_| anyhow::anyhow!("auth token `{}`: sha256 must be hex", t.name))?;
            let hash: [u8; 32] = raw
                .try_into()
                .map_err(|_| anyhow::anyhow!("auth token `{}`: sha256 must be 32 bytes", t.name))?;
            if t.role == Role::Reader && t.principal.is_none() {
                anyhow::bail!("auth token `{}`: a reader needs a principal", t.name);
            }
            tokens.insert(
                hash,
                Identity {
                    subject: t.name.clone(),
                    role: t.role,
                    principal: t.principal.clone(),
                },
            );
        }
        let jwt = match &cfg.jwt {
            None => None,
            Some(j) => {
                let mut keys = Vec::new();
                if let Some(path) = &j.hs256_secret_file {
                    let secret = std::fs::read(path)
                        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
                    let secret = String::from_utf8_lossy(&secret).trim().as_bytes().to_vec();
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
                    v.leeway = 5;
                    v.set_required_spec_claims(&["exp"]);
                    if let Some(iss) = &j.issuer {
                        v.set_issuer(&[iss]);
                    }
                    match &j.audience {
                        Some(aud) => v.set_audience(&[aud]),
                        None => v.validate_aud = false,
                    }
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
            mtls_role: None,
            tokens,
            jwt,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Also accept callers by a verified client certificate, with this role.
    pub fn with_client_certificates(mut self, role: Role) -> Authenticator {
        self.mtls_role = Some(role);
        self.enabled = true;
        self
    }

    /// The identity of a caller who sent no bearer credentials but a verified client
    /// certificate (DER): its subject's common name is the subject and principal.
    pub fn check_certificate(&self, der: &[u8]) -> Option<Identity> {
        let role = self.mtls_role?;
        let cn = common_name(der)?;
        Some(Identity {
            subject: cn.clone(),
            role,
            principal: Some(cn),
        })
    }

    /// What the `authorization` header value says about the caller.
    pub fn check(&self, authorization: Option<&str>) -> Caller {
        if !self.enabled {
            return Caller::Open;
        }
        let Some(value) = authorization else {
            return Caller::Refused("no credentials: send `authorization: Bearer <token>`".into());
        };
        let Some(token) = value.strip_prefix("Bearer ").map(str::trim) else {
            return Caller::Refused("the authorization header must be `Bearer <token>`".into());
        };
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(id) = self.tokens.get(&hash) {
            return Caller::Known(id.clone());
        }
        match &self.jwt {
            Some(jwt) if token.matches('.').count() == 2 => match jwt.verify(token) {
                Ok(id) => Caller::Known(id),
                Err(why) => Caller::Refused(why),
            },
            _ => Caller::Refused("unknown token".into()),
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
                    let principal = claims
                        .get(&self.principal_claim)
                        .and_then(serde_json::Value::as_str)
                        .map(str::to_owned);
                    if role == Role::Reader && principal.is_none() {
                        return Err(format!(
                            "a reader's JWT needs a `{}` claim",
                            self.principal_claim
                        ));
                    }
                    let subject = claims
                        .get("sub")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("jwt")
                        .to_owned();
                    return Ok(Identity {
                        subject,
                        role,
                        principal,
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

/// The last common name (OID 2.5.4.3) in a DER certificate: the subject's, which
/// follows the issuer's in the certificate body.
fn common_name(der: &[u8]) -> Option<String> {
    const CN: [u8; 5] = [0x06, 0x03, 0x55, 0x04, 0x03];
    let at = der.windows(CN.len()).rposition(|w| w == CN)?;
    let rest = der.get(at + CN.len()..)?;
    let (&tag, &len) = (rest.first()?, rest.get(1)?);
    // UTF8String, PrintableString or IA5String, short form length.
    if !matches!(tag, 0x0c | 0x13 | 0x16) || len >= 0x80 {
        return None;
    }
    let value = rest.get(2..2 + usize::from(len))?;
    String::from_utf8(value.to_vec())
        .ok()
        .filter(|s| !s.is_empty())
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
                "DeliverTrigger",
                Role::Runtime
            ) | (
                "hcp.sense.v1.PolicyService",
                "ReportBindingHealth",
                Role::Runtime | Role::Admin
            ) | ("hcp.sense.v1.RecordService", "ListRecords", Role::Reader)
                | ("hcp.sense.v1.RecordService", "ListDropReports", Role::Admin)
                | (
                    "hcp.sense.v1.PackService"
                        | "hcp.sense.v1.PolicyService"
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
        assert!(allowed("/grpc.health.v1.Health/Check", Role::Reader));
        assert!(!allowed("/unknown.Service/X", Role::Admin));
    }
}
