//! Service configuration: defaults, then an optional TOML file, then `HCP_SENSE_*` environment, then flags.
use clap::Args;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024;
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_DATABASE_URL: &str = "sqlite://hcp-sense.db?mode=rwc";

/// Most sink writers: each holds a database connection.
pub const MAX_SINK_WRITERS: usize = 64;

/// Options of `hcp-sense serve`. Every option may also be set in the TOML file
/// (same name, with `_` for `-`) or in the environment variable shown.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeOptions {
    /// TOML file with any of these options; flags and environment override it.
    #[arg(long, env = "HCP_SENSE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// TOML file holding only the `[auth]` table, kept apart so that it can come from a
    /// secret store while the rest of the configuration does not; `[auth]` then may not
    /// also appear in the configuration file.
    #[arg(long, env = "HCP_SENSE_AUTH_FILE", value_name = "FILE")]
    pub auth_file: Option<PathBuf>,

    /// Address the gRPC server listens on [default: 127.0.0.1:50051].
    #[arg(long, env = "HCP_SENSE_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,

    #[command(flatten)]
    pub database: DatabaseOptions,

    /// Apply pending migrations at start [default: true].
    #[arg(long, env = "HCP_SENSE_MIGRATE", value_name = "BOOL")]
    pub migrate: Option<bool>,

    /// Log format on stdout: `pretty`, `compact` or `json` [default: compact]. Level by RUST_LOG.
    #[arg(long, env = "HCP_SENSE_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,

    /// Largest trigger payload accepted, in bytes of JSON [default: 65536].
    #[arg(long, env = "HCP_SENSE_MAX_PAYLOAD_BYTES", value_name = "BYTES")]
    pub max_payload_bytes: Option<usize>,

    /// Delete records older than this many seconds, in small background batches [default: keep all].
    #[arg(long, env = "HCP_SENSE_RECORD_RETENTION_SECS", value_name = "SECS")]
    pub record_retention_secs: Option<u64>,

    /// Seconds between retention passes [default: 30].
    #[arg(long, env = "HCP_SENSE_PRUNE_INTERVAL_SECS", value_name = "SECS")]
    pub prune_interval_secs: Option<u64>,

    /// Serve hcp.sense.v1.BenchService, a no-op with DeliverTrigger's message shape, as a benchmark baseline.
    #[arg(long, env = "HCP_SENSE_BENCH_BASELINE", value_name = "BOOL")]
    pub bench_baseline: Option<bool>,

    /// Address of the HTTP server for /metrics (Prometheus text), /healthz and /readyz [default: 127.0.0.1:9464].
    #[arg(long, env = "HCP_SENSE_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// Most distinct `pack` label values on delivery metrics; the rest are `other` [default: 100].
    #[arg(long, env = "HCP_SENSE_METRICS_MAX_PACKS", value_name = "N")]
    pub metrics_max_packs: Option<usize>,

    /// Put a SHA-256 prefix of the principal, not the principal, on decision spans [default: false].
    #[arg(long, env = "HCP_SENSE_HASH_PRINCIPALS", value_name = "BOOL")]
    pub hash_principals: Option<bool>,

    /// Let OTEL_TRACES_SAMPLER sample away decision spans of dropped triggers too [default: false: always kept].
    #[arg(long, env = "HCP_SENSE_SAMPLE_DROP_DECISIONS", value_name = "BOOL")]
    pub sample_drop_decisions: Option<bool>,

    /// Serve TLS with this PEM certificate chain (needs --tls-key-file).
    #[arg(long, env = "HCP_SENSE_TLS_CERT_FILE", value_name = "FILE")]
    pub tls_cert_file: Option<PathBuf>,

    /// The PEM private key of --tls-cert-file.
    #[arg(long, env = "HCP_SENSE_TLS_KEY_FILE", value_name = "FILE")]
    pub tls_key_file: Option<PathBuf>,

    /// Accept client certificates signed by this PEM CA (mutual TLS); the certificate's
    /// common name becomes the caller's principal.
    #[arg(long, env = "HCP_SENSE_TLS_CLIENT_CA_FILE", value_name = "FILE")]
    pub tls_client_ca_file: Option<PathBuf>,

    /// Role of callers known by their client certificate: admin, runtime or reader [default: reader].
    #[arg(long, env = "HCP_SENSE_TLS_CLIENT_ROLE", value_name = "ROLE")]
    pub tls_client_role: Option<String>,

    /// Key that signs page tokens; replicas behind one address need the same one [default: random per process].
    #[arg(
        long,
        env = "HCP_SENSE_PAGE_TOKEN_SECRET",
        value_name = "SECRET",
        hide_env_values = true
    )]
    pub page_token_secret: Option<String>,

    /// Serve without authentication on a non-loopback address. Without `[auth]` in the
    /// configuration file the server otherwise refuses to bind anything but loopback.
    #[arg(long)]
    pub insecure_no_auth: bool,

    /// Calls a second each caller may make, bursts of twice that; 0 for no limit [default: 0].
    #[arg(long, env = "HCP_SENSE_RATE_LIMIT_PER_SEC", value_name = "N")]
    pub rate_limit_per_sec: Option<f64>,

    /// Largest gRPC request message accepted, in bytes [default: 1048576].
    #[arg(long, env = "HCP_SENSE_MAX_REQUEST_BYTES", value_name = "BYTES")]
    pub max_request_bytes: Option<usize>,

    /// Deepest JSON nesting accepted in a payload or manifest [default: 32].
    #[arg(long, env = "HCP_SENSE_MAX_JSON_DEPTH", value_name = "N")]
    pub max_json_depth: Option<usize>,

    /// Concurrent HTTP/2 streams per connection [default: 256].
    #[arg(long, env = "HCP_SENSE_MAX_CONCURRENT_STREAMS", value_name = "N")]
    pub max_concurrent_streams: Option<u32>,

    /// Longest a call may run before it is answered DEADLINE_EXCEEDED, in seconds [default: 30].
    #[arg(long, env = "HCP_SENSE_REQUEST_TIMEOUT_SECS", value_name = "SECS")]
    pub request_timeout_secs: Option<u64>,

    /// Sink writers committing record batches concurrently, each on a database connection of
    /// its own, 1 to 64; PostgreSQL only, SQLite always has one [default: 2].
    #[arg(long, env = "HCP_SENSE_SINK_WRITERS", value_name = "N")]
    pub sink_writers: Option<usize>,

    /// Seconds to wait for in-flight calls after SIGINT/SIGTERM before exiting [default: 30].
    #[arg(long, env = "HCP_SENSE_SHUTDOWN_GRACE_SECS", value_name = "SECS")]
    pub shutdown_grace_secs: Option<u64>,

    /// Seconds to keep trying to reach an unreachable database at start before giving up
    /// [default: 60].
    #[arg(long, env = "HCP_SENSE_DB_STARTUP_WAIT_SECS", value_name = "SECS")]
    pub db_startup_wait_secs: Option<u64>,

    /// Most client connections open at once; further clients wait in the listen backlog. Lowered to leave 64 of the process's open-file limit free [default: 10000].
    #[arg(long, env = "HCP_SENSE_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,

    /// A connection that has not started a call (TLS and HTTP/2 handshakes included) this long after it opened is closed [default: 10].
    #[arg(
        long,
        env = "HCP_SENSE_FIRST_REQUEST_TIMEOUT_SECS",
        value_name = "SECS"
    )]
    pub first_request_timeout_secs: Option<u64>,

    /// A connection with no call in flight for this long is closed; clients reconnect on their next call [default: 300].
    #[arg(long, env = "HCP_SENSE_IDLE_TIMEOUT_SECS", value_name = "SECS")]
    pub idle_timeout_secs: Option<u64>,

    /// Seconds between HTTP/2 PINGs on each connection, to find peers that vanished; 0 for none [default: 30].
    #[arg(
        long,
        env = "HCP_SENSE_HTTP2_KEEPALIVE_INTERVAL_SECS",
        value_name = "SECS"
    )]
    pub http2_keepalive_interval_secs: Option<u64>,

    /// A connection whose PING is not answered within this is closed [default: 20].
    #[arg(
        long,
        env = "HCP_SENSE_HTTP2_KEEPALIVE_TIMEOUT_SECS",
        value_name = "SECS"
    )]
    pub http2_keepalive_timeout_secs: Option<u64>,

    /// Most open grpc.health.v1 Watch streams on one connection [default: 16].
    #[arg(
        long,
        env = "HCP_SENSE_MAX_HEALTH_WATCHES_PER_CONNECTION",
        value_name = "N"
    )]
    pub max_health_watches_per_connection: Option<usize>,

    /// Most open grpc.health.v1 Watch streams in all [default: 1024].
    #[arg(long, env = "HCP_SENSE_MAX_HEALTH_WATCHES", value_name = "N")]
    pub max_health_watches: Option<usize>,

    /// Failed authentications a second one peer address may make, bursts of twice that; past it the address is refused RESOURCE_EXHAUSTED until its bucket refills; 0 for no limit [default: 5].
    #[arg(long, env = "HCP_SENSE_AUTH_FAILURE_RATE_PER_SEC", value_name = "N")]
    pub auth_failure_rate_per_sec: Option<f64>,

    /// What names a caller known by its client certificate: `common-name` (the subject's one
    /// CN) or `uri-san` (the one URI subject alternative name, such as a SPIFFE id)
    /// [default: common-name].
    #[arg(long, env = "HCP_SENSE_TLS_CLIENT_IDENTITY", value_name = "FROM")]
    pub tls_client_identity: Option<crate::auth::CertIdentity>,
}

