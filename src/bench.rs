//! `hcp-sense bench`: starts real servers, seeds policy and records, drives DeliverTrigger and ListRecords, and reports each against a no-op baseline measured in the same run.
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use sea_orm::{ActiveValue::Set, ConnectionTrait, EntityTrait, TransactionTrait};
use serde_json::json;
use tonic::transport::Channel;

use crate::config::StoreConfig;
use crate::domain::pack::lint;
use crate::grpc::convert::json_to_struct;
use crate::grpc::paging::{PageTokens, SEP};
use crate::grpc::pb::{
    bench_service_client::BenchServiceClient, deliver_trigger_noop_request,
    deliver_trigger_request, ingest_service_client::IngestServiceClient,
    record_service_client::RecordServiceClient, DeliverTriggerNoopRequest, DeliverTriggerRequest,
    ListRecordsRequest,
};
use crate::grpc::records::filter_fingerprint;
use crate::store::entity::{bindings, records, sense_activations, sense_grants};
use crate::store::{now_micros, Store};

/// Options of `hcp-sense bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchOptions {
    /// Seconds each measured phase runs.
    #[arg(long, default_value_t = 5)]
    pub duration_secs: u64,
    /// Concurrent callers: the recorded and no-op phases run at each, in turn.
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,512")]
    pub concurrency: Vec<usize>,
    /// HTTP/2 connections the callers share.
    #[arg(long, default_value_t = 4)]
    pub channels: usize,
    /// Registered packs.
    #[arg(long, default_value_t = 10)]
    pub packs: usize,
    /// Principals, each granted, bound and activated on one pack.
    #[arg(long, default_value_t = 1000)]
    pub principals: usize,
    /// Stores to measure: sqlite, postgres.
    #[arg(long, value_delimiter = ',', default_value = "sqlite,postgres")]
    pub stores: Vec<String>,
    /// Server on which the benchmark creates (and drops) its PostgreSQL database.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    pub postgres_url: String,
    /// Principal counts compared for throughput and policy memory (SQLite; 0 skips).
    #[arg(long, value_delimiter = ',', default_value = "10,100000")]
    pub scaling: Vec<usize>,
    /// Measure DeliverTrigger with OTLP export on (to a local receiver) against off.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub telemetry: bool,
    /// Records seeded for the ListRecords benchmark (0 skips).
    #[arg(long, default_value_t = 1_000_000)]
    pub list_records: usize,
    /// Old records seeded for the retention phase (0 skips).
    #[arg(long, default_value_t = 200_000)]
    pub retention_records: usize,
    /// Sink writers of the servers measured (PostgreSQL); the server's default when not given.
    #[arg(long)]
    pub sink_writers: Option<usize>,
    /// Measure DeliverTriggers, one stream per HTTP/2 connection.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub stream: bool,
    /// Measure the store's own bulk-insert rate for the same rows into the same schema.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub store_limit: bool,
    /// Sink writer counts compared on PostgreSQL behind a proxy adding --postgres-delay-ms to
    /// every round trip, at the largest concurrency (empty skips).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub writers_compare: Vec<usize>,
    /// Milliseconds the proxy of --writers-compare adds to each round trip to PostgreSQL.
    #[arg(long, default_value_t = 1.0)]
    pub postgres_delay_ms: f64,
    /// Also write every result row to this file as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Every result row printed, kept for `--json`.
static RESULTS: std::sync::Mutex<Vec<serde_json::Value>> = std::sync::Mutex::new(Vec::new());

fn result(v: serde_json::Value) {
    if let Ok(mut r) = RESULTS.lock() {
        r.push(v);
    }
}

/// Latency samples and throughput of one phase.
struct Phase {
    calls: usize,
    errors: usize,
    secs: f64,
    lat_us: Vec<u64>,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.calls as f64 / self.secs
    }
    fn pct(&self, q: f64) -> f64 {
        if self.lat_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_us.len() as f64) * q) as usize;
        self.lat_us[i.min(self.lat_us.len() - 1)] as f64 / 1000.0
    }
}

fn row(store: &str, name: &str, p: &Phase, base: Option<&Phase>) {
    let ratio = base.map_or(String::from("-"), |b| format!("{:.2}", p.rate() / b.rate()));
    result(json!({
        "store": store,
        "phase": name,
        "calls_per_sec": p.rate(),
        "p50_ms": p.pct(0.50),
        "p99_ms": p.pct(0.99),
        "p999_ms": p.pct(0.999),
        "errors": p.errors,
        "ratio": base.map(|b| p.rate() / b.rate()),
    }));
    println!(
        "{store:<9} {name:<28} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>7} {:>7}",
        p.rate(),
        p.pct(0.50),
        p.pct(0.99),
        p.pct(0.999),
        p.errors,
        ratio
    );
}

