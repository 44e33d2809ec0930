//! Shared test helpers: a fresh database per test, the server in-process on an ephemeral port, clients.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use hcp_sense::app::App;
use hcp_sense::config::Config;
use hcp_sense::grpc::pb::{
    ingest_service_client::IngestServiceClient, pack_service_client::PackServiceClient,
    policy_service_client::PolicyServiceClient, record_service_client::RecordServiceClient,
};
use hcp_sense::store::entity;
use sea_orm::EntityTrait;
use sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// Runs the test body once against SQLite and once against PostgreSQL, each
/// with a server of its own on a fresh database: `mod NAME { sqlite, postgres }`.
macro_rules! both_stores {
    ($(async fn $name:ident($app:ident) $body:block)+) => {$(
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            async fn run($app: crate::helpers::TestApp) $body
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                run(crate::helpers::spawn_app(crate::helpers::StoreKind::Sqlite).await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                run(crate::helpers::spawn_app(crate::helpers::StoreKind::Postgres).await).await
            }
        }
    )+};
}

/// A test of the served binary or of a database, once per store: `name => run` makes the tests
/// `name::sqlite` and `name::postgres`, each calling `run(StoreKind)`.
macro_rules! on_both_stores {
    ($name:ident => $run:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$run(crate::helpers::StoreKind::Sqlite).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$run(crate::helpers::StoreKind::Postgres).await
            }
        }
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Sqlite,
    Postgres,
}

