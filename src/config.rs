//! Service configuration: each option declared once below (flag, `HCP_SENSE_*` variable, file key, default), layered flags > environment > file > defaults.
//!
//! The TOML file is not a second declaration: its keys are the long option names with `_` for
//! `-`, and each value becomes that option's default before the command line is parsed, so it
//! goes through the same parser and sits under flags and the environment.
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgAction, Args, FromArgMatches};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// Sink writers by default: enough to overlap commits on a PostgreSQL a network away.
pub const DEFAULT_SINK_WRITERS: usize = 2;

/// Most sink writers: each holds a database connection.
pub const MAX_SINK_WRITERS: usize = 64;

/// Most concurrent streams a connection may be allowed: at this many the gRPC listener's
/// stream window (grpc/flow.rs) is about 2 KiB, below which a stream would need a round trip
/// per small message.
pub const MAX_CONCURRENT_STREAMS: u32 = 10_000;

/// Options of `hcp-sense serve`, and the configuration the service runs with once checked.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// TOML file with any of these options (keys are the long names with `_` for `-`); flags
    /// and environment override it.
    #[arg(long = "config", env = "HCP_SENSE_CONFIG", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// TOML file holding only the `[auth]` table, kept apart so that it can come from a
    /// secret store while the rest of the configuration does not; `[auth]` then may not
    /// also appear in the configuration file.
    #[arg(long, env = "HCP_SENSE_AUTH_FILE", value_name = "FILE")]
    pub auth_file: Option<PathBuf>,

    /// The `[auth]` table, from `--config` or `--auth-file`.
    #[arg(skip)]
    pub auth: crate::auth::AuthConfig,

    /// Address the gRPC server listens on.
    #[arg(
        long,
        env = "HCP_SENSE_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub database: StoreConfig,

    /// Apply pending migrations at start.
    #[arg(long, env = "HCP_SENSE_MIGRATE", value_name = "BOOL", action = ArgAction::Set, default_value_t = true)]
    pub migrate: bool,

    #[command(flatten)]
    pub logging: Logging,

    /// Largest trigger payload accepted, in bytes of JSON.
    #[arg(long, env = "HCP_SENSE_MAX_PAYLOAD_BYTES", value_name = "BYTES", default_value_t = 64 * 1024)]
    pub max_payload_bytes: usize,

    /// Delete records older than this many seconds, in small background batches; 0 or unset keeps all.
    #[arg(long = "record-retention-secs", env = "HCP_SENSE_RECORD_RETENTION_SECS", value_name = "SECS", value_parser = secs)]
    pub record_retention: Option<Duration>,

    /// Retention per land, over --record-retention-secs for the lands named: `user=30d,brain=365d`
    /// (an age with its unit, s, m, h or d; 0 keeps that land's records for ever).
    #[arg(long = "record-retention", env = "HCP_SENSE_RECORD_RETENTION", value_name = "LAND=AGE,...", value_parser = land_ages)]
    pub record_retention_lands: Option<LandAges>,

    /// Keep the decision log: an entry per decision answered (recorded, dropped, refused, a duplicate), readable with ListDecisions and `hcp-sense why`.
    #[arg(long = "decision-log", env = "HCP_SENSE_DECISION_LOG", value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub decision_log: bool,

    /// How long decision log entries are kept: an age with its unit (s, m, h or d); 0 keeps them for ever.
    #[arg(long = "decision-retention", env = "HCP_SENSE_DECISION_RETENTION", value_name = "AGE", value_parser = age, default_value = "7d")]
    pub decision_retention: Duration,

    /// Most decision log entries kept; past it the oldest go (on PostgreSQL whole partitions, by the planner's count); 0 for no bound.
    #[arg(
        long = "decision-max-entries",
        env = "HCP_SENSE_DECISION_MAX_ENTRIES",
        value_name = "N",
        default_value_t = 10_000_000
    )]
    pub decision_max_entries: u64,

    /// Decision log entries that are not records (drops, refusals, duplicates) written a second for one pack, principal, outcome and drop reason; past it they fold into one entry with a count.
    #[arg(
        long = "decision-fold-per-key",
        env = "HCP_SENSE_DECISION_FOLD_PER_KEY",
        value_name = "N",
        default_value_t = 10
    )]
    pub decision_fold_per_key: u32,

    /// Decision log entries that are not records written a second in all; past it every key's fold.
    #[arg(
        long = "decision-fold-in-all",
        env = "HCP_SENSE_DECISION_FOLD_IN_ALL",
        value_name = "N",
        default_value_t = 1000
    )]
    pub decision_fold_in_all: u32,

    /// Seconds between retention passes (at least 1).
    #[arg(long = "prune-interval-secs", env = "HCP_SENSE_PRUNE_INTERVAL_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub prune_interval: Duration,

    /// How often the decision log and the drop counts write what they have taken in the
    /// background (a listing writes first anyway). Not an option: tests lengthen it so that
    /// only their own listings write.
    #[arg(skip = crate::service::LOG_FLUSH_EVERY)]
    pub log_flush_interval: Duration,

    /// Serve hcp.sense.v1.BenchService, a no-op with DeliverTrigger's message shape, as a benchmark baseline.
    #[arg(long, env = "HCP_SENSE_BENCH_BASELINE", value_name = "BOOL", action = ArgAction::Set, default_value_t = false)]
    pub bench_baseline: bool,

    /// Address of the HTTP server for /metrics (Prometheus text), /healthz and /readyz.
    #[arg(
        long,
        env = "HCP_SENSE_METRICS_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:9464"
    )]
    pub metrics_listen: SocketAddr,

    /// Address of the HTTP ingress listener (POST /v1/ingress/{route}: signed webhooks);
    /// none by default. Its requests carry no token: each is authenticated by its signature.
    #[arg(long, env = "HCP_SENSE_INGRESS_LISTEN", value_name = "ADDR")]
    pub ingress_listen: Option<SocketAddr>,

    /// Address of the MCP door (Streamable HTTP at /mcp): the catalog, the caller's records
    /// and read-only tools for Model Context Protocol clients; none by default. Its calls
    /// carry the caller's bearer token and are answered by the gRPC API's own rules.
    #[arg(long, env = "HCP_SENSE_MCP_LISTEN", value_name = "ADDR")]
    pub mcp_listen: Option<SocketAddr>,

    /// Most live MCP subscriptions open at once in all; past it a new one is refused. Each is a WatchRecords the door opens in process, counted under --max-streams as well.
    #[arg(
        long,
        env = "HCP_SENSE_MCP_MAX_SUBSCRIPTIONS",
        value_name = "N",
        default_value_t = 1000
    )]
    pub mcp_max_subscriptions: usize,

    /// Most live MCP subscriptions one caller (one authenticated identity) holds at once; past it a new one is refused.
    #[arg(
        long,
        env = "HCP_SENSE_MCP_MAX_SUBSCRIPTIONS_PER_CALLER",
        value_name = "N",
        default_value_t = 16
    )]
    pub mcp_max_subscriptions_per_caller: usize,

    /// Most MCP sessions (the earlier revisions' `Mcp-Session-Id`, opened by `initialize`) open at once in all; past it a new one is refused 503.
    #[arg(
        long,
        env = "HCP_SENSE_MCP_MAX_SESSIONS",
        value_name = "N",
        default_value_t = 1000
    )]
    pub mcp_max_sessions: usize,

    /// Most MCP sessions one caller (one authenticated identity) holds open at once; past it a new one is refused 429.
    #[arg(
        long,
        env = "HCP_SENSE_MCP_MAX_SESSIONS_PER_CALLER",
        value_name = "N",
        default_value_t = 32
    )]
    pub mcp_max_sessions_per_caller: usize,

    /// An MCP session with no request and nothing sent to its client for this long is closed; a session with a live subscription pings its client, so stays open while the client answers.
    #[arg(
        long = "mcp-session-idle-timeout-secs",
        env = "HCP_SENSE_MCP_SESSION_IDLE_TIMEOUT_SECS",
        value_name = "SECS",
        default_value = "300",
        value_parser = secs
    )]
    pub mcp_session_idle_timeout: Duration,

    /// Address of the JSON door: every RPC as JSON over HTTP (the `google.api.http` routes
    /// of the protos; WatchRecords as Server-Sent Events; the OpenAPI document at
    /// /openapi.json); none by default. Its calls carry the caller's bearer token and are
    /// answered by the gRPC API's own rules.
    #[arg(long, env = "HCP_SENSE_HTTP_LISTEN", value_name = "ADDR")]
    pub http_listen: Option<SocketAddr>,

    /// Serve the operator console at /console/ on --http-listen (off by default). Its pages
    /// hold no data of their own: each one calls the JSON routes with the token the operator
    /// signs in with, under the API's role table.
    #[arg(long, env = "HCP_SENSE_CONSOLE", requires = "http_listen")]
    pub console: bool,

    /// Most event streams (WatchRecords as Server-Sent Events) the JSON door holds open at once
    /// in all; past it a new one is refused 429 RESOURCE_EXHAUSTED. Each holds a socket of the
    /// listener: kept below its socket cap, so calls always find room.
    #[arg(
        long,
        env = "HCP_SENSE_HTTP_MAX_STREAMS",
        value_name = "N",
        default_value_t = 512
    )]
    pub http_max_streams: usize,

    /// Most event streams one caller (one authenticated identity) holds open on the JSON door;
    /// past it a new one is refused 429 RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "HCP_SENSE_HTTP_MAX_STREAMS_PER_CALLER",
        value_name = "N",
        default_value_t = 16
    )]
    pub http_max_streams_per_caller: usize,

    /// NATS server whose JetStream streams NATS ingress routes consume (`nats://host:4222`), or
    /// a cluster's nodes comma-separated; none by default. Credentials, if any, go in the URL
    /// (`nats://user:pass@host`).
    #[arg(
        long,
        env = "HCP_SENSE_NATS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub nats_url: Option<String>,

    /// Most distinct `pack` label values on delivery metrics; the rest are `other`.
    #[arg(
        long,
        env = "HCP_SENSE_METRICS_MAX_PACKS",
        value_name = "N",
        default_value_t = 100
    )]
    pub metrics_max_packs: usize,

    /// Put a SHA-256 prefix of the principal, not the principal, on decision spans.
    #[arg(long, env = "HCP_SENSE_HASH_PRINCIPALS", value_name = "BOOL", action = ArgAction::Set, default_value_t = false)]
    pub hash_principals: bool,

    /// Let OTEL_TRACES_SAMPLER sample away decision spans of dropped triggers too (false: always kept).
    #[arg(long, env = "HCP_SENSE_SAMPLE_DROP_DECISIONS", value_name = "BOOL", action = ArgAction::Set, default_value_t = false)]
    pub sample_drop_decisions: bool,

    #[command(flatten)]
    pub tls: TlsOptions,

    /// Key that signs page tokens; replicas behind one address need the same one [default: random per process].
    #[arg(long, env = "HCP_SENSE_PAGE_TOKEN_SECRET", value_name = "SECRET", value_parser = secret, hide_env_values = true)]
    pub page_token_secret: Option<SecretString>,

    /// Serve without authentication on a non-loopback address. Without `[auth]` the server
    /// otherwise refuses to bind anything but loopback.
    #[arg(long)]
    pub insecure_no_auth: bool,

    /// Calls a second each caller may make, bursts of twice that; 0 for no limit.
    #[arg(
        long,
        env = "HCP_SENSE_RATE_LIMIT_PER_SEC",
        value_name = "N",
        default_value_t = 0.0
    )]
    pub rate_limit_per_sec: f64,

    /// Failed authentications a second one peer address may make before its JWT signatures are checked one at a time with every other such address (bursts of twice that); it is never refused for it, and valid credentials from it are always accepted; 0 for no budget.
    #[arg(
        long,
        env = "HCP_SENSE_AUTH_FAILURE_RATE_PER_SEC",
        value_name = "N",
        default_value_t = 5.0
    )]
    pub auth_failure_rate_per_sec: f64,

    /// Largest gRPC request message accepted, in bytes.
    #[arg(long, env = "HCP_SENSE_MAX_REQUEST_BYTES", value_name = "BYTES", default_value_t = 1 << 20)]
    pub max_request_bytes: usize,

    /// Deepest JSON nesting accepted in a payload or manifest.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_JSON_DEPTH",
        value_name = "N",
        default_value_t = 32
    )]
    pub max_json_depth: usize,

    /// Concurrent HTTP/2 streams per connection.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_CONCURRENT_STREAMS",
        value_name = "N",
        default_value_t = 256
    )]
    pub max_concurrent_streams: u32,

    /// Longest a call may run before it is answered DEADLINE_EXCEEDED, in seconds.
    #[arg(long = "request-timeout-secs", env = "HCP_SENSE_REQUEST_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub request_timeout: Duration,

    /// Sink writers committing record batches concurrently, each on a database connection of
    /// its own, 1 to 64; PostgreSQL only (with one express writer besides, for quiet packs
    /// beside a backlog), SQLite always has one.
    #[arg(long, env = "HCP_SENSE_SINK_WRITERS", value_name = "N", default_value_t = DEFAULT_SINK_WRITERS)]
    pub sink_writers: usize,

    /// Group commit at a steady rate: how long, in milliseconds, a sink writer waits for more
    /// records before it commits, 0 (the default: at once) to 50. Several records then share
    /// one commit (one sync of the log): less CPU per record, each answered up to this much
    /// later (the runtime's timer counts whole milliseconds). The writer waits only for the
    /// records the recent rate puts inside the delay (at most 64), and only while that is at
    /// least half of one.
    #[arg(long = "sink-commit-delay-ms", env = "HCP_SENSE_SINK_COMMIT_DELAY_MS", value_name = "MS", value_parser = commit_delay, default_value = "0")]
    pub sink_commit_delay: Duration,

    /// Threads that check payloads against their schemas and lint manifests, off the
    /// runtime's workers and at a lower priority (nice 10), 1 to 64.
    #[arg(
        long,
        env = "HCP_SENSE_CHECK_THREADS",
        value_name = "N",
        default_value_t = 1
    )]
    pub check_threads: usize,

    /// Checks that may wait for a check thread, 1 to 65536, a pack's lane at most a quarter of them (the lanes take turns); one more is answered UNAVAILABLE at once.
    #[arg(
        long,
        env = "HCP_SENSE_CHECK_QUEUE",
        value_name = "N",
        default_value_t = 64
    )]
    pub check_queue: usize,

    /// Seconds to wait for in-flight calls after SIGINT/SIGTERM before exiting.
    #[arg(long = "shutdown-grace-secs", env = "HCP_SENSE_SHUTDOWN_GRACE_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub shutdown_grace: Duration,

    /// Seconds to keep trying to reach an unreachable database at start before giving up.
    #[arg(long = "db-startup-wait-secs", env = "HCP_SENSE_DB_STARTUP_WAIT_SECS", value_name = "SECS", value_parser = secs, default_value = "60")]
    pub db_startup_wait: Duration,

    /// Most client connections open at once; further clients wait in the listen backlog. Lowered to leave 64 of the process's open-file limit free.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_CONNECTIONS",
        value_name = "N",
        default_value_t = 10_000
    )]
    pub max_connections: usize,

    /// A connection that has not started a call (TLS and HTTP/2 handshakes included) this long after it opened is closed.
    #[arg(long = "first-request-timeout-secs", env = "HCP_SENSE_FIRST_REQUEST_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "10")]
    pub first_request_timeout: Duration,

    /// A connection with no call in flight for this long is closed; clients reconnect on their next call.
    #[arg(long = "idle-timeout-secs", env = "HCP_SENSE_IDLE_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "300")]
    pub idle_timeout: Duration,

    /// A socket of the HTTP listeners (ingress, metrics) that moves no byte for this long is closed.
    #[arg(long = "http-idle-timeout-secs", env = "HCP_SENSE_HTTP_IDLE_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "60")]
    pub http_idle_timeout: Duration,

    /// A request to the HTTP listeners must finish its headers this long after its socket was ready for them (after connecting, or after the previous answer).
    #[arg(long = "http-header-timeout-secs", env = "HCP_SENSE_HTTP_HEADER_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "10")]
    pub http_header_timeout: Duration,

    /// A request to the HTTP listeners must finish its body this long after its headers; else it is answered 408 and its socket closed.
    #[arg(long = "http-body-timeout-secs", env = "HCP_SENSE_HTTP_BODY_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub http_body_timeout: Duration,

    /// Most sockets one peer (an IPv4 address, an IPv6 /64) may hold open on each HTTP listener; past it the peer's socket not serving a request that has waited longest is closed to make room.
    #[arg(
        long = "http-max-connections-per-peer",
        env = "HCP_SENSE_HTTP_MAX_CONNECTIONS_PER_PEER",
        value_name = "N",
        default_value_t = 256
    )]
    pub http_max_connections_per_peer: usize,

    /// Most gRPC connections one peer (an IPv4 address, an IPv6 /64) may hold open; past it the peer's connection with no call in flight that has waited longest is closed to make room.
    #[arg(
        long = "max-connections-per-peer",
        env = "HCP_SENSE_MAX_CONNECTIONS_PER_PEER",
        value_name = "N",
        default_value_t = 64
    )]
    pub max_connections_per_peer: usize,

    /// Seconds between HTTP/2 PINGs on each connection, to find peers that vanished; 0 for none.
    #[arg(long = "http2-keepalive-interval-secs", env = "HCP_SENSE_HTTP2_KEEPALIVE_INTERVAL_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub http2_keepalive_interval: Option<Duration>,

    /// A connection whose PING is not answered within this is closed.
    #[arg(long = "http2-keepalive-timeout-secs", env = "HCP_SENSE_HTTP2_KEEPALIVE_TIMEOUT_SECS", value_name = "SECS", value_parser = secs, default_value = "20")]
    pub http2_keepalive_timeout: Duration,

    /// Most open grpc.health.v1 Watch streams on one connection.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_HEALTH_WATCHES_PER_CONNECTION",
        value_name = "N",
        default_value_t = 16
    )]
    pub max_health_watches_per_connection: usize,

    /// Most open grpc.health.v1 Watch streams in all.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_HEALTH_WATCHES",
        value_name = "N",
        default_value_t = 1024
    )]
    pub max_health_watches: usize,

    /// Most long-lived streams (reflection, health Watch, WatchRecords, DeliverTriggers) open at once in all; past it an unauthenticated stream is refused RESOURCE_EXHAUSTED, and an authenticated one ends the oldest unauthenticated stream to make room.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_STREAMS",
        value_name = "N",
        default_value_t = 10_000
    )]
    pub max_streams: usize,

    /// Most long-lived streams of one peer (an IPv4 address, an IPv6 /64); past it as with --max-streams, among that peer's streams.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_STREAMS_PER_PEER",
        value_name = "N",
        default_value_t = 256
    )]
    pub max_streams_per_peer: usize,

    /// Most open reflection streams in all; past it, RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_REFLECTION_STREAMS",
        value_name = "N",
        default_value_t = 64
    )]
    pub max_reflection_streams: usize,

    /// Most open reflection streams of one peer; past it, RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_REFLECTION_STREAMS_PER_PEER",
        value_name = "N",
        default_value_t = 4
    )]
    pub max_reflection_streams_per_peer: usize,

    /// A connection is not shed at a connection cap within this many milliseconds of being accepted or of its last call's end (its next call may be on the way); 0 for none. Past it the socket with no call in flight that has waited longest goes: a real client's call follows its connect within a round trip, and a flood of fresh idle sockets keeps a new caller waiting no longer than this.
    #[arg(long = "shed-grace-ms", env = "HCP_SENSE_SHED_GRACE_MS", value_name = "MS", value_parser = millis, default_value = "250")]
    pub shed_grace: Duration,

    /// Most open WatchRecords streams on this server; past it, RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "HCP_SENSE_MAX_WATCHES",
        value_name = "N",
        default_value_t = 10_000
    )]
    pub max_watches: usize,

    /// Records committed after a watcher's position (of any principal) that it may be behind;
    /// one further behind is ended with a resume token. Also the size of the shared ring.
    #[arg(
        long,
        env = "HCP_SENSE_WATCH_MAX_BEHIND",
        value_name = "N",
        default_value_t = 10_000
    )]
    pub watch_max_behind: usize,

    /// Longest a watcher may go without catching up (or take one message) before it is ended
    /// with a resume token.
    #[arg(long = "watch-max-lag-secs", env = "HCP_SENSE_WATCH_MAX_LAG_SECS", value_name = "SECS", value_parser = secs, default_value = "30")]
    pub watch_max_lag: Duration,

    /// A watcher with nothing to send gets a progress message (its resume token) this often.
    #[arg(long = "watch-progress-secs", env = "HCP_SENSE_WATCH_PROGRESS_SECS", value_name = "SECS", value_parser = secs, default_value = "10")]
    pub watch_progress: Duration,
}