fn header() {
    println!(
        "{:<9} {:<28} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "store", "phase", "calls/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "ratio"
    );
}

/// A server process started from this binary.
struct Server {
    child: Child,
    addr: String,
    metrics: String,
}

impl Server {
    fn start(url: &str, extra: &[&str]) -> anyhow::Result<Server> {
        Server::start_env(url, extra, &[])
    }

    fn start_env(url: &str, extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Server> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .envs(env.iter().copied())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--database-url",
                url,
                "--bench-baseline",
                "true",
                "--page-token-secret",
                BENCH_TOKEN_SECRET,
            ])
            .args(extra)
            // The server's own RUST_LOG (default warn), plus the line that tells its address.
            .env(
                "RUST_LOG",
                format!(
                    "{},hcp_sense::app=info",
                    std::env::var("HCP_SENSE_BENCH_SERVER_LOG").unwrap_or_else(|_| "warn".into())
                ),
            )
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let word = |key: &str| {
                    line.split(key)
                        .nth(1)
                        .and_then(|a| a.split_whitespace().next())
                        .map(str::to_owned)
                };
                match (word(" addr="), word("metrics_addr=")) {
                    (Some(a), Some(m)) => {
                        let _ = tx.send((a, m));
                    }
                    // The server's own log lines go to stderr.
                    _ => eprintln!("{line}"),
                }
            }
        });
        let (addr, metrics) = rx.recv_timeout(Duration::from_secs(120))?;
        Ok(Server {
            child,
            addr,
            metrics,
        })
    }

    /// Resident and peak resident set size in KiB, from /proc.
    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let get = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (get("VmRSS:"), get("VmHWM:"))
    }

    /// The server's Prometheus samples: `name{labels}` to value.
    async fn scrape(&self) -> std::collections::HashMap<String, f64> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut out = std::collections::HashMap::new();
        let Ok(mut s) = tokio::net::TcpStream::connect(&self.metrics).await else {
            return out;
        };
        let req = format!(
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.metrics
        );
        let mut text = String::new();
        if s.write_all(req.as_bytes()).await.is_err() || s.read_to_string(&mut text).await.is_err()
        {
            return out;
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            if let Some((k, v)) = line.rsplit_once(' ') {
                if let Ok(v) = v.parse() {
                    out.insert(k.to_owned(), v);
                }
            }
        }
        out
    }

    async fn channels(&self, n: usize) -> anyhow::Result<Vec<Channel>> {
        let mut v = Vec::new();
        for _ in 0..n.max(1) {
            v.push(
                Channel::from_shared(format!("http://{}", self.addr))?
                    .connect()
                    .await?,
            );
        }
        Ok(v)
    }

    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What each call sends.
#[derive(Clone, Copy)]
enum Load {
    Noop,
    Recorded,
    Dropped,
}

fn trigger(i: usize, principals: usize, packs: usize, load: Load) -> DeliverTriggerRequest {
    let p = i % principals.max(1);
    let principal = match load {
        // Never granted: dropped with no_grant after the pack and ref are found.
        Load::Dropped => format!("stranger-{p}"),
        _ => format!("principal-{p}"),
    };
    DeliverTriggerRequest {
        pack_id: format!("pack-{}", p % packs.max(1)),
        r#ref: "issue.opened".into(),
        principal,
        land: "user".into(),
        payload_source: Some(deliver_trigger_request::PayloadSource::Payload(
            json_to_struct(&json!({ "issue": i, "title": "benchmark" })),
        )),
        ..Default::default()
    }
}

fn noop(t: DeliverTriggerRequest) -> DeliverTriggerNoopRequest {
    DeliverTriggerNoopRequest {
        pack_id: t.pack_id,
        r#ref: t.r#ref,
        principal: t.principal,
        land: t.land,
        payload_source: t.payload_source.map(|p| match p {
            deliver_trigger_request::PayloadSource::Payload(s) => {
                deliver_trigger_noop_request::PayloadSource::Payload(s)
            }
            deliver_trigger_request::PayloadSource::PayloadJson(j) => {
                deliver_trigger_noop_request::PayloadSource::PayloadJson(j)
            }
        }),
        project: t.project,
        trigger_id: t.trigger_id,
        source: t.source,
    }
}

async fn call(ch: &Channel, req: DeliverTriggerRequest, load: Load) -> bool {
    match load {
        Load::Noop => BenchServiceClient::new(ch.clone())
            .deliver_trigger_noop(noop(req))
            .await
            .is_ok(),
        _ => IngestServiceClient::new(ch.clone())
            .deliver_trigger(req)
            .await
            .is_ok(),
    }
}

