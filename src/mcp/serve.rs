//! The MCP door on HTTP: Streamable HTTP at `/mcp` on `--mcp-listen`, behind the HTTP listeners' socket limits, with a 401 for a request whose credentials the server would refuse.
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use super::Door;
use crate::auth::{Authenticator, Caller};
use crate::lifecycle::Signal;

/// The path the door answers on.
pub const PATH: &str = "/mcp";

/// The door's routes: `/mcp`, ended when `stopping` is given. Host names are not checked
/// when authentication is on (a rebinding page cannot send the caller's token); without it the
/// SDK's loopback-only check stands.
pub fn routes(
    door: Door,
    auth: Arc<Authenticator>,
    max_body_bytes: usize,
    stopping: &Signal,
) -> axum::Router {
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(stopping.child_token())
        .with_max_request_body_bytes(max_body_bytes);
    if auth.is_enabled() {
        config = config.disable_allowed_hosts();
    }
    let service = StreamableHttpService::new(
        move || Ok(door.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    axum::Router::new()
        .route_service(PATH, service)
        .layer(axum::middleware::from_fn_with_state(auth, authenticated))
}

/// Answers 401 with `WWW-Authenticate: Bearer` for missing or refused credentials, before
/// the MCP session sees the request; what a caller may do is the API's to say, call by call.
async fn authenticated(
    State(auth): State<Arc<Authenticator>>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match auth.check(authorization) {
        Caller::Refused(why) => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            axum::Json(serde_json::json!({ "error": why.public_message() })),
        )
            .into_response(),
        _ => next.run(request).await,
    }
}
