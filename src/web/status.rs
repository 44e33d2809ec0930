//! A refusal over HTTP: the call's `google.rpc.Status` as JSON, with the HTTP status its code maps to, `Retry-After` from its RetryInfo and a Bearer challenge for UNAUTHENTICATED.
use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use prost_reflect::{DescriptorPool, DynamicMessage};
use serde_json::Value;
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// The HTTP status of a gRPC code (google.rpc.Code's own mapping, as gRPC-JSON transcoders
/// answer). The door sees the API's status, not its Error: the code decides. (crate::reply's
/// HTTP statuses are the webhook senders', whose retry rules differ.)
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// `status` as google.rpc.Status JSON: `code`, `message`, and `details` (each an Any with its
/// `@type`), as a gRPC client would decode them from the trailers.
pub fn json(pool: &DescriptorPool, status: &Status) -> Value {
    let mut out = serde_json::json!({
        "code": status.code() as i32,
        "message": status.message(),
        "details": [],
    });
    if status.details().is_empty() {
        return out;
    }
    let decoded = pool
        .get_message_by_name("google.rpc.Status")
        .and_then(|d| DynamicMessage::decode(d, status.details()).ok())
        .and_then(|m| crate::mcp::call::to_json(&m, true).ok());
    if let Some(details) = decoded.as_ref().and_then(|d| d.get("details")) {
        out["details"] = details.clone();
    }
    out
}

/// The answer refusing a request with `status`.
pub fn response(pool: &DescriptorPool, status: &Status) -> Response {
    let body = json(pool, status).to_string();
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = http_status(status.code());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(wait) = status.get_details_retry_info().and_then(|r| r.retry_delay) {
        // Whole seconds, rounded up: a client waiting less would be refused again.
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        if let Ok(v) = HeaderValue::from_str(&secs.max(1).to_string()) {
            h.insert(header::RETRY_AFTER, v);
        }
    }
    if status.code() == Code::Unauthenticated {
        h.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"hcp-sense\""),
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn a_refusal_carries_its_details_as_json_and_its_wait_as_retry_after() {
        let pool = super::super::pool().expect("pool");
        let s = Status::from(Error::invalid("page_size", "must be at most 1000"));
        let j = json(&pool, &s);
        assert_eq!(j["code"], 3);
        assert_eq!(j["message"], s.message());
        assert_eq!(
            j["details"][0]["@type"],
            "type.googleapis.com/google.rpc.BadRequest"
        );
        assert_eq!(j["details"][0]["fieldViolations"][0]["field"], "page_size");
        assert_eq!(response(&pool, &s).status(), StatusCode::BAD_REQUEST);

        let s = Status::from(Error::Throttled {
            message: "slow down".into(),
            retry_after: std::time::Duration::from_millis(1500),
            reason: "RATE_LIMITED",
        });
        let j = json(&pool, &s);
        assert_eq!(j["code"], 8);
        let types: Vec<&str> = j["details"]
            .as_array()
            .expect("details")
            .iter()
            .filter_map(|d| d["@type"].as_str())
            .collect();
        assert!(
            types.contains(&"type.googleapis.com/google.rpc.RetryInfo"),
            "{j}"
        );
        assert!(
            types.contains(&"type.googleapis.com/google.rpc.ErrorInfo"),
            "{j}"
        );
        let r = response(&pool, &s);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = response(&pool, &Status::from(Error::Unauthenticated("no".into())));
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(r.headers().contains_key(header::WWW_AUTHENTICATE));
    }
}
