//! AIP-158 pagination: page sizes, opaque page tokens, and the records' position tokens that ListRecords and WatchRecords share.
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::domain::model::Position;
use crate::error::{Error, Result};

pub const DEFAULT_PAGE_SIZE: u64 = 50;
/// Separates the parts of a composite key inside a token; no id may contain it.
pub const SEP: char = '\u{1f}';
pub const MAX_PAGE_SIZE: u64 = 1000;
/// Most bytes of a page's items, encoded: a page ends before the item that would pass it (the
/// rest come on the next page), so a response stays well under a stock client's 4 MiB receive
/// limit. An item larger than this alone comes alone on its page.
pub const MAX_PAGE_BYTES: usize = 1024 * 1024;

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

/// The key that signs page tokens, owned by the server that issues them. Replicas that
/// share tokens are given the same secret; without one, each server draws its own.
#[derive(Clone)]
pub struct PageTokens {
    mac: HmacSha256,
}

impl std::fmt::Debug for PageTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PageTokens(..)")
    }
}

type HmacSha256 = Hmac<Sha256>;

/// Bytes of HMAC-SHA256 kept in a token.
const TAG_BYTES: usize = 16;

impl PageTokens {
    pub fn new(secret: Option<&str>) -> PageTokens {
        let key: [u8; 32] = match secret {
            Some(s) => Sha256::digest(s.as_bytes()).into(),
            None => {
                let seed = format!(
                    "{}{}{}{:?}",
                    uuid::Uuid::now_v7(),
                    uuid::Uuid::now_v7(),
                    std::process::id(),
                    std::time::SystemTime::now()
                );
                Sha256::digest(seed.as_bytes()).into()
            }
        };
        // HMAC takes a key of any length; a 32-byte key is padded to its block.
        let mac = HmacSha256::new_from_slice(&key)
            .unwrap_or_else(|_| HmacSha256::new(&Default::default()));
        PageTokens { mac }
    }

    fn mac(&self, body: &str) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(body.as_bytes());
        mac
    }

    /// Encodes a keyset position under a kind tag and a filter fingerprint, signed
    /// so that a changed token is refused rather than read.
    pub fn encode(&self, kind: &str, fp: &str, key: &str) -> String {
        let body = format!("{kind}\n{fp}\n{key}");
        let tag = self.mac(&body).finalize().into_bytes();
        let tag = hex::encode(&tag[..TAG_BYTES]);
        URL_SAFE_NO_PAD.encode(format!("{tag}\n{body}"))
    }

    /// Decodes a token made by `encode` for the same kind and filters; empty means the
    /// first page. The tag is checked in constant time.
    pub fn decode(&self, kind: &str, fp: &str, token: &str) -> Result<Option<String>> {
        if token.is_empty() {
            return Ok(None);
        }
        let bad = || Error::invalid("page_token", "is not a page token this list returned");
        let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
        let text = String::from_utf8(bytes).map_err(|_| bad())?;
        let (tag, body) = text.split_once('\n').ok_or_else(bad)?;
        let tag = hex::decode(tag).map_err(|_| bad())?;
        if tag.len() != TAG_BYTES || self.mac(body).verify_truncated_left(&tag).is_err() {
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
}

/// One request's page of a listing: its size, the key of the row it starts after (from the
/// previous page's token, which continues only the same kind of listing with the same
/// filters), and the next page's token.
pub struct Page<'t> {
    tokens: &'t PageTokens,
    kind: &'static str,
    fp: String,
    pub size: u64,
    key: Option<String>,
}

impl PageTokens {
    /// The page a request asks for: `page_size` read, `page_token` checked against the
    /// listing's kind and the fingerprint of its filters.
    pub fn page(
        &self,
        kind: &'static str,
        fp: String,
        page_size: i32,
        page_token: &str,
    ) -> Result<Page<'_>> {
        let size = self::page_size(page_size)?;
        let key = self.decode(kind, &fp, page_token)?;
        Ok(Page {
            tokens: self,
            kind,
            fp,
            size,
            key,
        })
    }
}

impl Page<'_> {
    /// Rows to fetch: one past the page, to know whether another follows.
    pub fn limit(&self) -> u64 {
        self.size + 1
    }

    /// The key the page starts after, in its `N` parts (none on the first page).
    pub fn after<const N: usize>(&self) -> Result<Option<[&str; N]>> {
        let Some(k) = &self.key else {
            return Ok(None);
        };
        let parts: Vec<&str> = k.splitn(N, SEP).collect();
        <[&str; N]>::try_from(parts)
            .map(Some)
            .map_err(|_| Error::invalid("page_token", "is malformed"))
    }

    /// `rows` cut to the page (its size, and MAX_PAGE_BYTES of messages) and made messages by
    /// `message`, with the next page's token (empty on the last), made of the last row's key
    /// parts.
    pub fn next<T, M: prost::Message, const N: usize>(
        &self,
        rows: &mut Vec<T>,
        key: impl Fn(&T) -> [String; N],
        message: impl FnMut(&T) -> M,
    ) -> (Vec<M>, String) {
        next_token(
            rows,
            self.size,
            |last| {
                let key = key(last).join(&SEP.to_string());
                self.tokens.encode(self.kind, &self.fp, &key)
            },
            message,
        )
    }
}

/// Positions, not receive times: a token of a release that paged by time is refused as not
/// issued here, and this release's tokens are refused by such a release. ListRecords' page
/// tokens and WatchRecords' resume tokens are one kind: either continues the other.
const RECORDS: &str = "records@position";

impl PageTokens {
    /// A ListRecords page token or WatchRecords resume token: the position a listing of
    /// filters `fp` continues after.
    pub fn position_token(&self, fp: &str, p: Position) -> String {
        self.encode(RECORDS, fp, &format!("{}{SEP}{}", p.txid, p.seq))
    }

