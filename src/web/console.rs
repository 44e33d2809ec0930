//! The operator console's files, embedded in the binary: pages that hold no data of their own and call the JSON routes with the operator's token.
use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;

/// Where the console is served.
pub const PATH: &str = "/console/";

/// Scripts and styles only from this origin, none inline; no frames; data only from the
/// JSON routes. A record's payload or a pack's description cannot run as script here even
/// if a page wrote it as markup (they write text).
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const FILES: &[(&str, &str, &str)] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("console/index.html"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("console/console.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("console/console.css"),
    ),
];

/// The file `path` names under the console, if it is one.
pub fn serve(path: &str) -> Option<Response> {
    if path == "/console" {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::MOVED_PERMANENTLY;
        r.headers_mut()
            .insert(header::LOCATION, HeaderValue::from_static(PATH));
        return Some(r);
    }
    let name = path.strip_prefix(PATH)?;
    let name = if name.is_empty() { "index.html" } else { name };
    let (_, kind, text) = FILES.iter().find(|(n, _, _)| *n == name)?;
    let mut r = Response::new(Body::from(*text));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Some(r)
}
