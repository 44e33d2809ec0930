//! The JSON door: every RPC of the API as JSON over HTTP on `--http-listen`, by the protos' `google.api.http` routes, called in process through the gRPC listener's own layers; WatchRecords as Server-Sent Events, the OpenAPI document, and the operator console.
//!
//! One generic layer, no handler per RPC: a request is matched to its method by the route
//! table read from the descriptors (rules), its path variables, query string and JSON body
//! become the method's request message (protobuf JSON), and the call goes through the same
//! tower layers as a gRPC client's (authentication, the role table, rate limits, stream caps,
//! deadlines), carrying the request's `Authorization`. The answer is the output's protobuf
//! JSON; a refusal is its `google.rpc.Status` as JSON, with the HTTP status of its code.
//!
//! No credential is ambient: the door reads only the `Authorization` header (no cookie), so
//! a page on another site cannot act with a signed-in operator's rights, and a POST must be
//! `Content-Type: application/json`, which no HTML form can send.
pub mod console;
pub mod openapi;
pub mod rules;
mod status;

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MethodDescriptor};
use serde_json::{Map, Value};
use tonic::metadata::AsciiMetadataValue;
use tonic::Status;

use crate::error::Error;
use crate::lifecycle::Signal;
use crate::mcp::call::{self, Api};
use rules::{BodyRule, Route};

/// A refusal of the request as written: `message` is `field: what is wrong`, and names the
/// field in its BadRequest detail too, as the API's own refusals do.
fn invalid(message: impl Into<String>) -> Status {
    let message = message.into();
    let (field, why) = message
        .split_once(": ")
        .unwrap_or(("request", message.as_str()));
    Error::invalid(field, why).into()
}

/// A route that does not fit its method: a bug of this binary, caught at start by the tests.
fn internal(message: String) -> Status {
    Error::internal(message).into()
}

/// Where the OpenAPI document is served.
pub const OPENAPI_PATH: &str = "/openapi.json";

/// Longest wait between two writes on an event stream: a comment line keeps the socket from
/// being closed as idle by this listener or a proxy between.
const MAX_PING: Duration = Duration::from_secs(15);

/// How the door is served.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Serve the console.
    pub console: bool,
    /// BenchService is offered.
    pub bench: bool,
    /// The listener closes a socket that moves no byte for this long.
    pub idle: Duration,
    /// Event streams open per caller and in all: each holds a socket of the listener, so the
    /// total stays below its socket cap and a caller's below the total.
    pub streams: crate::mcp::SubscriptionCaps,
}

/// The JSON door: the API it calls, its routes and what it serves beside them.
#[derive(Clone)]
pub struct Door(Arc<Inner>);

struct Inner {
    api: Api,
    /// Who a caller is, for the caps on its event streams.
    auth: Arc<crate::auth::Authenticator>,
    /// Event streams open, per caller and in all.
    streams: Arc<crate::mcp::StreamCounts>,
    routes: Vec<Route>,
    /// The API's descriptors and google.rpc's (a refusal's details).
    pool: DescriptorPool,
    openapi: Bytes,
    console: bool,
    /// Without authentication, only loopback host names are answered (a page elsewhere could
    /// point its own name at this address and call the open API with a browser's help).
    loopback_only: bool,
    ping: Duration,
    stopping: Signal,
}