/// Where the store is. Shared by `serve` and `migrate`.
#[derive(Debug, Clone, Args)]
pub struct StoreConfig {
    /// Store URL: `sqlite://PATH` or `postgres://USER@HOST/DB`. Also read from DATABASE_URL,
    /// under HCP_SENSE_DATABASE_URL and over the configuration file.
    #[arg(id = "database_url", long = "database-url", env = "HCP_SENSE_DATABASE_URL", value_name = "URL", value_parser = secret, hide_env_values = true, default_value = "sqlite://hcp-sense.db?mode=rwc")]
    pub url: SecretString,

    /// Most connections the store pool opens [default: 8 on PostgreSQL, 4 on SQLite].
    #[arg(
        id = "db_max_connections",
        long = "db-max-connections",
        env = "HCP_SENSE_DB_MAX_CONNECTIONS",
        value_name = "N"
    )]
    pub max_connections: Option<u32>,

    /// PostgreSQL: the time each records partition spans, in seconds of the database's clock
    /// (at least 1). Partitions are made ahead at this width; retention drops them whole.
    #[arg(
        long = "record-partition-secs",
        env = "HCP_SENSE_RECORD_PARTITION_SECS",
        value_name = "SECS",
        value_parser = partition_secs,
        default_value = "86400"
    )]
    pub partition_width: Duration,
}

