//! `hcp-sense-bench`: a client of the public gRPC API that starts real `hcp-sense` servers, seeds
//! them, drives them over a sweep of concurrency and reports every phase against a no-op baseline
//! measured in the same run.
mod console;
mod cost;
mod cpu;
mod decisions;
mod filter;
mod flood;
mod h2load;
mod hostile;
mod load;
mod mcp;
mod nats;
// The server's fix for sqlx's PostgreSQL sockets, so the store-limit phase does not measure
// delayed ACKs the server never waits on. Compiled in from the server's file rather than
// imported (the bench reaches the server only through hcp-sense-api: tests/it/bench.rs) or
// copied: the file uses nothing of the server's, only std, rustix and tracing.
#[path = "../../store/nodelay.rs"]
mod nodelay;
mod probe;
mod proxy;
mod records;
mod report;
mod retention;
mod scale;
mod scaling;
mod schema;
mod seed;
mod server;
mod sweep;
mod telemetry;
mod watch;
mod writers;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde_json::json;

use load::Population;

/// The wire contract's clients and messages, without the server (the `hcp-sense-api` crate).
pub use hcp_sense_api::v1 as pb;

/// Benchmarks hcp-sense servers it starts, through their public gRPC API.
#[derive(Debug, Clone, Parser)]
#[command(name = "hcp-sense-bench", version)]
struct Options {
    /// The hcp-sense binary to measure; by default the one next to this binary.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Seconds each measured phase runs.
    #[arg(long, default_value_t = 5)]
    duration_secs: u64,
    /// Concurrent callers: the recorded and no-op phases run at each, in turn.
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,512")]
    concurrency: Vec<usize>,
    /// HTTP/2 connections the callers share.
    #[arg(long, default_value_t = 8)]
    channels: usize,
    /// Registered packs.
    #[arg(long, default_value_t = 10)]
    packs: usize,
    /// Principals, each granted, bound and activated on one pack.
    #[arg(long, default_value_t = 1000)]
    principals: usize,
    /// Populations up to this many principals are seeded through the admin API; larger ones
    /// through the bulk path.
    #[arg(long, default_value_t = 10_000)]
    api_seed_limit: usize,
    /// Stores to measure: sqlite, postgres.
    #[arg(long, value_delimiter = ',', default_value = "sqlite,postgres")]
    stores: Vec<String>,
    /// Server on which the benchmark creates (and drops) its PostgreSQL databases.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    postgres_url: String,
    /// Principal counts compared for throughput and server memory (SQLite; 0 skips).
    #[arg(long, value_delimiter = ',', default_value = "10,100000")]
    scaling: Vec<usize>,
    /// Measure DeliverTrigger with OTLP export on (to a local receiver) against off.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    telemetry: bool,
    /// Records seeded (bulk path) for the ListRecords phase (0 skips).
    #[arg(long, default_value_t = 1_000_000)]
    list_records: usize,
    /// Records seeded (bulk path) over 30 daily partitions for the PostgreSQL scale phase:
    /// a retention pass dropping 9 of them under load, ListRecords, trigger-id lookups (0 skips).
    #[arg(long, default_value_t = 10_000_000)]
    scale_records: usize,
    /// The sweep's recorded phases send each trigger with a trigger id never sent before, so
    /// every record takes the idempotency path (on PostgreSQL, the trigger ledger).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    keyed: bool,
    /// Expired records seeded (bulk path) for the retention phase (0 skips).
    #[arg(long, default_value_t = 200_000)]
    retention_records: usize,
    /// Sink writers of the servers measured (PostgreSQL); the server's default when not given.
    #[arg(long)]
    sink_writers: Option<usize>,
    /// Measure DeliverTriggers, one stream per HTTP/2 connection.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    stream: bool,
    /// Triggers each DeliverTriggers stream keeps sent and unanswered.
    #[arg(long, default_value_t = 1024)]
    stream_in_flight: usize,
    /// Measure the store's own bulk-insert rate for the same rows into the same schema.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    store_limit: bool,
    /// Sink writer counts compared on PostgreSQL behind a proxy adding --postgres-delay-ms to
    /// every round trip, at 256 callers (`--writers-compare` alone skips).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1,4")]
    writers_compare: Vec<usize>,
    /// Milliseconds the proxy of --writers-compare adds to each round trip to PostgreSQL.
    #[arg(long, default_value_t = 1.0)]
    postgres_delay_ms: f64,
    /// Measure WatchRecords: ack-to-watcher latency at --watch-rate, and idle watchers' memory.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    watch: bool,
    /// Recorded triggers a second delivered while one watcher follows them, one phase each.
    #[arg(long, value_delimiter = ',', default_value = "1000,2500,5000")]
    watch_rate: Vec<f64>,
    /// Idle watches opened to measure their memory.
    #[arg(long, default_value_t = 1000)]
    watch_idle: usize,
    /// Measure the MCP door: how soon a subscribed MCP client hears of a record at --mcp-rate,
    /// and idle subscriptions' memory.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    mcp: bool,
    /// Recorded triggers a second delivered while one MCP client listens, one phase each.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    mcp_rate: Vec<f64>,
    /// Idle MCP subscriptions opened to measure their memory.
    #[arg(long, default_value_t = 1000)]
    mcp_idle: usize,
    /// Records seeded before the operator console's pages are loaded and timed (the console
    /// phase, on each store); 0 skips it.
    #[arg(long, default_value_t = 0)]
    console_records: usize,
    /// Measure CPU per call at a steady offered rate (the cost phase, on each store): Health,
    /// recorded without and with trigger ids, duplicates, drops; and on PostgreSQL a prepared
    /// insert and primary-key select of its own.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    cost: bool,
    /// Calls a second the cost phase offers.
    #[arg(long, default_value_t = 1000.0)]
    cost_rate: f64,
    /// Messages drained from NATS JetStream into records, against DeliverTriggers streams on
    /// the same server (0 skips).
    #[arg(long, default_value_t = 20_000)]
    nats_messages: usize,
    /// The NATS server (with JetStream) of the NATS phase.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Measure an activation filter's cost: the server's decision time and the recorded rate
    /// with every activation filtered against unfiltered.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    filter: bool,
    /// Measure the decision log's cost: the server's CPU per call and the recorded rate with
    /// the log on against off (two servers, alternately), and its account against the answers.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    decisions: bool,
    /// Decision log entries seeded on PostgreSQL for the look-up measure of the decisions
    /// phase: GetDecision and ListDecisions by trigger id (0 skips).
    #[arg(long, default_value_t = 10_000_000)]
    decision_entries: usize,
    /// Measure a payload schema's cost: the decision's time (validation included) and the
    /// recorded rate with a typical schema on the packs' ref against none.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    schema: bool,
    /// How many times the filter and schema phases run their eight alternating phases
    /// (A B B A B A A B); each adjacent A and B make a pair whose rates are compared.
    #[arg(long, default_value_t = 1)]
    ab_rounds: usize,
    /// Measure fairness: a quiet pack's latency beside Health/Check while another pack floods
    /// with --flood-callers, the flood's rate alone and beside it, and ten packs flooding.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    flood: bool,
    /// Measure the costliest payload schema lint accepts: Health/Check and a quiet pack's
    /// DeliverTrigger idle, then while --hostile-callers send the worst payload for it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    hostile: bool,
    /// Closed-loop callers sending the worst payload in the hostile phase.
    #[arg(long, default_value_t = 16)]
    hostile_callers: usize,
    /// Closed-loop callers of the flood phase.
    #[arg(long, default_value_t = 1024)]
    flood_callers: usize,
    /// Drive the flood that the flood phase's probe process measures beside from h2load
    /// (Debian's nghttp2-client) when it is on PATH, rather than from this process's callers.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    flood_h2load: bool,
    /// Run only the probe against this gRPC address (host:port), print its result as one JSON
    /// line and exit: the flood phase starts this binary so, as a process of its own.
    #[arg(long, hide = true)]
    probe_addr: Option<String>,
    /// The probe's quiet pack, whose DeliverTrigger it calls beside Health/Check.
    #[arg(long, hide = true, default_value_t = 1)]
    probe_pack: usize,
    /// Milliseconds between the probe's calls of each series (open loop).
    #[arg(long, hide = true, default_value_t = 20)]
    probe_every_ms: u64,
    /// Seconds the probe calls for.
    #[arg(long, hide = true, default_value_t = 5)]
    probe_secs: u64,
    /// Prefix of the probe's trigger ids: one of its own per probe run on a server, so that
    /// every trigger is a new record.
    #[arg(long, hide = true, default_value = "probe")]
    probe_tag: String,
    /// Also write every result to this file as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure nothing: print the README's Markdown tables from this `--json` file.
    #[arg(long, value_name = "JSON")]
    markdown: Option<PathBuf>,
}

