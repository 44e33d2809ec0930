//! Connections and deadlines under attack: idle and half-open sockets closed on their timers, the accept loop
//! under a file limit, bounded health Watch streams, and UNAVAILABLE (never CANCELLED) before a deadline.
use std::time::{Duration, Instant};

use hcp_sense::grpc::pb::{self, ingest_service_client::IngestServiceClient};
use sea_orm::{ConnectionTrait, TransactionTrait};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

use crate::helpers::{spawn_app_with, StoreKind, TestApp, TestDb};
use crate::identity::opened;
use crate::support::served::{serve_command, Served};

/// Server-side sockets in ESTABLISHED state on `port` (from /proc/net/tcp, IPv4 loopback).
/// A client socket of another test may have been given `port` as its own ephemeral port
/// (the listener binds with SO_REUSEADDR); its peer is a listener, so it is not counted.
fn established(port: u16) -> usize {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port_of = |a: &str| {
        a.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 3)
        .collect();
    let listening: std::collections::HashSet<u16> = rows
        .iter()
        .filter(|f| f[3] == "0A")
        .filter_map(|f| port_of(f[1]))
        .collect();
    rows.iter()
        .filter(|f| {
            f[3] == "01"
                && port_of(f[1]) == Some(port)
                && port_of(f[2]).is_some_and(|p| !listening.contains(&p))
        })
        .count()
}

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect")
}

pub async fn health_ok(ch: &Channel) -> Duration {
    let t = Instant::now();
    HealthClient::new(ch.clone())
        .check(HealthCheckRequest::default())
        .await
        .expect("health check");
    t.elapsed()
}

/// Opens `idle` sockets that send nothing and `half` that send half the HTTP/2 preface.
async fn flood(addr: &str, idle: usize, half: usize) -> Vec<TcpStream> {
    flood_timed(addr, idle, half)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// `flood`, with the moment each socket was opened.
async fn flood_timed(addr: &str, idle: usize, half: usize) -> Vec<(TcpStream, Instant)> {
    let mut socks = Vec::new();
    for i in 0..idle + half {
        // 3 s covers one lost SYN's retransmission (1 s), which a busy machine now and then has.
        let Ok(Ok(mut s)) =
            tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr)).await
        else {
            continue;
        };
        if i >= idle {
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n").await;
        }
        socks.push((s, Instant::now()));
    }
    socks
}

/// Whether the server has closed the socket (EOF or reset) within `within`.
async fn closed(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // A server may write its SETTINGS first; keep reading.
            Ok(Ok(_)) => {}
        }
    }
}