/// Where the store is. Shared by `serve` and `migrate`.
#[derive(Debug, Clone, Default, Args)]
pub struct DatabaseOptions {
    /// Store URL: `sqlite://PATH` (embedded default: sqlite://hcp-sense.db) or
    /// `postgres://USER@HOST/DB`. Also read from DATABASE_URL.
    #[arg(long, env = "HCP_SENSE_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,

    /// Most connections the store pool opens [default: 8 on PostgreSQL, 4 on SQLite].
    #[arg(long, env = "HCP_SENSE_DB_MAX_CONNECTIONS", value_name = "N")]
    pub db_max_connections: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Pretty,
    #[default]
    Compact,
    Json,
}

/// The validated configuration the service runs with.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub database: StoreConfig,
    pub migrate: bool,
    pub log_format: LogFormat,
    pub shutdown_grace: Duration,
    pub db_startup_wait: Duration,
    pub max_payload_bytes: usize,
    pub record_retention: Option<Duration>,
    pub prune_interval: Duration,
    pub bench_baseline: bool,
    pub metrics_listen: SocketAddr,
    pub metrics_max_packs: usize,
    pub hash_principals: bool,
    pub sample_drop_decisions: bool,
    pub auth: crate::auth::AuthConfig,
    pub insecure_no_auth: bool,
    pub rate_limit_per_sec: f64,
    pub max_request_bytes: usize,
    pub max_json_depth: usize,
    pub max_concurrent_streams: u32,
    pub request_timeout: Duration,
    pub sink_writers: usize,
    pub tls: Option<TlsConfig>,
    pub page_token_secret: Option<String>,
    pub max_connections: usize,
    pub first_request_timeout: Duration,
    pub idle_timeout: Duration,
    pub http2_keepalive_interval: Option<Duration>,
    pub http2_keepalive_timeout: Duration,
    pub max_health_watches_per_connection: usize,
    pub max_health_watches: usize,
    pub auth_failure_rate_per_sec: f64,
}