impl Options {
    fn duration(&self) -> Duration {
        Duration::from_secs(self.duration_secs)
    }

    fn population(&self, principals: usize) -> Population {
        Population {
            packs: self.packs.max(1),
            principals: principals.max(1),
        }
    }

    /// The first concurrency of the sweep: the one single-point phases run at.
    fn first(&self) -> usize {
        self.concurrency.first().copied().unwrap_or(32).max(1)
    }
}

fn main() {
    let mut o = Options::parse();
    if let Some(path) = &o.markdown {
        let parsed = std::fs::read_to_string(path)
            .map_err(anyhow::Error::from)
            .and_then(|t| Ok(serde_json::from_str(&t)?));
        match parsed {
            Ok(v) => print!("{}", report::markdown(&v)),
            Err(e) => {
                eprintln!("hcp-sense-bench: {}: {e}", path.display());
                std::process::exit(1);
            }
        }
        return;
    }
    // The probe runs on one thread: it measures the server on cores it shares with a flood,
    // and should add as little of its own to them as it can.
    let mut builder = if o.probe_addr.is_some() {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hcp-sense-bench: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    let outcome = runtime.block_on(async {
        if let Some(addr) = o.probe_addr.clone() {
            return probe::run(&o, &addr).await;
        }
        o.server_bin = Some(server::find_binary(o.server_bin.as_deref())?);
        run(&o).await
    });
    if let Err(e) = outcome {
        eprintln!("hcp-sense-bench: {e:#}");
        std::process::exit(1);
    }
}

fn bin(o: &Options) -> &Path {
    o.server_bin.as_deref().unwrap_or(Path::new("hcp-sense"))
}

async fn run(o: &Options) -> anyhow::Result<()> {
    println!(
        "hcp-sense-bench {}: {} s per phase, {:?} callers over {} HTTP/2 connections, {} packs, {} principals, {} cores, server {}",
        env!("CARGO_PKG_VERSION"),
        o.duration_secs,
        o.concurrency,
        o.channels,
        o.packs,
        o.principals,
        std::thread::available_parallelism().map_or(0, usize::from),
        bin(o).display()
    );
    println!(
        "ratio = calls/s over the no-op baseline's calls/s in the same run, on the same server\n"
    );
    for kind in &o.stores {
        sweep::sweep(o, kind).await?;
    }
    if o.stores.iter().any(|s| s == "postgres") && !o.writers_compare.is_empty() {
        writers::writers_compare(o).await?;
    }
    if o.flood {
        for kind in &o.stores {
            flood::flood_phase(o, kind).await?;
        }
        if o.stores.iter().any(|s| s == "postgres") {
            flood::flood_replicas_phase(o).await?;
        }
    }
    if o.hostile {
        for kind in &o.stores {
            hostile::hostile_phase(o, kind).await?;
        }
    }
    if o.filter {
        filter::filter_phase(o).await?;
    }
    if o.schema {
        schema::schema_phase(o).await?;
    }
    if o.decisions {
        decisions::decisions_phase(o).await?;
    }
    if o.watch {
        for kind in &o.stores {
            watch::watch_phase(o, kind).await?;
        }
    }
    if o.mcp {
        for kind in &o.stores {
            mcp::mcp_phase(o, kind).await?;
        }
    }
    if o.cost {
        for kind in &o.stores {
            cost::cost_phase(o, kind).await?;
        }
    }
    if o.console_records > 0 {
        for kind in &o.stores {
            console::console_phase(o, kind, o.console_records).await?;
        }
    }
    if o.nats_messages > 0 {
        for kind in &o.stores {
            nats::nats_phase(o, kind).await?;
        }
    }
    scaling::scaling(o).await?;
    if o.telemetry {
        telemetry::telemetry_cost(o).await?;
    }
    if o.list_records > 0 {
        records::list_records(o).await?;
    }
    if o.scale_records > 0 && o.stores.iter().any(|s| s == "postgres") {
        scale::scale_phase(o, o.scale_records).await?;
    }
    if o.retention_records > 0 {
        retention::retention(o).await?;
    }
    if let Some(path) = &o.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json!({
                "version": env!("CARGO_PKG_VERSION"),
                "cores": std::thread::available_parallelism().map_or(0, usize::from),
                "duration_secs": o.duration_secs,
                "channels": o.channels,
                "results": report::results(),
            }))?,
        )?;
    }
    Ok(())
}