impl Door {
    /// The door over `api`. `authenticated`: the API checks credentials. `idle`: the
    /// listener closes a socket that moves no byte for this long.
    pub fn new(
        api: Api,
        auth: Arc<crate::auth::Authenticator>,
        opts: Options,
        stopping: Signal,
    ) -> anyhow::Result<Door> {
        let pool = pool()?;
        // A service the server does not offer has no route (BenchService without
        // --bench-baseline).
        let routes = rules::routes(&pool)?
            .into_iter()
            .filter(|r| opts.bench || r.method.parent_service().name() != "BenchService")
            .collect::<Vec<_>>();
        let openapi = Bytes::from(serde_json::to_vec_pretty(&openapi::document(
            &routes, &pool,
        ))?);
        let streams = crate::mcp::StreamCounts::named(
            opts.streams,
            crate::mcp::Names {
                what: "event streams",
                door: "the JSON door",
                per_caller_option: "--http-max-streams-per-caller",
                total_option: "--http-max-streams",
            },
        );
        Ok(Door(Arc::new(Inner {
            api,
            loopback_only: !auth.is_enabled(),
            auth,
            streams,
            routes,
            pool,
            openapi,
            console: opts.console,
            ping: (opts.idle / 3).clamp(Duration::from_secs(1), MAX_PING),
            stopping,
        })))
    }

    /// The door's routes.
    pub fn routes(self) -> axum::Router {
        axum::Router::new().fallback(handle).with_state(self)
    }
}

/// The API's descriptors with google.rpc's, so a refusal's details are written as JSON.
pub fn pool() -> anyhow::Result<DescriptorPool> {
    let mut pool = DescriptorPool::decode(hcp_sense_api::v1::FILE_DESCRIPTOR_SET)?;
    pool.decode_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)?;
    Ok(pool)
}

async fn handle(State(door): State<Door>, req: Request) -> Response {
    let mut answer = door.answer(req).await;
    let h = answer.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    answer
}

impl Door {
    async fn answer(&self, req: Request) -> Response {
        let d = &self.0;
        if d.loopback_only && !loopback_host(req.headers()) {
            return status::response(
                &d.pool,
                &Status::from(Error::PermissionDenied(
                    "Host: without authentication the JSON door answers only a loopback host name (localhost, 127.0.0.1, [::1])".to_owned(),
                )),
            );
        }
        let path = req.uri().path().to_owned();
        let verb = req.method().clone();
        let read = verb == Method::GET || verb == Method::HEAD;
        if path == OPENAPI_PATH && read {
            return json_bytes(StatusCode::OK, d.openapi.clone());
        }
        if path == "/" && verb == Method::GET {
            return redirect(if d.console {
                console::PATH
            } else {
                OPENAPI_PATH
            });
        }
        if d.console && read {
            if let Some(page) = console::serve(&path) {
                return page;
            }
        }
        let mut allowed = Vec::new();
        for route in &d.routes {
            let Some(vars) = route.matches(&path) else {
                continue;
            };
            if route.verb != verb {
                allowed.push(route.verb.as_str());
                continue;
            }
            return match self.call(route, vars, req).await {
                Ok(answer) => answer,
                Err(status) => status::response(&d.pool, &status),
            };
        }
        if allowed.is_empty() {
            return status::response(
                &d.pool,
                &Status::from(Error::NotFound(format!(
                    "no route {verb} {path}: the routes are listed in {OPENAPI_PATH}"
                ))),
            );
        }
        let mut r = status::response(
            &d.pool,
            &Status::from(Error::NotFound(format!(
                "{path} is not served for {verb}: it is for {}",
                allowed.join(", ")
            ))),
        );
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        if let Ok(v) = HeaderValue::from_str(&allowed.join(", ")) {
            r.headers_mut().insert(header::ALLOW, v);
        }
        r
    }

