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
    /// Concurrent callers.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
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
                match line.split("addr=").nth(1) {
                    Some(a) => {
                        let _ = tx.send(a.split_whitespace().next().unwrap_or("").to_owned());
                    }
                    // The server's own log lines go to stderr.
                    None => eprintln!("{line}"),
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120))?;
        Ok(Server { child, addr })
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
async fn closed(chs: &[Channel], o: &BenchOptions, principals: usize, load: Load) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..o.concurrency {
        let ch = chs[w % chs.len()].clone();
        let stop = stop.clone();
        let (packs, conc) = (o.packs, o.concurrency);
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

/// Inserts `n` records received at `base` + i microseconds; returns the (time, id) of each 100,000th.
async fn seed_records(store: &Store, n: usize, base: i64) -> anyhow::Result<Vec<(i64, String)>> {
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
                        marks.push((t, id.clone()));
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
        "hcp-sense bench {}: {} s per phase, {} callers over {} HTTP/2 connections, {} packs, {} principals, {} cores",
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
    header();
    for kind in o.stores.clone() {
        let db = BenchDb::create(&kind, &o, "deliver").await?;
        let store = open_store(&db.url).await?;
        seed_policy(&store, o.packs, o.principals).await?;
        store.close().await;
        let server = Server::start(&db.url, &[])?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (idle_rss, _) = server.rss_kib();
        let chs = server.channels(o.channels).await?;
        let base = closed(&chs, &o, o.principals, Load::Noop).await;
        row(&kind, "baseline (no-op)", &base, None);
        let rec = closed(&chs, &o, o.principals, Load::Recorded).await;
        row(&kind, "recorded", &rec, Some(&base));
        let dropped = closed(&chs, &o, o.principals, Load::Dropped).await;
        row(&kind, "dropped", &dropped, Some(&base));
        let half = rec.rate().min(base.rate()) * 0.5;
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
            "{kind:<9} p99 at half of the recorded peak: {:.2} x the baseline's p99",
            rec_half.pct(0.99) / base_half.pct(0.99)
        );
        let (_, peak) = server.rss_kib();
        println!(
            "{kind:<9} server RSS: idle {:.1} MiB, peak {:.1} MiB\n",
            idle_rss as f64 / 1024.0,
            peak as f64 / 1024.0
        );
        server.stop();
        db.drop_db().await;
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
            let rec = closed(&chs, &o, *n, Load::Recorded).await;
            row("sqlite", &format!("recorded, {n} principals"), &rec, None);
            let dropped = closed(&chs, &o, *n, Load::Dropped).await;
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
                .map(|(t, id)| {
                    PageTokens::new(Some(BENCH_TOKEN_SECRET)).encode(
                        "records",
                        &fp,
                        &format!("{t}{SEP}{id}"),
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
        let base = closed(&chs, &o, o.principals, Load::Noop).await;
        row("sqlite", "baseline (no-op)", &base, None);
        let rec = closed(&chs, &o, o.principals, Load::Recorded).await;
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
    Ok(())
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
        let rec = closed(&chs, o, o.principals, Load::Recorded).await;
        row("sqlite", &format!("recorded, telemetry {name}"), &rec, None);
        let dropped = closed(&chs, o, o.principals, Load::Dropped).await;
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
