//! Running several replicas for real: server processes sharing one PostgreSQL, a database that
//! goes away under load, idempotent triggers across replicas and restarts, and the Helm chart.
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hcp_sense::grpc::pb::{
    self, ingest_service_client::IngestServiceClient, policy_service_client::PolicyServiceClient,
    record_service_client::RecordServiceClient,
};
use tonic::transport::Channel;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};

use crate::cli::{connect, set_up_weather, storm_warning, Served};
use crate::helpers::{http_status, postgres_admin_url, repo_path, StoreKind, TestDb};

/// The server's overall grpc.health.v1 status ("" service), or None if it does not answer.
async fn health(ch: &Channel) -> Option<ServingStatus> {
    let r = HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(r.into_inner().status).ok()
}

fn revoke_alice() -> pb::RevokeSenseEnableRequest {
    pb::RevokeSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "weather".into(),
    }
}

fn grant_alice() -> pb::GrantSenseEnableRequest {
    pb::GrantSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "weather".into(),
    }
}

fn recorded(r: &Result<pb::DeliverTriggerResponse, tonic::Status>) -> bool {
    r.as_ref()
        .is_ok_and(|r| r.disposition == pb::Disposition::RecordedInbox as i32)
}

/// Kills the connection of one replica (by its application_name) that LISTENs: the one whose
/// last statement was its LISTEN or its heartbeat.
async fn terminate_listener(db_name: &str, application_name: &str) -> usize {
    use sea_orm::ConnectionTrait;
    let admin = sea_orm::Database::connect(postgres_admin_url())
        .await
        .expect("admin");
    let killed = admin
        .query_all_raw(sea_orm::Statement::from_string(
            admin.get_database_backend(),
            format!(
                "SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity \
                 WHERE datname = '{db_name}' AND application_name = '{application_name}' \
                 AND (query ILIKE 'LISTEN%' OR query ILIKE 'SELECT pg_notify($1, %')"
            ),
        ))
        .await
        .expect("terminate");
    let _ = admin.close().await;
    killed.len()
}