    /// Calls `route`'s method with the request's fields.
    async fn call(
        &self,
        route: &Route,
        vars: Vec<(String, String)>,
        req: Request,
    ) -> Result<Response, Status> {
        let d = &self.0;
        let method = &route.method;
        let from = call::Origin {
            authorization: authorization(req.headers())?,
            peer: req
                .extensions()
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        };
        let query = req.uri().query().map(str::to_owned);
        let (parts, body) = req.into_parts();
        if parts.method == Method::POST && !is_json(&parts.headers) {
            let mut r = status::response(
                &d.pool,
                &invalid("Content-Type: a POST's body is JSON (application/json)"),
            );
            *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
            return Ok(r);
        }
        // The listener has read the body whole, within its size and time bounds.
        let body = axum::body::to_bytes(body, usize::MAX)
            .await
            .map_err(|e| invalid(format!("body: not read: {e}")))?;
        if method.is_client_streaming() {
            let inputs = items(method, &body)?;
            let stream = call::streaming_messages(&d.api, method, inputs, &from).await?;
            return Ok(self.lines(stream).await);
        }
        let mut fields = match route.body {
            BodyRule::Whole => {
                if query.as_deref().is_some_and(|q| !q.is_empty()) {
                    return Err(invalid(
                        "query string: this route takes its fields in the JSON body",
                    ));
                }
                body_object(&body)?
            }
            BodyRule::None => {
                if !body.is_empty() {
                    return Err(invalid(format!(
                        "body: {} {} takes no body; its fields go in the query string",
                        route.verb, route.template
                    )));
                }
                query_fields(method, query.as_deref().unwrap_or(""))?
            }
        };
        for (field, value) in vars {
            put_path_field(method, &mut fields, &field, value)?;
        }
        if method.is_server_streaming() {
            resume_from_last_event(method, &mut fields, &parts.headers)?;
        }
        let input = call::message_of(&method.input(), Value::Object(fields), None)?;
        if method.is_server_streaming() {
            let held = d.streams.open(self.caller(&parts.headers))?;
            let stream = call::server_stream_messages(&d.api, method, input, &from).await?;
            return Ok(self.events(stream, held));
        }
        let answer = call::unary_message(&d.api, method, input, &from).await?;
        let json = call::to_json(&answer, true)?;
        Ok(json_bytes(
            StatusCode::OK,
            Bytes::from(serde_json::to_vec(&json).unwrap_or_default()),
        ))
    }

    /// A server stream as Server-Sent Events: each message an event whose data is its JSON
    /// and whose id is its `resume_token`, so an EventSource that reconnects resumes after
    /// it; a status ending the stream an `error` event carrying it; a comment line while
    /// nothing else is written.
    fn events(&self, stream: tonic::Streaming<DynamicMessage>, held: crate::mcp::Held) -> Response {
        let d = self.0.clone();
        let ping = tokio::time::interval_at(tokio::time::Instant::now() + d.ping, d.ping);
        // The stream's place among the caps is given back when its body is dropped.
        let state = Some((stream, ping, held));
        let body = futures_util::stream::unfold(state, move |state| {
            let d = d.clone();
            async move {
                let (mut stream, mut ping, held) = state?;
                let (chunk, more) = tokio::select! {
                    m = stream.message() => match m {
                        Ok(Some(m)) => (event(&m), true),
                        Ok(None) => return None,
                        Err(s) => (error_event(&d.pool, &s), false),
                    },
                    _ = ping.tick() => (": ping\n\n".to_owned(), true),
                    () = d.stopping.wait() => (
                        error_event(&d.pool, &Status::from(Error::Unavailable("the server is stopping: reconnect to resume after the last event".to_owned()))),
                        false,
                    ),
                };
                let next = more.then_some((stream, ping, held));
                Some((Ok::<_, std::convert::Infallible>(Bytes::from(chunk)), next))
            }
        });
        let mut r = Response::new(Body::from_stream(body));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        r
    }

    /// Who the request's credentials are, for the stream caps: the identity they authenticate
    /// as (a refused one is refused by the call itself).
    fn caller(&self, headers: &HeaderMap) -> crate::mcp::CallerKey {
        let authorization = headers
            .get(header::AUTHORIZATION)
            .map(|v| v.to_str().unwrap_or(""));
        match self.0.auth.check(authorization) {
            crate::auth::Caller::Known(id) => crate::mcp::CallerKey::of(Some(&id.bucket())),
            _ => crate::mcp::CallerKey::of(None),
        }
    }