/// `--nats-url`: one NATS URL or several, comma-separated. Checked after parsing, not by a
/// value parser, whose refusal would repeat the value (it may carry credentials).
fn nats_urls(s: &str) -> Result<String, String> {
    let urls: Vec<&str> = s.split(',').map(str::trim).collect();
    for (n, u) in urls.iter().enumerate() {
        if u.is_empty() {
            return Err(format!("URL {} of {} is empty", n + 1, urls.len()));
        }
        u.parse::<async_nats::ServerAddr>()
            .map_err(|e| format!("URL {} of {} is not a NATS URL: {e}", n + 1, urls.len()))?;
    }
    Ok(s.to_owned())
}

/// `--record-partition-secs`: whole seconds, at least 1.
fn partition_secs(s: &str) -> Result<Duration, String> {
    match secs(s)? {
        d if d.is_zero() => Err("must be at least 1 second".to_owned()),
        d => Ok(d),
    }
}

impl StoreConfig {
    /// The store at `url` with its default pool size and daily record partitions.
    pub fn at(url: impl Into<String>) -> StoreConfig {
        StoreConfig {
            url: SecretString::from(url.into()),
            max_connections: None,
            partition_width: Duration::from_secs(86_400),
        }
    }
}

/// How the process logs. Shared by `serve` and `migrate`.
#[derive(Debug, Clone, Args)]
pub struct Logging {
    /// Log format on stdout: `pretty`, `compact` or `json`. Level by RUST_LOG.
    #[arg(
        long,
        env = "HCP_SENSE_LOG_FORMAT",
        value_name = "FORMAT",
        default_value = "compact"
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Pretty,
    #[default]
    Compact,
    Json,
}