/// Closed loop: `concurrency` callers, each calling again as soon as answered.
async fn closed(
    chs: &[Channel],
    o: &BenchOptions,
    concurrency: usize,
    principals: usize,
    load: Load,
) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let ch = chs[w % chs.len()].clone();
        let stop = stop.clone();
        let (packs, conc) = (o.packs, concurrency);
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut errors, mut i) = (Vec::new(), 0, w);
            while !stop.load(Ordering::Relaxed) {
                let req = trigger(i, principals, packs, load);
                let t = Instant::now();
                if call(&ch, req, load).await {
                    lat.push(t.elapsed().as_micros() as u64);
                } else {
                    errors += 1;
                }
                i += conc;
            }
            (lat, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(o.duration_secs)).await;
    stop.store(true, Ordering::Relaxed);
    gather(tasks, start).await
}

/// Open loop at a fixed rate; latency counts from the scheduled start, so queueing shows.
async fn open(
    chs: &[Channel],
    o: &BenchOptions,
    principals: usize,
    load: Load,
    rate: f64,
) -> Phase {
    let start = Instant::now();
    let total = (rate * o.duration_secs as f64) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + gap.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let ch = chs[i % chs.len()].clone();
        let packs = o.packs;
        tasks.push(tokio::spawn(async move {
            let ok = call(&ch, trigger(i, principals, packs, load), load).await;
            (vec![due.elapsed().as_micros() as u64], usize::from(!ok))
        }));
    }
    gather(tasks, start).await
}

async fn gather(tasks: Vec<tokio::task::JoinHandle<(Vec<u64>, usize)>>, start: Instant) -> Phase {
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        if let Ok((l, e)) = t.await {
            lat.extend(l);
            errors += e;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    lat.sort_unstable();
    Phase {
        calls: lat.len(),
        errors,
        secs,
        lat_us: lat,
    }
}

/// A database of the benchmark's own.
struct BenchDb {
    url: String,
    pg: Option<(String, String)>,
    _dir: Option<tempfile_dir::Dir>,
}

mod tempfile_dir {
    //! A directory removed on drop, without a dependency for it.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl BenchDb {
    async fn create(kind: &str, o: &BenchOptions, tag: &str) -> anyhow::Result<BenchDb> {
        let name = format!("hcp_sense_bench_{}_{tag}", std::process::id());
        match kind {
            "sqlite" => {
                let dir = std::env::temp_dir().join(&name);
                std::fs::create_dir_all(&dir)?;
                let path: PathBuf = dir.join("bench.db");
                Ok(BenchDb {
                    url: format!("sqlite://{}", path.display()),
                    pg: None,
                    _dir: Some(tempfile_dir::Dir(dir)),
                })
            }
            "postgres" => {
                let admin = sea_orm::Database::connect(o.postgres_url.as_str()).await?;
                admin
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name}"))
                    .await?;
                admin
                    .execute_unprepared(&format!("CREATE DATABASE {name}"))
                    .await?;
                let _ = admin.close().await;
                let root = o
                    .postgres_url
                    .rsplit_once('/')
                    .map_or(o.postgres_url.as_str(), |(r, _)| r);
                Ok(BenchDb {
                    url: format!("{root}/{name}"),
                    pg: Some((o.postgres_url.clone(), name)),
                    _dir: None,
                })
            }
            other => anyhow::bail!("unknown store `{other}`: use sqlite or postgres"),
        }
    }

    async fn drop_db(self) {
        if let Some((admin, name)) = &self.pg {
            if let Ok(a) = sea_orm::Database::connect(admin.as_str()).await {
                let _ = a
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await;
                let _ = a.close().await;
            }
        }
    }
}