    /// A stream's answers as JSON lines once the first has come (a refusal before it is the
    /// call's status); a status ending the stream later is a last line `{"error": …}`.
    async fn lines(&self, mut stream: tonic::Streaming<DynamicMessage>) -> Response {
        let d = self.0.clone();
        let first = match stream.message().await {
            Ok(m) => m,
            Err(s) => return status::response(&d.pool, &s),
        };
        let first = first.map(|m| line(&m));
        let body = futures_util::stream::unfold((Some(stream), first), move |(stream, pending)| {
            let d = d.clone();
            async move {
                if let Some(l) = pending {
                    return Some((
                        Ok::<_, std::convert::Infallible>(Bytes::from(l)),
                        (stream, None),
                    ));
                }
                let mut stream = stream?;
                match stream.message().await {
                    Ok(Some(m)) => Some((Ok(Bytes::from(line(&m))), (Some(stream), None))),
                    Ok(None) => None,
                    Err(s) => {
                        let mut l =
                            serde_json::json!({ "error": status::json(&d.pool, &s) }).to_string();
                        l.push('\n');
                        Some((Ok(Bytes::from(l)), (None, None)))
                    }
                }
            }
        });
        let mut r = Response::new(Body::from_stream(body));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        r
    }
}

/// One message as a JSON line.
fn line(m: &DynamicMessage) -> String {
    let mut l = call::to_json(m, true)
        .map(|j| j.to_string())
        .unwrap_or_else(|s| {
            serde_json::json!({ "error": { "code": s.code() as i32, "message": s.message() } })
                .to_string()
        });
    l.push('\n');
    l
}

/// One message as an event: its JSON as data (one line: JSON escapes every newline), its
/// resume token as id.
fn event(m: &DynamicMessage) -> String {
    let data = match call::to_json(m, true) {
        Ok(j) => j.to_string(),
        Err(s) => return error_event_plain(&s),
    };
    let id = m
        .get_field_by_name("resume_token")
        .and_then(|v| v.as_str().map(str::to_owned))
        .filter(|t| !t.is_empty() && !t.contains(['\n', '\r']));
    match id {
        Some(id) => format!("id: {id}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

fn error_event(pool: &DescriptorPool, s: &Status) -> String {
    format!("event: error\ndata: {}\n\n", status::json(pool, s))
}

fn error_event_plain(s: &Status) -> String {
    format!(
        "event: error\ndata: {}\n\n",
        serde_json::json!({ "code": s.code() as i32, "message": s.message() })
    )
}

/// An EventSource reconnecting sends the last event's id: the stream resumes after it,
/// unless the query names where to start.
fn resume_from_last_event(
    method: &MethodDescriptor,
    fields: &mut Map<String, Value>,
    headers: &HeaderMap,
) -> Result<(), Status> {
    let Some(last) = headers.get("last-event-id") else {
        return Ok(());
    };
    let Some(field) = method.input().get_field_by_name("resume_token") else {
        return Ok(());
    };
    let last = last
        .to_str()
        .map_err(|_| invalid("Last-Event-ID: must be a resume token (ASCII)"))?;
    let starts = field
        .containing_oneof()
        .map(|o| o.fields().collect::<Vec<_>>())
        .unwrap_or_else(|| vec![field.clone()]);
    let named = starts
        .iter()
        .any(|f| fields.contains_key(f.name()) || fields.contains_key(f.json_name()));
    if !named && !last.is_empty() {
        fields.insert(field.name().to_owned(), Value::String(last.to_owned()));
    }
    Ok(())
}

/// The request's `Authorization`, to be carried to the API as it is.
fn authorization(headers: &HeaderMap) -> Result<Option<AsciiMetadataValue>, Status> {
    match headers.get(header::AUTHORIZATION) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| AsciiMetadataValue::try_from(s).ok())
            .map(Some)
            .ok_or_else(|| {
                Status::from(Error::Unauthenticated(
                    "Authorization: credentials are missing or were refused".to_owned(),
                ))
            }),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| {
            let v = v.trim();
            v.eq_ignore_ascii_case("application/json")
                || v.eq_ignore_ascii_case("application/x-ndjson")
        })
}

/// A host name a browser can only mean this machine by: exactly one Host header, naming
/// `localhost` or a loopback address, with at most a numeric port.
fn loopback_host(headers: &HeaderMap) -> bool {
    let mut hosts = headers.get_all(header::HOST).iter();
    let (Some(host), None) = (hosts.next(), hosts.next()) else {
        return false;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((name, tail)) => match tail {
                "" => (name, None),
                t => match t.strip_prefix(':') {
                    Some(p) => (name, Some(p)),
                    None => return false,
                },
            },
            None => return false,
        },
        None => match host.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        },
    };
    let port_ok =
        port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    let bracketed = host.starts_with('[');
    port_ok
        && (name.eq_ignore_ascii_case("localhost") && !bracketed
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() && (ip.is_ipv6() == bracketed)))
}

