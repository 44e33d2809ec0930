//! The MCP door on HTTP: Streamable HTTP at `/mcp` on `--mcp-listen`, behind the HTTP listeners' socket limits, with a 401 for a request whose credentials the server would refuse, and sessions capped per caller and in all.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError, SessionConfig,
};
use rmcp::transport::streamable_http_server::session::{
    RestoreOutcome, ServerSseMessage, SessionId, SessionManager,
};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_stream::Stream;

use super::{CallerKey, Door};
use crate::auth::{Authenticator, Caller};
use crate::lifecycle::Signal;

/// The path the door answers on.
pub const PATH: &str = "/mcp";

/// The header naming an earlier revision's session.
const SESSION_HEADER: &str = "mcp-session-id";

/// Bounds on the earlier revisions' sessions (each opened by `initialize`).
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    /// Sessions open at once, in all.
    pub total: usize,
    /// Sessions one caller (one authenticated identity) holds open.
    pub per_caller: usize,
    /// A session with no traffic for this long is closed.
    pub idle: Duration,
}

/// The door's routes: `/mcp`, ended when `stopping` is given. Host names are not checked
/// when authentication is on (a rebinding page cannot send the caller's token); without it the
/// SDK's loopback-only check stands.
pub fn routes(
    door: Door,
    auth: Arc<Authenticator>,
    max_body_bytes: usize,
    limits: SessionLimits,
    stopping: &Signal,
) -> axum::Router {
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(stopping.child_token())
        .with_max_request_body_bytes(max_body_bytes);
    if auth.is_enabled() {
        config = config.disable_allowed_hosts();
    }
    let mut local = LocalSessionManager::default();
    let mut session_config = SessionConfig::default();
    session_config.keep_alive = Some(limits.idle);
    local.session_config = session_config;
    let sessions = Arc::new(Sessions {
        local,
        ledger: Arc::new(Mutex::new(Ledger::default())),
    });
    let gate = Gate {
        auth,
        limits,
        ledger: sessions.ledger.clone(),
        max_body_bytes,
    };
    let service = StreamableHttpService::new(move || Ok(door.for_session()), sessions, config);
    axum::Router::new()
        .route_service(PATH, service)
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(gate),
            admitted,
        ))
}

/// What the middleware needs: who may call, and the sessions' ledger.
struct Gate {
    auth: Arc<Authenticator>,
    limits: SessionLimits,
    ledger: Arc<Mutex<Ledger>>,
    max_body_bytes: usize,
}

/// The open sessions and who opened each, and the `initialize` requests under way.
#[derive(Default)]
struct Ledger {
    /// Open sessions, with the caller that opened each once its `initialize` is answered.
    live: HashMap<SessionId, Option<[u8; 32]>>,
    /// Per caller: sessions open and `initialize` requests under way.
    per_caller: HashMap<[u8; 32], usize>,
    /// `initialize` requests under way, in all.
    pending: usize,
}

fn lock(ledger: &Mutex<Ledger>) -> MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ledger {
    fn release(&mut self, caller: &[u8; 32]) {
        if let Some(n) = self.per_caller.get_mut(caller) {
            *n -= 1;
            if *n == 0 {
                self.per_caller.remove(caller);
            }
        }
    }
}

/// An `initialize` under way: its place among the caller's sessions, given back unless the
/// session it opened is recorded (`opened`).
struct Reserved {
    ledger: Arc<Mutex<Ledger>>,
    caller: [u8; 32],
    /// The session that holds the place now, if one was opened.
    opened: Option<SessionId>,
}

impl Reserved {
    /// The session `id` was opened: the place is the session's now, while it lives.
    fn opened(mut self, id: &str) {
        self.opened = Some(id.into());
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let mut ledger = lock(&self.ledger);
        ledger.pending -= 1;
        match self.opened.as_ref().and_then(|id| ledger.live.get_mut(id)) {
            Some(owner) => *owner = Some(self.caller),
            // None opened, or closed already.
            None => ledger.release(&self.caller),
        }
    }
}

/// rmcp's in-memory sessions, with each open one in the ledger until it closes (on DELETE,
/// at its idle timeout, when its client goes).
struct Sessions {
    local: LocalSessionManager,
    ledger: Arc<Mutex<Ledger>>,
}