/// TLS files and the role of callers known by their client certificate.
#[derive(Debug, Clone, Args)]
pub struct TlsOptions {
    /// Serve TLS with this PEM certificate chain (needs --tls-key-file).
    #[arg(
        long = "tls-cert-file",
        env = "HCP_SENSE_TLS_CERT_FILE",
        value_name = "FILE"
    )]
    pub cert_file: Option<PathBuf>,

    /// The PEM private key of --tls-cert-file.
    #[arg(
        long = "tls-key-file",
        env = "HCP_SENSE_TLS_KEY_FILE",
        value_name = "FILE"
    )]
    pub key_file: Option<PathBuf>,

    /// Accept client certificates signed by this PEM CA (mutual TLS); the certificate's
    /// name becomes the caller's principal.
    #[arg(
        long = "tls-client-ca-file",
        env = "HCP_SENSE_TLS_CLIENT_CA_FILE",
        value_name = "FILE"
    )]
    pub client_ca_file: Option<PathBuf>,

    /// Role of callers known by their client certificate.
    #[arg(
        long = "tls-client-role",
        env = "HCP_SENSE_TLS_CLIENT_ROLE",
        value_name = "ROLE",
        default_value = "reader"
    )]
    pub client_role: crate::auth::Role,

    /// What names a caller known by its client certificate: `common-name` (the subject's one
    /// CN) or `uri-san` (the one URI subject alternative name, such as a SPIFFE id).
    #[arg(
        long = "tls-client-identity",
        env = "HCP_SENSE_TLS_CLIENT_IDENTITY",
        value_name = "FROM",
        default_value = "common-name"
    )]
    pub client_identity: crate::auth::CertIdentity,
}

