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

/// Encodes a keyset position under a kind tag, so a token from one list is refused by another.
pub fn encode_token(kind: &str, key: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{kind}\n{key}"))
}

/// Decodes a token made by `encode_token` for the same kind; empty means the first page.
pub fn decode_token(kind: &str, token: &str) -> Result<Option<String>> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || Error::invalid("page_token", "is not a page token this list returned");
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    match text.split_once('\n') {
        Some((k, key)) if k == kind => Ok(Some(key.to_owned())),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_refuse_others() {
        let t = encode_token("packs", "github");
        assert_eq!(
            decode_token("packs", &t).ok().flatten().as_deref(),
            Some("github")
        );
        assert!(decode_token("records", &t).is_err());
        assert!(decode_token("packs", "%%%").is_err());
        assert!(decode_token("packs", "").ok().flatten().is_none());
        assert!(page_size(-1).is_err());
        assert_eq!(page_size(0).ok(), Some(DEFAULT_PAGE_SIZE));
        assert_eq!(page_size(5000).ok(), Some(MAX_PAGE_SIZE));
    }
}
