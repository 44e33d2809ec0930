//! `hcp-sense-bench`: a client of the public gRPC API that starts real `hcp-sense` servers, seeds
//! them, drives them over a sweep of concurrency and reports every phase against a no-op baseline
//! measured in the same run.
mod cpu;
mod filter;
mod flood;
mod hostile;
mod load;
mod nats;
// The server's own fix for sqlx's PostgreSQL sockets, compiled into this binary as a module of
// its own: the store-limit phase must not measure delayed ACKs the server never waits on.
#[path = "../../store/nodelay.rs"]
mod nodelay;
mod proxy;
mod report;
mod scale;
mod seed;
mod server;
mod telemetry;
mod watch;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;
use tonic::transport::Channel;

use load::{closed, open, stream, Load, Phase, Population};
use report::{header, result, row, Writer};
use seed::{now_micros, BenchDb};
use server::Server;

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

#[tokio::main]
async fn main() {
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
    let outcome = async {
        o.server_bin = Some(server::find_binary(o.server_bin.as_deref())?);
        run(&o).await
    }
    .await;
    if let Err(e) = outcome {
        eprintln!("hcp-sense-bench: {e:#}");
        std::process::exit(1);
    }
}

/// A migrated database seeded with `pop`, and a server on it started with `extra`.
async fn prepare(
    o: &Options,
    kind: &str,
    tag: &str,
    pop: Population,
    extra: &[&str],
) -> anyhow::Result<(BenchDb, Server)> {
    let bin = bin(o);
    let db = BenchDb::create(kind, &o.postgres_url, tag).await?;
    server::migrate(bin, &db.url)?;
    let server = Server::start(bin, &db.url, extra)?;
    let ch = server.channels(1).await?;
    if pop.principals <= o.api_seed_limit {
        let secs = seed::policy_via_api(&ch[0], pop).await?;
        println!(
            "{kind:<9} seeded {} principals on {} packs through the admin API in {secs:.1} s",
            pop.principals, pop.packs
        );
        return Ok((db, server));
    }
    seed::packs(&ch[0], pop).await?;
    server.stop();
    let conn = db.connect().await?;
    let t0 = Instant::now();
    seed::policy_bulk(&conn, pop).await?;
    let _ = conn.close().await;
    println!(
        "{kind:<9} seeded {} principals through the bulk path in {:.1} s",
        pop.principals,
        t0.elapsed().as_secs_f64()
    );
    // A server reads the policy when it starts.
    let server = Server::start(bin, &db.url, extra)?;
    Ok((db, server))
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
        sweep(o, kind).await?;
    }
    if o.stores.iter().any(|s| s == "postgres") && !o.writers_compare.is_empty() {
        writers_compare(o).await?;
    }
    if o.flood {
        for kind in &o.stores {
            flood_phase(o, kind).await?;
        }
        if o.stores.iter().any(|s| s == "postgres") {
            flood_replicas_phase(o).await?;
        }
    }
    if o.hostile {
        for kind in &o.stores {
            hostile_phase(o, kind).await?;
        }
    }
    if o.filter {
        filter_phase(o).await?;
    }
    if o.schema {
        schema_phase(o).await?;
    }
    if o.watch {
        for kind in &o.stores {
            watch_phase(o, kind).await?;
        }
    }
    if o.nats_messages > 0 {
        for kind in &o.stores {
            nats_phase(o, kind).await?;
        }
    }
    scaling(o).await?;
    if o.telemetry {
        telemetry_cost(o).await?;
    }
    if o.list_records > 0 {
        list_records(o).await?;
    }
    if o.scale_records > 0 && o.stores.iter().any(|s| s == "postgres") {
        scale::scale_phase(o, o.scale_records).await?;
    }
    if o.retention_records > 0 {
        retention(o).await?;
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

/// Fairness across two replicas on one PostgreSQL: one replica flooded (pack 0), the quiet pack
/// (pack 1) and Health measured on both at once.
async fn flood_replicas_phase(o: &Options) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, "postgres", "flood2", pop, &[]).await?;
    let other = Server::start(bin(o), &db.url, &[])?;
    let flooded = server.channels(o.channels).await?;
    let beside = other.channels(1).await?;
    let c = o.flood_callers;
    let r = flood::run_replicas(&flooded, &beside[0], o.duration(), c, 1, pop, "replicas").await;
    let ratio = |q: &flood::Paced, h: &flood::Paced, p: f64| q.pct(p) / h.pct(p).max(1e-9);
    println!(
        "postgres  flood, two replicas: {c} callers on one: there the quiet pack p50 {:.1} / p99 {:.1} ms, Health {:.1} / {:.1} ms ({:.2}x / {:.2}x); on the other the quiet pack {:.1} / {:.1} ms, Health {:.1} / {:.1} ms ({:.2}x / {:.2}x); flood {:.0}/s",
        r.quiet_flooded.pct(0.5), r.quiet_flooded.pct(0.99),
        r.health_flooded.pct(0.5), r.health_flooded.pct(0.99),
        ratio(&r.quiet_flooded, &r.health_flooded, 0.5), ratio(&r.quiet_flooded, &r.health_flooded, 0.99),
        r.quiet_other.pct(0.5), r.quiet_other.pct(0.99),
        r.health_other.pct(0.5), r.health_other.pct(0.99),
        ratio(&r.quiet_other, &r.health_other, 0.5), ratio(&r.quiet_other, &r.health_other, 0.99),
        r.flood_rate
    );
    result(json!({
        "store": "postgres", "phase": "flood replicas", "callers": c,
        "flooded_quiet_p50_ms": r.quiet_flooded.pct(0.5), "flooded_quiet_p99_ms": r.quiet_flooded.pct(0.99),
        "flooded_health_p50_ms": r.health_flooded.pct(0.5), "flooded_health_p99_ms": r.health_flooded.pct(0.99),
        "other_quiet_p50_ms": r.quiet_other.pct(0.5), "other_quiet_p99_ms": r.quiet_other.pct(0.99),
        "other_health_p50_ms": r.health_other.pct(0.5), "other_health_p99_ms": r.health_other.pct(0.99),
        "flood_per_sec": r.flood_rate,
        "quiet_errors": r.quiet_flooded.errors + r.quiet_other.errors,
        "errors": r.errors,
    }));
    other.stop();
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// The costliest payload schema lint accepts (a pattern whose DFA blows up, at the largest size
/// the budget allows at the payload limit), fed its worst payload by closed-loop callers:
/// Health/Check and pack 1's DeliverTrigger, every 20 ms, idle and meanwhile, as ratios of
/// the same series idle in the same run.
async fn hostile_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "hostile", pop, &[]).await?;
    let chs = server.channels(o.channels).await?;
    anyhow::ensure!(pop.packs >= 2, "the hostile phase needs --packs 2 or more");
    let n = hostile::worst_accepted(&chs[0]).await?;
    // The server's default payload limit (the benchmark starts servers with it).
    let worst = hostile::worst_payload(64 * 1024);
    let (d, c) = (o.duration(), o.hostile_callers);
    let (quiet_idle, health_idle, _) = hostile::run(&chs, d, 0, &worst, 1, pop, "idle").await;
    let (quiet, health, h) = hostile::run(&chs, d, c, &worst, 1, pop, "hostile").await;
    let ratio = |a: &load::Phase, b: &load::Phase, p: f64| a.pct(p) / b.pct(p).max(1e-9);
    println!(
        "{kind:<9} hostile: pattern a[ab]{{{n}}}c (the largest lint accepts), {c} callers sending 64 KiB of a/b: Health p50 {:.2} / p99 {:.2} ms against {:.2} / {:.2} idle ({:.2}x / {:.2}x); pack 1 DeliverTrigger p50 {:.2} / p99 {:.2} ms against {:.2} / {:.2} idle ({:.2}x / {:.2}x); errors {} / {}; the hostile calls: {:.0}/s answered {:?}, p50 {:.1} / p99 {:.1} ms",
        health.pct(0.5), health.pct(0.99), health_idle.pct(0.5), health_idle.pct(0.99),
        ratio(&health, &health_idle, 0.5), ratio(&health, &health_idle, 0.99),
        quiet.pct(0.5), quiet.pct(0.99), quiet_idle.pct(0.5), quiet_idle.pct(0.99),
        ratio(&quiet, &quiet_idle, 0.5), ratio(&quiet, &quiet_idle, 0.99),
        health.errors, quiet.errors,
        h.answers.calls as f64 / h.answers.secs.max(1e-9), h.codes,
        h.answers.pct(0.5), h.answers.pct(0.99),
    );
    result(json!({
        "store": kind, "phase": "hostile", "callers": c, "pattern_repeat": n,
        "health_idle_p50_ms": health_idle.pct(0.5), "health_idle_p99_ms": health_idle.pct(0.99),
        "health_p50_ms": health.pct(0.5), "health_p99_ms": health.pct(0.99),
        "quiet_idle_p50_ms": quiet_idle.pct(0.5), "quiet_idle_p99_ms": quiet_idle.pct(0.99),
        "quiet_p50_ms": quiet.pct(0.5), "quiet_p99_ms": quiet.pct(0.99),
        "health_errors": health.errors, "quiet_errors": quiet.errors,
        "hostile_per_sec": h.answers.calls as f64 / h.answers.secs.max(1e-9),
        "hostile_codes": h.codes,
        "hostile_p50_ms": h.answers.pct(0.5), "hostile_p99_ms": h.answers.pct(0.99),
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// Fairness on one store: pack 1 delivering every 20 ms beside Health/Check, with no flood and
/// while pack 0 floods; pack 0's rate alone and beside it; up to ten packs flooding at once,
/// with as many callers each. Then quotas (`quota_phase`).
async fn flood_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "flood", pop, &[]).await?;
    let chs = server.channels(o.channels).await?;
    let (d, c) = (o.duration(), o.flood_callers);
    anyhow::ensure!(pop.packs >= 2, "the flood phase needs --packs 2 or more");
    let spread = pop.packs.min(10);
    let calm = flood::run(&chs, d, 0, 1, Some(1), pop, "calm").await;
    let alone = flood::run(&chs, d, c, 1, None, pop, "alone").await;
    let scraped = server.scrape().await;
    let during = flood::run(&chs, d, c, 1, Some(1), pop, "during").await;
    let sink = flood::SinkDuring::between(&scraped, &server.scrape().await, "pack-1");
    let ten = flood::run(&chs, d, c, spread, None, pop, "ten").await;
    let rate = |m: &flood::Measured| m.rates.get(&0).copied().unwrap_or(0.0);
    let (q, h) = (&during.quiet, &during.health);
    println!(
        "{kind:<9} flood: quiet pack alone p50 {:.1} / p99 {:.1} ms; Health alone {:.1} / {:.1} ms",
        calm.quiet.pct(0.5),
        calm.quiet.pct(0.99),
        calm.health.pct(0.5),
        calm.health.pct(0.99)
    );
    println!(
        "{kind:<9} flood: {c} callers on one pack: quiet pack p50 {:.1} / p99 {:.1} ms, Health {:.1} / {:.1} ms: {:.2}x / {:.2}x Health's ({} quiet errors)",
        q.pct(0.5), q.pct(0.99), h.pct(0.5), h.pct(0.99),
        q.pct(0.5) / h.pct(0.5), q.pct(0.99) / h.pct(0.99), q.errors
    );
    println!(
        "{kind:<9} flood: where the quiet pack's time went: {:.2} ms in the sink's queue (mean), batches of {:.0} records (mean) committing in {:.2} ms (mean); the same trigger to the no-op on its connection meanwhile p50 {:.1} / p99 {:.1} ms ({:.2}x / {:.2}x Health's)",
        sink.quiet_wait_ms, sink.batch_records, sink.commit_ms,
        during.noop.pct(0.5), during.noop.pct(0.99),
        during.noop.pct(0.5) / h.pct(0.5), during.noop.pct(0.99) / h.pct(0.99)
    );
    println!(
        "{kind:<9} flood: flooding pack {:.0}/s alone, {:.0}/s beside the quiet pack ({:.2}x); {} flood errors",
        rate(&alone), rate(&during), rate(&during) / rate(&alone), alone.errors + during.errors
    );
    let total: f64 = ten.rates.values().sum();
    let shares: Vec<f64> = (0..spread)
        .map(|p| ten.rates.get(&p).copied().unwrap_or(0.0) * spread as f64 / total.max(1.0))
        .collect();
    let (lo, hi) = shares
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), s| (lo.min(*s), hi.max(*s)));
    println!(
        "{kind:<9} flood: {spread} packs flooding ({} callers each): {total:.0}/s in all, each pack's rate over an even share {lo:.2}x to {hi:.2}x; {} errors",
        c / spread, ten.errors
    );
    let flooding = Flooding {
        server: &server,
        chs: &chs,
        kind,
        duration: d,
        callers: c,
        pop,
    };
    let mut flooded = quota_phase(&flooding, rate(&alone)).await?;
    for (k, v) in [
        ("calm_quiet_p50_ms", calm.quiet.pct(0.5)),
        ("calm_quiet_p99_ms", calm.quiet.pct(0.99)),
        ("calm_health_p50_ms", calm.health.pct(0.5)),
        ("calm_health_p99_ms", calm.health.pct(0.99)),
        ("quiet_p50_ms", q.pct(0.5)),
        ("quiet_p99_ms", q.pct(0.99)),
        ("health_p50_ms", h.pct(0.5)),
        ("health_p99_ms", h.pct(0.99)),
        ("flood_alone_per_sec", rate(&alone)),
        ("flood_beside_quiet_per_sec", rate(&during)),
        ("spread_per_sec", total),
        ("spread_share_min", lo),
        ("spread_share_max", hi),
        // Where the quiet pack's time went.
        ("quiet_noop_p50_ms", during.noop.pct(0.5)),
        ("quiet_noop_p99_ms", during.noop.pct(0.99)),
        ("quiet_queue_wait_ms", sink.quiet_wait_ms),
        ("batch_records_mean", sink.batch_records),
        ("commit_ms_mean", sink.commit_ms),
    ] {
        flooded[k] = json!(v);
    }
    flooded["quiet_errors"] = json!(q.errors);
    flooded["spread_packs"] = json!(spread);
    flooded["errors"] = json!(alone.errors + during.errors + ten.errors);
    flooded["store"] = json!(kind);
    flooded["phase"] = json!("flood");
    flooded["callers"] = json!(c);
    result(flooded);
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// One store's flood phase: its server and channels, how long each part runs and with how
/// many callers, over which population.
struct Flooding<'a> {
    server: &'a Server,
    chs: &'a [Channel],
    kind: &'a str,
    duration: Duration,
    callers: usize,
    pop: Population,
}