fn timers(c: &mut hcp_sense::config::Config) {
    c.first_request_timeout = Duration::from_secs(1);
    c.idle_timeout = Duration::from_secs(2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_sockets_are_closed_while_calls_go_on() {
    let app = spawn_app_with(StoreKind::Sqlite, timers).await;
    let addr = app.addr.to_string();
    let mut socks = flood_timed(&addr, 300, 100).await;
    assert_eq!(socks.len(), 400);
    // A legitimate caller is served at once, on a new connection, during the flood.
    let ch = channel(&addr).await;
    let took = health_ok(&ch).await;
    assert!(took < Duration::from_secs(1), "call took {took:?}");
    let mut open = 0;
    for (s, opened_at) in &mut socks {
        let left = Duration::from_millis(2500).saturating_sub(opened_at.elapsed());
        if !closed(s, left).await {
            open += 1;
        }
    }
    assert_eq!(
        open, 0,
        "sockets still open 2.5 s after they were opened (first-request timeout 1 s)"
    );
    drop(socks);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closes_when_idle_but_not_while_a_stream_is_open() {
    let app = spawn_app_with(StoreKind::Sqlite, timers).await;
    let port = app.addr.port();
    let ch = channel(&app.addr.to_string()).await;
    health_ok(&ch).await;
    // The server's idle clock for `ch` started when it answered, a moment before this.
    let idle_since = Instant::now();
    let mut watching = HealthClient::new(channel(&app.addr.to_string()).await)
        .watch(HealthCheckRequest::default())
        .await
        .expect("watch")
        .into_inner();
    watching
        .message()
        .await
        .expect("first status")
        .expect("a status");
    assert!(established(port) >= 2);
    // The idle connection goes on its timer (2 s), not before it; a loaded machine may run
    // the timer late, so its close is awaited rather than assumed at a fixed moment.
    while established(port) > 1 && idle_since.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed_after = idle_since.elapsed();
    assert_eq!(
        established(port),
        1,
        "idle connection open after {closed_after:?}"
    );
    assert!(
        closed_after >= Duration::from_millis(1900),
        "closed after {closed_after:?}, before the idle timeout (2 s)"
    );
    // The one carrying a Watch stays past the idle timeout, its stream alive.
    tokio::time::sleep(Duration::from_millis(3500).saturating_sub(idle_since.elapsed())).await;
    assert_eq!(established(port), 1);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), watching.message())
            .await
            .is_err(),
        "the watch stream is still open"
    );
    // The channel reconnects on its next call.
    health_ok(&ch).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_128_file_limit_the_server_keeps_serving_and_recovers() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let serve = serve_command(&db.url);
    let args: Vec<String> = serve
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .chain(["--first-request-timeout-secs", "1"].map(str::to_owned))
        .collect();
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c")
        .arg("ulimit -n 128 && exec \"$0\" \"$@\"")
        .arg(serve.get_program())
        .args(&args);
    let server = Served::spawn(cmd);
    let existing = channel(&server.addr).await;
    health_ok(&existing).await;
    let ticks = || {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", server.pid())).unwrap_or_default();
        let f: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
    };
    let socks = flood(&server.addr, 130, 0).await;
    let t0 = ticks();
    let started = Instant::now();
    // An existing caller keeps being served while the flood holds every slot. Its socket, idle
    // since its last call ended before the flood came, has waited longest and may be the one
    // shed for the flood's: a call racing that close fails at the transport, and the caller's
    // next call, on the connection its channel makes again, is served.
    let mut failed = 0;
    for _ in 0..5 {
        let t = Instant::now();
        if let Err(s) = HealthClient::new(existing.clone())
            .check(HealthCheckRequest::default())
            .await
        {
            // How the client names a closed socket (broken pipe, reset, no connection).
            assert!(
                matches!(
                    s.code(),
                    Code::Unavailable | Code::Internal | Code::Unknown | Code::Aborted
                ),
                "{s:?}"
            );
            failed += 1;
            health_ok(&existing).await;
        }
        let took = t.elapsed();
        assert!(took < Duration::from_secs(1), "existing caller: {took:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(
        failed <= 1,
        "{failed} calls failed: a caller's new socket is kept"
    );
    let cpu = (ticks() - t0) as f64 / 100.0 / started.elapsed().as_secs_f64();
    assert!(
        cpu < 0.5,
        "the server spins at {:.0}% of a core",
        cpu * 100.0
    );
    drop(socks);
    // Recovered: a new caller is served once the flood's sockets are gone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fresh = channel(&server.addr).await;
    let took = health_ok(&fresh).await;
    assert!(took < Duration::from_secs(1), "new connection: {took:?}");
}

async fn watch(
    ch: &Channel,
) -> Result<tonic::Streaming<tonic_health::pb::HealthCheckResponse>, Code> {
    HealthClient::new(ch.clone())
        .watch(HealthCheckRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_watch_streams_are_bounded_per_connection_and_in_all() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.max_health_watches_per_connection = 16;
        c.max_health_watches = 20;
    })
    .await;
    let a = channel(&app.addr.to_string()).await;
    let b = channel(&app.addr.to_string()).await;
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(watch(&a).await.expect("within the connection's bound"));
    }
    assert_eq!(
        watch(&a).await.err(),
        Some(Code::ResourceExhausted),
        "17th on one connection"
    );
    for _ in 0..4 {
        held.push(watch(&b).await.expect("within the total"));
    }
    assert_eq!(
        watch(&b).await.err(),
        Some(Code::ResourceExhausted),
        "21st in all"
    );
    // Closing streams frees their slots.
    held.truncate(10);
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..4 {
        held.push(watch(&b).await.expect("freed"));
    }
    // Other calls are not affected.
    health_ok(&a).await;
    app.stop().await;
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_watch_attempts_leave_memory_where_it_was() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let server = Served::start(&db.url, &[]);
    let probe = channel(&server.addr).await;
    health_ok(&probe).await;
    let start = rss_kib(server.pid());
    let mut after = Vec::new();
    for round in 0..3 {
        let mut chans = Vec::new();
        for _ in 0..40 {
            chans.push(channel(&server.addr).await);
        }
        let mut tasks = Vec::new();
        for ch in &chans {
            for _ in 0..250 {
                let ch = ch.clone();
                tasks.push(tokio::spawn(async move { watch(&ch).await.ok() }));
            }
        }
        let mut open = Vec::new();
        for t in tasks {
            if let Some(s) = t.await.expect("task") {
                open.push(s);
            }
        }
        assert!(
            open.len() <= 1024,
            "round {round}: {} streams open",
            open.len()
        );
        drop(open);
        drop(chans);
        // The allocator hands freed memory back within about a second (.cargo/config.toml).
        tokio::time::sleep(Duration::from_millis(2500)).await;
        after.push(rss_kib(server.pid()));
    }
    health_ok(&probe).await;
    assert!(
        after.iter().all(|rss| *rss <= start + 10 * 1024),
        "RSS {start} KiB at the start, {after:?} KiB after each round"
    );
    eprintln!("watch rounds: RSS {start} KiB at the start, {after:?} KiB after each round");
}