/// Registers the packs and gives each principal a grant, a linked Binding and an inbox activation.
async fn seed_policy(store: &Store, packs: usize, principals: usize) -> anyhow::Result<()> {
    for k in 0..packs {
        let m = lint(&json!({
            "id": format!("pack-{k}"),
            "stimulusTriggers": [{ "ref": "issue.opened" }, { "ref": "binding.degraded" }],
            "policy": { "stimuli": [
                { "ref": "issue.opened", "operation": "read", "land": "user" },
                { "ref": "binding.degraded", "operation": "read", "land": "user" }
            ]},
            "binding": { "mode": "user", "hub": "bench" }
        }))
        .manifest
        .ok_or_else(|| anyhow::anyhow!("bench manifest fails lint"))?;
        store.put_pack(&m, now_micros()).await?;
    }
    let db = store.connection();
    let now = now_micros();
    let ids: Vec<usize> = (0..principals).collect();
    for chunk in ids.chunks(2000) {
        let txn = db.begin().await?;
        let who = |p: usize| {
            (
                format!("principal-{p}"),
                format!("pack-{}", p % packs.max(1)),
            )
        };
        sense_grants::Entity::insert_many(chunk.iter().map(|p| {
            let (principal, pack_id) = who(*p);
            sense_grants::ActiveModel {
                principal: Set(principal),
                pack_id: Set(pack_id),
                create_time: Set(now),
            }
        }))
        .exec_without_returning(&txn)
        .await?;
        bindings::Entity::insert_many(chunk.iter().map(|p| {
            let (principal, pack_id) = who(*p);
            bindings::ActiveModel {
                binding_id: Set(format!("b-{principal}")),
                principal: Set(principal),
                pack_id: Set(pack_id),
                mode: Set("user".into()),
                state: Set("linked".into()),
                update_time: Set(now),
            }
        }))
        .exec_without_returning(&txn)
        .await?;
        sense_activations::Entity::insert_many(chunk.iter().map(|p| {
            let (principal, pack_id) = who(*p);
            sense_activations::ActiveModel {
                principal: Set(principal),
                pack_id: Set(pack_id),
                enabled: Set(true),
                route: Set("inbox".into()),
                update_time: Set(now),
            }
        }))
        .exec_without_returning(&txn)
        .await?;
        txn.commit().await?;
    }
    Ok(())
}

/// Inserts `n` records received at `base` + i microseconds, at positions (0, i + 1) as records
/// written before positions existed have; returns the position of each 100,000th.
async fn seed_records(store: &Store, n: usize, base: i64) -> anyhow::Result<Vec<(i64, i64)>> {
    let db = store.connection();
    let mut marks = Vec::new();
    let mut i = 0;
    while i < n {
        let txn = db.begin().await?;
        for _ in 0..50 {
            if i >= n {
                break;
            }
            let end = (i + 1000).min(n);
            let rows: Vec<records::ActiveModel> = (i..end)
                .map(|j| {
                    let id = format!("{:08x}-0000-7000-8000-{:012x}", j / 65536, j);
                    let t = base + j as i64;
                    if j % 100_000 == 0 {
                        marks.push((0, j as i64 + 1));
                    }
                    records::ActiveModel {
                        record_id: Set(id),
                        principal: Set(format!("principal-{}", j % 1000)),
                        binding_id: Set(format!("b-principal-{}", j % 1000)),
                        land: Set("user".into()),
                        pack_id: Set(format!("pack-{}", j % 10)),
                        r#ref: Set("issue.opened".into()),
                        payload: Set(format!("{{\"issue\":{j}}}")),
                        route: Set("inbox".into()),
                        project: Set(None),
                        producer_trigger_id: Set(None),
                        received_time: Set(t),
                        commit_txid: Set(0),
                        seq: Set(j as i64 + 1),
                    }
                })
                .collect();
            records::Entity::insert_many(rows)
                .exec_without_returning(&txn)
                .await?;
            i = end;
        }
        txn.commit().await?;
    }
    // New records number on from the seeded ones.
    db.execute_unprepared(match store.engine() {
        crate::store::Engine::Sqlite => {
            "UPDATE record_sequence SET next = (SELECT max(seq) + 1 FROM records)"
        }
        crate::store::Engine::Postgres => {
            "SELECT setval('records_seq', (SELECT max(seq) + 1 FROM records), false)"
        }
    })
    .await?;
    Ok(marks)
}

async fn open_store(url: &str) -> anyhow::Result<Store> {
    let store = Store::connect(&StoreConfig {
        url: url.to_owned(),
        max_connections: Some(4),
    })
    .await?;
    store.migrate_up().await?;
    Ok(store)
}

/// The page-token key the benchmark shares with its servers, to craft a deep page's token.
const BENCH_TOKEN_SECRET: &str = "hcp-sense-bench";