/// Quotas on one store: what a refusal costs against a drop (the same callers, each sent
/// again at once), with the no-op as the floor under both, and a quota of a quarter of
/// `alone` (the flooding pack's rate alone) held while it floods beside the quiet pack. Each
/// with the CPU the server (and PostgreSQL) spent per answer: the cost on the service's side,
/// apart from the client's, which shares these cores.
async fn quota_phase(f: &Flooding<'_>, alone: f64) -> anyhow::Result<serde_json::Value> {
    let (server, chs, kind, pop) = (f.server, f.chs, f.kind, f.pop);
    let (d, c) = (f.duration, f.callers);
    let pid = server.pid();
    let costed = |m: fn(usize, usize, Population) -> pb::DeliverTriggerRequest| {
        let chs = &chs;
        async move {
            let before = cpu::sample(pid);
            let started = Instant::now();
            let (per_sec, errors) = flood::answers(chs, (d, c), m, pop, Load::Recorded).await;
            let calls = (per_sec * started.elapsed().as_secs_f64()) as usize;
            let cost = before.per_call(&cpu::sample(pid), calls);
            (per_sec, errors, cost.server + cost.postgres)
        }
    };
    // The floor under both: the same triggers to the no-op, which only decodes and answers.
    let noop = {
        let before = cpu::sample(pid);
        let started = Instant::now();
        let dropped = |w, n, p| flood::dropped(w, n, p, false);
        let (per_sec, errors) = flood::answers(chs, (d, c), dropped, pop, Load::Noop).await;
        let calls = (per_sec * started.elapsed().as_secs_f64()) as usize;
        (
            per_sec,
            errors,
            before.per_call(&cpu::sample(pid), calls).server,
        )
    };
    let drops = [
        costed(|w, n, p| flood::dropped(w, n, p, false)).await,
        costed(|w, n, p| flood::dropped(w, n, p, true)).await,
    ];
    let mut admin = pb::policy_service_client::PolicyServiceClient::new(chs[0].clone());
    admin.put_quota(pack_0_quota(0.001, 1)).await?;
    let refusals = [
        costed(|w, n, p| flood::of_pack_0(w, n, p, false)).await,
        costed(|w, n, p| flood::of_pack_0(w, n, p, true)).await,
    ];
    for (i, what) in ["without trigger ids", "with trigger ids"]
        .iter()
        .enumerate()
    {
        println!(
            "{kind:<9} flood: {c} callers {what}: refused over quota {:.0}/s vs dropped {:.0}/s ({:.2}x); server CPU per refusal {:.1} µs vs per drop {:.1} µs ({:.2}x); {} errors",
            refusals[i].0,
            drops[i].0,
            refusals[i].0 / drops[i].0.max(1e-9),
            refusals[i].2,
            drops[i].2,
            refusals[i].2 / drops[i].2.max(1e-9),
            refusals[i].1 + drops[i].1
        );
    }
    println!(
        "{kind:<9} flood: {c} callers to the no-op (decoded and answered, nothing else): {:.0}/s, server CPU {:.1} µs per answer: refusal over it {:.2}x, drop over it {:.2}x; {} errors",
        noop.0,
        noop.2,
        refusals[0].2 / noop.2.max(1e-9),
        drops[0].2 / noop.2.max(1e-9),
        noop.1
    );
    let mut costs = quota_held(f, alone).await?;
    for (k, v) in json!({
        "dropped_per_sec": drops[0].0, "refused_per_sec": refusals[0].0,
        "dropped_with_ids_per_sec": drops[1].0, "refused_with_ids_per_sec": refusals[1].0,
        "drop_server_cpu_us": drops[0].2, "refusal_server_cpu_us": refusals[0].2,
        "drop_with_ids_server_cpu_us": drops[1].2, "refusal_with_ids_server_cpu_us": refusals[1].2,
        "drop_refuse_errors": drops[0].1 + drops[1].1 + refusals[0].1 + refusals[1].1,
        // The floor under a refusal and a drop.
        "noop_per_sec": noop.0, "noop_server_cpu_us": noop.2, "noop_errors": noop.1,
    })
    .as_object()
    .into_iter()
    .flatten()
    {
        costs[k] = v.clone();
    }
    Ok(costs)
}

