//! The signature schemes of HTTP routes: Standard Webhooks, GitHub and CloudEvents over HMAC, checked against each of a route's secrets.
use std::collections::BTreeMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::domain::ingress::{standard_webhooks_key, IngressKind, TIMESTAMP_TOLERANCE_SECS};

type HmacSha256 = Hmac<Sha256>;

/// The header GitHub names a delivery's event in.
pub const GITHUB_EVENT: &str = "x-github-event";

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
    /// A digest of each of the route's signing keys the request verifies with, sorted: the
    /// route path is not signed, so the request verifies at every route holding one of them,
    /// and the ledger keys the delivery by them, not by the route.
    pub scopes: Vec<String>,
    /// A digest of the content the delivery id names: the body, and for GitHub the
    /// X-GitHub-Event header beside it. The same id with other content is another delivery
    /// reusing the id, refused.
    pub content_digest: String,
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

/// The ledger scope of a signing key: a digest of the key's bytes (never the key itself),
/// the same for every route that holds the key, whatever its kind.
fn scope_of(key: &[u8]) -> String {
    use sha2::Digest as _;
    let mut h = Sha256::new();
    h.update(b"hcp-sense ingress signing key\0");
    h.update(key);
    hex::encode(h.finalize())
}

/// A digest of `parts`, each length-prefixed so no two lists share one.
fn content_digest(parts: &[&[u8]]) -> String {
    use sha2::Digest as _;
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())
}

/// The sorted, distinct scopes of the keys that verified a request; refused when none did.
fn verified_by(mut scopes: Vec<String>, none: &str) -> Result<Vec<String>, Unsigned> {
    if scopes.is_empty() {
        return Err(Unsigned(none.into()));
    }
    scopes.sort();
    scopes.dedup();
    Ok(scopes)
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
            // Every secret is tried, not only until one verifies: each that does is a scope
            // of the delivery in the ledger.
            let mut scopes = Vec::new();
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
                    scopes.push(scope_of(&key));
                }
            }
            Ok(Verified {
                delivery_id: id.to_owned(),
                signed_at: Some(at),
                scopes: verified_by(
                    scopes,
                    "no webhook-signature matches a secret of this route",
                )?,
                content_digest: content_digest(&[body]),
            })
        }
        IngressKind::Github => {
            let sig = header("x-hub-signature-256")
                .ok_or_else(|| Unsigned("no X-Hub-Signature-256 header".into()))?;
            let given = sig
                .strip_prefix("sha256=")
                .and_then(|h| hex::decode(h).ok())
                .ok_or_else(|| Unsigned("X-Hub-Signature-256 is not sha256=<hex>".into()))?;
            let mut scopes = Vec::new();
            for secret in secrets {
                let Ok(mut mac) = HmacSha256::new_from_slice(secret.as_bytes()) else {
                    continue;
                };
                mac.update(body);
                if mac.verify_slice(&given).is_ok() {
                    scopes.push(scope_of(secret.as_bytes()));
                }
            }
            // GitHub names its event in X-GitHub-Event alone, outside the signature: the
            // ledger pins it beside the body, so a replay that changes it is refused, not
            // decided as another event.
            let event = header(GITHUB_EVENT).unwrap_or_default();
            Ok(Verified {
                delivery_id: github_delivery_id(body),
                signed_at: None,
                scopes: verified_by(
                    scopes,
                    "X-Hub-Signature-256 matches no secret of this route",
                )?,
                content_digest: content_digest(&[event.as_bytes(), body]),
            })
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
            Ok(id.clone())
        );
        // The event header is pinned beside the body: the same delivery, other content.
        headers.insert(GITHUB_EVENT.into(), "push".into());
        let push = verify(IngressKind::Github, &secrets, &headers, b"{}", 0).expect("signed");
        assert_eq!(push.key(), id.key());
        assert_ne!(push.content_digest, id.content_digest);
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
        let v = verify(IngressKind::StandardWebhooks, &both, &headers, b"{}", 1000)
            .expect("signed by the second secret");
        assert_eq!((v.delivery_id.as_str(), v.signed_at), ("msg_1", Some(1000)));
        // The ledger scope is the key's, not the route's: a route holding the same secret
        // alone shares the delivery's row.
        assert_eq!(v.scopes, vec![scope_of(&[7u8; 32])]);
        let alone = verify(
            IngressKind::StandardWebhooks,
            std::slice::from_ref(&secret),
            &headers,
            b"{}",
            1000,
        )
        .expect("signed");
        assert_eq!(alone.scopes, v.scopes);
        assert_eq!(alone.content_digest, v.content_digest);
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