/// Deliveries that would record, each with its own trigger id.
async fn burst(
    ch: &Channel,
    n: usize,
    tag: &str,
    timeout: Option<Duration>,
) -> Vec<(Result<(), Code>, Duration)> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let ch = ch.clone();
        let id = format!("{tag}-{i}");
        tasks.push(tokio::spawn(async move {
            let mut t = opened("alice");
            t.trigger_id = id;
            let mut req = tonic::Request::new(t);
            if let Some(d) = timeout {
                req.set_timeout(d);
            }
            let start = Instant::now();
            let r = IngestServiceClient::new(ch).deliver_trigger(req).await;
            (r.map(drop).map_err(|s| s.code()), start.elapsed())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

async fn ready_alice(app: &mut TestApp) {
    crate::identity::set_up(&app.channel, "", &["alice"]).await;
}

both_stores! {
    async fn a_store_that_does_not_answer_is_unavailable_before_the_deadline_never_cancelled(app) {
        let kind = if app.db.get_database_backend() == sea_orm::DbBackend::Sqlite { StoreKind::Sqlite } else { StoreKind::Postgres };
        app.stop().await;
        let mut app = spawn_app_with(kind, |c| c.request_timeout = Duration::from_secs(2)).await;
        ready_alice(&mut app).await;
        // Another session holds what the record writer needs: SQLite's write lock, or on
        // PostgreSQL a lock on the records table that inserts wait for (reads do not).
        let other = app.test_db.connect().await;
        let txn = other.begin().await.expect("begin");
        match kind {
            StoreKind::Sqlite => txn.execute_unprepared("INSERT INTO project_members (project, principal, create_time) VALUES ('hold', 'hold', 0)").await.map(drop),
            StoreKind::Postgres => txn.execute_unprepared("LOCK TABLE records IN SHARE MODE").await.map(drop),
        }.expect("hold the lock");
        let held = burst(&app.channel, 20, "server-deadline", None).await;
        let short = burst(&app.channel, 5, "client-deadline", Some(Duration::from_millis(700))).await;
        txn.rollback().await.expect("release");
        for (r, took) in &held {
            assert_eq!(*r, Err(Code::Unavailable), "server deadline 2 s: {r:?} after {took:?}");
            assert!(*took < Duration::from_secs(2), "answered after {took:?}");
        }
        for (r, took) in &short {
            assert_eq!(*r, Err(Code::Unavailable), "caller deadline 700 ms: {r:?} after {took:?}");
            assert!(*took < Duration::from_millis(700), "answered after {took:?}");
        }
        // Retries after the store answers again: every trigger recorded exactly once.
        let retried = burst(&app.channel, 20, "server-deadline", None).await;
        assert!(retried.iter().all(|(r, _)| r.is_ok()), "{retried:?}");
        let retried = burst(&app.channel, 5, "client-deadline", None).await;
        assert!(retried.iter().all(|(r, _)| r.is_ok()), "{retried:?}");
        assert_eq!(app.count("records").await, 25);
        app.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_nested_past_protobufs_limit_is_invalid_argument_naming_it() {
    use prost_types::{value::Kind, Struct, Value};
    let mut app = spawn_app_with(StoreKind::Sqlite, |_| {}).await;
    ready_alice(&mut app).await;
    let mut v = Value {
        kind: Some(Kind::NumberValue(1.0)),
    };
    for _ in 0..120 {
        v = Value {
            kind: Some(Kind::StructValue(Struct {
                fields: [("a".to_owned(), v)].into_iter().collect(),
            })),
        };
    }
    let Some(Kind::StructValue(deep)) = v.kind else {
        unreachable!()
    };
    let mut t = opened("alice");
    t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::Payload(
        deep.clone(),
    ));
    let e = app.ingest.deliver_trigger(t).await.expect_err("too deep");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(crate::helpers::violations(&e)[0].0, "payload");
    let e = app
        .packs
        .register_pack(pb::RegisterPackRequest {
            source: Some(pb::register_pack_request::Source::Manifest(deep)),
        })
        .await
        .expect_err("too deep");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(crate::helpers::violations(&e)[0].0, "manifest");
    // Non-finite numbers: refused naming the field and the path, never stored as null.
    for n in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let mut t = opened("alice");
        let payload = serde_json::json!({ "issue": { "list": [1, 2] } });
        let mut s = hcp_sense::grpc::convert::json_to_struct(&payload);
        if let Some(Kind::StructValue(inner)) =
            s.fields.get_mut("issue").and_then(|v| v.kind.as_mut())
        {
            if let Some(Kind::ListValue(l)) =
                inner.fields.get_mut("list").and_then(|v| v.kind.as_mut())
            {
                l.values[1] = Value {
                    kind: Some(Kind::NumberValue(n)),
                };
            }
        }
        t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::Payload(s));
        let e = app.ingest.deliver_trigger(t).await.expect_err("non-finite");
        assert_eq!(e.code(), Code::InvalidArgument);
        let v = crate::helpers::violations(&e);
        assert_eq!(v[0].0, "payload");
        assert!(v[0].1.contains("issue.list[1]"), "{v:?}");
    }
    assert_eq!(app.count("records").await, 0);
    app.stop().await;
}

/// Runs tests/python/stream_producer.py against `addr`: `channels` grpcio channels, each one
/// DeliverTriggers stream of `count` small triggers; panics unless every trigger is answered
/// once, in order, recorded. Returns what the script reports.
fn grpcio_stream_producer(
    addr: std::net::SocketAddr,
    channels: usize,
    count: usize,
    tag: &str,
) -> String {
    let out = std::process::Command::new("python3")
        .args([
            "tests/python/stream_producer.py",
            &addr.to_string(),
            "proto",
            &channels.to_string(),
            &count.to_string(),
            tag,
        ])
        .current_dir(crate::helpers::repo_path(""))
        .output()
        .expect("python3 with grpcio (see .ci/run)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the producer failed:\n{text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_fast_producer_of_small_triggers_is_slowed_by_flow_control_never_sent_goaway() {
    // grpcio writes each 43-byte trigger as one DATA frame. The server writes records far
    // slower than Python sends them, so most of each stream waits unread in HTTP/2's windows:
    // the producer must be held there, never disconnected (h2's GOAWAY too_many_data_frames).
    let mut app = spawn_app_with(StoreKind::Sqlite, |_| {}).await;
    ready_alice(&mut app).await;
    let addr = app.addr;
    let one = tokio::task::spawn_blocking(move || grpcio_stream_producer(addr, 1, 20_000, ""))
        .await
        .expect("producer");
    assert!(one.contains("\"request_bytes\": 43"), "{one}");
    assert!(one.contains("\"answered\": 20000"), "{one}");
    let eight = tokio::task::spawn_blocking(move || grpcio_stream_producer(addr, 8, 20_000, "b"))
        .await
        .expect("producers");
    assert!(eight.contains("\"answered\": 160000"), "{eight}");
    assert_eq!(app.count("records").await, 180_000);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_delivertriggers_stream_is_ended_unavailable_after_the_idle_timeout() {
    use tokio_stream::StreamExt;
    let idle = Duration::from_secs(1);
    let mut app = spawn_app_with(StoreKind::Sqlite, |c| c.idle_timeout = idle).await;
    ready_alice(&mut app).await;
    let open = |app: &TestApp| {
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::DeliverTriggersRequest>(4);
        let mut client = app.ingest.clone();
        let answers = async move {
            client
                .deliver_triggers(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .expect("stream opens")
                .into_inner()
        };
        (tx, answers)
    };
    let item = |id: &str| {
        let mut t = opened("alice");
        t.trigger_id = id.into();
        pb::DeliverTriggersRequest { trigger: Some(t) }
    };
    // A producer that sends every 400 ms is not idle, however long it goes on.
    let (tx, answers) = open(&app);
    let busy = tokio::spawn(async move {
        for i in 0..7 {
            tx.send(item(&format!("busy-{i}"))).await.expect("send");
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        drop(tx);
    });
    let mut answers = answers.await;
    let mut n = 0;
    while let Some(a) = answers.next().await {
        assert!(a.is_ok(), "answer {n}: {a:?}");
        n += 1;
    }
    assert_eq!(n, 7);
    busy.await.expect("producer");
    // One trigger, then silence: answered, then the stream ends UNAVAILABLE after the timeout.
    let (tx, answers) = open(&app);
    tx.send(item("quiet-0")).await.expect("send");
    let mut answers = answers.await;
    let first = answers.next().await.expect("an answer").expect("outcome");
    assert_eq!(first.index, 0);
    let since = Instant::now();
    let end = answers.next().await.expect("the stream ends with a status");
    let took = since.elapsed();
    let e = end.expect_err("idle");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("idle"), "{e:?}");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(5),
        "ended after {took:?}"
    );
    assert!(answers.next().await.is_none());
    drop(tx);
    assert_eq!(app.count("records").await, 8);
    app.stop().await;
}

/// SIGTERM with a DeliverTriggers stream open and its producer still sending: the triggers
/// read are answered, then the stream ends UNAVAILABLE at once (naming the first trigger not
/// read) rather than at the grace period's end, every trigger answered recorded is stored,
/// and the process exits well inside the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_delivertriggers_streams_at_once_and_loses_nothing_answered() {
    use tokio_stream::StreamExt;
    let db = TestDb::create(StoreKind::Sqlite).await;
    let served = Served::start(&db.url, &["--shutdown-grace-secs", "20"]);
    let ch = crate::cli::connect(&served.addr).await;
    crate::cli::set_up_weather(&ch).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::DeliverTriggersRequest>(4);
    let mut answers = IngestServiceClient::new(ch.clone())
        .deliver_triggers(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    // A producer sending a trigger every 50 ms until its stream ends.
    let producer = tokio::spawn(async move {
        for i in 0.. {
            let t = crate::cli::storm_warning(format!("s-{i}"));
            if tx
                .send(pb::DeliverTriggersRequest { trigger: Some(t) })
                .await
                .is_err()
            {
                return i;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        unreachable!()
    });
    let mut recorded = Vec::new();
    while recorded.len() < 3 {
        let a = answers.next().await.expect("an answer").expect("ok");
        recorded.push(a.index);
    }
    let reader = tokio::spawn(async move {
        let mut more = Vec::new();
        let end = loop {
            match answers.next().await {
                Some(Ok(a)) => more.push(a),
                Some(Err(s)) => break Some(s),
                None => break None,
            }
        };
        (more, end)
    });
    let (clean, took) = tokio::task::spawn_blocking(move || served.terminate_timed())
        .await
        .expect("terminate");
    assert!(clean, "exit 0");
    assert!(
        took < Duration::from_secs(10),
        "an open DeliverTriggers stream held shutdown for {took:?} (grace 20 s)"
    );
    let (more, end) = reader.await.expect("reader");
    let end = end.expect("the stream ends with a status");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    assert!(end.message().contains("shutting down"), "{}", end.message());
    let answered = recorded.len() as u64 + more.len() as u64;
    assert!(
        end.message().contains(&format!("from index {answered} on")),
        "{answered} answered: {}",
        end.message()
    );
    producer.abort();
    // Every trigger answered is stored.
    let conn = db.connect().await;
    let stored = conn
        .query_one_raw(sea_orm::Statement::from_string(
            conn.get_database_backend(),
            "SELECT count(*) AS n FROM records",
        ))
        .await
        .expect("count")
        .and_then(|r| r.try_get::<i64>("", "n").ok())
        .unwrap_or(-1);
    assert_eq!(stored as u64, answered);
}