/// A quota of `rate` a second (and `burst`) on the flooding pack, pack 0.
fn pack_0_quota(rate: f64, burst: u32) -> pb::PutQuotaRequest {
    pb::PutQuotaRequest {
        pack_id: "pack-0".into(),
        principal: None,
        rate_per_second: rate,
        burst,
    }
}

/// A quota of a quarter of `alone` (the flooding pack's rate alone, at least 100/s) on the
/// flooding pack while it floods beside the quiet pack: what it recorded, what it was refused,
/// and what the server counted meanwhile.
async fn quota_held(f: &Flooding<'_>, alone: f64) -> anyhow::Result<serde_json::Value> {
    let (server, chs, kind, pop) = (f.server, f.chs, f.kind, f.pop);
    let (d, c) = (f.duration, f.callers);
    let mut admin = pb::policy_service_client::PolicyServiceClient::new(chs[0].clone());
    let limit = (alone * 0.25).round().max(100.0);
    let before = server.scrape().await;
    admin
        .put_quota(pack_0_quota(limit, (limit / 10.0).ceil() as u32))
        .await?;
    let held = flood::run(chs, d, c, 1, Some(1), pop, "quota").await;
    let after = server.scrape().await;
    admin
        .delete_quota(pb::DeleteQuotaRequest {
            pack_id: "pack-0".into(),
            principal: None,
        })
        .await?;
    // What the server counted for pack 0 meanwhile: decided as recorded or dropped.
    let counted = |disposition: &str| -> f64 {
        after
            .iter()
            .filter(|(k, _)| {
                k.starts_with("hcp_sense_deliveries_total{")
                    && k.contains(r#"pack="pack-0""#)
                    && k.contains(&format!(r#"disposition="{disposition}"#))
            })
            .map(|(k, v)| v - before.get(k).copied().unwrap_or(0.0))
            .sum()
    };
    let held_rate = held.rates.get(&0).copied().unwrap_or(0.0);
    println!(
        "{kind:<9} flood: quota {limit:.0}/s on the flooding pack: recorded {held_rate:.0}/s ({:.3}x the quota), refused {:.0}/s with RetryInfo; server counted {:.0} recorded (of {} answered), {:.0} dropped; quiet pack p50 {:.1} / p99 {:.1} ms",
        held_rate / limit,
        held.refused_per_sec,
        counted("recorded"),
        held.recorded,
        counted("dropped"),
        held.quiet.pct(0.5),
        held.quiet.pct(0.99)
    );
    Ok(json!({
        "quota_per_sec": limit, "quota_recorded_per_sec": held_rate,
        "quota_refused_per_sec": held.refused_per_sec,
        "quota_counted_recorded": counted("recorded"), "quota_answered_recorded": held.recorded,
        "quota_counted_dropped": counted("dropped"),
        "quota_quiet_p50_ms": held.quiet.pct(0.5), "quota_quiet_p99_ms": held.quiet.pct(0.99),
    }))
}

/// An activation filter's cost on each store, at the sweep's first concurrency: recorded
/// phases with every activation unfiltered and filtered alternately (four of each), the
/// recorded rate and the server's own decision time of each.
async fn filter_phase(o: &Options) -> anyhow::Result<()> {
    ab_phase(o, "filter", ("no filter", "filtered"), |chs, pop, on| {
        let ch = chs[0].clone();
        async move { filter::activate_all(&ch, pop, if on { filter::TYPICAL } else { "" }).await }
    })
    .await
}

/// The cost of a payload schema on one server: recorded phases with the packs' `issue.opened`
/// declared without and with a typical schema (registered again before each), alternately.
async fn schema_phase(o: &Options) -> anyhow::Result<()> {
    let schema = seed::typical_schema();
    // The check alone, in this process: the benchmark triggers' payload against the schema,
    // with the validator and the options the server's payload schemas use (docs/manifest.md).
    let options = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_pattern_options(jsonschema::PatternOptions::regex())
        .should_validate_formats(true);
    // The formats the server leaves as annotations (docs/manifest.md).
    let annotated = [
        "regex",
        "uri-template",
        "iri",
        "iri-reference",
        "idn-email",
        "idn-hostname",
    ];
    let compiled = annotated
        .into_iter()
        .fold(options, |o, f| o.with_format(f, |_: &str| true))
        .build(&schema)
        .map_err(|e| anyhow::anyhow!("the typical schema: {e}"))?;
    let payload = match load::trigger(7, o.population(o.principals), Load::Recorded).payload_source
    {
        Some(pb::deliver_trigger_request::PayloadSource::Payload(s)) => load::json_of_struct(s),
        _ => anyhow::bail!("the benchmark trigger has a payload"),
    };
    anyhow::ensure!(compiled.is_valid(&payload), "the payload keeps the schema");
    const N: u32 = 200_000;
    let started = Instant::now();
    let mut failing = 0;
    for _ in 0..N {
        failing += usize::from(!compiled.is_valid(std::hint::black_box(&payload)));
    }
    let check_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(N);
    // Cold: each check after the caches were filled with something else, as a check between
    // other work meets its validator. The payload is read just before, as the server has just
    // decoded it when it checks it; an empty schema's check, timed the same way, is the floor
    // any check pays (the call, the clock).
    let empty = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&json!({}))
        .map_err(|e| anyhow::anyhow!("the empty schema: {e}"))?;
    const COLD: u32 = 2_000;
    let mut other = vec![0u8; 32 << 20];
    let (mut cold, mut floor) = (Duration::ZERO, Duration::ZERO);
    for n in 0..COLD {
        for (v, took) in [(&compiled, &mut cold), (&empty, &mut floor)] {
            for b in other.iter_mut().step_by(64) {
                *b = b.wrapping_add(n as u8);
            }
            std::hint::black_box(serde_json::to_vec(&payload)?);
            let at = Instant::now();
            failing += usize::from(!v.is_valid(std::hint::black_box(&payload)));
            *took += at.elapsed();
        }
    }
    std::hint::black_box(&other);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(COLD);
    let (cold_us, floor_us) = (per(cold), per(floor));
    println!("schema: one check of the benchmark payload against the typical schema {check_us:.3} us warm ({N} checks in this process), {cold_us:.3} us cold and an empty schema's {floor_us:.3} us cold ({COLD} checks each, each after 32 MiB written and the payload read); {failing} failing");
    result(
        json!({ "phase": "schema check", "check_us": check_us, "cold_check_us": cold_us, "cold_empty_check_us": floor_us, "checks": N }),
    );
    ab_phase(o, "schema", ("no schema", "schema"), move |chs, pop, on| {
        let (ch, schema) = (chs[0].clone(), schema.clone());
        async move { seed::packs_with(&ch, pop, on.then_some(&schema)).await }
    })
    .await
}

/// Phases A and B alternating on each store, at full load and at a steady 1,000/s, `set`
/// switching between them; the decision's time, the server's CPU per call and the rates.
async fn ab_phase<F, Fut>(
    o: &Options,
    name: &str,
    labels: (&str, &str),
    set: F,
) -> anyhow::Result<()>
where
    F: Fn(Vec<Channel>, Population, bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let c = o.first();
    let mean = |ms: &[filter::Measured], f: fn(&filter::Measured) -> f64| {
        ms.iter().map(f).sum::<f64>() / ms.len().max(1) as f64
    };
    for kind in &o.stores {
        let pop = o.population(o.principals);
        let (db, server) = prepare(o, kind, "filter", pop, &[]).await?;
        let chs = server.channels(o.channels).await?;
        // At full load for the rate; at a steady 1,000/s for the decision's own time, which
        // under full load also counts the time its thread waits for a core.
        for (pace, label) in [
            (filter::Pace::Closed(c), format!("C={c}")),
            (filter::Pace::Open(1000.0), "1000/s".to_owned()),
        ] {
            let (plain, filtered) =
                filter::alternating(&server, &chs, o.duration(), pace, pop, o.ab_rounds, |on| {
                    set(chs.clone(), pop, on)
                })
                .await?;
            for (p, f) in plain.iter().zip(&filtered) {
                row(
                    kind,
                    &format!("recorded, {label}, {}", labels.0),
                    &p.phase,
                    None,
                );
                row(
                    kind,
                    &format!("recorded, {label}, {}", labels.1),
                    &f.phase,
                    None,
                );
            }
            let (a, b) = (
                mean(&plain, |m| m.phase.rate()),
                mean(&filtered, |m| m.phase.rate()),
            );
            let (da, db_) = (
                mean(&plain, |m| m.decision_us),
                mean(&filtered, |m| m.decision_us),
            );
            let (ca, cb) = (
                mean(&plain, |m| m.server_cpu_us),
                mean(&filtered, |m| m.server_cpu_us),
            );
            let (la, lb) = labels;
            // Each A beside its B: the change of rate pair by pair, so a drift over the run
            // (records piling up) weighs on neither kind.
            let pairs = filter::pair_changes(&plain, &filtered);
            println!(
                "{kind:<9} {name} at {label}: decision {da:.2} us {la}, {db_:.2} us {lb} ({:+.2} us); server CPU per call {ca:.1} us {la}, {cb:.1} us {lb} ({:+.1} us); recorded {a:.0}/s {la}, {b:.0}/s {lb}: {:+.1}% (means of {}); pair by pair {:+.1}% ± {:.1}% (mean ± standard error of {} pairs), median {:+.1}%, {:+.1}% to {:+.1}%",
                db_ - da,
                cb - ca,
                (b / a - 1.0) * 100.0,
                plain.len(),
                pairs.mean * 100.0,
                pairs.standard_error * 100.0,
                pairs.n,
                pairs.median * 100.0,
                pairs.min * 100.0,
                pairs.max * 100.0,
            );
            result(json!({
                "store": kind, "phase": name, "load": label, "a": la, "b": lb,
                "plain_decision_us": da, "filtered_decision_us": db_, "extra_decision_us": db_ - da,
                "plain_server_cpu_us": ca, "filtered_server_cpu_us": cb,
                "plain_per_s": a, "filtered_per_s": b, "change": b / a - 1.0,
                "pairs": pairs.n, "pair_change_mean": pairs.mean,
                "pair_change_standard_error": pairs.standard_error,
                "pair_change_median": pairs.median,
            }));
        }
        server.stop();
        db.drop_db().await;
    }
    Ok(())
}

/// WatchRecords on one store: ack-to-watcher latency at a fixed rate, then idle watchers' memory.
async fn watch_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "watch", pop, &[]).await?;
    let chs = server.channels(o.channels).await?;
    for &rate in &o.watch_rate {
        let (lat, missing) = watch::latency(&chs, o.duration(), pop, rate).await?;
        let pct = |q: f64| {
            lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
                .map_or(f64::NAN, |us| *us as f64 / 1000.0)
        };
        let (p50, p99) = (pct(0.5), pct(0.99));
        println!(
            "{kind:<9} watch: ack to watcher p50 {p50:.2} ms, p99 {p99:.2} ms at {rate:.0} recorded/s ({} records, {missing} not received)",
            lat.len(),
        );
        result(json!({
            "store": kind, "phase": "watch", "rate": rate, "records": lat.len(),
            "missing": missing, "p50_ms": p50, "p99_ms": p99,
        }));
    }
    let mib = watch::idle_rss(&server, &chs, o.watch_idle).await?;
    println!(
        "{kind:<9} watch: {} idle watches: +{mib:.1} MiB RSS",
        o.watch_idle
    );
    result(json!({
        "store": kind, "phase": "idle watchers", "idle_watchers": o.watch_idle, "idle_rss_mib": mib,
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// NATS ingress on one store: the DeliverTriggers streams' rate, then messages drained from a
/// JetStream stream by the server's consumers, on the same server.
async fn nats_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "nats", pop, &["--nats-url", &o.nats_url]).await?;
    let chs = server.channels(o.channels).await?;
    let streamed = stream(&chs, o.duration(), pop, o.stream_in_flight)
        .await
        .rate();
    let conn = db.connect().await?;
    let drained = nats::drain(&chs[0], &conn, &o.nats_url, pop, o.nats_messages, kind).await?;
    let _ = conn.close().await;
    println!(
        "{kind:<9} nats: {} messages drained at {drained:.0} recorded/s; DeliverTriggers streams {streamed:.0}/s on the same server: {:.2}",
        o.nats_messages,
        drained / streamed
    );
    result(json!({
        "store": kind, "phase": "nats", "messages": o.nats_messages,
        "nats_per_s": drained, "stream_per_s": streamed, "ratio": drained / streamed,
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// The server's threads that write records: the sink's writers and SQLite's worker threads
/// (names as the kernel keeps them, 15 bytes).
const SINK_THREADS: &[&str] = &["hcp-sense-sink", "sqlx-sqlite-wor"];

/// The store's own limit: the same rows inserted into the migrated schema from this process,
/// as microseconds and CPU microseconds per row.
async fn store_limit(o: &Options, kind: &str, pop: Population) -> anyhow::Result<(f64, f64)> {
    let db = BenchDb::create(kind, &o.postgres_url, "limit").await?;
    server::migrate(bin(o), &db.url)?;
    let conn = db.connect().await?;
    let cpu0 = (cpu::client(), cpu::postgres());
    let (rows, secs) = seed::store_limit(&conn, pop, o.duration()).await?;
    let cpu1 = (cpu::client(), cpu::postgres());
    let _ = conn.close().await;
    db.drop_db().await;
    // This process did nothing else meanwhile: its CPU and PostgreSQL's are the insert's.
    let cpu_us = ((cpu1.0 - cpu0.0) + (cpu1.1 - cpu0.1)) * 1e6 / rows.max(1) as f64;
    let rate = rows as f64 / secs;
    println!(
        "{kind:<9} store limit: {rate:.0} rows/s, {:.1} us per row, {cpu_us:.1} us CPU per row (multi-row INSERT of 256 with bound values, one per transaction)",
        1e6 / rate
    );
    result(
        json!({ "store": kind, "phase": "store limit", "rows_per_sec": rate, "us_per_row": 1e6 / rate, "cpu_us_per_row": cpu_us }),
    );
    Ok((1e6 / rate, cpu_us))
}

/// One concurrency of the sweep: the no-op and recorded phases at `c` callers, where the
/// CPU went, and the sink's batches; the two phases' results.
async fn sweep_point(
    o: &Options,
    kind: &str,
    server: &Server,
    chs: &[Channel],
    c: usize,
    limit: Option<(f64, f64)>,
) -> (Phase, Phase) {
    let pop = o.population(o.principals);
    let cpu0 = cpu::sample(server.pid());
    let base = closed(chs, o.duration(), c, pop, Load::Noop).await;
    let cpu1 = cpu::sample(server.pid());
    row(kind, &format!("baseline (no-op), C={c}"), &base, None);
    let before = server.scrape().await;
    let cpu2 = cpu::sample(server.pid());
    let sink0 = cpu::threads(server.pid(), SINK_THREADS);
    let load = if o.keyed {
        Load::RecordedKeyed
    } else {
        Load::Recorded
    };
    let rec = closed(chs, o.duration(), c, pop, load).await;
    let sink1 = cpu::threads(server.pid(), SINK_THREADS);
    let cpu3 = cpu::sample(server.pid());
    let after = server.scrape().await;
    row(kind, &format!("recorded, C={c}"), &rec, Some(&base));
    let (nb, nr) = (
        cpu0.per_call(&cpu1, base.calls),
        cpu2.per_call(&cpu3, rec.calls),
    );
    println!(
        "{kind:<9}   CPU us per call at C={c}: no-op server {:.1} client {:.1} postgres {:.1}; recorded server {:.1} client {:.1} postgres {:.1}",
        nb.server, nb.client, nb.postgres, nr.server, nr.client, nr.postgres
    );
    result(json!({
        "store": kind, "phase": "cpu", "concurrency": c,
        "noop_us_per_call": { "server": nb.server, "client": nb.client, "postgres": nb.postgres },
        "recorded_us_per_call": { "server": nr.server, "client": nr.client, "postgres": nr.postgres },
    }));
    let w = Writer::between(&before, &after);
    // The writer's CPU: its threads, SQLite's worker threads, and PostgreSQL's processes
    // (the server sends PostgreSQL nothing else while it delivers).
    let writer_cpu = ((sink1 - sink0) * 1e6 + nr.postgres * rec.calls as f64) / w.records.max(1.0);
    println!(
        "{kind:<9}   sink at C={c}: {:.0} records per batch, batch commit p99 {:.2} ms, writer {:.1} us per record{}, {writer_cpu:.1} us CPU per record{}",
        w.per_batch,
        w.commit_p99_ms,
        w.us_per_record,
        limit.map_or(String::new(), |(l, _)| format!(" ({:.2} x the raw insert's {l:.1} us)", w.us_per_record / l)),
        limit.map_or(String::new(), |(_, c)| format!(" ({:.2} x the raw insert's {c:.1} us)", writer_cpu / c)),
    );
    let bound = 2.0 * (w.commit_p99_ms + base.pct(0.99));
    println!(
        "{kind:<9}   p99 bound at C={c}: {bound:.2} ms (2 x (commit p99 + no-op p99)); recorded p99 {:.2} ms",
        rec.pct(0.99)
    );
    result(json!({
        "store": kind, "phase": "sink", "concurrency": c,
        "records_per_batch": w.per_batch, "commit_p99_ms": w.commit_p99_ms,
        "writer_us_per_record": w.us_per_record,
        "writer_over_raw_insert": limit.map(|(l, _)| w.us_per_record / l),
        "writer_cpu_us_per_record": writer_cpu,
        "writer_cpu_over_raw_insert": limit.map(|(_, c)| writer_cpu / c),
        "p99_bound_ms": bound,
    }));
    (base, rec)
}

/// The store limit, then no-op and recorded over the concurrency sweep, dropped, the open loop
/// at half the recorded rate, and the DeliverTriggers streams, on one store.
async fn sweep(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let limit = if o.store_limit {
        Some(store_limit(o, kind, pop).await?)
    } else {
        None
    };
    let writers = o.sink_writers.map(|n| n.to_string());
    let mut extra: Vec<&str> = Vec::new();
    if let Some(n) = &writers {
        extra.extend(["--sink-writers", n.as_str()]);
    }
    let (db, server) = prepare(o, kind, "deliver", pop, &extra).await?;
    header();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (idle_rss, _) = server.rss_kib();
    let chs = server.channels(o.channels).await?;
    let (mut peak_base, mut peak_rec) = (0f64, 0f64);
    for &c in &o.concurrency {
        let (base, rec) = sweep_point(o, kind, &server, &chs, c.max(1), limit).await;
        peak_base = peak_base.max(base.rate());
        peak_rec = peak_rec.max(rec.rate());
    }
    println!(
        "{kind:<9} peak recorded {peak_rec:.0}/s over peak no-op {peak_base:.0}/s: {:.2}",
        peak_rec / peak_base
    );
    result(
        json!({ "store": kind, "phase": "peak", "recorded_per_sec": peak_rec, "noop_per_sec": peak_base, "ratio": peak_rec / peak_base }),
    );
    let first = o.first();
    let dropped = closed(&chs, o.duration(), first, pop, Load::Dropped).await;
    row(kind, &format!("dropped, C={first}"), &dropped, None);
    let rec = closed(&chs, o.duration(), first, pop, Load::Recorded).await;
    let half = rec.rate() * 0.5;
    let base_half = open(&chs, o.duration(), pop, Load::Noop, half).await;
    row(kind, &format!("baseline @ {half:.0}/s"), &base_half, None);
    let rec_half = open(&chs, o.duration(), pop, Load::Recorded, half).await;
    row(
        kind,
        &format!("recorded @ {half:.0}/s"),
        &rec_half,
        Some(&base_half),
    );
    println!(
        "{kind:<9} p99 at half of the recorded rate: {:.2} x the baseline's p99",
        rec_half.pct(0.99) / base_half.pct(0.99)
    );
    if o.stream {
        let streamed = stream(&chs, o.duration(), pop, o.stream_in_flight).await;
        row(
            kind,
            &format!("DeliverTriggers, {} streams", chs.len()),
            &streamed,
            None,
        );
        if let Some((l, _)) = limit {
            println!(
                "{kind:<9} DeliverTriggers {:.0}/s over the raw insert's {:.0} rows/s: {:.2}",
                streamed.rate(),
                1e6 / l,
                streamed.rate() * l / 1e6
            );
            result(
                json!({ "store": kind, "phase": "stream over store limit", "ratio": streamed.rate() * l / 1e6 }),
            );
        }
    }
    let (_, peak) = server.rss_kib();
    println!(
        "{kind:<9} server RSS: idle {:.1} MiB, peak {:.1} MiB\n",
        idle_rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    server.stop();
    db.drop_db().await;
    Ok(())
}

/// Recorded throughput at 256 callers (or the sweep's largest below that) for each sink writer
/// count, on PostgreSQL reached through a proxy that delays every round trip, as a network
/// between them would.
async fn writers_compare(o: &Options) -> anyhow::Result<()> {
    let c = o
        .concurrency
        .iter()
        .copied()
        .filter(|c| *c <= 256)
        .max()
        .unwrap_or(256)
        .max(1);
    println!(
        "sink writers (postgres through a proxy adding {} ms per round trip), C={c}",
        o.postgres_delay_ms
    );
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "postgres", "writers", pop, &[]).await?;
    seeded.stop();
    header();
    let (head, rest) = db
        .url
        .split_once('@')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no user"))?;
    let (upstream, tail) = rest
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no database"))?;
    let proxy = proxy::delay_proxy(
        upstream.to_owned(),
        Duration::from_secs_f64(o.postgres_delay_ms / 1000.0),
    )
    .await?;
    let url = format!("{head}@{proxy}/{tail}");
    let mut rates = Vec::new();
    for &w in &o.writers_compare {
        let n = w.to_string();
        let server = Server::start(bin(o), &url, &["--sink-writers", &n])?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), c, pop, Load::Recorded).await;
        row("postgres", &format!("recorded, {w} writers"), &rec, None);
        rates.push((w, rec.rate()));
        server.stop();
    }
    if let (Some(lo), Some(hi)) = (rates.first(), rates.last()) {
        println!(
            "{} writers / {} writer(s): {:.2}\n",
            hi.0,
            lo.0,
            hi.1 / lo.1
        );
        result(
            json!({ "phase": "writers compare", "delay_ms": o.postgres_delay_ms, "concurrency": c, "rates": rates }),
        );
    }
    db.drop_db().await;
    Ok(())
}

/// Deliveries and server memory at each principal count of --scaling (SQLite).
async fn scaling(o: &Options) -> anyhow::Result<()> {
    let counts: Vec<usize> = o.scaling.iter().copied().filter(|n| *n > 0).collect();
    if counts.is_empty() {
        return Ok(());
    }
    println!("principal scaling (sqlite): deliveries and server memory");
    let first = o.first();
    let mut rows = Vec::new();
    for &n in &counts {
        let pop = o.population(n);
        let (db, server) = prepare(o, "sqlite", &format!("scale{n}"), pop, &[]).await?;
        // The idle size of a server that loaded this policy at start.
        server.stop();
        let server = Server::start(bin(o), &db.url, &[])?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss, _) = server.rss_kib();
        header();
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), first, pop, Load::Recorded).await;
        row("sqlite", &format!("recorded, {n} principals"), &rec, None);
        let dropped = closed(&chs, o.duration(), first, pop, Load::Dropped).await;
        row(
            "sqlite",
            &format!("dropped, {n} principals"),
            &dropped,
            None,
        );
        rows.push((n, rss, rec.rate(), dropped.rate()));
        server.stop();
        db.drop_db().await;
    }
    if let (Some(lo), Some(hi)) = (rows.first(), rows.last()) {
        println!(
            "recorded at {} / at {} principals: {:.2}; dropped: {:.2}",
            hi.0,
            lo.0,
            hi.2 / lo.2,
            hi.3 / lo.3
        );
        if hi.0 > lo.0 {
            let per = (hi.1 as f64 - lo.1 as f64) * 1024.0 / (hi.0 - lo.0) as f64;
            println!("server idle RSS grows by {per:.0} bytes per (principal, pack) entry ({} KiB at {}, {} KiB at {}; includes SQLite page caches and allocator slack)", lo.1, lo.0, hi.1, hi.0);
            result(
                json!({ "phase": "scaling", "rss_bytes_per_principal": per, "recorded_ratio": hi.2 / lo.2, "dropped_ratio": hi.3 / lo.3 }),
            );
        }
    }
    println!();
    Ok(())
}

/// DeliverTrigger with telemetry fully on (every span exported over OTLP to a local receiver)
/// against off, on one database, in one run.
async fn telemetry_cost(o: &Options) -> anyhow::Result<()> {
    println!("telemetry (sqlite): OTLP export of every span to a local receiver, against none");
    let counter = telemetry::SpanCounter::default();
    let endpoint = counter.serve().await?;
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "sqlite", "telemetry", pop, &[]).await?;
    seeded.stop();
    header();
    let mut rates = Vec::new();
    for (name, env) in [
        ("off", vec![]),
        (
            "on",
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_TRACES_SAMPLER", "always_on"),
            ],
        ),
    ] {
        let server = Server::start_env(bin(o), &db.url, &[], &env)?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o.duration(), o.first(), pop, Load::Recorded).await;
        row("sqlite", &format!("recorded, telemetry {name}"), &rec, None);
        let dropped = closed(&chs, o.duration(), o.first(), pop, Load::Dropped).await;
        row(
            "sqlite",
            &format!("dropped, telemetry {name}"),
            &dropped,
            None,
        );
        rates.push((rec.rate(), dropped.rate()));
        server.stop();
    }
    if let [off, on] = rates[..] {
        println!(
            "telemetry on / off: recorded {:.2}, dropped {:.2}; spans received {}\n",
            on.0 / off.0,
            on.1 / off.1,
            counter.spans()
        );
    }
    db.drop_db().await;
    Ok(())
}

