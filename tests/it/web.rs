//! The JSON door with the clients users bring (a plain HTTP client, curl, Python's OpenAPI validator, headless Chromium): every RPC by its route, the API's refusals as google.rpc.Status, WatchRecords as Server-Sent Events, the OpenAPI document against what is served, and the operator console.
use std::net::SocketAddr;
use std::time::Duration;

use hcp_sense::grpc::pb;
use serde_json::{json, Value};

use crate::helpers::{spawn_app_with, StoreKind, TestApp};
use crate::security::{bearer, secured_with, ADMIN, RUNTIME};
use crate::support::http1::Req;

/// A pack description that would run if a page wrote it as markup.
const MARKUP: &str = "<img src=x onerror=alert(2)><script>alert(3)</script>";

/// The reader token of `secured_with`: alice's.
const ALICE: &str = crate::security::READER;

/// A server with tokens and JWTs (`secured_with`), the JSON door and the console; `github`
/// registered and opened for alice and bob.
async fn served(
    kind: StoreKind,
    adjust: impl FnOnce(&mut hcp_sense::config::Config),
) -> (TestApp, tempfile::TempDir, SocketAddr) {
    let (app, dir) = secured_with(kind, |c| {
        c.http_listen = Some("127.0.0.1:0".parse().expect("addr"));
        c.console = true;
        adjust(c);
    })
    .await;
    crate::identity::set_up(&app.channel, ADMIN, &["alice", "bob"]).await;
    let web = app.web_addr.expect("the JSON door is configured");
    (app, dir, web)
}

/// Delivers one of github's `issue.opened` to `principal` over JSON, with `trigger_id`.
async fn deliver(web: SocketAddr, principal: &str, trigger_id: &str) -> Value {
    let a = Req::new("POST", "/v1/triggers:deliver")
        .bearer(RUNTIME)
        .json(&json!({
            "packId": "github", "ref": "issue.opened", "principal": principal, "land": "user",
            "triggerId": trigger_id,
            "payload": { "action": "opened", "issue": { "number": 7, "title": "<img src=x onerror=alert(1)>" } },
        }))
        .send(web)
        .await;
    assert_eq!(a.status, 200, "{a:?}");
    a.json()
}