/// A body that must be one JSON object (an empty body is `{}`).
fn body_object(body: &[u8]) -> Result<Map<String, Value>, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(invalid(
            "body: must be a JSON object (the request message's protobuf JSON)",
        )),
        Err(e) => Err(invalid(format!("body: not JSON: {e}"))),
    }
}

/// A streaming call's requests: a JSON array of them, or one JSON object a line.
fn items(method: &MethodDescriptor, body: &[u8]) -> Result<Vec<DynamicMessage>, Status> {
    let text = std::str::from_utf8(body).map_err(|_| invalid("body: not UTF-8"))?;
    let values: Vec<Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str::<Vec<Value>>(text)
            .map_err(|e| invalid(format!("body: not a JSON array: {e}")))?
    } else {
        let mut out = Vec::new();
        for (n, l) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            out.push(
                serde_json::from_str(l)
                    .map_err(|e| invalid(format!("body: line {}: not JSON: {e}", n + 1)))?,
            );
        }
        out
    };
    if values.is_empty() {
        return Err(invalid(
            "body: no requests (a JSON array of them, or one JSON object a line)",
        ));
    }
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| call::message_of(&method.input(), v, Some(&format!("body[{i}]"))))
        .collect()
}

/// The query string's fields, each typed by its field: `page_size=10`, `route=ROUTE_INBOX`,
/// `start_time=2026-01-01T00:00:00Z`, a nested field by its dotted path. A repeated field
/// may be given more than once; any other field once.
fn query_fields(method: &MethodDescriptor, query: &str) -> Result<Map<String, Value>, Status> {
    let input = method.input();
    let mut fields = Map::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(k), Some(v)) = (rules::query_decode(k), rules::query_decode(v)) else {
            return Err(invalid(format!(
                "query string: `{pair}` is not percent-encoded UTF-8"
            )));
        };
        let Some(field) = rules::field(&input, &k) else {
            return Err(invalid(format!(
                "{k}: not a field of {} (query parameters are its fields, by name)",
                input.full_name()
            )));
        };
        let value = match field.kind() {
            Kind::Bool => match v.as_str() {
                "true" | "1" => Value::Bool(true),
                "false" | "0" => Value::Bool(false),
                _ => Value::String(v),
            },
            Kind::Double | Kind::Float => v
                .parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .and_then(serde_json::Number::from_f64)
                .map_or(Value::String(v), Value::Number),
            Kind::Enum(_) => v.parse::<i64>().map_or(Value::String(v), Value::from),
            Kind::Message(m) if !is_scalar_message(&m) => {
                return Err(invalid(format!(
                    "{k}: a message; give its fields in the query string ({k}.field=…)"
                )))
            }
            _ => Value::String(v),
        };
        // One field, whichever name it is given by (`page_size`, `pageSize`).
        let k = proto_path(&input, &k);
        let slot = slot(&mut fields, &k)?;
        match (field.is_list(), slot) {
            (true, s @ Value::Null) => *s = Value::Array(vec![value]),
            (true, Value::Array(items)) => items.push(value),
            (false, s @ Value::Null) => *s = value,
            _ => {
                return Err(invalid(format!(
                    "{k}: given more than once (only a repeated field may be)"
                )))
            }
        }
    }
    Ok(fields)
}