impl SessionManager for Sessions {
    type Error = LocalSessionManagerError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let (id, transport) = self.local.create_session().await?;
        lock(&self.ledger).live.insert(id.clone(), None);
        Ok((id, transport))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.local.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.local.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        {
            let mut ledger = lock(&self.ledger);
            if let Some(Some(caller)) = ledger.live.remove(id) {
                ledger.release(&caller);
            }
        }
        self.local.close_session(id).await
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.local.create_stream(id, message).await
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.local.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.local.create_standalone_stream(id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.local.resume(id, last_event_id).await
    }

    async fn restore_session(
        &self,
        _id: SessionId,
    ) -> Result<RestoreOutcome<Self::Transport>, Self::Error> {
        // Sessions live in this process alone.
        Ok(RestoreOutcome::NotSupported)
    }
}

/// Answers 401 with `WWW-Authenticate: Bearer` for missing or refused credentials, before
/// the MCP session sees the request (what a caller may do is the API's to say, call by
/// call); keeps each session to the caller that opened it; refuses a body that is not one
/// JSON-RPC message (400, with the JSON-RPC error that says why) and an `initialize` past the
/// session caps. The caller's [`CallerKey`] goes on the request for the door's own caps.
async fn admitted(State(gate): State<Arc<Gate>>, mut request: Request, next: Next) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let caller = match gate.auth.check(authorization) {
        Caller::Refused(why) => {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                axum::Json(serde_json::json!({ "error": why.public_message() })),
            )
                .into_response()
        }
        Caller::Known(id) => CallerKey::of(Some(&id.bucket())),
        Caller::Open => CallerKey::of(None),
    };
    request.extensions_mut().insert(caller);
    let session: Option<SessionId> = request
        .headers()
        .get(SESSION_HEADER)
        .map(|v| v.to_str().unwrap_or_default().into());
    if let Some(id) = &session {
        // A session is its opener's: other credentials naming it (to hear its subscription
        // on its stream, say) are answered as for a session that does not exist.
        let owner = lock(&gate.ledger).live.get(id).copied().flatten();
        if owner.is_some_and(|o| o != caller.0) {
            return session_not_found();
        }
    }
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is over {} bytes (--max-request-bytes)",
                gate.max_body_bytes
            ),
        )
            .into_response()
    };
    // A declared length over the limit is refused before a byte of the body is read.
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > gate.max_body_bytes as u64) {
        return too_large();
    }
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, gate.max_body_bytes).await else {
        return too_large();
    };
    if let Err(not_one) = one_message(&bytes) {
        return not_one.answer();
    }
    let init = if session.is_none() {
        initialize_id(&bytes)
    } else {
        None
    };
    let request = Request::from_parts(parts, Body::from(bytes));
    // A session is opened by an `initialize`, which names none.
    let Some(id) = init else {
        return next.run(request).await;
    };
    let reserved = match gate.reserve(caller.0) {
        Ok(r) => r,
        Err(refusal) => return refusal.answer(id),
    };
    let answer = next.run(request).await;
    match answer
        .headers()
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        Some(session) if answer.status().is_success() => reserved.opened(session),
        _ => drop(reserved),
    }
    answer
}

/// The SDK's own answer for a session it does not hold, word for word.
fn session_not_found() -> Response {
    let mut answer = Response::new(Body::from("Not Found: Session not found"));
    *answer.status_mut() = StatusCode::NOT_FOUND;
    answer
}

/// Why a body is not one JSON-RPC message: the error answered (400) in its place.
struct NotOne {
    id: serde_json::Value,
    code: i64,
    message: String,
}

impl NotOne {
    fn answer(self) -> Response {
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": self.id,
            "error": { "code": self.code, "message": self.message },
        });
        // A request whose params are wrong is still a request, answered as rmcp answers
        // one (a client's SDK reads a JSON-RPC error in a 200, and fails a 400 as HTTP's).
        let status = if self.code == -32602 {
            StatusCode::OK
        } else {
            StatusCode::BAD_REQUEST
        };
        (status, axum::Json(body)).into_response()
    }
}

