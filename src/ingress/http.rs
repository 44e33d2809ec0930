//! The HTTP ingress listener: POST /v1/ingress/{route} turns a signed webhook into triggers through `Ingress::receive`, answering only after each is recorded or counted as dropped.
use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Json;
use serde_json::json;

use super::Ingress;
use crate::error::Error;
use crate::reply::Reply;

/// The routes of the ingress listener; a body over `max_body_bytes` is answered 413.
pub fn routes(ingress: Ingress, max_body_bytes: usize) -> axum::Router {
    axum::Router::new()
        .route("/v1/ingress/{route}", post(receive))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(ingress)
}

/// Header names in lower case; a header given several times is one value joined by ", "
/// (RFC 9110's list form); values that are not visible ASCII are left out.
fn header_map(h: &HeaderMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in h {
        let Ok(v) = value.to_str() else { continue };
        out.entry(name.as_str().to_owned())
            .and_modify(|e| {
                e.push_str(", ");
                e.push_str(v);
            })
            .or_insert_with(|| v.to_owned());
    }
    out
}

async fn receive(
    State(ingress): State<Ingress>,
    Path(route): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let headers = header_map(&headers);
    // A store gone silent never says so: the request is answered 503 in the call's time.
    let received = tokio::time::timeout(
        ingress.delivery.call_timeout(),
        ingress.receive(&route, &headers, &body, now),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Error::Unavailable(
            "the store did not answer in time; retry".into(),
        ))
    });
    match received {
        Ok(receipt) => (
            StatusCode::ACCEPTED,
            Json(json!({
                "route": route,
                "triggers": receipt.triggers,
                "replay": receipt.replay,
            })),
        )
            .into_response(),
        Err(e) => {
            if matches!(e, Error::InvalidArgument(_) | Error::Unauthenticated(_)) {
                ingress.delivery.metrics.ingress_refused("http");
            }
            refusal(e)
        }
    }
}

/// The answer for an error, from the error table: its status, and its message as JSON (with
/// every field and rule for bad input, and the wait when over a limit).
fn refusal(e: Error) -> Response {
    let r = Reply::from(e);
    let mut body = json!({ "error": r.message });
    if let Some(v) = &r.violations {
        body["violations"] = v
            .iter()
            .map(|v| json!({"field": v.field, "description": v.description}))
            .collect();
    }
    if let Some(wait) = r.retry_after {
        body["retry_after_ms"] = json!(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1));
    }
    let mut answer = (r.http, Json(body)).into_response();
    if let Some(wait) = r.retry_after {
        // Whole seconds (RFC 9110), rounded up: a sender retrying sooner finds no token.
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        if let Ok(v) = HeaderValue::from_str(&secs.max(1).to_string()) {
            answer.headers_mut().insert("retry-after", v);
        }
    } else if r.http == StatusCode::SERVICE_UNAVAILABLE {
        // Webhook senders retry; tell them when.
        answer
            .headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    answer
}
