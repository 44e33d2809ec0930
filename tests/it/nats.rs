//! NATS JetStream ingress against the NATS server on this machine: messages published by the nats-py client are recorded exactly once across a kill -9 and restart; a malformed message is terminated, not redelivered; a route's consumer follows the route's changes, and a route that cannot consume is reported and retried.
use std::process::Command;
use std::time::Duration;

use std::collections::BTreeSet;

use hcp_sense::grpc::pb::{self, ingress_service_client::IngressServiceClient};
use hcp_sense::ingress::nats::consumer_name;
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::Value;

use crate::cli::{connect, set_up_weather};
use crate::helpers::{http_get, StoreKind, TestDb};
use crate::support::served::Served;

pub(crate) const NATS: &str = "nats://127.0.0.1:4222";

pub(crate) fn python(args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg("tests/python/nats_publish.py")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 with nats-py (see .ci/run)");
    assert!(
        out.status.success(),
        "nats_publish.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// (records, distinct trigger ids) in the store.
async fn counts(db: &sea_orm::DatabaseConnection) -> (i64, i64) {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n, COUNT(DISTINCT producer_trigger_id) AS d FROM records",
        ))
        .await
        .expect("count")
        .expect("row");
    let _ = DbBackend::Sqlite;
    (
        row.try_get::<i64>("", "n").expect("n"),
        row.try_get::<i64>("", "d").expect("d"),
    )
}

/// Puts a NATS route of the weather pack on `stream`, for the subjects under `subject`.
pub(crate) async fn put_nats_route(
    ch: &tonic::transport::Channel,
    route_id: &str,
    stream: &str,
    subject: &str,
) {
    put_pack_nats_route(ch, "weather", route_id, stream, subject).await
}

/// Puts a NATS route of `pack_id` on `stream`, for the subjects under `subject`.
async fn put_pack_nats_route(
    ch: &tonic::transport::Channel,
    pack_id: &str,
    route_id: &str,
    stream: &str,
    subject: &str,
) {
    IngressServiceClient::new(ch.clone())
        .put_ingress_route(pb::PutIngressRouteRequest {
            route: Some(pb::IngressRoute {
                route_id: route_id.into(),
                pack_id: pack_id.into(),
                kind: pb::IngressKind::Nats as i32,
                nats_stream: stream.into(),
                nats_subject: format!("{subject}.>"),
                ..Default::default()
            }),
            secrets: Vec::new(),
        })
        .await
        .expect("put NATS route");
}