/// Pages through an unfiltered listing `pages` pages of `size` deep; returns the token there.
async fn page_down(ch: &Channel, size: i32, pages: usize) -> anyhow::Result<String> {
    let mut client = pb::record_service_client::RecordServiceClient::new(ch.clone());
    let mut token = String::new();
    for _ in 0..pages {
        let r = client
            .list_records(pb::ListRecordsRequest {
                page_size: size,
                page_token: token.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        if r.next_page_token.is_empty() {
            break;
        }
        token = r.next_page_token;
    }
    Ok(token)
}

/// 300 ListRecords calls for a page of 100 from `token`, one after another; a call that errs
/// or returns a short page counts as an error.
async fn list_page_latency(ch: &Channel, token: &str) -> Phase {
    let mut client = pb::record_service_client::RecordServiceClient::new(ch.clone());
    let mut lat = Vec::new();
    let start = Instant::now();
    let mut errors = 0;
    for _ in 0..300 {
        let t = Instant::now();
        match client
            .list_records(pb::ListRecordsRequest {
                page_size: 100,
                page_token: token.to_owned(),
                ..Default::default()
            })
            .await
        {
            Ok(r) if r.get_ref().records.len() == 100 => lat.push(t.elapsed().as_micros() as u64),
            _ => errors += 1,
        }
    }
    lat.sort_unstable();
    Phase {
        calls: lat.len(),
        errors,
        secs: start.elapsed().as_secs_f64(),
        lat_us: lat,
    }
}

/// ListRecords' first page and a page deep into the listing, reached by paging.
async fn list_records(o: &Options) -> anyhow::Result<()> {
    println!("ListRecords: a page of 100 from {} records", o.list_records);
    let pop = o.population(o.principals);
    for kind in &o.stores {
        let db = BenchDb::create(kind, &o.postgres_url, "list").await?;
        server::migrate(bin(o), &db.url)?;
        let conn = db.connect().await?;
        let t0 = Instant::now();
        seed::records_bulk(&conn, pop, o.list_records, now_micros() - 3_600_000_000).await?;
        let _ = conn.close().await;
        println!(
            "{kind:<9} seeded {} records through the bulk path in {:.1} s",
            o.list_records,
            t0.elapsed().as_secs_f64()
        );
        let server = Server::start(bin(o), &db.url, &[])?;
        let chs = server.channels(1).await?;
        let t0 = Instant::now();
        // 90% of the way down, 1,000 records a page.
        let deep = page_down(&chs[0], 1000, o.list_records * 9 / 10 / 1000).await?;
        println!(
            "{kind:<9} paged {} records down in {:.1} s",
            o.list_records * 9 / 10,
            t0.elapsed().as_secs_f64()
        );
        header();
        for (name, token) in [("first page", String::new()), ("deep page", deep)] {
            let p = list_page_latency(&chs[0], &token).await;
            row(kind, &format!("ListRecords {name}"), &p, None);
        }
        server.stop();
        db.drop_db().await;
    }
    println!();
    Ok(())
}

/// Deliveries while the server prunes expired records (SQLite, the single writer).
async fn retention(o: &Options) -> anyhow::Result<()> {
    println!(
        "retention (sqlite): deliveries while {} expired records are pruned",
        o.retention_records
    );
    let pop = o.population(o.principals);
    let (db, seeded) = prepare(o, "sqlite", "retention", pop, &[]).await?;
    seeded.stop();
    let conn = db.connect().await?;
    seed::records_bulk(
        &conn,
        pop,
        o.retention_records,
        now_micros() - 2 * 86_400_000_000,
    )
    .await?;
    let _ = conn.close().await;
    let server = Server::start(
        bin(o),
        &db.url,
        &[
            "--record-retention-secs",
            "86400",
            "--prune-interval-secs",
            "1",
        ],
    )?;
    header();
    let chs = server.channels(o.channels).await?;
    let base = closed(&chs, o.duration(), o.first(), pop, Load::Noop).await;
    row("sqlite", "baseline (no-op)", &base, None);
    let rec = closed(&chs, o.duration(), o.first(), pop, Load::Recorded).await;
    row("sqlite", "recorded while pruning", &rec, Some(&base));
    server.stop();
    let conn = db.connect().await?;
    let left = seed::count_before(&conn, now_micros() - 86_400_000_000).await?;
    let _ = conn.close().await;
    println!(
        "expired records left after the phase: {left} of {}",
        o.retention_records
    );
    result(
        json!({ "phase": "retention", "expired_left": left, "expired_seeded": o.retention_records }),
    );
    db.drop_db().await;
    Ok(())
}