/// Runs every phase and prints the results.
pub async fn run(o: BenchOptions) -> anyhow::Result<()> {
    println!(
        "hcp-sense bench {}: {} s per phase, {:?} callers over {} HTTP/2 connections, {} packs, {} principals, {} cores",
        env!("CARGO_PKG_VERSION"),
        o.duration_secs,
        o.concurrency,
        o.channels,
        o.packs,
        o.principals,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!(
        "ratio = calls/s over the no-op baseline's calls/s in the same run, on the same server\n"
    );
    let first = o.concurrency.first().copied().unwrap_or(32).max(1);
    let writers = o.sink_writers.map(|n| n.to_string());
    let mut extra: Vec<&str> = Vec::new();
    if let Some(n) = &writers {
        extra.extend(["--sink-writers", n.as_str()]);
    }
    header();
    for kind in o.stores.clone() {
        let limit = if o.store_limit {
            Some(store_limit(&kind, &o).await?)
        } else {
            None
        };
        let db = BenchDb::create(&kind, &o, "deliver").await?;
        let store = open_store(&db.url).await?;
        seed_policy(&store, o.packs, o.principals).await?;
        store.close().await;
        let server = Server::start(&db.url, &extra)?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (idle_rss, _) = server.rss_kib();
        let chs = server.channels(o.channels).await?;
        let (mut peak_base, mut peak_rec) = (0f64, 0f64);
        for &c in &o.concurrency {
            let c = c.max(1);
            let base = closed(&chs, &o, c, o.principals, Load::Noop).await;
            row(&kind, &format!("baseline (no-op), C={c}"), &base, None);
            let before = server.scrape().await;
            let rec = closed(&chs, &o, c, o.principals, Load::Recorded).await;
            let after = server.scrape().await;
            row(&kind, &format!("recorded, C={c}"), &rec, Some(&base));
            let w = Writer::between(&before, &after);
            println!(
                "{kind:<9}   sink at C={c}: {:.0} records per batch, batch commit p99 {:.2} ms, writer {:.1} us per record{}",
                w.per_batch,
                w.commit_p99_ms,
                w.us_per_record,
                limit.map_or(String::new(), |l| format!(" ({:.2} x the raw insert's {l:.1} us)", w.us_per_record / l))
            );
            println!(
                "{kind:<9}   p99 bound at C={c}: {:.2} ms (2 x (commit p99 + no-op p99)); recorded p99 {:.2} ms",
                2.0 * (w.commit_p99_ms + base.pct(0.99)),
                rec.pct(0.99)
            );
            result(json!({
                "store": kind, "phase": "sink", "concurrency": c,
                "records_per_batch": w.per_batch, "commit_p99_ms": w.commit_p99_ms,
                "writer_us_per_record": w.us_per_record,
                "p99_bound_ms": 2.0 * (w.commit_p99_ms + base.pct(0.99)),
            }));
            peak_base = peak_base.max(base.rate());
            peak_rec = peak_rec.max(rec.rate());
        }
        println!(
            "{kind:<9} peak recorded {peak_rec:.0}/s over peak no-op {peak_base:.0}/s: {:.2}",
            peak_rec / peak_base
        );
        let dropped = closed(&chs, &o, first, o.principals, Load::Dropped).await;
        row(&kind, &format!("dropped, C={first}"), &dropped, None);
        let rec = closed(&chs, &o, first, o.principals, Load::Recorded).await;
        let half = rec.rate() * 0.5;
        let base_half = open(&chs, &o, o.principals, Load::Noop, half).await;
        row(&kind, &format!("baseline @ {half:.0}/s"), &base_half, None);
        let rec_half = open(&chs, &o, o.principals, Load::Recorded, half).await;
        row(
            &kind,
            &format!("recorded @ {half:.0}/s"),
            &rec_half,
            Some(&base_half),
        );
        println!(
            "{kind:<9} p99 at half of the recorded rate: {:.2} x the baseline's p99",
            rec_half.pct(0.99) / base_half.pct(0.99)
        );
        if o.stream {
            let streamed = stream(&chs, &o).await;
            row(
                &kind,
                &format!("DeliverTriggers, {} streams", chs.len()),
                &streamed,
                None,
            );
            if let Some(l) = limit {
                println!(
                    "{kind:<9} DeliverTriggers {:.0}/s over the raw insert's {:.0} rows/s: {:.2}",
                    streamed.rate(),
                    1e6 / l,
                    streamed.rate() * l / 1e6
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
    }

    if o.stores.iter().any(|s| s == "postgres") && !o.writers_compare.is_empty() {
        writers_compare(&o).await?;
    }

    let scaling: Vec<usize> = o.scaling.iter().copied().filter(|n| *n > 0).collect();
    if !scaling.is_empty() {
        println!("principal scaling (sqlite): deliveries and policy memory");
        header();
        let mut rows = Vec::new();
        for n in &scaling {
            let db = BenchDb::create("sqlite", &o, &format!("scale{n}")).await?;
            let store = open_store(&db.url).await?;
            seed_policy(&store, o.packs, *n).await?;
            let view = store.load_policy().await?;
            println!(
                "sqlite    policy view of {} entries: {} bytes each (structure estimate)",
                view.entries(),
                view.approx_bytes() / view.entries().max(1)
            );
            drop(view);
            store.close().await;
            let server = Server::start(&db.url, &[])?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (rss, _) = server.rss_kib();
            let chs = server.channels(o.channels).await?;
            let rec = closed(&chs, &o, first, *n, Load::Recorded).await;
            row("sqlite", &format!("recorded, {n} principals"), &rec, None);
            let dropped = closed(&chs, &o, first, *n, Load::Dropped).await;
            row(
                "sqlite",
                &format!("dropped, {n} principals"),
                &dropped,
                None,
            );
            rows.push((*n, rss, rec.rate(), dropped.rate()));
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
            }
        }
        println!();
    }

    if o.telemetry {
        telemetry_cost(&o).await?;
    }

    if o.list_records > 0 {
        println!("ListRecords: a page of 100 from {} records", o.list_records);
        header();
        for kind in o.stores.clone() {
            let db = BenchDb::create(&kind, &o, "list").await?;
            let store = open_store(&db.url).await?;
            let t0 = Instant::now();
            let marks = seed_records(&store, o.list_records, now_micros() - 3_600_000_000).await?;
            store.close().await;
            println!(
                "{kind:<9} seeded {} records in {:.1} s",
                o.list_records,
                t0.elapsed().as_secs_f64()
            );
            let server = Server::start(&db.url, &[])?;
            let chs = server.channels(1).await?;
            let mut client = RecordServiceClient::new(chs[0].clone());
            // A token deep into an unfiltered, ascending listing, as the server would issue it.
            let fp = filter_fingerprint(&crate::domain::model::RecordFilter::default());
            let deep = marks
                .last()
                .map(|(txid, seq)| {
                    PageTokens::new(Some(BENCH_TOKEN_SECRET)).encode(
                        "records@position",
                        &fp,
                        &format!("{txid}{SEP}{seq}"),
                    )
                })
                .unwrap_or_default();
            for (name, token) in [("first page", String::new()), ("deep page", deep)] {
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut errors = 0;
                for _ in 0..300 {
                    let t = Instant::now();
                    match client
                        .list_records(ListRecordsRequest {
                            page_size: 100,
                            page_token: token.clone(),
                            ..Default::default()
                        })
                        .await
                    {
                        Ok(r) if r.get_ref().records.len() == 100 => {
                            lat.push(t.elapsed().as_micros() as u64)
                        }
                        _ => errors += 1,
                    }
                }
                lat.sort_unstable();
                let p = Phase {
                    calls: lat.len(),
                    errors,
                    secs: start.elapsed().as_secs_f64(),
                    lat_us: lat,
                };
                row(&kind, &format!("ListRecords {name}"), &p, None);
            }
            server.stop();
            db.drop_db().await;
        }
        println!();
    }

    if o.retention_records > 0 {
        println!(
            "retention (sqlite): deliveries while {} expired records are pruned",
            o.retention_records
        );
        header();
        let db = BenchDb::create("sqlite", &o, "retention").await?;
        let store = open_store(&db.url).await?;
        seed_policy(&store, o.packs, o.principals).await?;
        seed_records(
            &store,
            o.retention_records,
            now_micros() - 2 * 86_400_000_000,
        )
        .await?;
        store.close().await;
        let server = Server::start(
            &db.url,
            &[
                "--record-retention-secs",
                "86400",
                "--prune-interval-secs",
                "1",
            ],
        )?;
        let chs = server.channels(o.channels).await?;
        let base = closed(&chs, &o, first, o.principals, Load::Noop).await;
        row("sqlite", "baseline (no-op)", &base, None);
        let rec = closed(&chs, &o, first, o.principals, Load::Recorded).await;
        row("sqlite", "recorded while pruning", &rec, Some(&base));
        server.stop();
        let store = open_store(&db.url).await?;
        let left = store
            .connection()
            .query_one_raw(sea_orm::Statement::from_string(
                store.connection().get_database_backend(),
                format!(
                    "SELECT COUNT(*) AS n FROM records WHERE received_time < {}",
                    now_micros() - 86_400_000_000
                ),
            ))
            .await?
            .and_then(|r| r.try_get::<i64>("", "n").ok())
            .unwrap_or(-1);
        println!(
            "expired records left after the phase: {left} of {}",
            o.retention_records
        );
        store.close().await;
        db.drop_db().await;
    }
    if let Some(path) = &o.json {
        let rows = RESULTS.lock().map(|r| r.clone()).unwrap_or_default();
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json!({ "results": rows }))?,
        )?;
    }
    Ok(())
}

/// What the sink did between two scrapes of the server's metrics.
struct Writer {
    per_batch: f64,
    commit_p99_ms: f64,
    us_per_record: f64,
}

impl Writer {
    fn between(
        a: &std::collections::HashMap<String, f64>,
        b: &std::collections::HashMap<String, f64>,
    ) -> Writer {
        let d = |k: &str| b.get(k).copied().unwrap_or(0.0) - a.get(k).copied().unwrap_or(0.0);
        let records = d("hcp_sense_sink_batch_records_sum");
        let batches = d("hcp_sense_sink_batch_records_count");
        let secs = d("hcp_sense_sink_commit_duration_seconds_sum");
        // The 99th percentile's bucket bound, from the bucket counts' deltas.
        let mut buckets: Vec<(f64, f64)> = b
            .keys()
            .filter_map(|k| {
                let le = k
                    .strip_prefix("hcp_sense_sink_commit_duration_seconds_bucket{le=\"")?
                    .strip_suffix("\"}")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, d(k)))
            })
            .collect();
        buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
        let total = buckets.last().map_or(0.0, |x| x.1);
        let p99 = buckets
            .iter()
            .find(|(_, n)| *n >= total * 0.99)
            .map_or(f64::NAN, |(le, _)| *le);
        Writer {
            per_batch: records / batches.max(1.0),
            commit_p99_ms: p99 * 1000.0,
            us_per_record: secs * 1e6 / records.max(1.0),
        }
    }
}