/// A dotted field path with each step by its proto name.
fn proto_path(message: &prost_reflect::MessageDescriptor, path: &str) -> String {
    let mut at = message.clone();
    let mut out = Vec::new();
    for step in path.split('.') {
        let Some(f) = at
            .get_field_by_name(step)
            .or_else(|| at.get_field_by_json_name(step))
        else {
            out.push(step.to_owned());
            continue;
        };
        out.push(f.name().to_owned());
        if let Kind::Message(m) = f.kind() {
            at = m;
        }
    }
    out.join(".")
}

/// Messages written as one JSON string or number (Timestamp, Duration, wrappers, FieldMask).
fn is_scalar_message(m: &prost_reflect::MessageDescriptor) -> bool {
    m.package_name() == "google.protobuf"
        && !matches!(m.name(), "Struct" | "ListValue" | "Any" | "Empty")
}

/// The JSON value at a dotted path of `fields`, made (null) if absent.
fn slot<'a>(fields: &'a mut Map<String, Value>, path: &str) -> Result<&'a mut Value, Status> {
    let mut at = fields;
    let mut steps = path.split('.').peekable();
    loop {
        let step = steps.next().unwrap_or_default();
        if steps.peek().is_none() {
            return Ok(at.entry(step.to_owned()).or_insert(Value::Null));
        }
        let next = at
            .entry(step.to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
        at = match next {
            Value::Object(m) => m,
            _ => return Err(invalid(format!("{path}: {step} is not a message here"))),
        };
    }
}

/// Sets a path variable's field; the body may name it too, only with the same value.
fn put_path_field(
    method: &MethodDescriptor,
    fields: &mut Map<String, Value>,
    path: &str,
    value: String,
) -> Result<(), Status> {
    let input = method.input();
    // The body may spell each step by its JSON name.
    let mut at = &mut *fields;
    let mut message = input.clone();
    let steps: Vec<&str> = path.split('.').collect();
    for (i, step) in steps.iter().enumerate() {
        let Some(f) = message.get_field_by_name(step) else {
            return Err(internal(format!(
                "route field {path} is not in {}",
                input.full_name()
            )));
        };
        let key = if at.contains_key(f.json_name()) && !at.contains_key(f.name()) {
            f.json_name().to_owned()
        } else {
            f.name().to_owned()
        };
        if i + 1 == steps.len() {
            match at.get(&key) {
                Some(Value::String(s)) if *s != value => {
                    return Err(invalid(format!(
                        "{path}: the body says `{s}`, the path `{value}`"
                    )))
                }
                Some(Value::String(_)) | Some(Value::Null) | None => {}
                Some(_) => return Err(invalid(format!("{path}: must be a string"))),
            }
            at.insert(key, Value::String(value));
            return Ok(());
        }
        let Kind::Message(m) = f.kind() else {
            return Err(internal(format!(
                "route field {path}: {step} is not a message"
            )));
        };
        message = m;
        let next = at.entry(key).or_insert_with(|| Value::Object(Map::new()));
        at = match next {
            Value::Object(m) => m,
            _ => return Err(invalid(format!("{step}: must be an object"))),
        };
    }
    Ok(())
}