    /// The position a page or resume token holds (`None`: empty, the start), reported as
    /// `field` when it is not one.
    pub fn token_position(&self, fp: &str, token: &str, field: &str) -> Result<Option<Position>> {
        let rename = |e: Error| match e {
            Error::InvalidArgument(mut v) => {
                for x in &mut v {
                    x.field = field.to_owned();
                }
                Error::InvalidArgument(v)
            }
            e => e,
        };
        let Some(k) = self.decode(RECORDS, fp, token).map_err(rename)? else {
            return Ok(None);
        };
        let bad = || Error::invalid(field, "is malformed");
        let (txid, seq) = k.split_once(SEP).ok_or_else(bad)?;
        Ok(Some(Position {
            txid: txid.parse().map_err(|_| bad())?,
            seq: seq.parse().map_err(|_| bad())?,
        }))
    }
}

/// Trims a page fetched with one extra item to `size` items and to MAX_PAGE_BYTES of their
/// messages (at least one item), and returns the messages and the token for the next page.
pub fn next_token<T, M: prost::Message>(
    items: &mut Vec<T>,
    size: u64,
    token: impl Fn(&T) -> String,
    message: impl FnMut(&T) -> M,
) -> (Vec<M>, String) {
    next_token_within(items, size, MAX_PAGE_BYTES, token, message)
}

/// What a message costs a page as an item of a repeated field: itself, its length, and a tag
/// (two bytes at most for the fields used).
fn page_cost(m: &impl prost::Message) -> usize {
    let len = m.encoded_len();
    len + prost::encoding::length_delimiter_len(len) + 2
}

fn next_token_within<T, M: prost::Message>(
    items: &mut Vec<T>,
    size: u64,
    max_bytes: usize,
    token: impl Fn(&T) -> String,
    mut message: impl FnMut(&T) -> M,
) -> (Vec<M>, String) {
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    let mut page = Vec::with_capacity(items.len().min(size));
    let mut bytes = 0usize;
    for item in items.iter().take(size) {
        let m = message(item);
        let len = page_cost(&m);
        if !page.is_empty() && bytes + len > max_bytes {
            break;
        }
        bytes += len;
        page.push(m);
    }
    let more = items.len() > page.len();
    items.truncate(page.len());
    let next = match (more, items.last()) {
        (true, Some(last)) => token(last),
        _ => String::new(),
    };
    (page, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages through `items` of the given sizes (bytes of a string each) `size` at a time within
    /// `max_bytes`: the pages' lengths, every item exactly once, in order.
    fn pages_of(sizes: &[usize], size: u64, max_bytes: usize) -> Vec<usize> {
        let all: Vec<(usize, String)> = sizes
            .iter()
            .enumerate()
            .map(|(i, n)| (i, "x".repeat(*n)))
            .collect();
        let mut seen = Vec::new();
        let mut lens = Vec::new();
        let mut after: Option<usize> = None;
        loop {
            let mut rows: Vec<(usize, String)> = all
                .iter()
                .filter(|(i, _)| after.is_none_or(|a| *i > a))
                .take(usize::try_from(size).expect("size") + 1)
                .cloned()
                .collect();
            let (page, token) = next_token_within(
                &mut rows,
                size,
                max_bytes,
                |last| last.0.to_string(),
                |r| r.1.clone(),
            );
            let bytes: usize = page.iter().map(page_cost).sum();
            assert!(page.len() == 1 || bytes <= max_bytes, "{bytes}");
            assert_eq!(page.len(), rows.len());
            lens.push(page.len());
            seen.extend(rows.iter().map(|r| r.0));
            if token.is_empty() {
                break;
            }
            after = Some(token.parse().expect("token"));
        }
        assert_eq!(seen, (0..sizes.len()).collect::<Vec<_>>());
        lens
    }

    #[test]
    fn a_page_ends_before_the_item_that_would_pass_its_bytes_and_nothing_is_lost() {
        let b = page_cost(&"x".repeat(96));
        // Exactly ten fit; the eleventh starts the next page.
        assert_eq!(pages_of(&[96; 25], 100, 10 * b), vec![10, 10, 5]);
        assert_eq!(pages_of(&[96; 25], 100, 10 * b - 1), vec![9, 9, 7]);
        // The count still ends pages first when it is smaller.
        assert_eq!(pages_of(&[96; 25], 4, 10 * b), vec![4, 4, 4, 4, 4, 4, 1]);
        // An item past the bound comes alone on its page; the next page goes on after it.
        assert_eq!(pages_of(&[10, 5000, 10, 10], 100, 1000), vec![1, 1, 2]);
        assert_eq!(pages_of(&[5000], 100, 1000), vec![1]);
        assert_eq!(pages_of(&[], 100, 1000), vec![0]);
    }

    #[test]
    fn tokens_round_trip_and_refuse_others() {
        let tokens = PageTokens::new(Some("k"));
        let encode_token = |k: &str, f: &str, key: &str| tokens.encode(k, f, key);
        let decode_token = |k: &str, f: &str, t: &str| tokens.decode(k, f, t);
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
        // Another key's token is refused; the same secret reads it (replicas).
        assert!(PageTokens::new(Some("other"))
            .decode("packs", &fp, &t)
            .is_err());
        assert!(PageTokens::new(None).decode("packs", &fp, &t).is_err());
        assert!(PageTokens::new(Some("k")).decode("packs", &fp, &t).is_ok());
        assert!(page_size(-1).is_err());
        assert_eq!(page_size(0).ok(), Some(DEFAULT_PAGE_SIZE));
        assert_eq!(page_size(5000).ok(), Some(MAX_PAGE_SIZE));
    }
}