/// Triggers a benchmark stream keeps sent and unanswered.
const STREAM_IN_FLIGHT: usize = 2048;

/// DeliverTriggers: one stream per connection, each sending as fast as the server takes them.
async fn stream(chs: &[Channel], o: &BenchOptions) -> Phase {
    use crate::grpc::pb::DeliverTriggersRequest;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (k, ch) in chs.iter().enumerate() {
        let (ch, stop) = (ch.clone(), stop.clone());
        let (packs, principals, streams) = (o.packs, o.principals, chs.len());
        tasks.push(tokio::spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<DeliverTriggersRequest>(64);
            let sent = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
            // A relay keeps a bounded number of triggers unanswered; latency counts from send.
            let window = Arc::new(tokio::sync::Semaphore::new(STREAM_IN_FLIGHT));
            let feeder = {
                let (stop, sent, window) = (stop.clone(), sent.clone(), window.clone());
                tokio::spawn(async move {
                    let mut i = k;
                    while !stop.load(Ordering::Relaxed) {
                        match window.acquire().await {
                            Ok(p) => p.forget(),
                            Err(_) => break,
                        }
                        let req = DeliverTriggersRequest {
                            trigger: Some(trigger(i, principals, packs, Load::Recorded)),
                        };
                        if let Ok(mut q) = sent.lock() {
                            q.push_back(Instant::now());
                        }
                        if tx.send(req).await.is_err() {
                            break;
                        }
                        i += streams;
                    }
                })
            };
            let (mut lat, mut errors) = (Vec::new(), 0);
            match IngestServiceClient::new(ch)
                .deliver_triggers(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
            {
                Ok(resp) => {
                    let mut answers = resp.into_inner();
                    while let Ok(Some(a)) = answers.message().await {
                        window.add_permits(1);
                        let at = sent.lock().ok().and_then(|mut q| q.pop_front());
                        match (a.result, at) {
                            (
                                Some(crate::grpc::pb::deliver_triggers_response::Result::Outcome(
                                    _,
                                )),
                                Some(t),
                            ) => lat.push(t.elapsed().as_micros() as u64),
                            _ => errors += 1,
                        }
                    }
                }
                Err(_) => errors += 1,
            }
            let _ = feeder.await;
            (lat, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(o.duration_secs)).await;
    stop.store(true, Ordering::Relaxed);
    gather(tasks, start).await
}

/// Recorded throughput at the largest concurrency for each sink writer count, on PostgreSQL
/// reached through a proxy that delays every round trip, as a network between them would.
async fn writers_compare(o: &BenchOptions) -> anyhow::Result<()> {
    let c = o.concurrency.iter().copied().max().unwrap_or(256).max(1);
    println!(
        "sink writers (postgres through a proxy adding {} ms per round trip), C={c}",
        o.postgres_delay_ms
    );
    header();
    let db = BenchDb::create("postgres", o, "writers").await?;
    let store = open_store(&db.url).await?;
    seed_policy(&store, o.packs, o.principals).await?;
    store.close().await;
    let (head, rest) = db
        .url
        .split_once('@')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no user"))?;
    let (upstream, tail) = rest
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("the PostgreSQL URL names no database"))?;
    let proxy = delay_proxy(
        upstream.to_owned(),
        Duration::from_secs_f64(o.postgres_delay_ms / 1000.0),
    )
    .await?;
    let url = format!("{head}@{proxy}/{tail}");
    let mut rates = Vec::new();
    for &w in &o.writers_compare {
        let n = w.to_string();
        let server = Server::start(&url, &["--sink-writers", &n])?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o, c, o.principals, Load::Recorded).await;
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

/// A TCP proxy on an ephemeral port that holds every chunk bound for the database `delay`
/// before passing it on (tokio's timer rounds up to its 1 ms tick), without limiting
/// throughput; answers pass straight back. Returns its address.
async fn delay_proxy(upstream: String, delay: Duration) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(delay_pipe(cr, sw, delay));
                tokio::spawn(delay_pipe(sr, cw, Duration::ZERO));
            });
        }
    });
    Ok(addr)
}

