//! The one table from the service's errors to gRPC statuses.
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::error::{Error, Interruption};

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::NotFound(m) => Status::not_found(m),
            Error::AlreadyExists(m) => Status::already_exists(m),
            Error::InvalidArgument(violations) => {
                let message = Error::InvalidArgument(violations.clone()).to_string();
                let mut details = ErrorDetails::new();
                for v in violations {
                    details.add_bad_request_violation(v.field, v.description);
                }
                Status::with_error_details(Code::InvalidArgument, message, details)
            }
            Error::FailedPrecondition(m) => Status::failed_precondition(m),
            Error::PermissionDenied(m) => Status::permission_denied(m),
            Error::Unauthenticated(m) => Status::unauthenticated(m),
            Error::ResourceExhausted(m) => Status::resource_exhausted(m),
            Error::Throttled {
                message,
                retry_after,
                reason,
            } => {
                let mut details = ErrorDetails::new();
                details.set_retry_info(Some(retry_after));
                details.set_error_info(reason, "hcp.sense.v1", std::collections::HashMap::new());
                Status::with_error_details(Code::ResourceExhausted, message, details)
            }
            Error::Unavailable(m) => Status::unavailable(m),
            Error::Interrupted {
                cause,
                message,
                resume_token,
            } => {
                let (code, reason) = match cause {
                    Interruption::Behind => (Code::ResourceExhausted, "WATCH_BEHIND"),
                    Interruption::Unavailable => (Code::Unavailable, "WATCH_INTERRUPTED"),
                };
                let mut details = ErrorDetails::new();
                details.set_error_info(
                    reason,
                    "hcp.sense.v1",
                    std::collections::HashMap::from([("resume_token".to_owned(), resume_token)]),
                );
                Status::with_error_details(code, message, details)
            }
            // The cause was logged where it happened; the client learns nothing internal.
            Error::Internal(_) => Status::internal("internal error"),
        }
    }
}