/// TLS files and the role of callers known by their client certificate.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: Option<PathBuf>,
    pub client_role: crate::auth::Role,
    pub client_identity: crate::auth::CertIdentity,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub url: String,
    pub max_connections: Option<u32>,
}

impl DatabaseOptions {
    fn or(self, file: DatabaseOptions) -> DatabaseOptions {
        DatabaseOptions {
            database_url: self
                .database_url
                .or_else(|| std::env::var("DATABASE_URL").ok().filter(|s| !s.is_empty()))
                .or(file.database_url),
            db_max_connections: self.db_max_connections.or(file.db_max_connections),
        }
    }

    /// Resolves the store settings with the environment's DATABASE_URL as a fallback.
    pub fn resolve(self) -> StoreConfig {
        let o = self.or(DatabaseOptions::default());
        StoreConfig {
            url: o
                .database_url
                .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
            max_connections: o.db_max_connections,
        }
    }
}

impl ServeOptions {
    /// Layers these options (flags and environment, already merged by clap)
    /// over the TOML file, if any, and over the defaults.
    pub fn resolve(self) -> anyhow::Result<Config> {
        let file = match &self.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let database = self
            .database
            .or(DatabaseOptions {
                database_url: file.database_url,
                db_max_connections: file.db_max_connections,
            })
            .resolve();
        Ok(Config {
            listen: match self.listen.or(file.listen) {
                Some(a) => a,
                None => DEFAULT_LISTEN.parse()?,
            },
            database,
            migrate: self.migrate.or(file.migrate).unwrap_or(true),
            log_format: self.log_format.or(file.log_format).unwrap_or_default(),
            db_startup_wait: Duration::from_secs(
                self.db_startup_wait_secs
                    .or(file.db_startup_wait_secs)
                    .unwrap_or(60),
            ),
            shutdown_grace: Duration::from_secs(
                self.shutdown_grace_secs
                    .or(file.shutdown_grace_secs)
                    .unwrap_or(30),
            ),
            max_payload_bytes: self
                .max_payload_bytes
                .or(file.max_payload_bytes)
                .unwrap_or(DEFAULT_MAX_PAYLOAD_BYTES),
            record_retention: self
                .record_retention_secs
                .or(file.record_retention_secs)
                .filter(|s| *s > 0)
                .map(Duration::from_secs),
            prune_interval: Duration::from_secs(
                self.prune_interval_secs
                    .or(file.prune_interval_secs)
                    .unwrap_or(30)
                    .max(1),
            ),
            bench_baseline: self.bench_baseline.or(file.bench_baseline).unwrap_or(false),
            metrics_listen: match self.metrics_listen.or(file.metrics_listen) {
                Some(a) => a,
                None => DEFAULT_METRICS_LISTEN.parse()?,
            },
            metrics_max_packs: self
                .metrics_max_packs
                .or(file.metrics_max_packs)
                .unwrap_or(100),
            hash_principals: self
                .hash_principals
                .or(file.hash_principals)
                .unwrap_or(false),
            sample_drop_decisions: self
                .sample_drop_decisions
                .or(file.sample_drop_decisions)
                .unwrap_or(false),
            auth: match (&self.auth_file, file.auth) {
                (Some(path), None) => read_auth_file(path)?,
                (Some(path), Some(_)) => anyhow::bail!(
                    "[auth] is set both in the configuration file and in --auth-file {}; keep one",
                    path.display()
                ),
                (None, auth) => auth.unwrap_or_default(),
            },
            insecure_no_auth: self.insecure_no_auth || file.insecure_no_auth.unwrap_or(false),
            rate_limit_per_sec: self
                .rate_limit_per_sec
                .or(file.rate_limit_per_sec)
                .unwrap_or(0.0),
            max_request_bytes: self
                .max_request_bytes
                .or(file.max_request_bytes)
                .unwrap_or(1 << 20),
            max_json_depth: self.max_json_depth.or(file.max_json_depth).unwrap_or(32),
            max_concurrent_streams: self
                .max_concurrent_streams
                .or(file.max_concurrent_streams)
                .unwrap_or(256),
            request_timeout: Duration::from_secs(
                self.request_timeout_secs
                    .or(file.request_timeout_secs)
                    .unwrap_or(30),
            ),
            sink_writers: match self.sink_writers.or(file.sink_writers) {
                Some(n) if !(1..=MAX_SINK_WRITERS).contains(&n) => anyhow::bail!(
                    "--sink-writers must be from 1 to {MAX_SINK_WRITERS}, not {n}"
                ),
                Some(n) => n,
                None => crate::service::DEFAULT_SINK_WRITERS,
            },
            tls: match (
                self.tls_cert_file.or(file.tls_cert_file),
                self.tls_key_file.or(file.tls_key_file),
                self.tls_client_ca_file.or(file.tls_client_ca_file),
            ) {
                (Some(cert_file), Some(key_file), client_ca_file) => {
                    let role = self
                        .tls_client_role
                        .or(file.tls_client_role)
                        .unwrap_or_else(|| "reader".into());
                    Some(TlsConfig {
                        cert_file,
                        key_file,
                        client_ca_file,
                        client_identity: self
                            .tls_client_identity
                            .or(file.tls_client_identity)
                            .unwrap_or_default(),
                        client_role: crate::auth::Role::parse(&role).ok_or_else(|| {
                            anyhow::anyhow!(
                                "tls_client_role `{role}` must be admin, runtime or reader"
                            )
                        })?,
                    })
                }
                (None, None, None) => None,
                // Client certificates without TLS would be silently ignored: no caller could
                // present one, and the operator would believe certificates are checked.
                (None, None, Some(_)) => anyhow::bail!(
                    "--tls-client-ca-file needs --tls-cert-file and --tls-key-file: client certificates are only read over TLS"
                ),
                _ => anyhow::bail!("TLS needs both --tls-cert-file and --tls-key-file"),
            },
            page_token_secret: self.page_token_secret.or(file.page_token_secret),
            max_connections: self.max_connections.or(file.max_connections).unwrap_or(10_000),
            first_request_timeout: Duration::from_secs(self.first_request_timeout_secs.or(file.first_request_timeout_secs).unwrap_or(10)),
            idle_timeout: Duration::from_secs(self.idle_timeout_secs.or(file.idle_timeout_secs).unwrap_or(300)),
            http2_keepalive_interval: Some(self.http2_keepalive_interval_secs.or(file.http2_keepalive_interval_secs).unwrap_or(30)).filter(|s| *s > 0).map(Duration::from_secs),
            http2_keepalive_timeout: Duration::from_secs(self.http2_keepalive_timeout_secs.or(file.http2_keepalive_timeout_secs).unwrap_or(20)),
            max_health_watches_per_connection: self.max_health_watches_per_connection.or(file.max_health_watches_per_connection).unwrap_or(16),
            max_health_watches: self.max_health_watches.or(file.max_health_watches).unwrap_or(1024),
            auth_failure_rate_per_sec: self.auth_failure_rate_per_sec.or(file.auth_failure_rate_per_sec).unwrap_or(5.0),
        })
    }
}