impl TlsOptions {
    /// The server's certificate and key, if TLS is on; an incomplete set is refused rather
    /// than served without what the operator asked for.
    pub fn files(&self) -> anyhow::Result<Option<(&Path, &Path)>> {
        match (&self.cert_file, &self.key_file, &self.client_ca_file) {
            (Some(cert), Some(key), _) => Ok(Some((cert, key))),
            (None, None, None) => Ok(None),
            // Client certificates without TLS would be silently ignored: no caller could
            // present one, and the operator would believe certificates are checked.
            (None, None, Some(_)) => anyhow::bail!(
                "--tls-client-ca-file needs --tls-cert-file and --tls-key-file: client certificates are only read over TLS"
            ),
            _ => anyhow::bail!("TLS needs both --tls-cert-file and --tls-key-file"),
        }
    }
}

/// Most `--sink-commit-delay-ms`.
pub const MAX_SINK_COMMIT_DELAY: Duration = Duration::from_millis(50);

fn commit_delay(s: &str) -> Result<Duration, String> {
    let d = millis(s)?;
    if d > MAX_SINK_COMMIT_DELAY {
        return Err(format!(
            "must be at most {} milliseconds, not {s}",
            MAX_SINK_COMMIT_DELAY.as_millis()
        ));
    }
    Ok(d)
}

fn millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| "must be a whole number of milliseconds".to_owned())
}

/// An age with its unit; zero for `0` (for ever).
fn age(s: &str) -> Result<Duration, String> {
    Ok(crate::domain::model::parse_age(s)?.unwrap_or_default())
}

fn secs(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| "must be a whole number of seconds".to_owned())
}

/// `--record-retention`: an age per land.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LandAges(pub std::collections::BTreeMap<String, Option<Duration>>);

fn land_ages(s: &str) -> Result<LandAges, String> {
    crate::domain::model::Retention::parse_lands(s).map(LandAges)
}