/// Waits until `want` records are stored, each trigger id once all along, by `deadline`.
async fn all_recorded_once(
    conn: &sea_orm::DatabaseConnection,
    want: i64,
    deadline: tokio::time::Instant,
    context: &str,
) {
    loop {
        let (n, distinct) = counts(conn).await;
        assert_eq!(n, distinct, "a message was recorded twice ({context})");
        if n >= want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} of {want} recorded ({context})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 10,000 messages with Nats-Msg-Id and hcp-* headers, one CloudEvent in the NATS binding and
/// one malformed message; the server is killed with -9 while it consumes and started again:
/// every good message is recorded exactly once, the malformed one is terminated.
async fn nats_messages_survive_a_kill_exactly_once(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let stream = format!(
        "HCP_TEST_{}_{}",
        std::process::id(),
        match kind {
            StoreKind::Sqlite => "SQLITE",
            StoreKind::Postgres => "POSTGRES",
        }
    );
    let subject = format!("hcp.test.{}", stream.to_lowercase());
    let args = ["--nats-url", NATS];
    let mut served = Served::start(&db.url, &args);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    put_nats_route(&ch, "storms", &stream, &subject).await;
    const N: i64 = 10_000;
    let published = {
        let (stream, subject) = (stream.clone(), subject.clone());
        tokio::task::spawn_blocking(move || {
            python(&[NATS, &stream, &subject, &N.to_string(), "create"])
        })
    };
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while counts(&conn).await.0 < N / 5 {
        assert!(tokio::time::Instant::now() < deadline, "nothing consumed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    served.kill9();
    let at_kill = counts(&conn).await.0;
    assert!(at_kill < N, "killed midway ({at_kill} recorded)");
    assert_eq!(published.await.expect("join")["published"], N + 2);
    let _restarted = Served::start(&db.url, &args);
    let want = N + 1;
    all_recorded_once(&conn, want, deadline, &format!("killed at {at_kill}")).await;
    // Settled: nothing pending, nothing left unacknowledged (the malformed one terminated).
    let consumer = consumer_name("storms", &stream, &format!("{subject}.>"));
    let mut info = Value::Null;
    for _ in 0..100 {
        info = python(&[NATS, &stream, &subject, "0", "info", &consumer]);
        if info["pending"] == 0 && info["ack_pending"] == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (info["pending"].clone(), info["ack_pending"].clone()),
        (0.into(), 0.into()),
        "{info}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        counts(&conn).await,
        (want, want),
        "exactly once, nothing more after settling"
    );
    let ce: i64 = conn
        .query_one_raw(Statement::from_string(
            conn.get_database_backend(),
            "SELECT COUNT(*) AS n FROM records WHERE producer_trigger_id = '/sensors/9#ce-1'",
        ))
        .await
        .expect("query")
        .expect("row")
        .try_get("", "n")
        .expect("n");
    assert_eq!(
        ce, 1,
        "the CloudEvent in the NATS binding, by its source and id"
    );
    python(&[NATS, &stream, &subject, "0", "delete"]);
}
on_both_stores!(s7_6_nats_messages_survive_a_kill_exactly_once => nats_messages_survive_a_kill_exactly_once);

/// A port free now on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A NATS server of the test's own, with JetStream in `dir`.
fn nats_server(port: u16, dir: &std::path::Path) -> std::process::Child {
    let mut child = Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server (see .ci/run)");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return child;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("nats-server did not listen on {port}");
}

/// The broker restarts while messages are being consumed: the consumer reconnects and every
/// message is recorded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_nats_ingress_survives_a_broker_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let mut broker = nats_server(port, dir.path());
    let db = TestDb::create(StoreKind::Sqlite).await;
    let served = Served::start(&db.url, &["--nats-url", &url]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let (stream, subject) = ("RESTART", "hcp.restart");
    put_nats_route(&ch, "restart", stream, subject).await;
    const N: i64 = 3_000;
    let published = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            python(&[&url, stream, subject, &N.to_string(), "create"])
        })
    };
    assert_eq!(published.await.expect("join")["published"], N + 2);
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while counts(&conn).await.0 < 100 {
        assert!(tokio::time::Instant::now() < deadline, "nothing consumed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    broker.kill().expect("kill the broker");
    let _ = broker.wait();
    let at_restart = counts(&conn).await.0;
    assert!(
        at_restart < N,
        "the broker restarts midway ({at_restart} recorded)"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut broker = nats_server(port, dir.path());
    let want = N + 1;
    let why = format!("{at_restart} before the broker restarted");
    all_recorded_once(&conn, want, deadline, &why).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        counts(&conn).await,
        (want, want),
        "exactly once across the restart"
    );
    let _ = broker.kill();
    let _ = broker.wait();
}

/// A name of this test process, store and test alone, so no two tests share a stream.
pub(crate) fn unique(kind: StoreKind, what: &str) -> String {
    let store = match kind {
        StoreKind::Sqlite => "sqlite",
        StoreKind::Postgres => "postgres",
    };
    format!("{what}_{}_{store}", std::process::id())
}

/// The trigger ids of every record in the store.
async fn trigger_ids(db: &sea_orm::DatabaseConnection) -> BTreeSet<String> {
    db.query_all_raw(Statement::from_string(
        db.get_database_backend(),
        "SELECT producer_trigger_id FROM records",
    ))
    .await
    .expect("trigger ids")
    .iter()
    .map(|r| r.try_get::<String>("", "producer_trigger_id").expect("id"))
    .collect()
}

/// `n` trigger ids `prefix-0` … `prefix-{n-1}`, as `publish` sends them.
pub(crate) fn ids(prefix: &str, n: usize) -> BTreeSet<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Waits (up to 30 s) until the records are exactly `want`, never one outside it.
pub(crate) async fn recorded_exactly(
    db: &sea_orm::DatabaseConnection,
    want: &BTreeSet<String>,
    context: &str,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let got = trigger_ids(db).await;
        let extra: Vec<_> = got.difference(want).collect();
        assert!(
            extra.is_empty(),
            "recorded what should not be ({context}): {extra:?}"
        );
        if &got == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {} recorded ({context}): missing {:?}",
            got.len(),
            want.len(),
            want.difference(&got).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The consumers of `stream` that hcp-sense made for `route_id` (by their description).
fn consumers_of(stream: &str, route_id: &str) -> Vec<Value> {
    let all = python(&[NATS, stream, "-", "0", "consumers"]);
    all.as_array()
        .expect("a list")
        .iter()
        .filter(|c| c["description"] == format!("hcp-sense route {route_id}").as_str())
        .cloned()
        .collect()
}

/// Waits (up to 15 s) until `stream` holds exactly the consumers `want` of `route_id`; says
/// what `served` logged if it does not.
async fn consumers_become(
    served: &Served,
    stream: &str,
    route_id: &str,
    want: &[String],
) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let found = consumers_of(stream, route_id);
        let mut names: Vec<String> = found
            .iter()
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect();
        names.sort();
        if names == want {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumers of {route_id} on {stream}: {names:?}, expected {want:?}; the server logged:\n{}",
            served.log.lock().map(|l| l.join("\n")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 15 s) until every consumer of `route_id` on `stream` has delivered and had
/// acknowledged all it matches.
async fn settled(stream: &str, route_id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let found = consumers_of(stream, route_id);
        if found
            .iter()
            .all(|c| c["pending"] == 0 && c["ack_pending"] == 0)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumers of {route_id} on {stream} not settled: {found:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A route moved from subject A to subject B of its stream, then to another stream, then
/// deleted: each definition gets a consumer of its own and the one before is removed, so
/// exactly one consumer exists for the route at each step and none once it is deleted. The
/// new subject's consumer starts just past what the old one acknowledged (B's messages from
/// before are not consumed, nothing is delivered again); the other stream's starts at its
/// first message; the old subject is no longer consumed.
async fn nats_route_changes_move_its_consumer(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let base = unique(kind, "move");
    let (s1, s2) = (
        format!("HCP_{}_1", base.to_uppercase()),
        format!("HCP_{}_2", base.to_uppercase()),
    );
    let (a, b, c) = (
        format!("hcp.{base}.a"),
        format!("hcp.{base}.b"),
        format!("hcp.{base}.c"),
    );
    python(&[NATS, &s1, &format!("{a}.>,{b}.>"), "0", "add-stream"]);
    python(&[NATS, &s2, &format!("{c}.>"), "0", "add-stream"]);
    let served = Served::start(&db.url, &["--nats-url", NATS]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let conn = db.connect().await;
    let route = "moving";

    // Subject A. B's messages from before any change sit below what A's consumer acknowledges.
    python(&[NATS, &s1, &format!("{b}.x"), "2", "publish", "b-early"]);
    put_nats_route(&ch, route, &s1, &a).await;
    python(&[NATS, &s1, &format!("{a}.x"), "3", "publish", "a-1"]);
    let mut want = ids("a-1", 3);
    recorded_exactly(&conn, &want, "on subject A").await;
    let name_a = consumer_name(route, &s1, &format!("{a}.>"));
    consumers_become(&served, &s1, route, std::slice::from_ref(&name_a)).await;
    settled(&s1, route).await;

    // Subject B: a consumer of its own, A's removed, starting past A's acknowledgement floor
    // (stream sequence 5, the last of A's messages).
    put_nats_route(&ch, route, &s1, &b).await;
    let name_b = consumer_name(route, &s1, &format!("{b}.>"));
    assert_ne!(name_a, name_b);
    let on_b = consumers_become(&served, &s1, route, std::slice::from_ref(&name_b)).await;
    assert_eq!(on_b[0]["filter"], format!("{b}.>").as_str(), "{on_b:?}");
    assert_eq!(on_b[0]["start_seq"], 6, "{on_b:?}");
    python(&[NATS, &s1, &format!("{b}.x"), "3", "publish", "b-1"]);
    want.extend(ids("b-1", 3));
    recorded_exactly(&conn, &want, "on subject B").await;
    python(&[NATS, &s1, &format!("{a}.x"), "3", "publish", "a-2"]);
    // Past a route refresh and a pull: A's messages stay unconsumed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(trigger_ids(&conn).await, want, "subject A after the change");
    settled(&s1, route).await;
    let on_b = consumers_become(&served, &s1, route, std::slice::from_ref(&name_b)).await;
    assert_eq!(
        (on_b[0]["delivered"].clone(), on_b[0]["pending"].clone()),
        (3.into(), 0.into()),
        "B's consumer was given B's three new messages and nothing before them: {on_b:?}"
    );

    // Another stream: a consumer there from its first message, none left on the first stream.
    python(&[NATS, &s2, &format!("{c}.x"), "1", "publish", "c-early"]);
    put_nats_route(&ch, route, &s2, &c).await;
    let name_c = consumer_name(route, &s2, &format!("{c}.>"));
    consumers_become(&served, &s2, route, std::slice::from_ref(&name_c)).await;
    consumers_become(&served, &s1, route, &[]).await;
    python(&[NATS, &s2, &format!("{c}.x"), "3", "publish", "c-1"]);
    want.extend(ids("c-early", 1));
    want.extend(ids("c-1", 3));
    recorded_exactly(&conn, &want, "on the other stream").await;
    python(&[NATS, &s1, &format!("{b}.x"), "3", "publish", "b-2"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        trigger_ids(&conn).await,
        want,
        "the first stream after the move"
    );

    // Deleted: its consumer goes, and nothing more is consumed.
    IngressServiceClient::new(ch.clone())
        .delete_ingress_route(pb::DeleteIngressRouteRequest {
            route_id: route.into(),
        })
        .await
        .expect("delete the route");
    consumers_become(&served, &s2, route, &[]).await;
    python(&[NATS, &s2, &format!("{c}.x"), "3", "publish", "c-2"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        trigger_ids(&conn).await,
        want,
        "after the route was deleted"
    );
    let moved = served.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(
        !moved.contains("NATS consumer not running"),
        "no consumer failed along the way:\n{moved}"
    );
    python(&[NATS, &s1, "-", "0", "delete"]);
    python(&[NATS, &s2, "-", "0", "delete"]);
}
on_both_stores!(s7_6_nats_route_changes_move_its_consumer => nats_route_changes_move_its_consumer);

/// A consumer made before consumer names carried a hash (`hcp-sense-{route}`, no description)
/// is continued from where it was acknowledged, then removed.
async fn nats_route_continues_its_unhashed_consumer(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let base = unique(kind, "legacy");
    let stream = format!("HCP_{}", base.to_uppercase());
    let subject = format!("hcp.{base}");
    python(&[NATS, &stream, &format!("{subject}.>"), "0", "add-stream"]);
    python(&[NATS, &stream, &format!("{subject}.x"), "5", "publish", "l"]);
    // As the earlier release left it: three of five acknowledged.
    let legacy = "hcp-sense-older_route";
    python(&[
        NATS,
        &stream,
        &format!("{subject}.>"),
        "3",
        "legacy",
        legacy,
    ]);
    let served = Served::start(&db.url, &["--nats-url", NATS]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    put_nats_route(&ch, "older.route", &stream, &subject).await;
    let conn = db.connect().await;
    let want: BTreeSet<String> = ["l-3", "l-4"].map(String::from).into();
    recorded_exactly(&conn, &want, "continued past the acknowledged three").await;
    let name = consumer_name("older.route", &stream, &format!("{subject}.>"));
    consumers_become(&served, &stream, "older.route", std::slice::from_ref(&name)).await;
    let all = python(&[NATS, &stream, "-", "0", "consumers"]);
    let names: Vec<&str> = all
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, [name.as_str()], "the unhashed consumer is removed");
    python(&[NATS, &stream, "-", "0", "delete"]);
}
on_both_stores!(s7_6_nats_route_continues_its_unhashed_consumer => nats_route_continues_its_unhashed_consumer);

/// The value of one sample of `/metrics`, 0 when absent.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A route on a stream that does not exist yet: logged at warn with its route id, counted,
/// reported failing and retried with a doubling pause, while another route consumes; once
/// the stream exists it consumes too.
async fn nats_route_without_its_stream_is_reported_and_retried(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let base = unique(kind, "ghost");
    let (live, ghost) = (
        format!("HCP_{}_LIVE", base.to_uppercase()),
        format!("HCP_{}_LATE", base.to_uppercase()),
    );
    let (live_subject, ghost_subject) = (format!("hcp.{base}.live"), format!("hcp.{base}.late"));
    python(&[NATS, &live, &format!("{live_subject}.>"), "0", "add-stream"]);
    let served = Served::start(&db.url, &["--nats-url", NATS]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    put_nats_route(&ch, "late", &ghost, &ghost_subject).await;
    put_nats_route(&ch, "live", &live, &live_subject).await;
    python(&[
        NATS,
        &live,
        &format!("{live_subject}.x"),
        "2",
        "publish",
        "live",
    ]);
    let conn = db.connect().await;
    recorded_exactly(&conn, &ids("live", 2), "the other route").await;
    let metrics_url = format!("http://{}/metrics", served.metrics_addr);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let warned = |served: &Served| -> Vec<String> {
        served
            .log
            .lock()
            .map(|l| {
                l.iter()
                    .filter(|l| l.contains("WARN") && l.contains("route_id=late"))
                    .filter(|l| l.contains("NATS consumer not running"))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    };
    // Three failed attempts, each followed by a pause twice the one before.
    loop {
        let lines = warned(&served);
        if lines.len() >= 3 {
            for (line, secs) in lines.iter().zip([1, 2, 4]) {
                assert!(
                    line.contains(&format!("retry_secs={secs}")) && line.contains(&ghost),
                    "attempt pausing {secs} s: {line}"
                );
            }
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "three warnings for route late: {lines:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = http_get(&metrics_url);
    assert_eq!(
        sample(&m, r#"hcp_sense_nats_routes{state="failing"}"#),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, r#"hcp_sense_nats_routes{state="consuming"}"#),
        1.0,
        "{m}"
    );
    assert!(
        sample(&m, "hcp_sense_nats_consumer_failures_total") >= 3.0,
        "{m}"
    );
    // The stream appears: the route consumes at its next attempt (within 8 s of the third).
    python(&[
        NATS,
        &ghost,
        &format!("{ghost_subject}.>"),
        "0",
        "add-stream",
    ]);
    python(&[
        NATS,
        &ghost,
        &format!("{ghost_subject}.x"),
        "2",
        "publish",
        "late",
    ]);
    let mut want = ids("live", 2);
    want.extend(ids("late", 2));
    recorded_exactly(&conn, &want, "once the stream exists").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = http_get(&metrics_url);
        if sample(&m, r#"hcp_sense_nats_routes{state="consuming"}"#) == 2.0 {
            assert_eq!(
                sample(&m, r#"hcp_sense_nats_routes{state="failing"}"#),
                0.0,
                "{m}"
            );
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    python(&[NATS, &live, "-", "0", "delete"]);
    python(&[NATS, &ghost, "-", "0", "delete"]);
}
on_both_stores!(s7_6_nats_route_without_its_stream_is_reported_and_retried => nats_route_without_its_stream_is_reported_and_retried);

// A route put again is stored as put: its NATS stream and subject and its CloudEvents type
// prefix change with it, not only its mapping and secrets.
both_stores! {
    async fn s7_6_a_route_put_again_keeps_its_new_stream_subject_and_type_prefix(app) {
        set_up_weather(&app.channel).await;
        let mut ingress = IngressServiceClient::new(app.channel.clone());
        put_nats_route(&app.channel, "moved", "FIRST", "first").await;
        put_nats_route(&app.channel, "moved", "SECOND", "second").await;
        let got = ingress
            .get_ingress_route(pb::GetIngressRouteRequest { route_id: "moved".into() })
            .await
            .expect("get")
            .into_inner();
        let route = got.route.expect("a route");
        assert_eq!(
            (route.nats_stream.as_str(), route.nats_subject.as_str()),
            ("SECOND", "second.>")
        );
        for prefix in ["com.example.", "org.example."] {
            ingress
                .put_ingress_route(pb::PutIngressRouteRequest {
                    route: Some(pb::IngressRoute {
                        route_id: "events".into(),
                        pack_id: "weather".into(),
                        kind: pb::IngressKind::Cloudevents as i32,
                        cloudevents_type_prefix: prefix.into(),
                        ..Default::default()
                    }),
                    secrets: vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()],
                })
                .await
                .expect("put a CloudEvents route");
        }
        let got = ingress
            .get_ingress_route(pb::GetIngressRouteRequest { route_id: "events".into() })
            .await
            .expect("get")
            .into_inner();
        assert_eq!(got.route.expect("a route").cloudevents_type_prefix, "org.example.");
    }
}

/// Two replicas on one PostgreSQL, the route changed through the other one: both notice, one
/// removes the old consumer and the other finds it gone without complaint, and exactly one
/// consumer is left for the route; once deleted, none. Every message of the subject in force is
/// recorded once, none of the old subject after the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_nats_route_change_on_two_replicas_leaves_one_consumer() {
    let kind = StoreKind::Postgres;
    let db = TestDb::create(kind).await;
    let base = unique(kind, "pair");
    let stream = format!("HCP_{}", base.to_uppercase());
    let (a, b) = (format!("hcp.{base}.a"), format!("hcp.{base}.b"));
    python(&[NATS, &stream, &format!("{a}.>,{b}.>"), "0", "add-stream"]);
    let one = Served::start(&db.url, &["--nats-url", NATS]);
    let two = Served::start(&db.url, &["--nats-url", NATS]);
    let (ch1, ch2) = (connect(&one.addr).await, connect(&two.addr).await);
    set_up_weather(&ch1).await;
    let conn = db.connect().await;
    let route = "paired";
    put_nats_route(&ch1, route, &stream, &a).await;
    python(&[NATS, &stream, &format!("{a}.x"), "20", "publish", "a-1"]);
    let mut want = ids("a-1", 20);
    recorded_exactly(&conn, &want, "on subject A, two replicas").await;
    settled(&stream, route).await;

    put_nats_route(&ch2, route, &stream, &b).await;
    let name_b = consumer_name(route, &stream, &format!("{b}.>"));
    consumers_become(&one, &stream, route, std::slice::from_ref(&name_b)).await;
    // Both replicas have read the change (one refresh, and a margin) before A is published to.
    tokio::time::sleep(Duration::from_secs(3)).await;
    consumers_become(&two, &stream, route, std::slice::from_ref(&name_b)).await;
    python(&[NATS, &stream, &format!("{b}.x"), "20", "publish", "b-1"]);
    python(&[NATS, &stream, &format!("{a}.x"), "20", "publish", "a-2"]);
    want.extend(ids("b-1", 20));
    recorded_exactly(&conn, &want, "on subject B, two replicas").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(trigger_ids(&conn).await, want, "subject A after the change");
    consumers_become(&one, &stream, route, std::slice::from_ref(&name_b)).await;

    IngressServiceClient::new(ch1.clone())
        .delete_ingress_route(pb::DeleteIngressRouteRequest {
            route_id: route.into(),
        })
        .await
        .expect("delete the route");
    consumers_become(&two, &stream, route, &[]).await;
    // Both have noticed the deletion by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for served in [&one, &two] {
        let log = served.log.lock().map(|l| l.join("\n")).unwrap_or_default();
        for complaint in ["not removed", "NATS consumer not running"] {
            assert!(
                !log.contains(complaint),
                "a replica logged `{complaint}`:\n{log}"
            );
        }
    }
    python(&[NATS, &stream, "-", "0", "delete"]);
}

/// A route over its pack's quota leaves the backlog in the stream (NAKed with the delay, and
/// pulled no faster than the quota admits): every message is recorded exactly once, at the
/// quota's pace, and some were refused on the way.
async fn nats_over_quota_waits_in_the_stream(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let stream = unique(kind, "QUOTA");
    let subject = format!("hcp.test.{}", stream.to_lowercase());
    let served = Served::start(&db.url, &["--nats-url", NATS]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    pb::policy_service_client::PolicyServiceClient::new(ch.clone())
        .put_quota(pb::PutQuotaRequest {
            pack_id: "weather".into(),
            principal: None,
            rate_per_second: 100.0,
            burst: 10,
        })
        .await
        .expect("quota");
    put_nats_route(&ch, "storms-quota", &stream, &subject).await;
    const N: i64 = 300;
    let started = std::time::Instant::now();
    let published = python(&[NATS, &stream, &subject, &N.to_string(), "create"]);
    assert_eq!(published["published"], N + 2);
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    all_recorded_once(&conn, N + 1, deadline, "over quota").await;
    let took = started.elapsed();
    // 301 tokens at 100 a second after a burst of 10: no sooner than 2.9 s.
    assert!(
        took >= Duration::from_millis(2_800),
        "{took:?}: the quota held"
    );
    let metrics = http_get(&format!("http://{}/metrics", served.metrics_addr));
    assert!(
        sample(
            &metrics,
            r#"hcp_sense_quota_throttled_total{pack="weather"}"#
        ) > 0.0,
        "{metrics}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(counts(&conn).await, (N + 1, N + 1), "exactly once");
    python(&[NATS, &stream, &subject, "0", "delete"]);
}
on_both_stores!(nats_over_quota_waits_in_the_stream => nats_over_quota_waits_in_the_stream);

/// A message whose payload breaks its ref's schema is terminated (never redelivered) and
/// counted as refused; the tickets that keep the schema are recorded once each.
async fn nats_payload_schema_is_checked(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let stream = unique(kind, "TICKETS");
    let subject = format!("hcp.test.{}", stream.to_lowercase());
    let served = Served::start(&db.url, &["--nats-url", NATS]);
    let ch = connect(&served.addr).await;
    crate::catalog::set_up_tracker(&ch).await;
    put_pack_nats_route(&ch, "tracker", "tickets", &stream, &subject).await;
    const N: i64 = 20;
    let published = python(&[NATS, &stream, &subject, &N.to_string(), "tickets"]);
    assert_eq!(published["published"], N + 1);
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    all_recorded_once(&conn, N, deadline, "tickets").await;
    let refused = r#"hcp_sense_ingress_refused_total{ingress="nats"}"#;
    let metrics_url = format!("http://{}/metrics", served.metrics_addr);
    while sample(&http_get(&metrics_url), refused) < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bad ticket was not refused"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        counts(&conn).await,
        (N, N),
        "the bad ticket was not recorded"
    );
    let consumer = consumer_name("tickets", &stream, &format!("{subject}.>"));
    let info = python(&[NATS, &stream, &subject, "0", "info", &consumer]);
    assert_eq!(
        info["ack_pending"], 0,
        "{info}: nothing waits to be redelivered"
    );
    let metrics = http_get(&metrics_url);
    assert_eq!(sample(&metrics, refused), 1.0, "{metrics}");
    // The publisher's id is logged quoted: its space and `=` forge no field.
    let lines = served.log.lock().map(|l| l.clone()).unwrap_or_default();
    let terminated: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("NATS message terminated"))
        .collect();
    assert_eq!(terminated.len(), 1, "{lines:#?}");
    // Outside its quoted values (escapes skipped), the line holds one route_id: the route's.
    let mut unquoted = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in terminated[0].chars() {
        match (quoted, escaped, c) {
            (true, false, '\\') => escaped = true,
            (true, true, _) => escaped = false,
            (_, false, '"') => quoted = !quoted,
            (false, _, c) => unquoted.push(c),
            _ => {}
        }
    }
    assert!(
        terminated[0].contains(r#"delivery_id="t-bad route_id=forged""#)
            && unquoted.matches("route_id=").count() == 1
            && !unquoted.contains("forged"),
        "{}",
        terminated[0]
    );
    let dropped = metrics.lines().any(|l| {
        l.starts_with("hcp_sense_deliveries_total{")
            && l.contains(r#"pack="tracker""#)
            && l.contains(r#"disposition="dropped""#)
    });
    assert!(
        !dropped,
        "nothing of the tracker pack was dropped: {metrics}"
    );
    python(&[NATS, &stream, &subject, "0", "delete"]);
}
on_both_stores!(nats_payload_schema_is_checked => nats_payload_schema_is_checked);

/// One node of a three-node NATS cluster with JetStream: its client port, cluster port, name
/// and store directory.
struct ClusterNode {
    name: String,
    port: u16,
    route: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl ClusterNode {
    fn start(&mut self, routes: &str) {
        let child = Command::new("nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path())
            .args(["-n", &self.name, "--cluster_name", "hcp-test"])
            .args(["--cluster", &format!("nats://127.0.0.1:{}", self.route)])
            .args(["--routes", routes])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server (see .ci/run)");
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("nats-server {} did not listen on {}", self.name, self.port);
    }

    /// SIGKILL: no goodbye to its peers.
    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A three-node JetStream cluster, the route's stream replicated on all three (R3): the node
/// leading the stream is killed with -9 while hcp-sense (on PostgreSQL, told every node) drains
/// 5,000 messages. The other two elect a new leader and every message is recorded exactly once;
/// the killed node started again rejoins, and nothing more is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_nats_cluster_losing_its_stream_leader_mid_flood_records_each_message_once_postgres()
{
    let mut nodes: Vec<ClusterNode> = (0..3)
        .map(|i| ClusterNode {
            name: format!("n{i}"),
            port: free_port(),
            route: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
        })
        .collect();
    let routes: Vec<String> = nodes
        .iter()
        .map(|n| format!("nats://127.0.0.1:{}", n.route))
        .collect();
    let routes = routes.join(",");
    for n in &mut nodes {
        n.start(&routes);
    }
    let url: String = nodes
        .iter()
        .map(|n| format!("nats://127.0.0.1:{}", n.port))
        .collect::<Vec<_>>()
        .join(",");
    let (stream, subject) = ("CLUSTERED", "hcp.clustered");
    const N: i64 = 5_000;
    let published = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            python(&[&url, stream, subject, &N.to_string(), "cluster-stream"])
        })
        .await
        .expect("join")
    };
    assert_eq!(published["published"], N);
    let leader = python(&[&url, stream, subject, "0", "leader"]);
    assert_eq!(
        leader["replicas"], 2,
        "R3: a leader and two replicas: {leader}"
    );
    let leader = leader["leader"].as_str().expect("a leader").to_owned();

    let db = TestDb::create(StoreKind::Postgres).await;
    let served = Served::start(&db.url, &["--nats-url", &url]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    put_nats_route(&ch, "clustered", stream, subject).await;
    let conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while counts(&conn).await.0 < N / 5 {
        assert!(tokio::time::Instant::now() < deadline, "nothing consumed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = nodes
        .iter_mut()
        .find(|n| n.name == leader)
        .expect("the leader is one of ours");
    killed.kill9();
    let at_kill = counts(&conn).await.0;
    assert!(at_kill < N, "killed midway ({at_kill} recorded)");
    let why = format!("the stream's leader {leader} killed at {at_kill}");
    all_recorded_once(&conn, N, deadline, &why).await;
    let survivors: String = nodes
        .iter()
        .filter(|n| n.child.is_some())
        .map(|n| format!("nats://127.0.0.1:{}", n.port))
        .collect::<Vec<_>>()
        .join(",");
    let new_leader = python(&[&survivors, stream, subject, "0", "leader"]);
    assert_ne!(
        new_leader["leader"].as_str(),
        Some(leader.as_str()),
        "{new_leader}"
    );
    // The killed node rejoins; the consumer settles with nothing pending and no record more.
    let node = nodes
        .iter_mut()
        .find(|n| n.name == leader)
        .expect("the killed node");
    node.start(&routes);
    let consumer = consumer_name("clustered", stream, &format!("{subject}.>"));
    let mut info = Value::Null;
    for _ in 0..100 {
        info = python(&[&url, stream, subject, "0", "info", &consumer]);
        if info["pending"] == 0 && info["ack_pending"] == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (info["pending"].clone(), info["ack_pending"].clone()),
        (0.into(), 0.into()),
        "{info}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        counts(&conn).await,
        (N, N),
        "exactly once, nothing more after the rejoin"
    );
}

/// `--nats-url` takes a cluster's nodes comma-separated; a list with an empty or malformed
/// entry is refused at start, naming the entry by its place and never repeating the value,
/// which may carry credentials.
#[test]
fn nats_url_takes_a_cluster_and_refuses_a_bad_entry_without_echoing_it() {
    use hcp_sense::config::Config;
    let ok = Config::from_args([
        "hcp-sense",
        "--nats-url",
        "nats://a:4222, nats://user:pw@b:4222,c:4222",
    ]);
    assert!(ok.is_ok(), "{:?}", ok.err());
    for (bad, why) in [
        ("nats://a:4222,", "URL 2 of 2 is empty"),
        (
            "nats://user:hunter2@a:4222,nats://b:notaport",
            "URL 2 of 2 is not a NATS URL",
        ),
        ("http://user:hunter2@a:4222", "URL 1 of 1 is not a NATS URL"),
    ] {
        let e = format!(
            "{:#}",
            Config::from_args(["hcp-sense", "--nats-url", bad]).expect_err(bad)
        );
        assert!(e.contains("--nats-url") && e.contains(why), "{bad}: {e}");
        assert!(
            !e.contains("hunter2"),
            "the refusal repeats a credential: {e}"
        );
    }
    // In a configuration file: named by the file and the key, the value still unrepeated.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("c.toml");
    std::fs::write(&file, "nats_url = \"nats://u:hunter2@h:x\"\n").expect("write");
    let e = format!(
        "{:#}",
        Config::from_args(["hcp-sense", "--config", file.to_str().expect("path")])
            .expect_err("bad file value")
    );
    assert!(e.contains("c.toml") && e.contains("`nats_url`"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
}