/// The TOML file's keys: the long option names with `_` for `-`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    database_url: Option<String>,
    db_max_connections: Option<u32>,
    migrate: Option<bool>,
    log_format: Option<LogFormat>,
    shutdown_grace_secs: Option<u64>,
    db_startup_wait_secs: Option<u64>,
    max_payload_bytes: Option<usize>,
    record_retention_secs: Option<u64>,
    prune_interval_secs: Option<u64>,
    bench_baseline: Option<bool>,
    metrics_listen: Option<SocketAddr>,
    metrics_max_packs: Option<usize>,
    hash_principals: Option<bool>,
    sample_drop_decisions: Option<bool>,
    auth: Option<crate::auth::AuthConfig>,
    insecure_no_auth: Option<bool>,
    rate_limit_per_sec: Option<f64>,
    max_request_bytes: Option<usize>,
    max_json_depth: Option<usize>,
    max_concurrent_streams: Option<u32>,
    request_timeout_secs: Option<u64>,
    sink_writers: Option<usize>,
    tls_cert_file: Option<PathBuf>,
    tls_key_file: Option<PathBuf>,
    tls_client_ca_file: Option<PathBuf>,
    tls_client_role: Option<String>,
    page_token_secret: Option<String>,
    max_connections: Option<usize>,
    first_request_timeout_secs: Option<u64>,
    idle_timeout_secs: Option<u64>,
    http2_keepalive_interval_secs: Option<u64>,
    http2_keepalive_timeout_secs: Option<u64>,
    max_health_watches_per_connection: Option<usize>,
    max_health_watches: Option<usize>,
    auth_failure_rate_per_sec: Option<f64>,
    tls_client_identity: Option<crate::auth::CertIdentity>,
}