/// Refuses a body that is not one JSON-RPC message: not JSON (-32700), or not a request,
/// notification or response of JSON-RPC 2.0 (-32600: a batch, a `method` that is not a
/// string, an `id` that is neither a string nor an integer); and a request to a method this
/// server serves whose params are not the method's (-32602).
fn one_message(body: &[u8]) -> Result<(), NotOne> {
    use serde_json::Value;
    let not_one = |id: &Value, code: i64, message: String| NotOne {
        id: id.clone(),
        code,
        message,
    };
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        not_one(
            &Value::Null,
            -32700,
            format!("parse error: the body is not JSON: {e}"),
        )
    })?;
    let Some(m) = v.as_object() else {
        let why = if v.is_array() {
            "invalid request: a batch (a JSON array) is not accepted: send one message a request"
        } else {
            "invalid request: a JSON-RPC message is a JSON object"
        };
        return Err(not_one(&Value::Null, -32600, why.to_owned()));
    };
    let id = m.get("id").unwrap_or(&Value::Null);
    let invalid = |why: &str| not_one(id, -32600, format!("invalid request: {why}"));
    if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid("`jsonrpc` must be \"2.0\""));
    }
    if !(id.is_null() && !m.contains_key("id") || id.is_string() || id.is_i64() || id.is_u64()) {
        return Err(invalid("`id` must be a string or an integer"));
    }
    match m.get("method") {
        // A notification is never answered, not even to say its params are wrong.
        Some(Value::String(_)) if !m.contains_key("id") => Ok(()),
        Some(Value::String(method)) => match params_refused(method, m.get("params")) {
            // rmcp reads a request whose params do not parse as a method of its own it does
            // not know, and would answer -32601 (method not found).
            Some(why) => Err(not_one(id, -32602, format!("invalid params: {why}"))),
            None => Ok(()),
        },
        Some(_) => Err(invalid("`method` must be a string")),
        // A client's answer to the server's own request (a ping).
        None if m.contains_key("result") || m.contains_key("error") => Ok(()),
        None => Err(invalid("`method` is missing")),
    }
}

/// Why the `params` of a request to a method this server serves are not the method's: a
/// field missing, or of the wrong type, as serde names it. None for params that parse, and
/// for any other method (rmcp answers those).
fn params_refused(method: &str, params: Option<&serde_json::Value>) -> Option<String> {
    use rmcp::model::{
        CallToolRequestParams, InitializeRequestParams, PaginatedRequestParams,
        ReadResourceRequestParams, SubscribeRequestParams, UnsubscribeRequestParams,
    };
    use serde::de::DeserializeOwned;
    fn parse<P: DeserializeOwned>(
        method: &str,
        params: Option<&serde_json::Value>,
    ) -> Option<String> {
        let Some(params) = params else {
            return Some(format!(
                "`{method}` takes `params` (an object); there are none"
            ));
        };
        serde_json::from_value::<P>(params.clone())
            .err()
            .map(|e| format!("`params` of `{method}`: {e}"))
    }
    match method {
        "initialize" => parse::<InitializeRequestParams>(method, params),
        "tools/call" => parse::<CallToolRequestParams>(method, params),
        "resources/read" => parse::<ReadResourceRequestParams>(method, params),
        "resources/subscribe" => parse::<SubscribeRequestParams>(method, params),
        "resources/unsubscribe" => parse::<UnsubscribeRequestParams>(method, params),
        // Optional params: checked when given (null is none).
        "tools/list" | "resources/list" | "resources/templates/list" => params
            .filter(|p| !p.is_null())
            .and_then(|p| parse::<PaginatedRequestParams>(method, Some(p))),
        _ => None,
    }
}

/// The JSON-RPC id of an `initialize` request; `None` for any other body.
fn initialize_id(body: &[u8]) -> Option<serde_json::Value> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        #[serde(borrow)]
        method: Option<&'a str>,
        id: Option<serde_json::Value>,
    }
    let head: Head<'_> = serde_json::from_slice(body).ok()?;
    (head.method == Some("initialize")).then(|| head.id.unwrap_or(serde_json::Value::Null))
}