fn json_bytes(code: StatusCode, body: Bytes) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn redirect(to: &'static str) -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::SEE_OTHER;
    r.headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static(to));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method(name: &str) -> MethodDescriptor {
        let pool = pool().expect("pool");
        let found = pool
            .services()
            .flat_map(|s| s.methods().collect::<Vec<_>>())
            .find(|m| m.name() == name)
            .expect("method");
        found
    }

    #[test]
    fn query_parameters_are_typed_by_their_fields() {
        let m = method("ListRecords");
        let f = query_fields(
            &m,
            "page_size=10&route=ROUTE_INBOX&pack_id=a%2Bb&principal=x+y",
        )
        .expect("fields");
        assert_eq!(f["page_size"], "10");
        assert_eq!(f["route"], "ROUTE_INBOX");
        assert_eq!(f["pack_id"], "a+b");
        assert_eq!(f["principal"], "x y");
        let input = call::message_of(&m.input(), Value::Object(f), None).expect("message");
        assert_eq!(
            input
                .get_field_by_name("page_size")
                .and_then(|v| v.as_i32()),
            Some(10)
        );
        let e = query_fields(&m, "nope=1").expect_err("unknown");
        assert!(
            e.message()
                .starts_with("nope: not a field of hcp.sense.v1.ListRecordsRequest"),
            "{}",
            e.message()
        );
        let e = query_fields(&m, "pack_id=a&pack_id=b").expect_err("twice");
        assert!(e.message().contains("more than once"), "{}", e.message());
        let e = query_fields(&m, "page_size=1&pageSize=3").expect_err("twice, by both names");
        assert!(e.message().contains("more than once"), "{}", e.message());
        let e = call::message_of(
            &m.input(),
            Value::Object(query_fields(&m, "page_size=many").expect("f")),
            None,
        )
        .expect_err("not a number");
        assert!(e.message().starts_with("page_size"), "{}", e.message());
    }

    #[test]
    fn a_path_variable_agrees_with_the_body_or_is_refused() {
        let m = method("PutIngressRoute");
        let mut f = body_object(br#"{"route": {"routeId": "a", "packId": "p"}}"#).expect("body");
        put_path_field(&m, &mut f, "route.route_id", "a".into()).expect("same");
        let mut f = body_object(br#"{"route": {"routeId": "b"}}"#).expect("body");
        let e = put_path_field(&m, &mut f, "route.route_id", "a".into()).expect_err("differs");
        assert!(
            e.message().starts_with("route.route_id: the body says `b`"),
            "{}",
            e.message()
        );
        let mut f = Map::new();
        put_path_field(&m, &mut f, "route.route_id", "a".into()).expect("set");
        assert_eq!(f["route"]["route_id"], "a");
    }

    #[test]
    fn without_authentication_only_loopback_host_names_are_answered() {
        let host = |h: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, HeaderValue::from_str(h).expect("h"));
            loopback_host(&m)
        };
        assert!(host("localhost:8080"));
        assert!(host("127.0.0.1:1"));
        assert!(host("[::1]:80"));
        assert!(!host("evil.example:8080"));
        assert!(!host("localhost.evil.example"));
        assert!(!host("10.0.0.1"));
        for h in [
            "[::1]evil.example",
            "[::1].evil.example",
            "127.0.0.1:evil",
            "localhost:52080, evil.example",
            "::1",
            "[127.0.0.1]",
            "localhost:",
        ] {
            assert!(!host(h), "{h}");
        }
        let mut two = HeaderMap::new();
        two.append(header::HOST, HeaderValue::from_static("localhost"));
        two.append(header::HOST, HeaderValue::from_static("evil.example"));
        assert!(!loopback_host(&two));
        assert!(!loopback_host(&HeaderMap::new()), "no Host at all");
    }

    #[test]
    fn a_reconnecting_event_source_resumes_after_its_last_event() {
        let m = method("WatchRecords");
        let mut h = HeaderMap::new();
        h.insert("last-event-id", HeaderValue::from_static("tok"));
        let mut f = Map::new();
        resume_from_last_event(&m, &mut f, &h).expect("ok");
        assert_eq!(f["resume_token"], "tok");
        let mut f = Map::new();
        f.insert("afterRecordId".into(), "r".into());
        resume_from_last_event(&m, &mut f, &h).expect("ok");
        assert!(!f.contains_key("resume_token"), "an explicit start wins");
    }
}
