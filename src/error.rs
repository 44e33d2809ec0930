//! The one semantic error enum of the service; `reply` maps it, in one table, to what each protocol tells a caller.
use std::fmt;

/// A field of a request and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub field: String,
    pub description: String,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    /// Bad input, one violation per field and rule.
    #[error("{}", summary(.0))]
    InvalidArgument(Vec<Violation>),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    PermissionDenied(String),
    /// No credentials, or credentials that were refused; the message says no more than that.
    #[error("{0}")]
    Unauthenticated(String),
    /// A rate limit or a bound on open streams; the call may be retried later.
    #[error("{0}")]
    ResourceExhausted(String),
    /// Over a quota: nothing was decided; the caller may retry after `retry_after`.
    #[error("{message}")]
    Throttled {
        message: String,
        retry_after: std::time::Duration,
        /// ErrorInfo's reason: `QUOTA_EXCEEDED` (a pack's or principal's quota) or
        /// `RATE_LIMITED` (a caller's rate limit).
        reason: &'static str,
    },
    /// The store (or another dependency) cannot be reached; the call may be retried.
    #[error("{0}")]
    Unavailable(String),
    /// A stream ended before the caller ended it, with the token to resume it from.
    #[error("{message}")]
    Interrupted {
        cause: Interruption,
        message: String,
        resume_token: String,
    },
    /// A fault of the service, with its cause chain; where it becomes a reply the chain is
    /// logged and the client gets a generic message.
    #[error("internal error: {0:#}")]
    Internal(anyhow::Error),
}

/// Why a stream was ended early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    /// The reader fell behind the bounds on a watcher; resuming loses nothing.
    Behind,
    /// The store cannot be reached, or the server is shutting down.
    Unavailable,
}

impl Error {
    /// One violated rule for one field.
    pub fn invalid(field: impl Into<String>, description: impl fmt::Display) -> Self {
        Error::InvalidArgument(vec![Violation {
            field: field.into(),
            description: description.to_string(),
        }])
    }

    /// A fault of the service, said in words for operators only.
    pub fn internal(what: impl fmt::Display + fmt::Debug + Send + Sync + 'static) -> Self {
        Error::Internal(anyhow::Error::msg(what))
    }

    /// A fault of the service caused by `cause`, whose chain operators' logs keep.
    pub fn internal_from(
        what: impl fmt::Display + fmt::Debug + Send + Sync + 'static,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Internal(anyhow::Error::new(cause).context(what))
    }
}

/// Every violation, `field: description`, joined by "; ".
pub(crate) fn summary(v: &[Violation]) -> String {
    v.iter()
        .map(|v| {
            if v.field.is_empty() {
                v.description.clone()
            } else {
                format!("{}: {}", v.field, v.description)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