impl Config {
    /// The retention the options give: per land, else --record-retention-secs.
    pub fn retention(&self) -> crate::domain::model::Retention {
        crate::domain::model::Retention {
            default: self.record_retention,
            lands: self
                .record_retention_lands
                .as_ref()
                .map(|l| l.0.clone())
                .unwrap_or_default(),
        }
    }
}

fn secret(s: &str) -> Result<SecretString, std::convert::Infallible> {
    Ok(SecretString::from(s.to_owned()))
}

impl Config {
    /// A configuration for the given store with every other option at its declared default,
    /// the environment ignored, and both listeners on free loopback ports.
    pub fn for_database(url: impl Into<String>) -> Config {
        let cmd = Config::augment_args(clap::Command::new("hcp-sense")).mut_args(|a| a.env(None));
        let matches = cmd
            .try_get_matches_from(["hcp-sense"])
            .expect("the declared defaults parse");
        let mut config = Config::from_arg_matches(&matches).expect("the declared defaults parse");
        config.database = StoreConfig::at(url);
        config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.metrics_listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config
    }

    /// Parses a `serve` command line (flags and environment over the file over defaults) and
    /// checks it: what `hcp-sense serve ARGS` would run with.
    pub fn from_args<I, T>(args: I) -> anyhow::Result<Config>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            config: Config,
        }
        let (serve, auth) = parse::<Serve>(args)?;
        serve.config.checked(auth)
    }

    /// Takes `[auth]` from the configuration file or the auth file (never both), and applies
    /// the rules between options that no one option's parser can see.
    pub fn checked(mut self, file_auth: FileAuth) -> anyhow::Result<Config> {
        self.auth = match (&self.auth_file, file_auth) {
            (Some(path), None) => read_auth_file(path)?,
            (Some(path), Some(_)) => anyhow::bail!(
                "[auth] is set both in the configuration file and in --auth-file {}; keep one",
                path.display()
            ),
            (None, auth) => auth.unwrap_or_default(),
        };
        if !(1..=MAX_SINK_WRITERS).contains(&self.sink_writers) {
            anyhow::bail!(
                "--sink-writers must be from 1 to {MAX_SINK_WRITERS}, not {}",
                self.sink_writers
            );
        }
        if !(1..=64).contains(&self.check_threads) {
            anyhow::bail!(
                "--check-threads must be from 1 to 64, not {}",
                self.check_threads
            );
        }
        if !(1..=65_536).contains(&self.check_queue) {
            anyhow::bail!(
                "--check-queue must be from 1 to 65536, not {}",
                self.check_queue
            );
        }
        self.tls.files()?;
        let most = MAX_CONCURRENT_STREAMS;
        if !(1..=most).contains(&self.max_concurrent_streams) {
            anyhow::bail!(
                "--max-concurrent-streams must be from 1 to {most}, not {}: the HTTP/2 windows that keep a producer inside h2's frame budget shrink with every stream allowed",
                self.max_concurrent_streams
            );
        }
        let deepest = crate::domain::pack::schema::cost::COST_DEPTH;
        if !(1..=deepest).contains(&self.max_json_depth) {
            anyhow::bail!(
                "--max-json-depth must be from 1 to {deepest}, not {}: payload schemas are bounded for payloads no deeper",
                self.max_json_depth
            );
        }
        if let Some(url) = &self.nats_url {
            nats_urls(url).map_err(|why| anyhow::anyhow!("--nats-url: {why}"))?;
        }
        for (flag, n) in [
            ("--max-streams", self.max_streams),
            ("--max-streams-per-peer", self.max_streams_per_peer),
            ("--max-reflection-streams", self.max_reflection_streams),
            (
                "--max-reflection-streams-per-peer",
                self.max_reflection_streams_per_peer,
            ),
            ("--max-connections-per-peer", self.max_connections_per_peer),
            ("--mcp-max-subscriptions", self.mcp_max_subscriptions),
            (
                "--mcp-max-subscriptions-per-caller",
                self.mcp_max_subscriptions_per_caller,
            ),
            ("--mcp-max-sessions", self.mcp_max_sessions),
            (
                "--mcp-max-sessions-per-caller",
                self.mcp_max_sessions_per_caller,
            ),
        ] {
            if n == 0 {
                anyhow::bail!("{flag} must be at least 1");
            }
        }
        if self.mcp_session_idle_timeout.is_zero() {
            anyhow::bail!("--mcp-session-idle-timeout-secs must be at least 1");
        }
        if self.http_max_streams == 0 || self.http_max_streams_per_caller == 0 {
            anyhow::bail!(
                "--http-max-streams and --http-max-streams-per-caller must be at least 1"
            );
        }
        if self.console && self.http_listen.is_none() {
            anyhow::bail!("--console serves the console on --http-listen: set --http-listen too");
        }
        if self.shed_grace > self.first_request_timeout {
            anyhow::bail!(
                "--shed-grace-ms ({} ms) must be at most --first-request-timeout-secs ({} s): a connection waiting for room waits at most that long",
                self.shed_grace.as_millis(),
                self.first_request_timeout.as_secs()
            );
        }
        if self.watch_max_behind == 0 {
            anyhow::bail!("--watch-max-behind must be at least 1");
        }
        if self.watch_progress.is_zero() || self.watch_max_lag.is_zero() {
            anyhow::bail!("--watch-progress-secs and --watch-max-lag-secs must be at least 1");
        }
        // Zero means "off" for these two, as documented.
        self.record_retention = self.record_retention.filter(|d| !d.is_zero());
        self.http2_keepalive_interval = self.http2_keepalive_interval.filter(|d| !d.is_zero());
        self.prune_interval = self.prune_interval.max(Duration::from_secs(1));
        Ok(self)
    }

    /// The page-token key, if one is configured.
    pub fn page_token_secret(&self) -> Option<&str> {
        self.page_token_secret.as_ref().map(|s| s.expose_secret())
    }
}