/// Every operation of the OpenAPI document, called with an admin's token: none is the door's
/// own "no route" or "not served", and afterwards every method of the API has been called
/// (its latency histogram counts it).
async fn every_rpc_is_reached_by_its_json_route(kind: StoreKind) {
    let (app, _dir, web) = served(kind, |c| c.bench_baseline = true).await;
    let doc = Req::new("GET", "/openapi.json").send(web).await;
    assert_eq!(doc.status, 200);
    assert_eq!(doc.header("content-type"), Some("application/json"));
    let doc = doc.json();
    let pool = hcp_sense::web::pool().expect("pool");
    let mut methods: Vec<String> = pool
        .services()
        .filter(|s| s.package_name() == "hcp.sense.v1")
        .flat_map(|s| {
            s.methods()
                .map(|m| format!("{}_{}", s.name(), m.name()))
                .collect::<Vec<_>>()
        })
        .collect();
    methods.sort();
    let mut operations = Vec::new();
    for (path, ops) in doc["paths"].as_object().expect("paths") {
        for (verb, op) in ops.as_object().expect("operations") {
            operations.push(op["operationId"].as_str().expect("operationId").to_owned());
            let concrete = concrete(path);
            let mut req = Req::new(verb_of(verb), &concrete).bearer(ADMIN);
            let streaming = op["requestBody"]["content"]
                .get("application/x-ndjson")
                .is_some();
            if op.get("requestBody").is_some() {
                req = req.json(&if streaming { json!([{}]) } else { json!({}) });
            }
            let a = req.send(web).await;
            let body = if a.header("content-type") == Some("text/event-stream") {
                json!({})
            } else if streaming && a.status == 200 {
                serde_json::from_str(a.body.lines().next().unwrap_or("{}")).expect("a JSON line")
            } else {
                a.json()
            };
            let message = body["message"].as_str().unwrap_or_default();
            assert!(
                !message.starts_with("no route") && a.status != 405,
                "{verb} {concrete} is not served: {a:?}"
            );
            // No route lets a reader past the role table: what it may not call over gRPC
            // is 403 here too.
            let (service, rpc) = op["summary"]
                .as_str()
                .and_then(|s| s.rsplit_once('.'))
                .expect("summary: Service.Method");
            let method = format!("/{service}/{rpc}");
            if !hcp_sense::auth::allowed(&method, hcp_sense::auth::Role::Reader) {
                let mut req = Req::new(verb_of(verb), &concrete).bearer(ALICE);
                if op.get("requestBody").is_some() {
                    req = req.json(&if streaming { json!([{}]) } else { json!({}) });
                }
                let a = req.send(web).await;
                assert_eq!(a.status, 403, "a reader calling {method}: {a:?}");
            }
        }
    }
    operations.sort();
    assert_eq!(operations, methods, "one operation per RPC, and only those");
    let metrics = crate::helpers::http_get(&format!("http://{}/metrics", app.metrics_addr));
    for s in pool
        .services()
        .filter(|s| s.package_name() == "hcp.sense.v1")
    {
        for m in s.methods() {
            let series = format!("method=\"/{}/{}\"", s.full_name(), m.name());
            assert!(
                metrics
                    .lines()
                    .any(|l| l.contains("rpc_duration_seconds_count") && l.contains(&series)),
                "{series} was never called through its JSON route"
            );
        }
    }
}
on_both_stores!(every_rpc_is_reached_by_its_json_route => every_rpc_is_reached_by_its_json_route);

/// A template's path with each variable `x`.
fn concrete(template: &str) -> String {
    let mut out = String::new();
    let mut in_var = false;
    for c in template.chars() {
        match c {
            '{' => in_var = true,
            '}' => {
                in_var = false;
                out.push('x');
            }
            _ if in_var => {}
            _ => out.push(c),
        }
    }
    out
}

fn verb_of(v: &str) -> &'static str {
    match v {
        "get" => "GET",
        "post" => "POST",
        "put" => "PUT",
        "delete" => "DELETE",
        "patch" => "PATCH",
        other => panic!("verb {other}"),
    }
}

/// The OpenAPI document validates as OpenAPI 3.1 (openapi-spec-validator), and every path
/// it names answers on the door with the verbs it lists and no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_validates_and_lists_what_is_served() {
    let (_app, _dir, web) = served(StoreKind::Sqlite, |_| {}).await;
    let report = crate::support::python::run(
        "openapi_check.py",
        "openapi-spec-validator",
        json!({ "url": format!("http://{web}/openapi.json") }),
    )
    .await;
    assert_eq!(report["valid"], true, "{report}");
    // BenchService is offered (and routed) only with --bench-baseline.
    let methods = hcp_sense::web::pool()
        .expect("pool")
        .services()
        .filter(|s| s.package_name() == "hcp.sense.v1" && s.name() != "BenchService")
        .map(|s| s.methods().len() as u64)
        .sum::<u64>();
    assert_eq!(report["operations"].as_u64(), Some(methods), "{report}");
    // A verb the document does not list for a path is 405, naming the ones it does.
    let a = Req::new("PATCH", "/v1/packs").bearer(ADMIN).send(web).await;
    assert_eq!(a.status, 405, "{a:?}");
    assert_eq!(a.header("allow"), Some("POST, GET"));
}

