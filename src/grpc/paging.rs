//! AIP-158 pagination: page sizes and opaque page tokens.
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

pub const DEFAULT_PAGE_SIZE: u64 = 50;
/// Separates the parts of a composite key inside a token; no id may contain it.
pub const SEP: char = '\u{1f}';
pub const MAX_PAGE_SIZE: u64 = 1000;

/// Reads `page_size`: 0 means the default, larger than the maximum means the maximum.
pub fn page_size(requested: i32) -> Result<u64> {
    match u64::try_from(requested) {
        Err(_) => Err(Error::invalid("page_size", "must not be negative")),
        Ok(0) => Ok(DEFAULT_PAGE_SIZE),
        Ok(n) => Ok(n.min(MAX_PAGE_SIZE)),
    }
}

/// A stable fingerprint (FNV-1a, 64 bits) of a listing's filters, so a token
/// only continues the listing it came from, across restarts and releases.
pub fn fingerprint(parts: &[&str]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0x1f]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

static SECRET: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();

/// Sets the key that signs page tokens; replicas that share tokens share it.
/// Without it, each process draws its own at first use.
pub fn set_token_secret(secret: &str) {
    let _ = SECRET.set(Sha256::digest(secret.as_bytes()).into());
}

fn secret() -> &'static [u8; 32] {
    SECRET.get_or_init(|| {
        let seed = format!(
            "{}{}{}{:?}",
            uuid::Uuid::now_v7(),
            uuid::Uuid::now_v7(),
            std::process::id(),
            std::time::SystemTime::now()
        );
        Sha256::digest(seed.as_bytes()).into()
    })
}

/// HMAC-SHA256 of a token body, truncated to 16 bytes.
fn tag(body: &str) -> String {
    let key = secret();
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for (i, k) in key.iter().enumerate() {
        ipad[i] ^= k;
        opad[i] ^= k;
    }
    let inner = Sha256::new()
        .chain_update(ipad)
        .chain_update(body.as_bytes())
        .finalize();
    let outer = Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize();
    outer.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Encodes a keyset position under a kind tag and a filter fingerprint, signed
/// so that a changed token is refused rather than read.
pub fn encode_token(kind: &str, fp: &str, key: &str) -> String {
    let body = format!("{kind}\n{fp}\n{key}");
    let mac = tag(&body);
    URL_SAFE_NO_PAD.encode(format!("{mac}\n{body}"))
}

/// Decodes a token made by `encode_token` for the same kind and filters;
/// empty means the first page.
pub fn decode_token(kind: &str, fp: &str, token: &str) -> Result<Option<String>> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || Error::invalid("page_token", "is not a page token this list returned");
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let (mac, body) = text.split_once('\n').ok_or_else(bad)?;
    if mac != tag(body) {
        return Err(Error::invalid(
            "page_token",
            "has been altered or was not issued by this service",
        ));
    }
    let mut parts = body.splitn(3, '\n');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(k), Some(f), Some(key)) if k == kind && f == fp => Ok(Some(key.to_owned())),
        (Some(k), Some(_), Some(_)) if k == kind => Err(Error::invalid(
            "page_token",
            "was issued for a listing with other filters or order",
        )),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_refuse_others() {
        let fp = fingerprint(&["a", "b"]);
        assert_eq!(fp, fingerprint(&["a", "b"]));
        assert_ne!(fp, fingerprint(&["ab", ""]));
        let t = encode_token("packs", &fp, "github");
        assert_eq!(
            decode_token("packs", &fp, &t).ok().flatten().as_deref(),
            Some("github")
        );
        assert!(decode_token("records", &fp, &t).is_err());
        assert!(decode_token("packs", "other", &t).is_err());
        assert!(decode_token("packs", &fp, "%%%").is_err());
        // Any change to a token's content is refused.
        let raw = String::from_utf8(URL_SAFE_NO_PAD.decode(&t).expect("b64")).expect("utf8");
        let forged = URL_SAFE_NO_PAD.encode(raw.replace("github", "gitlab"));
        assert!(decode_token("packs", &fp, &forged).is_err());
        assert!(decode_token("packs", &fp, "").ok().flatten().is_none());
        assert!(page_size(-1).is_err());
        assert_eq!(page_size(0).ok(), Some(DEFAULT_PAGE_SIZE));
        assert_eq!(page_size(5000).ok(), Some(MAX_PAGE_SIZE));
    }
}
