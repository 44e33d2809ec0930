//! Behind PgBouncer (Debian's package) in session mode: every replica's records, listings and policy changes as on the primary, partitions made and dropped through it.
use super::*;

/// A PgBouncer of the test's own, in front of the machine's PostgreSQL, run as `postgres`
/// (PgBouncer refuses root).
struct Pooler {
    dir: tempfile::TempDir,
    port: u16,
    child: std::process::Child,
}

impl Pooler {
    fn start(mode: &str) -> Pooler {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        std::fs::write(dir.path().join("users.txt"), "\"postgres\" \"\"\n").expect("users");
        // hcp-sense asks for idle_in_transaction_session_timeout in the startup packet's
        // `options`; PgBouncer cannot pass that on, so it is ignored here and set on the role
        // or database instead (docs/partitions.md).
        std::fs::write(
            dir.path().join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host=127.0.0.1 port=5432\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 auth_type = trust\nauth_file = {dir}/users.txt\npool_mode = {mode}\n\
                 ignore_startup_parameters = options,extra_float_digits\n\
                 max_client_conn = 200\ndefault_pool_size = 40\n\
                 unix_socket_dir =\nlogfile = {dir}/pgbouncer.log\n",
                dir = dir.path().display()
            ),
        )
        .expect("ini");
        let ini = dir.path().join("pgbouncer.ini");
        let mut cmd = if crate::support::postgres::is_root() {
            let _ = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(dir.path())
                .status();
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "pgbouncer"]);
            c
        } else {
            Command::new("pgbouncer")
        };
        let mut child = cmd
            .arg(&ini)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("pgbouncer (see .ci/run)");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Pooler { dir, port, child };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("pgbouncer did not listen on {port}");
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for Pooler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("pkill")
            .args(["-f", &self.dir.path().display().to_string()])
            .status();
    }
}

/// Two replicas reach PostgreSQL only through PgBouncer in session mode: migrations, records
/// (keyed, with a redelivery answered its first record), a listing through either replica, a
/// grant revoked on one taking effect on the other, and a write that finds no partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_behind_pgbouncer_in_session_mode_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let database = db
        .url
        .rsplit('/')
        .next()
        .expect("a database name")
        .to_owned();
    let pooler = Pooler::start("session");
    let url = pooler.url(&database);
    let one = Served::start(&url, &["--page-token-secret", "shared"]);
    let two = Served::start(
        &url,
        &["--page-token-secret", "shared", "--migrate", "false"],
    );
    let (ch1, ch2) = (connect(&one.addr).await, connect(&two.addr).await);
    set_up_weather(&ch1).await;
    // The second replica learns the grant and activation over LISTEN, through the pooler.
    let mut acked = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = IngestServiceClient::new(ch2.clone())
            .deliver_trigger(storm_warning(format!("warm-{}", acked.len())))
            .await
            .expect("deliver")
            .into_inner();
        if !r.record_id.is_empty() {
            acked.push(r.record_id);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second replica never took the set-up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..40 {
        let ch = if i % 2 == 0 { &ch1 } else { &ch2 };
        let r = IngestServiceClient::new(ch.clone())
            .deliver_trigger(storm_warning(format!("p-{i}")))
            .await
            .expect("deliver through the pooler")
            .into_inner();
        acked.push(r.record_id);
    }
    let again = IngestServiceClient::new(ch2.clone())
        .deliver_trigger(storm_warning("p-0".into()))
        .await
        .expect("deliver again")
        .into_inner();
    assert!(again.duplicate);
    assert_eq!(again.record_id, acked[1]);
    assert_eq!(
        crate::position::list_all(&ch2, 7, String::new()).await,
        acked
    );
    // A policy change on one replica reaches the other (LISTEN through the session pool).
    pb::policy_service_client::PolicyServiceClient::new(ch1.clone())
        .revoke_sense_enable(pb::RevokeSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "weather".into(),
        })
        .await
        .expect("revoke");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = IngestServiceClient::new(ch2.clone())
            .deliver_trigger(storm_warning(format!(
                "after-{}",
                Instant::now().elapsed().as_nanos()
            )))
            .await
            .expect("deliver")
            .into_inner();
        if r.drop_reason == pb::DropReason::NoGrant as i32 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the revocation did not reach the other replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
