//! The error table (`crate::reply`) rendered for gRPC: a status bounded to fit a stock client's trailers, and a DeliverTriggers item's error.
//!
//! A status travels in HTTP/2 trailers, and stock clients cap them: grpcio at 8 KiB (soft) and
//! 16 KiB (hard), counting each entry's name and value plus 32 bytes. A status over the cap
//! reaches the caller as RESOURCE_EXHAUSTED "Stream removed", which reads as a quota and invites
//! retries. The message is sent twice — percent-encoded in `grpc-message` (up to three bytes a
//! byte: every non-ASCII byte is escaped) and in `grpc-status-details-bin` (base64, four bytes
//! for three) — and the details once; so every message, violation and field path is cut to a
//! number of bytes as well as characters, and the whole stays within TRAILER_BUDGET whatever
//! the script of its text.
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::convert::duration;
use super::pb;
pub use crate::domain::pack::schema::{MAX_DESCRIPTION_CHARS, MAX_VIOLATIONS};
use crate::error::{Error, Violation};
use crate::reply::{Reply, DOMAIN};

/// What a status may take of a client's trailers, names and HPACK's 32 bytes an entry counted:
/// well under grpcio's 8 KiB soft limit.
pub const TRAILER_BUDGET: usize = 7 * 1024;
/// Most bytes (UTF-8) of a status's message.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Most bytes of an INVALID_ARGUMENT's message: it names the violations its details list.
pub const MAX_INVALID_MESSAGE_BYTES: usize = 384;
/// Most bytes of a violation's description (and at most MAX_DESCRIPTION_CHARS characters):
/// 200 ASCII characters, 180 Cyrillic, 120 CJK, 90 emoji.
pub const MAX_DESCRIPTION_BYTES: usize = 360;
/// Most bytes of a violation's field path.
pub const MAX_FIELD_BYTES: usize = 96;
/// Most characters of a violation's field path.
const MAX_FIELD_CHARS: usize = 96;

const ELLIPSIS: char = '…';

/// `text` cut to at most `chars` characters and `bytes` bytes; a cut text ends in an ellipsis
/// (counted in both).
pub fn cut(text: &str, chars: usize, bytes: usize) -> String {
    let mut end = 0;
    for (n, (at, c)) in text.char_indices().enumerate() {
        if n >= chars || at + c.len_utf8() > bytes {
            // Cut: leave room for the ellipsis.
            let room = bytes.saturating_sub(ELLIPSIS.len_utf8());
            let mut keep = 0;
            for (m, (at, c)) in text.char_indices().enumerate() {
                if m + 1 >= chars || at + c.len_utf8() > room {
                    break;
                }
                keep = at + c.len_utf8();
            }
            let mut out = String::with_capacity(keep + ELLIPSIS.len_utf8());
            out.push_str(&text[..keep]);
            if chars > 0 && bytes >= ELLIPSIS.len_utf8() {
                out.push(ELLIPSIS);
            }
            return out;
        }
        end = at + c.len_utf8();
    }
    text[..end].to_owned()
}

/// A message cut to MAX_MESSAGE_BYTES.
fn message(m: String) -> String {
    if m.len() <= MAX_MESSAGE_BYTES {
        return m;
    }
    cut(&m, usize::MAX, MAX_MESSAGE_BYTES)
}

/// The violations a status lists: at most MAX_VIOLATIONS, each field and description cut.
fn bounded(violations: &[Violation]) -> Vec<Violation> {
    violations
        .iter()
        .take(MAX_VIOLATIONS)
        .map(|v| Violation {
            field: cut(&v.field, MAX_FIELD_CHARS, MAX_FIELD_BYTES),
            description: cut(&v.description, MAX_DESCRIPTION_CHARS, MAX_DESCRIPTION_BYTES),
        })
        .collect()
}