/// The configuration file's `[auth]` table, if it has one: [`Config::checked`] takes it.
pub type FileAuth = Option<crate::auth::AuthConfig>;

/// Parses the command line of `P`, whose serve options are a flattened [`Config`]: a first
/// pass finds `--config` (and answers `--help`), then the file's values and DATABASE_URL
/// become defaults of the options they name and the command line is parsed again. A clap
/// error (help and version included) is returned as a `clap::Error` for the caller to print.
pub fn parse<P: clap::Parser>(
    args: impl IntoIterator<Item = impl Into<OsString> + Clone>,
) -> anyhow::Result<(P, FileAuth)> {
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let first = P::command().try_get_matches_from(&args)?;
    let serve = match first.subcommand() {
        Some((_, sub)) => sub,
        None => &first,
    };
    let file = match serve.try_get_one::<PathBuf>("config_file").ok().flatten() {
        Some(path) => Some((path.clone(), read_file(path)?)),
        None => None,
    };
    let mut layers: Vec<(String, String)> = Vec::new();
    let mut auth = None;
    if let Some((path, table)) = &file {
        let known = Config::augment_args(clap::Command::new("serve"));
        for (key, value) in table {
            if key == "auth" {
                auth = Some(
                    crate::auth::AuthConfig::deserialize(value.clone()).map_err(|e| {
                        anyhow::anyhow!("config file {}: [auth]: {e}", path.display())
                    })?,
                );
                continue;
            }
            let long = key.replace('_', "-");
            let arg = known
                .get_arguments()
                .find(|a| {
                    a.get_long() == Some(long.as_str())
                        && !matches!(long.as_str(), "config" | "auth-file")
                })
                .ok_or_else(|| {
                    anyhow::anyhow!("config file {}: unknown key `{key}`", path.display())
                })?;
            let text = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                _ => anyhow::bail!(
                    "config file {}: `{key}` must be a string, a number or a boolean",
                    path.display()
                ),
            };
            // Checked here, by the option's own parser, so that the error names the file.
            let checked = if arg.get_action().takes_values() {
                clap::Command::new("hcp-sense")
                    .no_binary_name(true)
                    .arg(arg.clone().env(None).default_value(None).required(false))
                    .try_get_matches_from([format!("--{long}={text}")])
                    .map(drop)
                    .map_err(|e| {
                        let e = e.to_string();
                        e.lines()
                            .next()
                            .unwrap_or_default()
                            .trim_start_matches("error: ")
                            .to_owned()
                    })
            } else {
                text.parse::<bool>()
                    .map(drop)
                    .map_err(|_| "must be true or false".to_owned())
            };
            // Checked beside the option's parser: a refusal there would repeat the value.
            let checked = checked.and_then(|()| match long.as_str() {
                "nats-url" => nats_urls(&text).map(drop),
                _ => Ok(()),
            });
            checked
                .map_err(|why| anyhow::anyhow!("config file {}: `{key}`: {why}", path.display()))?;
            layers.push((long, text));
        }
    }
    // DATABASE_URL, the variable every database tool reads, sits under HCP_SENSE_DATABASE_URL
    // and over the file.
    if let Some(url) = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        layers.retain(|(long, _)| long != "database-url");
        layers.push(("database-url".into(), url));
    }
    let layer = |cmd: clap::Command| {
        cmd.mut_args(
            |a| match layers.iter().find(|(long, _)| a.get_long() == Some(long)) {
                Some((_, text)) => a.default_value(text.clone()),
                None => a,
            },
        )
    };
    let mut cmd = layer(P::command());
    let subcommands: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    for name in subcommands {
        cmd = cmd.mut_subcommand(name, layer);
    }
    let matches = cmd.try_get_matches_from(&args)?;
    Ok((P::from_arg_matches(&matches)?, auth))
}