fn with_app_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// Two `hcp-sense` processes on one database: a revoke on A stops B's recording within the
/// bound; B's listening connection cut makes B refuse (UNAVAILABLE, NOT_SERVING) until it has
/// reloaded by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_server_processes_follow_each_other_and_fail_closed_without_a_listener_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let a = Served::start(&with_app_name(&db.url, "replica-a"), &[]);
    let b = Served::start(&with_app_name(&db.url, "replica-b"), &[]);
    let (ch_a, ch_b) = (connect(&a.addr).await, connect(&b.addr).await);
    set_up_weather(&ch_a).await;
    let mut policy_a = PolicyServiceClient::new(ch_a.clone());
    let mut ingest_b = IngestServiceClient::new(ch_b.clone());

    // B hears A's setup.
    let start = Instant::now();
    while !recorded(
        &ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner()),
    ) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "B never saw A's setup"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    // Revoke on A: B drops within 1 s, and keeps dropping after.
    policy_a
        .revoke_sense_enable(revoke_alice())
        .await
        .expect("revoke");
    let revoked_at = Instant::now();
    loop {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B")
            .into_inner();
        if r.drop_reason == pb::DropReason::NoGrant as i32 {
            break;
        }
        assert!(
            revoked_at.elapsed() < Duration::from_secs(1),
            "B still records {:?} after the revoke on A",
            revoked_at.elapsed()
        );
    }
    eprintln!("revoke on A reached B in {:?}", revoked_at.elapsed());
    // Past the bound, B keeps dropping.
    tokio::time::sleep_until((revoked_at + Duration::from_secs(1)).into()).await;
    for _ in 0..20 {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B")
            .into_inner();
        assert_eq!(
            r.drop_reason,
            pb::DropReason::NoGrant as i32,
            "after the bound"
        );
    }
    assert_eq!(health(&ch_b).await, Some(ServingStatus::Serving));

    // Cut B's listener and grant again on A at once: that NOTIFY may never reach B.
    let db_name = db.url.rsplit('/').next().unwrap_or_default().to_owned();
    assert_eq!(
        terminate_listener(&db_name, "replica-b").await,
        1,
        "B listens"
    );
    policy_a
        .grant_sense_enable(grant_alice())
        .await
        .expect("grant again");
    let cut_at = Instant::now();
    let (mut unavailable, mut not_serving, mut not_ready) = (0, 0, 0);
    let recovered = loop {
        let r = ingest_b.deliver_trigger(storm_warning(String::new())).await;
        match &r {
            Err(s) if s.code() == tonic::Code::Unavailable => unavailable += 1,
            Err(s) => panic!("B answered {s:?} while catching up"),
            Ok(_) => {}
        }
        let h = health(&ch_b).await;
        if h == Some(ServingStatus::NotServing) {
            not_serving += 1;
            if not_ready == 0 && http_status(&format!("http://{}/readyz", b.metrics_addr)) == 503 {
                not_ready += 1;
            }
        }
        if recorded(&r.map(|r| r.into_inner())) && h == Some(ServingStatus::Serving) {
            break cut_at.elapsed();
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(5),
            "B did not recover within 5 s of losing its listener"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    eprintln!(
        "B without a listener: {unavailable} UNAVAILABLE, {not_serving} NOT_SERVING; recovered in {recovered:?}"
    );
    assert!(
        unavailable > 0,
        "B kept deciding while its listener was gone"
    );
    assert!(not_serving > 0, "B's health never said NOT_SERVING");
    assert!(not_ready > 0, "B's /readyz never said 503");
    assert_eq!(
        http_status(&format!("http://{}/readyz", b.metrics_addr)),
        200
    );

    // A burst of admin writes on A, ending revoked: a second later B is revoked too.
    for i in 0..60 {
        if i % 2 == 0 {
            policy_a
                .grant_sense_enable(grant_alice())
                .await
                .expect("grant");
        } else {
            policy_a
                .revoke_sense_enable(revoke_alice())
                .await
                .expect("revoke");
        }
    }
    let burst_end = Instant::now();
    tokio::time::sleep_until((burst_end + Duration::from_secs(1)).into()).await;
    for _ in 0..20 {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B after the burst")
            .into_inner();
        assert_eq!(
            r.drop_reason,
            pb::DropReason::NoGrant as i32,
            "B records a second after a burst on A that ended revoked"
        );
    }
    assert!(a.terminate() && b.terminate(), "both exit 0 on SIGTERM");
}

/// The records stored for one producer trigger id.
async fn records_for(db: &TestDb, trigger_id: &str) -> Vec<String> {
    use hcp_sense::store::entity::records;
    use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
    records::Entity::find()
        .filter(records::Column::ProducerTriggerId.eq(trigger_id))
        .all(&db.connect().await)
        .await
        .expect("records")
        .into_iter()
        .map(|r| r.record_id)
        .collect()
}

async fn deliver_once(ch: &Channel, trigger_id: &str) -> pb::DeliverTriggerResponse {
    IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning(trigger_id.into()))
        .await
        .expect("deliver")
        .into_inner()
}