/// The message of an INVALID_ARGUMENT: `field: description` of as many listed violations as
/// fit MAX_INVALID_MESSAGE_BYTES, then how many more there were and where they are.
fn invalid_message(listed: &[Violation], total: usize) -> String {
    let one = |v: &Violation| {
        if v.field.is_empty() {
            v.description.clone()
        } else {
            format!("{}: {}", v.field, v.description)
        }
    };
    // Room kept for the tail naming the rest.
    const TAIL: usize = 96;
    let mut out = String::new();
    let mut named = 0;
    for v in listed {
        let part = one(v);
        let sep = if out.is_empty() { "" } else { "; " };
        let room = MAX_INVALID_MESSAGE_BYTES - TAIL;
        if out.len() + sep.len() + part.len() > room {
            if out.is_empty() {
                out = cut(&part, usize::MAX, room);
                named = 1;
            }
            break;
        }
        out.push_str(sep);
        out.push_str(&part);
        named += 1;
    }
    if named < total {
        let more = total - named;
        let s = if more == 1 { "" } else { "s" };
        out.push_str(&format!("; and {more} more violation{s}"));
        if total > listed.len() {
            out.push_str(&format!(
                " (the first {} are in the status details)",
                listed.len()
            ));
        } else {
            out.push_str(" (in the status details)");
        }
    }
    out
}

fn invalid_argument(violations: Vec<Violation>) -> Status {
    let total = violations.len();
    let mut listed = bounded(&violations);
    loop {
        let mut details = ErrorDetails::new();
        for v in &listed {
            details.add_bad_request_violation(v.field.clone(), v.description.clone());
        }
        let status = Status::with_error_details(
            Code::InvalidArgument,
            invalid_message(&listed, total),
            details,
        );
        // The bounds above keep the worst case within the budget (tests below); this keeps
        // it there should they ever be loosened.
        if listed.len() <= 1 || trailer_bytes(&status) <= TRAILER_BUDGET {
            return status;
        }
        listed.pop();
    }
}

/// The size of a status's trailers as a client counts them: names, values, 32 bytes each.
pub fn trailer_bytes(status: &Status) -> usize {
    let mut map = http::HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        return usize::MAX;
    }
    map.iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 32)
        .sum()
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        status(Reply::from(e))
    }
}

/// A reply as a status: its message cut, its violations bounded and named in the message,
/// its wait and its ErrorInfo as details.
fn status(r: Reply) -> Status {
    if let Some(violations) = r.violations {
        return invalid_argument(violations);
    }
    if r.retry_after.is_none() && r.info.is_none() {
        return Status::new(r.grpc, message(r.message));
    }
    let mut details = ErrorDetails::new();
    if r.retry_after.is_some() {
        details.set_retry_info(r.retry_after);
    }
    if let Some(info) = r.info {
        details.set_error_info(info.reason, DOMAIN, info.metadata);
    }
    Status::with_error_details(r.grpc, message(r.message), details)
}