/// A refusal over JSON is the status a gRPC client gets: the same code and message, the same
/// field violations as a BadRequest detail, the HTTP status of the code.
async fn refusals_carry_the_grpc_status_and_its_details(kind: StoreKind) {
    let (app, _dir, web) = served(kind, |_| {}).await;
    // INVALID_ARGUMENT, from the API.
    let grpc = pb::record_service_client::RecordServiceClient::new(bearer(&app.channel, ADMIN))
        .list_records(pb::ListRecordsRequest {
            page_size: -5,
            ..Default::default()
        })
        .await
        .expect_err("a negative page size");
    let a = Req::new("GET", "/v1/records?page_size=-5")
        .bearer(ADMIN)
        .send(web)
        .await;
    assert_eq!(a.status, 400, "{a:?}");
    let j = a.json();
    assert_eq!(j["code"], grpc.code() as i32);
    assert_eq!(j["message"], grpc.message());
    let violations: Vec<(String, String)> = j["details"]
        .as_array()
        .expect("details")
        .iter()
        .filter(|d| d["@type"] == "type.googleapis.com/google.rpc.BadRequest")
        .flat_map(|d| d["fieldViolations"].as_array().cloned().unwrap_or_default())
        .map(|v| {
            (
                v["field"].as_str().unwrap_or_default().to_owned(),
                v["description"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(violations, crate::helpers::violations(&grpc));
    assert!(!violations.is_empty());
    // UNAUTHENTICATED: no credentials, and refused ones, with a Bearer challenge.
    for req in [
        Req::new("GET", "/v1/packs"),
        Req::new("GET", "/v1/packs").bearer("not-a-token"),
    ] {
        let a = req.send(web).await;
        assert_eq!(a.status, 401, "{a:?}");
        assert_eq!(a.json()["code"], 16);
        assert!(
            a.header("www-authenticate")
                .is_some_and(|h| h.starts_with("Bearer")),
            "{a:?}"
        );
    }
    // PERMISSION_DENIED: a reader granting, as over gRPC.
    let grpc = pb::policy_service_client::PolicyServiceClient::new(bearer(&app.channel, ALICE))
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect_err("a reader may not grant");
    let a = Req::new("POST", "/v1/packs/github/grants")
        .bearer(ALICE)
        .json(&json!({ "principal": "mallory" }))
        .send(web)
        .await;
    assert_eq!(a.status, 403, "{a:?}");
    assert_eq!(a.json()["message"], grpc.message());
    // NOT_FOUND and its route's field names.
    let a = Req::new("GET", "/v1/packs/nope")
        .bearer(ADMIN)
        .send(web)
        .await;
    assert_eq!(
        (a.status, a.json()["code"].as_i64()),
        (404, Some(5)),
        "{a:?}"
    );
    // A field the request message lacks is named.
    let a = Req::new("GET", "/v1/packs?colour=red")
        .bearer(ADMIN)
        .send(web)
        .await;
    assert_eq!(a.status, 400);
    assert!(
        a.json()["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("colour: not a field of hcp.sense.v1.ListPacksRequest"),
        "{a:?}"
    );
    // A body's field that contradicts the path is refused, naming it; the same value is fine.
    let a = Req::new("POST", "/v1/packs/github/activations")
        .bearer(ADMIN)
        .json(&json!({ "packId": "other", "principal": "alice", "route": "ROUTE_INBOX" }))
        .send(web)
        .await;
    assert_eq!(a.status, 400);
    assert!(
        a.json()["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("pack_id: the body says `other`"),
        "{a:?}"
    );
    let a = Req::new("POST", "/v1/packs/github/activations")
        .bearer(ADMIN)
        .json(&json!({ "packId": "github", "principal": "alice", "route": "ROUTE_INBOX" }))
        .send(web)
        .await;
    assert_eq!(a.status, 200, "{a:?}");
}
on_both_stores!(refusals_carry_the_grpc_status_and_its_details => refusals_carry_the_grpc_status_and_its_details);

/// Over a caller's rate limit the answer is 429 with the RetryInfo detail and Retry-After
/// in whole seconds, rounded up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_rate_limit_the_answer_says_when_to_retry() {
    let (app, _dir) = secured_with(StoreKind::Sqlite, |c| {
        c.http_listen = Some("127.0.0.1:0".parse().expect("addr"));
        c.rate_limit_per_sec = 0.5;
    })
    .await;
    let web = app.web_addr.expect("door");
    let mut refused = None;
    for _ in 0..20 {
        let a = Req::new("GET", "/v1/caller").bearer(ALICE).send(web).await;
        if a.status != 200 {
            refused = Some(a);
            break;
        }
    }
    let a = refused.expect("refused within 20 calls at 0.5/s");
    assert_eq!(a.status, 429, "{a:?}");
    let j = a.json();
    assert_eq!(j["code"], 8);
    let delay = j["details"]
        .as_array()
        .expect("details")
        .iter()
        .find(|d| d["@type"] == "type.googleapis.com/google.rpc.RetryInfo")
        .and_then(|d| d["retryDelay"].as_str())
        .unwrap_or_else(|| panic!("a RetryInfo: {j}"))
        .trim_end_matches('s')
        .parse::<f64>()
        .expect("seconds");
    let after: f64 = a
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    assert_eq!(after, delay.ceil().max(1.0), "{a:?}");
}

/// A reader reads its own records over JSON and nobody else's; a record of another is
/// NOT_FOUND, as one that does not exist.
async fn s7_5_3_a_reader_reads_only_its_own_records_over_json(kind: StoreKind) {
    let (_app, _dir, web) = served(kind, |_| {}).await;
    let alices = deliver(web, "alice", "a-1").await["recordId"]
        .as_str()
        .expect("id")
        .to_owned();
    let bobs = deliver(web, "bob", "b-1").await["recordId"]
        .as_str()
        .expect("id")
        .to_owned();
    let list = Req::new("GET", "/v1/records").bearer(ALICE).send(web).await;
    assert_eq!(list.status, 200, "{list:?}");
    let ids: Vec<&str> = list.json()["records"]
        .as_array()
        .expect("records")
        .iter()
        .filter_map(|r| r["recordId"].as_str().map(|_| ""))
        .collect();
    assert_eq!(ids.len(), 1);
    let list = list.json();
    assert_eq!(list["records"][0]["recordId"], alices.as_str());
    assert_eq!(list["records"][0]["principal"], "alice");
    let own = Req::new("GET", &format!("/v1/records/{alices}"))
        .bearer(ALICE)
        .send(web)
        .await;
    assert_eq!(own.status, 200);
    let other = Req::new("GET", &format!("/v1/records/{bobs}"))
        .bearer(ALICE)
        .send(web)
        .await;
    assert_eq!(other.status, 404, "{other:?}");
    let asked = Req::new("GET", "/v1/records?principal=bob")
        .bearer(ALICE)
        .send(web)
        .await;
    assert_ne!(
        asked.status, 200,
        "a reader naming another principal is refused: {asked:?}"
    );
}
on_both_stores!(s7_5_3_a_reader_reads_only_its_own_records_over_json => s7_5_3_a_reader_reads_only_its_own_records_over_json);

/// WatchRecords as Server-Sent Events: each record an event whose id is its resume token;
/// a client reconnecting with Last-Event-ID hears exactly what committed meanwhile.
async fn watch_records_as_events_resumes_from_the_last_event_id(kind: StoreKind) {
    let (_app, _dir, web) = served(kind, |_| {}).await;
    let (head, mut events) = Req::new("GET", "/v1/records:watch?from_now=true")
        .bearer(ALICE)
        .header("Accept", "text/event-stream")
        .events(web)
        .await;
    assert_eq!(head.status, 200, "{head:?}");
    assert_eq!(head.header("content-type"), Some("text/event-stream"));
    // The watch is open once it has told its start; a progress event may come first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = deliver(web, "alice", "w-1").await["recordId"]
        .as_str()
        .expect("id")
        .to_owned();
    deliver(web, "bob", "w-bob").await;
    let e = events
        .next_records(Duration::from_secs(10))
        .await
        .expect("an event");
    assert_eq!(e.event, None, "{e:?}");
    let j = e.json();
    assert_eq!(j["records"][0]["recordId"], first.as_str());
    assert_eq!(
        j["records"].as_array().map(Vec::len),
        Some(1),
        "bob's is not alice's: {j}"
    );
    // The payload is data: written as JSON, never as markup.
    assert_eq!(
        j["records"][0]["payload"]["issue"]["title"],
        "<img src=x onerror=alert(1)>"
    );
    let last = e.id.clone().expect("an id");
    assert_eq!(j["resumeToken"], last.as_str());
    drop(events);
    let mut missed = Vec::new();
    for i in 2..=4 {
        missed.push(
            deliver(web, "alice", &format!("w-{i}")).await["recordId"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let (head, mut events) = Req::new("GET", "/v1/records:watch")
        .bearer(ALICE)
        .header("Last-Event-ID", last)
        .events(web)
        .await;
    assert_eq!(head.status, 200, "{head:?}");
    let mut heard = Vec::new();
    while heard.len() < missed.len() {
        let e = events
            .next_records(Duration::from_secs(10))
            .await
            .expect("the missed records");
        for r in e.json()["records"].as_array().expect("records") {
            heard.push(r["recordId"].as_str().expect("id").to_owned());
        }
    }
    assert_eq!(
        heard, missed,
        "exactly what committed meanwhile, in order, no repeat"
    );
    // A malformed Last-Event-ID is the API's refusal of the token.
    let (head, _) = Req::new("GET", "/v1/records:watch")
        .bearer(ALICE)
        .header("Last-Event-ID", "garbage")
        .events(web)
        .await;
    assert_eq!(head.status, 400, "{head:?}");
}
on_both_stores!(watch_records_as_events_resumes_from_the_last_event_id => watch_records_as_events_resumes_from_the_last_event_id);

/// An event stream opened with a JWT ends at its expiry with an `error` event carrying
/// UNAUTHENTICATED; the JWT then opens nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_ends_when_its_jwt_expires() {
    use crate::security::{jwt_until, now};
    let (_app, _dir, web) = served(StoreKind::Sqlite, |_| {}).await;
    let exp = now() + 3;
    let due = (exp + hcp_sense::auth::JWT_LEEWAY_SECS as i64) as f64;
    let jwt = jwt_until("reader", "alice", exp);
    let (head, mut events) = Req::new("GET", "/v1/records:watch?from_now=true")
        .bearer(&jwt)
        .events(web)
        .await;
    assert_eq!(head.status, 200, "{head:?}");
    let ended = loop {
        let e = events
            .next(Duration::from_secs(20))
            .await
            .expect("an end within 20 s");
        if e.event.as_deref() == Some("error") {
            break e;
        }
    };
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    assert!(
        (at - due).abs() < 2.0,
        "ended {:+.2} s from the expiry",
        at - due
    );
    assert_eq!(ended.json()["code"], 16, "{ended:?}");
    assert!(
        events.next(Duration::from_secs(2)).await.is_none(),
        "the stream ends there"
    );
    let a = Req::new("GET", "/v1/records").bearer(&jwt).send(web).await;
    assert_eq!(a.status, 401);
}

/// GetCaller says who the credentials are: an admin token, a reader token with its
/// principal, a JWT with its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_caller_is_told_who_its_credentials_are() {
    use crate::security::{jwt_until, now};
    let (_app, _dir, web) = served(StoreKind::Sqlite, |_| {}).await;
    let a = Req::new("GET", "/v1/caller")
        .bearer(ADMIN)
        .send(web)
        .await
        .json();
    assert_eq!(a["subject"], "ops");
    assert_eq!(a["role"], "CALLER_ROLE_ADMIN");
    assert_eq!(a["credentialKind"], "CREDENTIAL_KIND_TOKEN");
    assert_eq!(a["authenticated"], true);
    let r = Req::new("GET", "/v1/caller")
        .bearer(ALICE)
        .send(web)
        .await
        .json();
    assert_eq!(r["role"], "CALLER_ROLE_READER");
    assert_eq!(r["principal"], "alice");
    let exp = now() + 600;
    let j = Req::new("GET", "/v1/caller")
        .bearer(&jwt_until("runtime", "rt-9", exp))
        .send(web)
        .await
        .json();
    assert_eq!(j["subject"], "rt-9");
    assert_eq!(j["credentialKind"], "CREDENTIAL_KIND_JWT");
    assert!(
        j["expireTime"]
            .as_str()
            .is_some_and(|t| t.starts_with("20")),
        "{j}"
    );
    assert_eq!(Req::new("GET", "/v1/caller").send(web).await.status, 401);
}

/// No ambient authority: a POST must be JSON (no HTML form can send it), nothing reads a
/// cookie, and without authentication only loopback host names are answered (a page that
/// rebinds its own name to this address gets nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_site_cannot_act_through_the_door() {
    let (_app, _dir, web) = served(StoreKind::Sqlite, |_| {}).await;
    for kind in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let a = Req::new("POST", "/v1/packs/github/grants")
            .bearer(ADMIN)
            .header("Content-Type", kind)
            .body(r#"{"principal":"mallory"}"#)
            .send(web)
            .await;
        assert_eq!(a.status, 415, "{kind}: {a:?}");
    }
    let a = Req::new("POST", "/v1/packs/github/grants")
        .header("Cookie", format!("token={ADMIN}; session={ADMIN}"))
        .json(&json!({ "principal": "mallory" }))
        .send(web)
        .await;
    assert_eq!(a.status, 401, "a cookie is no credential: {a:?}");
    // No CORS: a preflight is not answered with an allowance.
    let a = Req::new("OPTIONS", "/v1/packs")
        .header("Origin", "https://evil.example")
        .header("Access-Control-Request-Method", "POST")
        .send(web)
        .await;
    assert!(a.header("access-control-allow-origin").is_none(), "{a:?}");

    let open = spawn_app_with(StoreKind::Sqlite, |c| {
        c.http_listen = Some("127.0.0.1:0".parse().expect("addr"));
    })
    .await;
    let open_web = open.web_addr.expect("door");
    let a = Req::new("GET", "/v1/packs")
        .header("Host", "rebound.evil.example")
        .send(open_web)
        .await;
    assert_eq!(a.status, 403, "{a:?}");
    assert!(a.json()["message"]
        .as_str()
        .unwrap_or_default()
        .starts_with("Host:"));
    let a = Req::new("GET", "/v1/packs")
        .header("Host", format!("localhost:{}", open_web.port()))
        .send(open_web)
        .await;
    assert_eq!(a.status, 200, "{a:?}");
}

/// The door has the HTTP listeners' bounds: a body over --max-request-bytes is 413 (one of
/// exactly that size is read), and a head that never finishes is closed at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_is_bounded_like_the_other_listeners() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_app, _dir, web) = served(StoreKind::Sqlite, |c| {
        c.max_request_bytes = 4096;
        c.http_header_timeout = Duration::from_secs(1);
    })
    .await;
    let body = |n: usize| {
        // A JSON object of exactly n bytes: {"manifestText":"xxx…"}.
        let pad = n - r#"{"manifestText":""}"#.len();
        format!(r#"{{"manifestText":"{}"}}"#, "x".repeat(pad))
    };
    let at = Req::new("POST", "/v1/packs:lint")
        .bearer(ADMIN)
        .header("Content-Type", "application/json")
        .body(body(4096))
        .send(web)
        .await;
    assert_ne!(at.status, 413, "{at:?}");
    let over = Req::new("POST", "/v1/packs:lint")
        .bearer(ADMIN)
        .header("Content-Type", "application/json")
        .body(body(4097))
        .send(web)
        .await;
    assert_eq!(over.status, 413, "{over:?}");
    let mut s = tokio::net::TcpStream::connect(web).await.expect("connect");
    s.write_all(b"GET /v1/packs HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("half a head");
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "a head that never finishes is closed at its deadline"
    );
}

/// The console's pages are served only with --console, as files of the binary, under a
/// policy that runs no script but its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_under_a_strict_policy_only_when_asked() {
    let (_app, _dir, web) = served(StoreKind::Sqlite, |_| {}).await;
    let page = Req::new("GET", "/console/").send(web).await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("<main>"));
    let csp = page.header("content-security-policy").expect("a policy");
    assert!(
        csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert!(!csp.contains("unsafe-inline"));
    assert_eq!(
        Req::new("GET", "/console/console.js")
            .send(web)
            .await
            .status,
        200
    );
    assert_eq!(
        Req::new("GET", "/console/../openapi.json")
            .send(web)
            .await
            .status,
        404
    );
    let plain = spawn_app_with(StoreKind::Sqlite, |c| {
        c.http_listen = Some("127.0.0.1:0".parse().expect("addr"));
    })
    .await;
    let a = Req::new("GET", "/console/")
        .header("Host", "localhost")
        .send(plain.web_addr.expect("door"))
        .await;
    assert_eq!(a.status, 404, "{a:?}");
}

/// The console in Debian's headless Chromium (Selenium): an admin signs in and sees who
/// and which role, grants and activates alice, watches her inbox and sees a delivered
/// trigger arrive (its payload shown as text, never run), finds a dropped trigger's reason
/// and its decision's deciding check; a reader's attempt to grant is refused on the page.
async fn the_console_drives_the_api_in_a_real_browser(kind: StoreKind) {
    let (app, _dir) = secured_with(kind, |c| {
        c.http_listen = Some("127.0.0.1:0".parse().expect("addr"));
        c.console = true;
    })
    .await;
    let web = app.web_addr.expect("the JSON door is configured");
    // github registered (opened for bob), its first trigger described in markup, and a
    // Binding of alice's: the console grants and activates her.
    let mut github = crate::helpers::example("github.pack.json");
    github["stimulusTriggers"][0]["description"] = json!(MARKUP);
    crate::identity::set_up_pack(&app.channel, ADMIN, &github, &["bob"]).await;
    pb::policy_service_client::PolicyServiceClient::new(bearer(&app.channel, ADMIN))
        .put_binding(pb::PutBindingRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
            binding_id: "b-alice".into(),
            state: pb::BindingState::Linked as i32,
        })
        .await
        .expect("bind alice");
    let shots = std::env::var("HCP_SENSE_CONSOLE_SHOTS").unwrap_or_default();
    let report = crate::support::python::run(
        "console_browser.py",
        "selenium and Debian's chromium-driver",
        json!({
            "url": format!("http://{web}"),
            "admin": ADMIN,
            "runtime": RUNTIME,
            "reader": ALICE,
            "screenshots": shots,
        }),
    )
    .await;
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(
        report["who"]
            .as_str()
            .map(|w| w.contains("ops") && w.contains("admin")),
        Some(true),
        "{report}"
    );
    assert_eq!(report["granted"], true, "{report}");
    assert_eq!(
        report["description_as_text"], true,
        "a pack's description is text: {report}"
    );
    assert_eq!(
        report["audited"],
        json!([["ops", "ActivateSense"], ["ops", "GrantSenseEnable"]]),
        "{report}"
    );
    assert_eq!(report["inbox_row"], true, "{report}");
    assert_eq!(
        report["inbox_rows"], 2,
        "the earlier record listed, the new one live: {report}"
    );
    assert_eq!(report["recent_listed"], true, "{report}");
    assert_eq!(
        report["drops_over_time"][1], "1",
        "one undeclared_ref drop this hour: {report}"
    );
    assert!(
        report["admission"]
            .as_str()
            .is_some_and(|a| a.contains("admits now")),
        "{report}"
    );
    assert_eq!(report["unlabelled"], json!([]), "{report}");
    assert_eq!(report["tables_without_caption"], 0, "{report}");
    assert_eq!(report["lang"], "en", "{report}");
    assert_eq!(report["payload_as_text"], true, "{report}");
    assert_eq!(report["injected_elements"], 0, "{report}");
    assert_eq!(report["drop_reason_shown"], true, "{report}");
    assert_eq!(report["deciding_check_shown"], true, "{report}");
    assert!(
        report["reader_grant"]
            .as_str()
            .is_some_and(|m| m.contains("403")),
        "{report}"
    );
    assert_eq!(report["alerts"], 0, "{report}");
}
on_both_stores!(the_console_drives_the_api_in_a_real_browser => the_console_drives_the_api_in_a_real_browser);

/// Event streams hold a socket each: one caller holds at most --http-max-streams-per-caller,
/// all callers --http-max-streams (below the listener's socket cap, so calls find room), a
/// refusal is 429 naming the cap, and a closed stream makes room. The door's streams are
/// capped per client address by --max-streams-per-peer too, as gRPC streams are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_are_capped_per_caller_and_in_all() {
    let (_app, _dir, web) = served(StoreKind::Sqlite, |c| {
        c.http_max_streams = 3;
        c.http_max_streams_per_caller = 2;
    })
    .await;
    let open = |token: &'static str| async move {
        Req::new("GET", "/v1/records:watch?from_now=true")
            .bearer(token)
            .events(web)
            .await
    };
    let a1 = open(ALICE).await;
    let a2 = open(ALICE).await;
    assert_eq!((a1.0.status, a2.0.status), (200, 200));
    let (refused, _) = open(ALICE).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    let j: Value = serde_json::from_str(&refused.body).expect("a status");
    assert_eq!(j["code"], 8);
    assert!(
        j["message"]
            .as_str()
            .unwrap_or_default()
            .contains("--http-max-streams-per-caller 2"),
        "{j}"
    );
    let admin = open(ADMIN).await;
    assert_eq!(admin.0.status, 200, "the third in all");
    let (full, _) = open(ADMIN).await;
    assert_eq!(full.status, 429, "{full:?}");
    assert!(full.body.contains("--http-max-streams 3"), "{full:?}");
    // Calls still find room.
    assert_eq!(
        Req::new("GET", "/v1/packs")
            .bearer(ADMIN)
            .send(web)
            .await
            .status,
        200
    );
    drop(a1);
    let mut again = None;
    for _ in 0..50 {
        let (head, events) = open(ADMIN).await;
        if head.status == 200 {
            again = Some(events);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(again.is_some(), "a closed stream makes room");

    let (_app, _dir, web) = served(StoreKind::Sqlite, |c| c.max_streams_per_peer = 2).await;
    let open = |token: &'static str| async move {
        Req::new("GET", "/v1/records:watch?from_now=true")
            .bearer(token)
            .events(web)
            .await
    };
    let _held = (open(ALICE).await, open(ADMIN).await);
    assert_eq!(_held.0 .0.status, 200);
    assert_eq!(_held.1 .0.status, 200);
    let (refused, _) = open(ADMIN).await;
    assert_eq!(refused.status, 429, "the peer's third stream: {refused:?}");
}

/// Without authentication the door is every role's: it is not served off loopback unless
/// --insecure-no-auth says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_authentication_the_door_is_served_on_loopback_only() {
    let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
    let mut c = hcp_sense::config::Config::for_database(db.url.clone());
    c.http_listen = Some("0.0.0.0:0".parse().expect("addr"));
    let e = hcp_sense::app::App::build(c.clone())
        .await
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .contains("refusing to serve the JSON door on 0.0.0.0:0"),
        "{e}"
    );
    c.insecure_no_auth = true;
    let app = hcp_sense::app::App::build(c)
        .await
        .expect("served when told");
    assert!(app.web_addr().is_some());
}
