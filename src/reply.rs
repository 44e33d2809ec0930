//! The one table from an `Error` to what a caller is told — gRPC code, HTTP status, message and details — which each protocol renders: grpc/status.rs as a status or a stream item's error, ingress/http.rs as a status line and a JSON body.
use std::collections::HashMap;
use std::time::Duration;

use http::StatusCode;
use tonic::Code;

use crate::error::{summary, Error, Interruption, Violation};

/// The domain of every ErrorInfo the service sends.
pub const DOMAIN: &str = "hcp.sense.v1";

/// What a caller is told of one error, whatever the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// A gRPC status's code, and a DeliverTriggers item's.
    pub grpc: Code,
    /// The status of an HTTP delivery's answer.
    pub http: StatusCode,
    /// The message, whole: each protocol bounds it as it must. Never an internal cause.
    pub message: String,
    /// Bad input, one violation per field and rule, whole; `Some` for INVALID_ARGUMENT only.
    pub violations: Option<Vec<Violation>>,
    /// When the call may be retried (a quota or a rate limit).
    pub retry_after: Option<Duration>,
    /// What a program reads to tell this refusal from others of its code.
    pub info: Option<Info>,
}

/// An ErrorInfo: a reason in capitals, and facts by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub reason: &'static str,
    pub metadata: HashMap<String, String>,
}

impl Reply {
    fn plain(grpc: Code, http: StatusCode, message: String) -> Reply {
        Reply {
            grpc,
            http,
            message,
            violations: None,
            retry_after: None,
            info: None,
        }
    }
}

impl From<Error> for Reply {
    fn from(e: Error) -> Reply {
        match e {
            Error::NotFound(m) => Reply::plain(Code::NotFound, StatusCode::NOT_FOUND, m),
            Error::AlreadyExists(m) => Reply::plain(Code::AlreadyExists, StatusCode::CONFLICT, m),
            Error::InvalidArgument(violations) => Reply {
                // Every violation, `field: description`, joined (the error's own text).
                message: summary(&violations),
                violations: Some(violations),
                ..Reply::plain(
                    Code::InvalidArgument,
                    StatusCode::BAD_REQUEST,
                    String::new(),
                )
            },
            Error::FailedPrecondition(m) => Reply::plain(
                Code::FailedPrecondition,
                StatusCode::UNPROCESSABLE_ENTITY,
                m,
            ),
            Error::PermissionDenied(m) => {
                Reply::plain(Code::PermissionDenied, StatusCode::UNPROCESSABLE_ENTITY, m)
            }
            Error::Unauthenticated(m) => {
                Reply::plain(Code::Unauthenticated, StatusCode::UNAUTHORIZED, m)
            }
            Error::ResourceExhausted(m) => {
                Reply::plain(Code::ResourceExhausted, StatusCode::TOO_MANY_REQUESTS, m)
            }
            Error::Throttled {
                message,
                retry_after,
                reason,
            } => Reply {
                retry_after: Some(retry_after),
                info: Some(Info {
                    reason,
                    metadata: HashMap::new(),
                }),
                ..Reply::plain(
                    Code::ResourceExhausted,
                    StatusCode::TOO_MANY_REQUESTS,
                    message,
                )
            },
            Error::Unavailable(m) => {
                Reply::plain(Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE, m)
            }
            Error::Interrupted {
                cause,
                message,
                resume_token,
            } => {
                let (code, reason) = match cause {
                    Interruption::Behind => (Code::ResourceExhausted, "WATCH_BEHIND"),
                    Interruption::Unavailable => (Code::Unavailable, "WATCH_INTERRUPTED"),
                };
                Reply {
                    info: Some(Info {
                        reason,
                        metadata: HashMap::from([("resume_token".to_owned(), resume_token)]),
                    }),
                    ..Reply::plain(code, StatusCode::SERVICE_UNAVAILABLE, message)
                }
            }
            // Operators get the whole cause chain, once, where it becomes a reply; the
            // caller learns nothing internal.
            Error::Internal(cause) => {
                tracing::error!(error = %format_args!("{cause:#}"), "internal error");
                Reply::plain(
                    Code::Internal,
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error".into(),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_has_its_row() {
        let m = || "why".to_owned();
        let rows = [
            (Error::NotFound(m()), Code::NotFound, 404),
            (Error::AlreadyExists(m()), Code::AlreadyExists, 409),
            (
                Error::FailedPrecondition(m()),
                Code::FailedPrecondition,
                422,
            ),
            (Error::PermissionDenied(m()), Code::PermissionDenied, 422),
            (Error::Unauthenticated(m()), Code::Unauthenticated, 401),
            (Error::ResourceExhausted(m()), Code::ResourceExhausted, 429),
            (Error::Unavailable(m()), Code::Unavailable, 503),
        ];
        for (e, grpc, http) in rows {
            let r = Reply::from(e);
            assert_eq!((r.grpc, r.http.as_u16()), (grpc, http), "{r:?}");
            assert_eq!(r.message, "why");
            assert_eq!((r.violations, r.retry_after, r.info), (None, None, None));
        }
    }

    #[test]
    fn bad_input_lists_every_violation_and_names_them_in_its_message() {
        let v = |f: &str| Violation {
            field: f.into(),
            description: "is required".into(),
        };
        let r = Reply::from(Error::InvalidArgument(vec![v("a"), v("b")]));
        assert_eq!(
            (r.grpc, r.http),
            (Code::InvalidArgument, StatusCode::BAD_REQUEST)
        );
        assert_eq!(r.message, "a: is required; b: is required");
        assert_eq!(r.violations, Some(vec![v("a"), v("b")]));
    }

    #[test]
    fn a_refusal_to_retry_says_when_and_an_interruption_where_to_resume() {
        let r = Reply::from(Error::Throttled {
            message: "over".into(),
            retry_after: Duration::from_millis(1500),
            reason: "QUOTA_EXCEEDED",
        });
        assert_eq!((r.grpc, r.http.as_u16()), (Code::ResourceExhausted, 429));
        assert_eq!(r.retry_after, Some(Duration::from_millis(1500)));
        assert_eq!(r.info.map(|i| i.reason), Some("QUOTA_EXCEEDED"));
        for (cause, code, reason) in [
            (
                Interruption::Behind,
                Code::ResourceExhausted,
                "WATCH_BEHIND",
            ),
            (
                Interruption::Unavailable,
                Code::Unavailable,
                "WATCH_INTERRUPTED",
            ),
        ] {
            let r = Reply::from(Error::Interrupted {
                cause,
                message: "ended".into(),
                resume_token: "t".into(),
            });
            assert_eq!((r.grpc, r.http.as_u16()), (code, 503));
            let info = r.info.expect("an interruption carries its ErrorInfo");
            assert_eq!(info.reason, reason);
            assert_eq!(info.metadata["resume_token"], "t");
        }
    }

    #[test]
    fn an_internal_error_tells_nothing_of_its_cause() {
        let r = Reply::from(Error::internal("the pool's socket at 10.0.0.7 broke"));
        assert_eq!((r.grpc, r.http.as_u16()), (Code::Internal, 500));
        assert_eq!(r.message, "internal error");
    }
}