fn read_file(path: &Path) -> anyhow::Result<toml::Table> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    fn serve(args: &[&str]) -> anyhow::Result<Config> {
        Config::from_args(std::iter::once("hcp-sense").chain(args.iter().copied()))
    }

    #[test]
    fn the_console_is_served_only_beside_the_json_door() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "c.toml", "console = true\n");
        let p = path.to_str().expect("path");
        let e = serve(&["--config", p]).expect_err("a console with no listener");
        assert!(e.to_string().contains("--http-listen"), "{e}");
        serve(&["--config", p, "--http-listen", "127.0.0.1:0"]).expect("beside the door");
    }

    #[test]
    fn flags_override_the_file_and_the_file_overrides_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(
            &dir,
            "c.toml",
            "listen = \"127.0.0.1:7000\"\nmigrate = false\nshutdown_grace_secs = 5\nrate_limit_per_sec = 2\nhttp2_keepalive_interval_secs = 0\ninsecure_no_auth = true\n",
        );
        let p = path.to_str().expect("path");
        let cfg = serve(&["--config", p, "--listen", "127.0.0.1:7001"]).expect("resolve");
        assert_eq!(cfg.listen.port(), 7001);
        assert!(!cfg.migrate);
        assert!(cfg.insecure_no_auth);
        assert_eq!(cfg.shutdown_grace, Duration::from_secs(5));
        assert_eq!(cfg.rate_limit_per_sec, 2.0);
        assert_eq!(cfg.http2_keepalive_interval, None, "0 turns PINGs off");
        // Options the file leaves out keep their declared defaults.
        assert_eq!(cfg.request_timeout, Duration::from_secs(30));
        assert_eq!(cfg.max_json_depth, 32);
        let defaults = serve(&[]).expect("defaults");
        assert_eq!(defaults.listen.to_string(), "127.0.0.1:50051");
        assert_eq!(
            defaults.http2_keepalive_interval,
            Some(Duration::from_secs(30))
        );
        assert!(defaults.migrate);
    }

    #[test]
    fn the_file_is_checked_by_each_options_own_parser_and_names_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (text, want) in [
            ("bogus = 1\n", "unknown key `bogus`"),
            ("config = \"x.toml\"\n", "unknown key `config`"),
            ("listen = \"nowhere\"\n", "`listen`"),
            ("shutdown_grace_secs = -1\n", "`shutdown_grace_secs`"),
            ("log_format = \"xml\"\n", "`log_format`"),
            (
                "listen = [\"127.0.0.1:1\"]\n",
                "must be a string, a number or a boolean",
            ),
            ("listen = \n", "config file"),
        ] {
            let path = write(&dir, "c.toml", text);
            let err = serve(&["--config", path.to_str().expect("path")]).expect_err(text);
            let err = format!("{err:#}");
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(err.contains("c.toml"), "{text:?} names the file: {err}");
        }
    }

    #[test]
    fn the_sink_commit_delay_bounds_are_exact() {
        assert_eq!(
            serve(&[]).expect("default").sink_commit_delay,
            Duration::ZERO
        );
        for (ms, want) in [("0", 0), ("1", 1), ("50", 50)] {
            let got = serve(&[&format!("--sink-commit-delay-ms={ms}")]).expect(ms);
            assert_eq!(got.sink_commit_delay, Duration::from_millis(want));
        }
        for (ms, why) in [
            ("51", "must be at most 50 milliseconds, not 51"),
            ("-1", "must be a whole number of milliseconds"),
            ("0.5", "must be a whole number of milliseconds"),
        ] {
            let err = serve(&[&format!("--sink-commit-delay-ms={ms}")])
                .expect_err(ms)
                .to_string();
            assert!(err.contains("--sink-commit-delay-ms"), "{ms}: {err}");
            assert!(err.contains(why), "{ms}: {err}");
        }
    }

    #[test]
    fn the_sink_writer_bounds_are_exact() {
        for n in ["1", "64"] {
            assert_eq!(
                serve(&["--sink-writers", n])
                    .expect(n)
                    .sink_writers
                    .to_string(),
                n
            );
        }
        for n in ["0", "65"] {
            let err = serve(&["--sink-writers", n]).expect_err(n).to_string();
            assert!(err.contains("--sink-writers must be from 1 to 64"), "{err}");
        }
    }

    #[test]
    fn secrets_never_print() {
        let cfg = serve(&[
            "--page-token-secret",
            "hunter2-page",
            "--database-url",
            "postgres://u:hunter2-db@127.0.0.1/x",
        ])
        .expect("resolve");
        let shown = format!("{cfg:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert_eq!(cfg.page_token_secret(), Some("hunter2-page"));
        assert_eq!(
            cfg.database.url.expose_secret(),
            "postgres://u:hunter2-db@127.0.0.1/x"
        );
    }

    #[test]
    fn stream_caps_are_at_least_one_and_the_shed_grace_at_most_the_first_request_timeout() {
        for flag in [
            "--max-streams",
            "--max-streams-per-peer",
            "--max-reflection-streams",
            "--max-reflection-streams-per-peer",
        ] {
            let e = serve(&[flag, "0"]).expect_err("0 refused");
            assert!(e.to_string().contains(flag), "{flag}: {e}");
            serve(&[flag, "1"]).unwrap_or_else(|e| panic!("{flag} 1: {e}"));
        }
        serve(&["--shed-grace-ms", "10000"]).expect("the grace = the first-request timeout");
        let e = serve(&["--shed-grace-ms", "10001"]).expect_err("n + 1");
        assert!(e.to_string().contains("--shed-grace-ms"), "{e}");
    }

    #[test]
    fn for_database_keeps_the_declared_defaults() {
        let d = Config::for_database("sqlite::memory:");
        let s = serve(&[]).expect("defaults");
        assert_eq!(d.database.url.expose_secret(), "sqlite::memory:");
        assert_eq!(d.listen.port(), 0);
        assert_eq!(
            (
                d.max_payload_bytes,
                d.max_request_bytes,
                d.sink_writers,
                d.idle_timeout,
                d.tls.client_role
            ),
            (
                s.max_payload_bytes,
                s.max_request_bytes,
                s.sink_writers,
                s.idle_timeout,
                s.tls.client_role
            )
        );
    }

    #[test]
    fn auth_comes_from_the_auth_file_and_only_from_one_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let auth = write(
            &dir,
            "auth.toml",
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"00\"\nrole = \"admin\"\n",
        );
        let a = auth.to_str().expect("path");
        let cfg = serve(&["--auth-file", a]).expect("resolve");
        assert_eq!(cfg.auth.tokens.len(), 1);
        assert_eq!(cfg.auth.tokens[0].name, "ops");

        let main = write(&dir, "c.toml", "[auth]\ntokens = []\n");
        let m = main.to_str().expect("path");
        assert!(!serve(&["--config", m])
            .expect("file auth")
            .auth
            .is_enabled());
        let err = serve(&["--config", m, "--auth-file", a]).expect_err("auth twice");
        assert!(err.to_string().contains("--auth-file"), "{err}");

        std::fs::write(&auth, "listen = \"0.0.0.0:1\"\n").expect("write");
        let err = serve(&["--auth-file", a]).expect_err("not an auth table");
        assert!(err.to_string().contains("auth file"), "{err}");
    }
}