/// A DeliverTriggers item's error: the code and message DeliverTrigger's status would carry,
/// the wait, and every violation whole (an item travels in the stream's body, not in
/// trailers, so only the message is bounded).
pub fn trigger_error(e: Error) -> pb::TriggerError {
    let r = Reply::from(e);
    let retry_delay = r.retry_after.map(duration);
    let violations = r
        .violations
        .iter()
        .flatten()
        .map(|v| pb::FieldViolation {
            field: v.field.clone(),
            description: v.description.clone(),
        })
        .collect();
    let status = status(r);
    pb::TriggerError {
        code: status.code() as i32,
        message: status.message().to_owned(),
        retry_delay,
        violations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Interruption;

    /// Texts of each width of UTF-8: ASCII (with spaces, which are escaped too), Cyrillic,
    /// CJK, 4-byte emoji.
    fn scripts() -> [(&'static str, String); 4] {
        [
            ("ascii", "a value quoted whole ".repeat(400)),
            ("cyrillic", "значение ".repeat(800)),
            ("cjk", "値を引用する".repeat(800)),
            ("emoji", "🦀🚀".repeat(2000)),
        ]
    }

    #[test]
    fn the_worst_refusal_of_every_script_fits_the_trailer_budget() {
        for (script, text) in scripts() {
            let violations: Vec<Violation> = (0..20)
                .map(|i| Violation {
                    field: format!("trigger.payload/{i}/{text}"),
                    description: format!("{text} is not one of the allowed values"),
                })
                .collect();
            let status = Status::from(Error::InvalidArgument(violations));
            assert_eq!(status.code(), Code::InvalidArgument);
            let size = trailer_bytes(&status);
            eprintln!("{script}: {size} bytes of trailers");
            assert!(size <= TRAILER_BUDGET, "{script}: {size} bytes of trailers");
            let listed = status
                .get_details_bad_request()
                .map(|b| b.field_violations)
                .unwrap_or_default();
            // Every listed violation is kept: the bounds, not the budget's last resort, cut.
            assert_eq!(listed.len(), MAX_VIOLATIONS, "{script}");
            for v in &listed {
                assert!(
                    v.description.chars().count() <= MAX_DESCRIPTION_CHARS,
                    "{script}"
                );
                assert!(v.description.len() <= MAX_DESCRIPTION_BYTES, "{script}");
                assert!(v.description.ends_with(ELLIPSIS), "{script}");
                assert!(v.field.len() <= MAX_FIELD_BYTES, "{script}");
                assert!(v.field.starts_with("trigger.payload/"), "{script}");
            }
            assert!(
                status.message().len() <= MAX_INVALID_MESSAGE_BYTES,
                "{script}"
            );
            assert!(
                status
                    .message()
                    .ends_with("more violations (the first 8 are in the status details)"),
                "{script}: {}",
                status.message()
            );
            // Every other refusal with a long message fits as well.
            for e in [
                Error::NotFound(text.clone()),
                Error::Unavailable(text.clone()),
                Error::Throttled {
                    message: text.clone(),
                    retry_after: std::time::Duration::from_secs(1),
                    reason: "QUOTA_EXCEEDED",
                },
                Error::Interrupted {
                    cause: Interruption::Behind,
                    message: text.clone(),
                    resume_token: "t".repeat(200),
                },
            ] {
                let s = Status::from(e);
                assert!(
                    trailer_bytes(&s) <= TRAILER_BUDGET,
                    "{script}: {:?}",
                    s.code()
                );
                assert!(s.message().len() <= MAX_MESSAGE_BYTES);
            }
        }
    }

    #[test]
    fn a_description_of_the_documented_length_is_kept_whole_and_one_more_is_cut() {
        let at = "x".repeat(MAX_DESCRIPTION_CHARS);
        let over = "x".repeat(MAX_DESCRIPTION_CHARS + 1);
        assert_eq!(cut(&at, MAX_DESCRIPTION_CHARS, MAX_DESCRIPTION_BYTES), at);
        let c = cut(&over, MAX_DESCRIPTION_CHARS, MAX_DESCRIPTION_BYTES);
        assert_eq!(c.chars().count(), MAX_DESCRIPTION_CHARS);
        assert!(c.ends_with(ELLIPSIS));
        // Cyrillic: 180 characters are 360 bytes and kept; 181 are cut.
        let cy = "ж".repeat(180);
        assert_eq!(cut(&cy, MAX_DESCRIPTION_CHARS, MAX_DESCRIPTION_BYTES), cy);
        let c = cut(
            &"ж".repeat(181),
            MAX_DESCRIPTION_CHARS,
            MAX_DESCRIPTION_BYTES,
        );
        assert!(c.len() <= MAX_DESCRIPTION_BYTES && c.ends_with(ELLIPSIS));
        // Never inside a character.
        let e = cut(
            &"🦀".repeat(200),
            MAX_DESCRIPTION_CHARS,
            MAX_DESCRIPTION_BYTES,
        );
        assert_eq!(e.chars().filter(|c| *c == '🦀').count(), 89);
    }

    #[test]
    fn a_short_refusal_says_the_same_as_before() {
        let s = Status::from(Error::invalid("pack_id", "must not be empty"));
        assert_eq!(s.message(), "pack_id: must not be empty");
        let v = vec![
            Violation {
                field: "a".into(),
                description: "x".into(),
            },
            Violation {
                field: "b".into(),
                description: "y".into(),
            },
        ];
        assert_eq!(
            Status::from(Error::InvalidArgument(v)).message(),
            "a: x; b: y"
        );
    }
}