/// A producer trigger id seen again for the same pack returns the first record and stores
/// nothing new: on another replica, and after the server is killed and started again.
async fn idempotent_across_replicas_and_restarts(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let mut first = Served::start(&db.url, &[]);
    let ch = connect(&first.addr).await;
    set_up_weather(&ch).await;
    let original = deliver_once(&ch, "storm-42").await;
    assert_eq!(original.disposition, pb::Disposition::RecordedInbox as i32);
    assert_eq!(
        records_for(&db, "storm-42").await,
        vec![original.record_id.clone()]
    );

    let mut others = Vec::new();
    if kind == StoreKind::Postgres {
        // A second replica, concurrently with the first.
        let other = Served::start(&db.url, &[]);
        let ch_other = connect(&other.addr).await;
        let again = deliver_once(&ch_other, "storm-42").await;
        assert_eq!(
            again.record_id, original.record_id,
            "the other replica returns the first record"
        );
        // A new id sent to both replicas at once, many times: one record, one answer.
        let mut calls = Vec::new();
        for i in 0..20 {
            let ch = if i % 2 == 0 {
                ch.clone()
            } else {
                ch_other.clone()
            };
            calls.push(tokio::spawn(async move {
                deliver_once(&ch, "storm-77").await.record_id
            }));
        }
        let mut ids = std::collections::BTreeSet::new();
        for c in calls {
            ids.insert(c.await.expect("call"));
        }
        assert_eq!(
            ids.len(),
            1,
            "concurrent duplicates on two replicas: {ids:?}"
        );
        assert_eq!(
            records_for(&db, "storm-77").await,
            ids.into_iter().collect::<Vec<_>>()
        );
        others.push(other);
    }
    first.kill9();
    let restarted = Served::start(&db.url, &[]);
    let again = deliver_once(&connect(&restarted.addr).await, "storm-42").await;
    assert_eq!(
        again.record_id, original.record_id,
        "after kill -9 and restart"
    );
    assert_eq!(again.disposition, original.disposition);
    assert_eq!(
        records_for(&db, "storm-42").await,
        vec![original.record_id.clone()],
        "stored once"
    );
    // A new id is a new record.
    let fresh = deliver_once(&connect(&restarted.addr).await, "storm-43").await;
    assert_ne!(fresh.record_id, original.record_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_trigger_ids_across_replicas_and_restarts_postgres() {
    idempotent_across_replicas_and_restarts(StoreKind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_trigger_ids_across_restarts_sqlite() {
    idempotent_across_replicas_and_restarts(StoreKind::Sqlite).await;
}

/// A PostgreSQL server of this test's own (initdb into a temporary directory, its own port), so
/// that stopping it touches no other test.
struct PrivatePostgres {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    fn start() -> PrivatePostgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries under /usr/lib/postgresql (see .ci/run)")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("pg_ctl").exists())
            .max()
            .expect("pg_ctl");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("hcp-sense-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        // TLS (server.pem, server.key), so that clients can ask for sslmode=require.
        crate::security::make_certs(&dir);
        let pg = PrivatePostgres { dir, bin, port };
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(&pg.dir)
                .status()
                .expect("chown");
            assert!(ok.success(), "chown to postgres");
        }
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        pg.up();
        pg
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one of PostgreSQL's programs, as the postgres user when we are root.
    fn run(&self, program: &str, args: &[&str]) {
        let exe = self.bin.join(program);
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let o = cmd.args(args).output().expect(program);
        assert!(
            o.status.success(),
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }

    fn up(&self) {
        let opts = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1 -c fsync=off -c ssl=on \
             -c ssl_cert_file={dir}/server.pem -c ssl_key_file={dir}/server.key",
            port = self.port,
            dir = self.dir.display()
        );
        let log = self.dir.join("log").display().to_string();
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-o", &opts, "-l", &log, "-w", "start"],
        );
    }

    /// A fast shutdown: sessions are terminated, transactions in flight roll back.
    fn down(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let exe = self.bin.join("pg_ctl");
        let data = self.data();
        let _ = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(["-D", &data, "-m", "immediate", "stop"])
                .output()
        } else {
            Command::new(&exe)
                .args(["-D", &data, "-m", "immediate", "stop"])
                .output()
        };
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// PostgreSQL (reached over TLS) stopped under load: deliveries answer UNAVAILABLE, readiness
/// goes NOT_SERVING,
/// nothing is acknowledged without its record; started again, the same process records again
/// within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_under_load_is_unavailable_and_recovers_by_itself() {
    let pg = Arc::new(PrivatePostgres::start());
    // Over TLS, as a production database is reached.
    let url = format!("{}?sslmode=require&application_name=sense-tls", pg.url());
    let served = Served::start(&url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    assert_eq!(health(&ch).await, Some(ServingStatus::Serving));
    {
        use sea_orm::ConnectionTrait;
        let conn = sea_orm::Database::connect(pg.url()).await.expect("connect");
        let row = conn
            .query_one_raw(sea_orm::Statement::from_string(
                conn.get_database_backend(),
                "SELECT count(*) AS n, coalesce(bool_and(s.ssl), false) AS all_tls \
                 FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = 'sense-tls'",
            ))
            .await
            .expect("pg_stat_ssl")
            .expect("row");
        let n: i64 = row.try_get("", "n").expect("n");
        let all_tls: bool = row.try_get("", "all_tls").expect("all_tls");
        assert!(n > 0 && all_tls, "{n} connections, all over TLS: {all_tls}");
    }

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..6 {
        let mut ingest = IngestServiceClient::new(ch.clone());
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut codes: HashMap<tonic::Code, usize> = HashMap::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let trigger_id = format!("w{w}-{i}");
                match ingest
                    .deliver_trigger(storm_warning(trigger_id.clone()))
                    .await
                {
                    Ok(r) => acked.push((trigger_id, r.into_inner().record_id)),
                    Err(s) => {
                        *codes.entry(s.code()).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            (acked, codes)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let down = pg.clone();
    tokio::task::spawn_blocking(move || down.down())
        .await
        .expect("stop PostgreSQL");
    let stopped_at = Instant::now();
    // Readiness follows at once (the policy listener's connection drops), on gRPC and HTTP.
    loop {
        let grpc = health(&ch).await;
        let http = http_status(&format!("http://{}/readyz", served.metrics_addr));
        if grpc == Some(ServingStatus::NotServing) && http == 503 {
            break;
        }
        assert!(
            stopped_at.elapsed() < Duration::from_secs(2),
            "still {grpc:?} / HTTP {http} 2 s after PostgreSQL stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "NOT_SERVING {:?} after PostgreSQL stopped",
        stopped_at.elapsed()
    );
    // While it is down, a delivery is refused as UNAVAILABLE.
    let r = IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning("during-outage".into()))
        .await;
    assert_eq!(
        r.as_ref().map_err(|s| s.code()).err(),
        Some(tonic::Code::Unavailable),
        "{r:?}"
    );
    // So are an admin write and a read; the refused revoke changes nothing, in the store or in
    // the view (alice's triggers are recorded again once PostgreSQL is back).
    let revoke = {
        let ch = ch.clone();
        tokio::spawn(async move {
            PolicyServiceClient::new(ch)
                .revoke_sense_enable(revoke_alice())
                .await
                .map(|_| ())
        })
    };
    let list = RecordServiceClient::new(ch.clone())
        .list_records(pb::ListRecordsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await;
    let revoke = revoke.await.expect("revoke task");
    for (what, code) in [
        ("RevokeSenseEnable", revoke.err().map(|s| s.code())),
        ("ListRecords", list.err().map(|s| s.code())),
    ] {
        assert_eq!(
            code,
            Some(tonic::Code::Unavailable),
            "{what} during the outage"
        );
    }

    let up = pg.clone();
    tokio::task::spawn_blocking(move || up.up())
        .await
        .expect("start PostgreSQL");
    let started_at = Instant::now();
    let mut ingest = IngestServiceClient::new(ch.clone());
    let recovered = loop {
        let r = ingest
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner());
        if recorded(&r) && health(&ch).await == Some(ServingStatus::Serving) {
            break started_at.elapsed();
        }
        assert!(
            started_at.elapsed() < Duration::from_secs(5),
            "not recovered 5 s after PostgreSQL came back: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("recording and SERVING {recovered:?} after PostgreSQL started");
    assert_eq!(
        http_status(&format!("http://{}/readyz", served.metrics_addr)),
        200
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);

    let mut acked = Vec::new();
    let mut codes: HashMap<tonic::Code, usize> = HashMap::new();
    for w in workers {
        let (a, c) = w.await.expect("worker");
        acked.extend(a);
        for (code, n) in c {
            *codes.entry(code).or_default() += n;
        }
    }
    eprintln!("{} acknowledged; refused: {codes:?}", acked.len());
    assert!(
        codes.keys().all(|c| *c == tonic::Code::Unavailable),
        "only UNAVAILABLE during the outage: {codes:?}"
    );
    assert!(codes.get(&tonic::Code::Unavailable).copied().unwrap_or(0) > 0);
    let conn = sea_orm::Database::connect(pg.url()).await.expect("connect");
    use sea_orm::EntityTrait;
    let rows = hcp_sense::store::entity::records::Entity::find()
        .all(&conn)
        .await
        .expect("records");
    let mut by_trigger: HashMap<String, Vec<String>> = HashMap::new();
    for r in rows {
        if let Some(t) = r.producer_trigger_id {
            by_trigger.entry(t).or_default().push(r.record_id);
        }
    }
    for (trigger_id, record_id) in &acked {
        assert_eq!(
            by_trigger.get(trigger_id),
            Some(&vec![record_id.clone()]),
            "acknowledged trigger {trigger_id} is stored once under its record id"
        );
    }
    assert!(served.terminate(), "exits 0 on SIGTERM");
}

/// A TCP proxy that can freeze: while frozen it forwards nothing and closes nothing, as a
/// network partition or a vanished database host does.
struct FreezingProxy {
    addr: String,
    frozen: Arc<AtomicBool>,
    /// Connections opened before this epoch are frozen for good (a failover: the old host is
    /// gone without a word, new connections reach the new one).
    epoch: Arc<std::sync::atomic::AtomicU64>,
}

impl FreezingProxy {
    async fn start(upstream: String) -> FreezingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let epoch = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (f, e) = (frozen.clone(), epoch.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (f, e, upstream) = (f.clone(), e.clone(), upstream.clone());
                tokio::spawn(async move {
                    let born = e.load(Ordering::SeqCst);
                    let gate = Gate {
                        frozen: f,
                        epoch: e,
                        born,
                    };
                    gate.open().await;
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(pump(cr, sw, gate.clone()));
                    pump(sr, cw, gate).await;
                });
            }
        });
        FreezingProxy {
            addr,
            frozen,
            epoch,
        }
    }

    /// A server whose database (postgres://user@HOST:PORT/name) is reached through a proxy.
    async fn serve(db: &TestDb, extra: &[&str]) -> (FreezingProxy, Served) {
        let (head, rest) = db.url.split_once('@').expect("url with user");
        let (host_port, tail) = rest.split_once('/').expect("url with database");
        let proxy = FreezingProxy::start(host_port.to_owned()).await;
        let served = Served::start(&format!("{head}@{}/{tail}", proxy.addr), extra);
        (proxy, served)
    }

    fn freeze(&self, on: bool) {
        self.frozen.store(on, Ordering::SeqCst);
    }

    /// Every connection open now goes silent for good; new ones flow.
    fn fail_over(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether one proxied connection may pass bytes.
#[derive(Clone)]
struct Gate {
    frozen: Arc<AtomicBool>,
    epoch: Arc<std::sync::atomic::AtomicU64>,
    born: u64,
}

impl Gate {
    async fn open(&self) {
        while self.frozen.load(Ordering::SeqCst) || self.epoch.load(Ordering::SeqCst) > self.born {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    gate: Gate,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        gate.open().await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The database silently unreachable (its connections neither answer nor close): the policy
/// listener's heartbeat goes unanswered, so the server fails closed — UNAVAILABLE and
/// NOT_SERVING — and when traffic flows again it recovers by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_lost_database_fails_closed_and_recovers_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &[]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut ingest = IngestServiceClient::new(ch.clone());
    let deliver = |ingest: &mut IngestServiceClient<Channel>| {
        let mut req = tonic::Request::new(storm_warning(String::new()));
        req.set_timeout(Duration::from_millis(500));
        let mut ingest = ingest.clone();
        async move { ingest.deliver_trigger(req).await.map(|r| r.into_inner()) }
    };
    assert!(recorded(&deliver(&mut ingest).await));

    proxy.freeze(true);
    let frozen_at = Instant::now();
    let (mut unavailable, mut not_serving) = (false, false);
    while !(unavailable && not_serving) {
        assert!(
            frozen_at.elapsed() < Duration::from_secs(3),
            "still deciding 3 s into a silent outage (UNAVAILABLE seen: {unavailable}, NOT_SERVING seen: {not_serving}); log:\n{}", served.log.lock().map(|l| l.join("\n")).unwrap_or_default()
        );
        match deliver(&mut ingest).await {
            Err(s) if s.code() == tonic::Code::Unavailable => unavailable = true,
            Ok(r) if recorded(&Ok(r.clone())) => {
                panic!("recorded while the database cannot be reached: {r:?}")
            }
            _ => {}
        }
        not_serving |= health(&ch).await == Some(ServingStatus::NotServing);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "failed closed {:?} into a silent outage",
        frozen_at.elapsed()
    );

    proxy.freeze(false);
    let thawed_at = Instant::now();
    loop {
        if recorded(&deliver(&mut ingest).await)
            && health(&ch).await == Some(ServingStatus::Serving)
        {
            break;
        }
        assert!(
            thawed_at.elapsed() < Duration::from_secs(5),
            "not recovered 5 s after the database was reachable again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "recovered {:?} after traffic flowed again",
        thawed_at.elapsed()
    );
    assert!(served.terminate());
}

/// A failover: every open database connection goes silent for good while new ones reach the
/// database. The server fails closed, then moves its listener, pool and record writer to new
/// connections and records again, with nothing acknowledged that was not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_silent_failover_the_server_moves_to_new_connections_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--request-timeout-secs", "2"]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut acked = Vec::new();
    for i in 0..20 {
        let id = format!("before-{i}");
        let r = ingest
            .deliver_trigger(storm_warning(id.clone()))
            .await
            .expect("deliver")
            .into_inner();
        acked.push((id, r.record_id));
    }
    proxy.fail_over();
    let failed_over = Instant::now();
    let mut i = 0;
    let recovered = loop {
        i += 1;
        let id = format!("after-{i}");
        let mut req = tonic::Request::new(storm_warning(id.clone()));
        req.set_timeout(Duration::from_secs(3));
        if let Ok(r) = ingest.deliver_trigger(req).await {
            acked.push((id, r.into_inner().record_id));
            if health(&ch).await == Some(ServingStatus::Serving) {
                break failed_over.elapsed();
            }
        }
        assert!(
            failed_over.elapsed() < Duration::from_secs(20),
            "still not recording 20 s after a failover; log:\n{}",
            served.log.lock().map(|l| l.join("\n")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("recording again {recovered:?} after the failover");
    for (id, record_id) in &acked {
        assert_eq!(
            records_for(&db, id).await,
            vec![record_id.clone()],
            "acknowledged trigger {id}"
        );
    }
    assert!(served.terminate());
}

/// A call that outlives the grace period (its record write waiting on a database gone silent)
/// does not hold up shutdown: after SIGTERM no new connection is accepted, and the process
/// exits 0 once the grace period is over, without acknowledging that call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_at_the_grace_period_with_a_call_still_in_flight_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--shutdown-grace-secs", "1"]).await;
    let addr = served.addr.clone();
    let ch = connect(&addr).await;
    set_up_weather(&ch).await;
    proxy.freeze(true);
    let stuck = {
        let mut ingest = IngestServiceClient::new(ch.clone());
        tokio::spawn(async move {
            ingest
                .deliver_trigger(storm_warning("in-flight".into()))
                .await
                .map(|r| r.into_inner())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = tokio::task::spawn_blocking(move || served.terminate_timed());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await;
    assert!(
        refused.is_err(),
        "a new connection was accepted during the grace period"
    );
    let (exited_cleanly, took) = stopping.await.expect("join");
    eprintln!("exited {took:?} after SIGTERM with a call in flight");
    assert!(exited_cleanly, "exit 0 after the grace period");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1300),
        "exit {took:?} after SIGTERM; the grace period is 1 s"
    );
    let r = stuck.await.expect("call");
    assert!(r.is_err(), "acknowledged without a record: {r:?}");
    proxy.freeze(false);
    assert!(
        records_for(&db, "in-flight").await.is_empty(),
        "the call's record was written after all"
    );
}

/// A replica started while its database is down keeps trying, and serves once the database
/// is up, instead of exiting (where Kubernetes would back off for minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_while_postgres_is_down_waits_for_it() {
    let pg = Arc::new(PrivatePostgres::start());
    pg.down();
    let url = pg.url();
    let starting = std::thread::spawn(move || Served::start(&url, &[]));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!starting.is_finished(), "started without a database");
    let up = pg.clone();
    tokio::task::spawn_blocking(move || up.up())
        .await
        .expect("start PostgreSQL");
    let up_at = Instant::now();
    let served = tokio::task::spawn_blocking(move || starting.join().expect("server thread"))
        .await
        .expect("join");
    eprintln!("serving {:?} after PostgreSQL started", up_at.elapsed());
    assert!(up_at.elapsed() < Duration::from_secs(10));
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    assert!(recorded(
        &IngestServiceClient::new(ch.clone())
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner())
    ));
    assert!(served.terminate());
}

/// The Helm chart renders with Helm's own library, lints, and every object validates against
/// Kubernetes' schemas (tests/helm/check_chart.py); the configuration it renders starts the
/// real binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_chart_renders_validates_and_its_config_starts_the_server() {
    let out = tempfile::tempdir().expect("tempdir");
    let o = Command::new("python3")
        .arg(repo_path("tests/helm/check_chart.py"))
        .arg("--emit-config")
        .arg(out.path())
        .output()
        .expect("python3 with helm-python-sdk and kubernetes-validate (see .ci/run)");
    assert!(
        o.status.success(),
        "check_chart.py failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let db = TestDb::create(StoreKind::Postgres).await;
    let config = out.path().join("config-default.toml");
    // Authentication as the chart supplies it: the [auth] table in a file of its own.
    let token = "chart-admin-token";
    let auth = out.path().join("auth.toml");
    std::fs::write(
        &auth,
        format!(
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nrole = \"admin\"\n",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(token))
        ),
    )
    .expect("auth.toml");
    // As the chart's hook Job runs it, before any server: `migrate up` with the URL from the
    // environment; the servers then start with the rendered `migrate = false`.
    let job = Command::new(crate::cli::BIN)
        .args(["migrate", "up"])
        .env_remove("DATABASE_URL")
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_LOG_FORMAT", "json")
        .output()
        .expect("migrate up");
    let job_out = String::from_utf8_lossy(&job.stdout);
    assert!(job.status.success(), "migrate up: {job_out}");
    // One stream of JSON lines, the migrations' states among them.
    let events: Vec<serde_json::Value> = job_out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let applied = events
        .iter()
        .filter(|e| e.to_string().contains("\"state\":\"applied\""))
        .count();
    assert!(applied >= 2, "{job_out}");
    let mut cmd = Command::new(crate::cli::BIN);
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        // The rendered config binds every interface; here it stays on loopback.
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_AUTH_FILE", &auth);
    let served = Served::spawn(cmd);
    let ch = connect(&served.addr).await;
    assert_eq!(health(&ch).await, Some(ServingStatus::Serving));
    let live = HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: hcp_sense::app::LIVENESS.into(),
        })
        .await
        .expect("liveness entry")
        .into_inner();
    assert_eq!(live.status, ServingStatus::Serving as i32);
    let mut packs = pb::pack_service_client::PackServiceClient::new(ch.clone());
    let refused = packs
        .list_packs(pb::ListPacksRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(pb::ListPacksRequest::default());
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    packs.list_packs(req).await.expect("the auth file's token");
    assert!(served.terminate());

    // The production values' config.toml: TLS with client certificates, JSON logs, retention,
    // rate limits. Only the addresses, the certificate paths and the log format (read here to
    // find the address) are overridden.
    let certs = out.path().join("certs");
    std::fs::create_dir_all(&certs).expect("certs");
    crate::security::make_certs(&certs);
    let mut cmd = Command::new(crate::cli::BIN);
    cmd.arg("serve")
        .arg("--config")
        .arg(out.path().join("config.toml"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--log-format", "compact"])
        .arg("--tls-cert-file")
        .arg(certs.join("server.pem"))
        .arg("--tls-key-file")
        .arg(certs.join("server.key"))
        .arg("--tls-client-ca-file")
        .arg(certs.join("ca.pem"))
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_AUTH_FILE", &auth);
    let served = Served::spawn(cmd);
    let readyz = format!("http://{}/readyz", served.metrics_addr);
    let start = Instant::now();
    while http_status(&readyz) != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "production config: not ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served.terminate());
}

/// The image is built by the commands CI runs, in a build stage of its own, and runs as the
/// non-root user the chart expects.
#[test]
fn dockerfile_builds_with_the_commands_ci_runs_and_runs_as_non_root() {
    let dockerfile = std::fs::read_to_string(repo_path("Dockerfile")).expect("Dockerfile");
    let ci = std::fs::read_to_string(repo_path(".ci/run")).expect(".ci/run");
    let ci_lines: Vec<&str> = ci.lines().map(str::trim).collect();
    // Instructions, with continuation lines joined.
    let joined = dockerfile.replace("\\\n", " ");
    let instructions: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let stages = instructions
        .iter()
        .filter(|l| l.starts_with("FROM "))
        .count();
    assert!(stages >= 2, "multi-stage: {stages} FROM");
    let cargo: Vec<String> = instructions
        .iter()
        .filter(|l| l.starts_with("RUN "))
        .filter_map(|l| l.find("cargo ").map(|i| l[i..].trim().to_owned()))
        .collect();
    for want in ["cargo fmt", "cargo clippy", "cargo build --release"] {
        assert!(
            cargo.iter().any(|c| c.starts_with(want)),
            "the Dockerfile runs `{want}`: {cargo:?}"
        );
    }
    for c in &cargo {
        assert!(
            ci_lines.contains(&c.as_str()),
            "the Dockerfile's `{c}` is not a command of .ci/run"
        );
    }
    let last_stage = &instructions[instructions
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("FROM")..];
    let user = last_stage
        .iter()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap_or_default();
    assert_eq!(uid, "65532", "the chart's runAsUser");
    assert!(
        last_stage
            .iter()
            .any(|l| l.starts_with("ENTRYPOINT") && l.contains("hcp-sense")),
        "the entrypoint is the binary (the chart passes only arguments)"
    );
    let values = std::fs::read_to_string(repo_path("helm/hcp-sense/values.yaml")).expect("values");
    assert!(values.contains("runAsUser: 65532"));
}

/// The database goes silent under callers: each is answered UNAVAILABLE — which producers
/// retry — before its own deadline or the server's, never CANCELLED or DEADLINE_EXCEEDED; the
/// retries after it comes back leave every trigger recorded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_database_is_unavailable_before_every_deadline_postgres() {
    use hcp_sense::grpc::pb::ingest_service_client::IngestServiceClient;
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--request-timeout-secs", "3"]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let deliver = |id: String, deadline: Option<Duration>| {
        let ch = ch.clone();
        async move {
            let mut req = tonic::Request::new(storm_warning(id));
            if let Some(d) = deadline {
                req.set_timeout(d);
            }
            let started = Instant::now();
            let r = IngestServiceClient::new(ch)
                .deliver_trigger(req)
                .await
                .map(tonic::Response::into_inner);
            (r, started.elapsed())
        }
    };
    assert!(recorded(&deliver("warm-up".into(), None).await.0));
    proxy.freeze(true);
    let mut calls = Vec::new();
    for i in 0..50 {
        // 40 bounded by the server's 3 s, 10 by their own 1 s deadline.
        let deadline = (i >= 40).then_some(Duration::from_secs(1));
        calls.push((
            deadline.unwrap_or(Duration::from_secs(3)),
            tokio::spawn(deliver(format!("silent-{i}"), deadline)),
        ));
    }
    for (bound, call) in calls {
        let (r, took) = call.await.expect("call");
        let code = r.as_ref().err().map(tonic::Status::code);
        assert_eq!(code, Some(tonic::Code::Unavailable), "{r:?} after {took:?}");
        assert!(
            took < bound,
            "answered after {took:?}, its deadline was {bound:?}"
        );
    }
    proxy.freeze(false);
    let thawed = Instant::now();
    for i in 0..50 {
        while !recorded(&deliver(format!("silent-{i}"), None).await.0) {
            assert!(thawed.elapsed() < Duration::from_secs(20), "not recovered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let conn = db.connect().await;
    use sea_orm::ConnectionTrait;
    let row = conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT COUNT(*) AS n, COUNT(DISTINCT producer_trigger_id) AS d FROM records",
        ))
        .await
        .expect("count")
        .expect("row");
    let (n, d): (i64, i64) = (
        row.try_get("", "n").expect("n"),
        row.try_get("", "d").expect("d"),
    );
    assert_eq!((n, d), (51, 51), "every trigger once, the warm-up included");
    assert!(served.terminate());
}