/// The PostgreSQL server tests create their databases on (trust auth, user postgres).
pub fn postgres_admin_url() -> String {
    std::env::var("HCP_SENSE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A database of its own for one test, removed when dropped.
#[allow(dead_code)]
pub struct TestDb {
    pub kind: StoreKind,
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg_name: Option<String>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl TestDb {
    pub async fn create(kind: StoreKind) -> TestDb {
        match kind {
            StoreKind::Sqlite => {
                let dir = tempfile::tempdir().expect("tempdir");
                let url = format!("sqlite://{}/hcp-sense.db", dir.path().display());
                TestDb {
                    kind,
                    url,
                    _dir: Some(dir),
                    pg_name: None,
                }
            }
            StoreKind::Postgres => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0);
                let name = format!(
                    "hcp_sense_t_{}_{}_{}",
                    std::process::id(),
                    NEXT.fetch_add(1, Ordering::Relaxed),
                    nanos
                );
                let admin = Database::connect(postgres_admin_url())
                    .await
                    .expect("PostgreSQL must be running for the tests (see .ci/run)");
                admin
                    .execute_unprepared(&format!("CREATE DATABASE {name}"))
                    .await
                    .expect("create test database");
                let _ = admin.close().await;
                let base = postgres_admin_url();
                let root = base.rsplit_once('/').map_or(base.as_str(), |(r, _)| r);
                TestDb {
                    kind,
                    url: format!("{root}/{name}"),
                    _dir: None,
                    pg_name: Some(name),
                }
            }
        }
    }

    /// A connection of the test's own, for looking at tables directly.
    pub async fn connect(&self) -> DatabaseConnection {
        Database::connect(self.url.as_str())
            .await
            .expect("connect test database")
    }

    /// The service's store on this database, with at most `max_connections`, unmigrated.
    pub async fn store(&self, max_connections: u32) -> hcp_sense::store::Store {
        hcp_sense::store::Store::connect(&hcp_sense::config::StoreConfig {
            max_connections: Some(max_connections),
            ..hcp_sense::config::StoreConfig::at(self.url.clone())
        })
        .await
        .expect("connect")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(name) = self.pg_name.take() else {
            return;
        };
        // Drop runs inside the test's runtime; a thread of its own may block.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(admin) = Database::connect(postgres_admin_url()).await {
                    let _ = admin
                        .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

/// A running server on a fresh database, with clients and a direct database connection.
#[allow(dead_code)]
pub struct TestApp {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// The HTTP ingress listener, when the test configured one.
    pub ingress_addr: Option<SocketAddr>,
    /// The MCP door, when the test configured one.
    pub mcp_addr: Option<SocketAddr>,
    /// The JSON door, when the test configured one.
    pub web_addr: Option<SocketAddr>,
    pub packs: PackServiceClient<Channel>,
    pub policy: PolicyServiceClient<Channel>,
    pub ingest: IngestServiceClient<Channel>,
    pub records: RecordServiceClient<Channel>,
    pub channel: Channel,
    pub db: DatabaseConnection,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<anyhow::Result<()>>>,
    // Last: the database outlives the server and the connection.
    pub test_db: TestDb,
}

pub async fn spawn_app(kind: StoreKind) -> TestApp {
    spawn_app_with(kind, |_| {}).await
}

/// A server whose configuration the test adjusts first.
pub async fn spawn_app_with(kind: StoreKind, adjust: impl FnOnce(&mut Config)) -> TestApp {
    crate::trace::install();
    let test_db = TestDb::create(kind).await;
    let mut config = Config::for_database(test_db.url.clone());
    adjust(&mut config);
    let tls = config.tls.cert_file.is_some();
    let app = App::build(config).await.expect("build app");
    let addr = app.local_addr();
    let metrics_addr = app.metrics_addr();
    let ingress_addr = app.ingress_addr();
    let mcp_addr = app.mcp_addr();
    let web_addr = app.web_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    // A TLS server gets a lazy plain channel, which its tests do not use.
    let channel = if tls {
        Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect_lazy()
    } else {
        Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect to the test server")
    };
    let db = test_db.connect().await;
    TestApp {
        addr,
        metrics_addr,
        ingress_addr,
        mcp_addr,
        web_addr,
        packs: PackServiceClient::new(channel.clone()),
        policy: PolicyServiceClient::new(channel.clone()),
        ingest: IngestServiceClient::new(channel.clone()),
        records: RecordServiceClient::new(channel.clone()),
        channel,
        db,
        stop: Some(stop),
        server: Some(server),
        test_db,
    }
}

impl TestApp {
    /// Rows in a table, read directly from the database.
    pub async fn count(&self, table: &str) -> i64 {
        let backend = self.db.get_database_backend();
        let row = self
            .db
            .query_one_raw(Statement::from_string(
                backend,
                format!("SELECT COUNT(*) AS n FROM {table}"),
            ))
            .await
            .expect("count query")
            .expect("a row");
        row.try_get::<i64>("", "n").expect("n")
    }

    /// Every row of every table, sorted, as text; the sink and the drop log only when asked.
    pub async fn snapshot(&self, with_sink: bool) -> Vec<String> {
        let mut out = Vec::new();
        macro_rules! dump {
            ($($m:ident),+) => {$(
                let mut rows: Vec<String> = entity::$m::Entity::find()
                    .all(&self.db)
                    .await
                    .expect("snapshot")
                    .into_iter()
                    .map(|r| format!("{r:?}"))
                    .collect();
                rows.sort();
                out.push(format!("{}: {rows:?}", stringify!($m)));
            )+};
        }
        dump!(
            packs,
            pack_triggers,
            pack_stimuli,
            pack_commands,
            sense_grants,
            bindings,
            sense_activations,
            execute_states,
            project_members
        );
        if with_sink {
            dump!(records, drop_reports);
        }
        out
    }

    /// Stops the server and waits until it has exited cleanly.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server
                .await
                .expect("server task")
                .expect("server exits cleanly");
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// The path of a file in the repository.
pub fn repo_path(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A manifest from `examples/` as JSON.
pub fn example(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(repo_path(&format!("examples/{name}"))).expect("example");
    hcp_sense::domain::pack::parse_manifest_text(&text).expect("example parses")
}

/// The field violations of an INVALID_ARGUMENT status: (field, description).
pub fn violations(status: &tonic::Status) -> Vec<(String, String)> {
    use tonic_types::StatusExt;
    status
        .get_details_bad_request()
        .map(|b| {
            b.field_violations
                .into_iter()
                .map(|v| (v.field, v.description))
                .collect()
        })
        .unwrap_or_default()
}

/// The body of an HTTP GET, by the real curl; panics unless it answers 2xx.
pub fn http_get(url: &str) -> String {
    let o = std::process::Command::new("curl")
        .args(["-sf", "--max-time", "10", url])
        .output()
        .expect("curl must be installed (see .ci/run)");
    assert!(
        o.status.success(),
        "GET {url}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The HTTP status of GET `url` (0 when nothing answers).
pub fn http_status(url: &str) -> u16 {
    let o = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
        ])
        .arg(url)
        .output()
        .expect("curl must be installed (see .ci/run)");
    String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A second server on a test's database (PostgreSQL), as another replica.
pub struct Replica {
    pub channel: tonic::transport::Channel,
    /// Its HTTP ingress listener, when configured.
    pub ingress_addr: Option<SocketAddr>,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Replica {
    pub async fn start(url: &str) -> Replica {
        Replica::start_with(url, |_| {}).await
    }

    /// A replica whose configuration the test adjusts first.
    pub async fn start_with(url: &str, adjust: impl FnOnce(&mut Config)) -> Replica {
        let mut config = Config::for_database(url.to_owned());
        config.migrate = false;
        adjust(&mut config);
        let b = App::build(config).await.expect("replica");
        let addr = b.local_addr();
        let ingress_addr = b.ingress_addr();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(b.run_until(async move {
            let _ = stopped.await;
        }));
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        Replica {
            channel,
            ingress_addr,
            stop,
            served,
        }
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.served.await;
    }
}
