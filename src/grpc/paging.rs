//! AIP-158 pagination: page sizes and opaque page tokens.
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

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

/// Encodes a keyset position under a kind tag and a filter fingerprint.
pub fn encode_token(kind: &str, fp: &str, key: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{kind}\n{fp}\n{key}"))
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
    let mut parts = text.splitn(3, '\n');
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
        assert!(decode_token("packs", &fp, "").ok().flatten().is_none());
        assert!(page_size(-1).is_err());
        assert_eq!(page_size(0).ok(), Some(DEFAULT_PAGE_SIZE));
        assert_eq!(page_size(5000).ok(), Some(MAX_PAGE_SIZE));
    }
}
