//! NATS JetStream ingress against the NATS server on this machine: messages published by the nats-py client are recorded exactly once across a kill -9 and restart; a malformed message is terminated, not redelivered.
use std::process::Command;
use std::time::Duration;

use hcp_sense::grpc::pb::{self, ingress_service_client::IngressServiceClient};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::Value;

use crate::cli::{connect, set_up_weather};
use crate::helpers::{StoreKind, TestDb};
use crate::support::served::Served;

const NATS: &str = "nats://127.0.0.1:4222";

fn python(args: &[&str]) -> Value {
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
async fn put_nats_route(
    ch: &tonic::transport::Channel,
    route_id: &str,
    stream: &str,
    subject: &str,
) {
    IngressServiceClient::new(ch.clone())
        .put_ingress_route(pb::PutIngressRouteRequest {
            route: Some(pb::IngressRoute {
                route_id: route_id.into(),
                pack_id: "weather".into(),
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
    let mut info = Value::Null;
    for _ in 0..100 {
        info = python(&[NATS, &stream, &subject, "0", "info", "hcp-sense-storms"]);
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