fn read_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading config file {}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))
}

/// The auth file's only key: the `[auth]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthFile {
    auth: crate::auth::AuthConfig,
}

fn read_auth_file(path: &Path) -> anyhow::Result<crate::auth::AuthConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading auth file {}: {e}", path.display()))?;
    let file: AuthFile =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("auth file {}: {e}", path.display()))?;
    Ok(file.auth)
}

impl Config {
    /// A configuration for the given store with every other option at its default.
    pub fn for_database(url: impl Into<String>) -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            database: StoreConfig {
                url: url.into(),
                max_connections: None,
            },
            migrate: true,
            log_format: LogFormat::Compact,
            shutdown_grace: Duration::from_secs(30),
            db_startup_wait: Duration::from_secs(60),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            record_retention: None,
            prune_interval: Duration::from_secs(30),
            bench_baseline: false,
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_max_packs: 100,
            hash_principals: false,
            sample_drop_decisions: false,
            auth: crate::auth::AuthConfig::default(),
            insecure_no_auth: false,
            rate_limit_per_sec: 0.0,
            max_request_bytes: 1 << 20,
            max_json_depth: 32,
            max_concurrent_streams: 256,
            request_timeout: Duration::from_secs(30),
            sink_writers: crate::service::DEFAULT_SINK_WRITERS,
            tls: None,
            page_token_secret: None,
            max_connections: 10_000,
            first_request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            http2_keepalive_interval: Some(Duration::from_secs(30)),
            http2_keepalive_timeout: Duration::from_secs(20),
            max_health_watches_per_connection: 16,
            max_health_watches: 1024,
            auth_failure_rate_per_sec: 5.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_and_file_overrides_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:7000\"\ndatabase_url = \"sqlite://from-file.db\"\nmigrate = false\nshutdown_grace_secs = 5\n",
        )
        .expect("write");
        let cfg = ServeOptions {
            config: Some(path.clone()),
            listen: Some("127.0.0.1:7001".parse().expect("addr")),
            ..Default::default()
        }
        .resolve()
        .expect("resolve");
        assert_eq!(cfg.listen.port(), 7001);
        assert!(!cfg.migrate);
        assert_eq!(cfg.shutdown_grace, Duration::from_secs(5));
        if std::env::var_os("DATABASE_URL").is_none() {
            assert_eq!(cfg.database.url, "sqlite://from-file.db");
        }
        std::fs::write(&path, "listen = \"127.0.0.1:7000\"\nbogus = 1\n").expect("write");
        let err = ServeOptions {
            config: Some(path),
            ..Default::default()
        }
        .resolve()
        .expect_err("unknown key");
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn auth_comes_from_the_auth_file_and_only_from_one_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let auth = dir.path().join("auth.toml");
        std::fs::write(
            &auth,
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"00\"\nrole = \"admin\"\n",
        )
        .expect("write");
        let cfg = ServeOptions {
            auth_file: Some(auth.clone()),
            ..Default::default()
        }
        .resolve()
        .expect("resolve");
        assert_eq!(cfg.auth.tokens.len(), 1);
        assert_eq!(cfg.auth.tokens[0].name, "ops");

        let main = dir.path().join("c.toml");
        std::fs::write(&main, "[auth]\ntokens = []\n").expect("write");
        let err = ServeOptions {
            config: Some(main),
            auth_file: Some(auth.clone()),
            ..Default::default()
        }
        .resolve()
        .expect_err("auth twice");
        assert!(err.to_string().contains("--auth-file"), "{err}");

        std::fs::write(&auth, "listen = \"0.0.0.0:1\"\n").expect("write");
        let err = ServeOptions {
            auth_file: Some(auth),
            ..Default::default()
        }
        .resolve()
        .expect_err("not an auth table");
        assert!(err.to_string().contains("auth file"), "{err}");
    }
}