/// Why a session was refused.
enum Refusal {
    Caller(usize),
    Total(usize),
}

impl Gate {
    fn reserve(&self, caller: [u8; 32]) -> Result<Reserved, Refusal> {
        let mut ledger = lock(&self.ledger);
        let mine = ledger.per_caller.get(&caller).copied().unwrap_or(0);
        if mine >= self.limits.per_caller {
            return Err(Refusal::Caller(mine));
        }
        let open = ledger.live.len() + ledger.pending;
        if open >= self.limits.total {
            return Err(Refusal::Total(open));
        }
        ledger.pending += 1;
        *ledger.per_caller.entry(caller).or_insert(0) += 1;
        Ok(Reserved {
            ledger: self.ledger.clone(),
            caller,
            opened: None,
        })
    }
}

impl Refusal {
    /// The refusal as the gRPC API words a cap: RESOURCE_EXHAUSTED naming it, here in a
    /// JSON-RPC error answering the `initialize` (429 for the caller's cap, 503 with
    /// `Retry-After` for the door's).
    fn answer(&self, id: serde_json::Value) -> Response {
        let (status, message) = match self {
            Refusal::Caller(n) => (
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "RESOURCE_EXHAUSTED: this caller has {n} MCP sessions open, the most one caller may hold (--mcp-max-sessions-per-caller): close one (DELETE /mcp with its Mcp-Session-Id) or let it idle out"
                ),
            ),
            Refusal::Total(n) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "RESOURCE_EXHAUSTED: the MCP door has {n} sessions open, its most (--mcp-max-sessions): try again later"
                ),
            ),
        };
        let body = serde_json::json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {
                "code": -32000,
                "message": message,
                "data": { "code": "RESOURCE_EXHAUSTED" },
            },
        });
        let mut answer = (status, axum::Json(body)).into_response();
        if matches!(self, Refusal::Total(_)) {
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_that_is_not_one_json_rpc_message_is_refused_with_the_reason() {
        let code = |body: &str| match one_message(body.as_bytes()) {
            Ok(()) => None,
            Err(not_one) => Some(not_one.answer().status().as_u16()),
        };
        for ok in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","id":"a","method":"ping"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            r#"{"jsonrpc":"2.0","id":3,"result":{}}"#,
        ] {
            assert_eq!(code(ok), None, "{ok}");
        }
        for bad in [
            "",
            "not json",
            "[]",
            r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#,
            "5",
            r#"{"id":1,"method":"ping"}"#,
            r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":5}"#,
            r#"{"jsonrpc":"2.0","id":{},"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
        ] {
            assert_eq!(code(bad), Some(400), "{bad}");
        }
        // The params of a method served, as its schema has them; any other method's are
        // rmcp's to answer.
        let params = |body: &str| match one_message(body.as_bytes()) {
            Ok(()) => None,
            Err(not_one) => Some((not_one.code, not_one.message)),
        };
        for ok in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"list_records","arguments":{}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":null}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"x"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"hcp://inbox"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"prompts/get","params":5}"#,
            r#"{"jsonrpc":"2.0","method":"tools/call","params":5}"#,
        ] {
            assert_eq!(params(ok), None, "{ok}");
        }
        for (bad, names) in [
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":5}}"#,
                "tools/call",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
                "there are none",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#,
                "name",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":[]}}"#,
                "resources/read",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"resources/subscribe","params":"x"}"#,
                "resources/subscribe",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"cursor":7}}"#,
                "tools/list",
            ),
        ] {
            let (code, message) = params(bad).unwrap_or_else(|| panic!("{bad} was taken"));
            assert_eq!(code, -32602, "{bad}");
            assert!(message.contains(names), "{bad}: {message}");
        }
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(code(&deep), Some(400));
    }

    #[test]
    fn only_an_initialize_is_read_as_one() {
        assert_eq!(
            initialize_id(br#"{"jsonrpc":"2.0","id":7,"method":"initialize","params":{}}"#),
            Some(serde_json::json!(7))
        );
        assert_eq!(
            initialize_id(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            None
        );
        assert_eq!(initialize_id(b"not json"), None);
        assert_eq!(initialize_id(br#"[{"method":"initialize"}]"#), None);
    }
}