async fn delay_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    one_way: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    tokio::spawn(async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx
                    .send((tokio::time::Instant::now() + one_way, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
}

/// The store's own limit: the same rows inserted into the same schema from this process, 256
/// to a multi-row INSERT and one INSERT to a transaction, on one connection. Returns the
/// microseconds per row.
async fn store_limit(kind: &str, o: &BenchOptions) -> anyhow::Result<f64> {
    let db = BenchDb::create(kind, o, "limit").await?;
    let store = open_store(&db.url).await?;
    let conn = store.connection();
    let sqlite = store.engine() == crate::store::Engine::Sqlite;
    let start = Instant::now();
    let mut n: usize = 0;
    while start.elapsed() < Duration::from_secs(o.duration_secs) {
        let txn = conn.begin().await?;
        let rows: Vec<records::ActiveModel> = (n..n + 256)
            .map(|j| {
                let p = j % o.principals.max(1);
                records::ActiveModel {
                    record_id: Set(uuid::Uuid::now_v7().to_string()),
                    principal: Set(format!("principal-{p}")),
                    binding_id: Set(format!("b-principal-{p}")),
                    land: Set("user".into()),
                    pack_id: Set(format!("pack-{}", p % o.packs.max(1))),
                    r#ref: Set("issue.opened".into()),
                    payload: Set(json!({ "issue": j, "title": "benchmark" }).to_string()),
                    route: Set("inbox".into()),
                    project: Set(None),
                    producer_trigger_id: Set(None),
                    received_time: Set(now_micros()),
                    // PostgreSQL fills both from their defaults, as the sink's insert does.
                    commit_txid: if sqlite {
                        Set(0)
                    } else {
                        sea_orm::ActiveValue::NotSet
                    },
                    seq: if sqlite {
                        Set(j as i64 + 1)
                    } else {
                        sea_orm::ActiveValue::NotSet
                    },
                }
            })
            .collect();
        records::Entity::insert_many(rows)
            .exec_without_returning(&txn)
            .await?;
        txn.commit().await?;
        n += 256;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
    let p = Phase {
        calls: n,
        errors: 0,
        secs: start.elapsed().as_secs_f64(),
        lat_us: vec![us as u64],
    };
    println!(
        "{kind:<9} store limit: {:.0} rows/s, {us:.1} us per row (multi-row INSERT of 256, one per transaction)",
        p.rate()
    );
    result(
        json!({ "store": kind, "phase": "store limit", "rows_per_sec": p.rate(), "us_per_row": us }),
    );
    store.close().await;
    db.drop_db().await;
    Ok(us)
}

/// An OTLP/gRPC receiver that counts the spans it is sent.
#[derive(Clone, Default)]
struct SpanCounter(Arc<std::sync::atomic::AtomicUsize>);

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService
    for SpanCounter
{
    async fn export(
        &self,
        req: tonic::Request<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
        >,
    ) -> Result<
        tonic::Response<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse,
        >,
        tonic::Status,
    > {
        let n: usize = req
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(n, Ordering::Relaxed);
        Ok(tonic::Response::new(Default::default()))
    }
}

/// DeliverTrigger with telemetry fully on (every span exported over OTLP to a
/// local receiver) against off, on one database, in one run.
async fn telemetry_cost(o: &BenchOptions) -> anyhow::Result<()> {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer;
    println!("telemetry (sqlite): OTLP export of every span to a local receiver, against none");
    let first = o.concurrency.first().copied().unwrap_or(32).max(1);
    header();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let counter = SpanCounter::default();
    let svc = TraceServiceServer::new(counter.clone());
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    let db = BenchDb::create("sqlite", o, "telemetry").await?;
    let store = open_store(&db.url).await?;
    seed_policy(&store, o.packs, o.principals).await?;
    store.close().await;
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
        let server = Server::start_env(&db.url, &[], &env)?;
        let chs = server.channels(o.channels).await?;
        let rec = closed(&chs, o, first, o.principals, Load::Recorded).await;
        row("sqlite", &format!("recorded, telemetry {name}"), &rec, None);
        let dropped = closed(&chs, o, first, o.principals, Load::Dropped).await;
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
            counter.0.load(Ordering::Relaxed)
        );
    }
    db.drop_db().await;
    Ok(())
}
