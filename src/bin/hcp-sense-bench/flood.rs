//! The flood phase: one pack floods while a quiet pack delivers at a steady pace, measured against gRPC Health on the same server at the same moment, and ten packs flooding at once.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tonic::transport::Channel;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
use tonic_types::StatusExt;

use crate::load::{trigger, Load, Population};
use crate::pb::ingest_service_client::IngestServiceClient;
use crate::probe::{self, Probed};
use crate::report::result;
use crate::seed::prepare;
use crate::server::Server;
use crate::{bin, cpu, h2load, pb, Options};

/// One paced series: `Phase`'s latencies (sorted, µs) and errors; its `pct` reads them.
pub use crate::load::Phase as Paced;

/// The `n`th trigger of `pack` (principal `pack + packs·k` is on pack `pack`), with an id of
/// its own so every one is a new record.
pub fn of_pack(
    pack: usize,
    n: usize,
    pop: Population,
    tag: &str,
) -> crate::pb::DeliverTriggerRequest {
    let per_pack = (pop.principals / pop.packs.max(1)).max(1);
    let i = pack + pop.packs * (n % per_pack);
    let mut t = trigger(i, pop, Load::Recorded);
    t.trigger_id = format!("{tag}-{pack}-{n}");
    t
}

/// What a paced series calls.
#[derive(Clone, Copy)]
pub enum Call {
    /// The pack's DeliverTrigger.
    Deliver(usize),
    /// The same trigger to BenchService's no-op: decoded and answered, nothing decided or
    /// written: the call's way through the server without the sink.
    Noop(usize),
    Health,
}

impl From<Option<usize>> for Call {
    fn from(pack: Option<usize>) -> Call {
        pack.map_or(Call::Health, Call::Deliver)
    }
}

/// A call every `every` until `stop`, each on its own (open loop: a slow answer does not
/// delay the next call): a quiet pack's DeliverTrigger (`pack` Some) or Health/Check (None).
/// Latency counts from each call's scheduled start.
pub async fn paced(
    ch: Channel,
    pack: impl Into<Call>,
    pop: Population,
    every: Duration,
    stop: Arc<AtomicBool>,
    tag: String,
) -> Paced {
    let pack = pack.into();
    let start = Instant::now();
    let mut calls = Vec::new();
    for n in 0.. {
        let due = start + every.mul_f64(n as f64);
        tokio::time::sleep_until(due.into()).await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let (ch, tag) = (ch.clone(), tag.clone());
        calls.push(tokio::spawn(async move {
            let ok = match pack {
                Call::Deliver(p) => IngestServiceClient::new(ch)
                    .deliver_trigger(of_pack(p, n, pop, &tag))
                    .await
                    .is_ok(),
                Call::Noop(p) => crate::load::call(&ch, of_pack(p, n, pop, &tag), Load::Noop).await,
                Call::Health => HealthClient::new(ch)
                    .check(HealthCheckRequest::default())
                    .await
                    .is_ok(),
            };
            ok.then(|| due.elapsed().as_micros() as u64)
        }));
    }
    let (mut lat, mut errors) = (Vec::new(), 0);
    for c in calls {
        match c.await {
            Ok(Some(us)) => lat.push(us),
            _ => errors += 1,
        }
    }
    lat.sort_unstable();
    Paced {
        calls: lat.len(),
        errors,
        secs: start.elapsed().as_secs_f64(),
        lat_us: lat,
    }
}

/// Health/Check every `every` until `stop`, on the last of `chs` (the quiet pack's calls go
/// on the first).
pub fn health_every(
    chs: &[Channel],
    pop: Population,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Paced> {
    tokio::spawn(paced(
        chs[chs.len() - 1].clone(),
        None,
        pop,
        every,
        stop,
        String::new(),
    ))
}

/// The pack of flooding caller `w` among `spread` packs, as many callers on each.
fn pack_of(w: usize, spread: usize) -> usize {
    w % spread.max(1)
}

/// Closed-loop callers flooding (`pack_of`), until `stop`; returns recorded triggers per pack,
/// errors, and the calls refused over a quota with RetryInfo (sent again at once: a producer
/// that ignores the delay it is told).
async fn flood(
    chs: &[Channel],
    callers: usize,
    spread: usize,
    pop: Population,
    stop: Arc<AtomicBool>,
    tag: &str,
) -> (HashMap<usize, usize>, usize, usize) {
    let mut tasks = Vec::new();
    for w in 0..callers {
        let mut ingest = IngestServiceClient::new(chs[w % chs.len()].clone());
        let (stop, tag) = (stop.clone(), format!("{tag}-{w}"));
        let pack = pack_of(w, spread);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut refused) = (0, 0, 0);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                match ingest.deliver_trigger(of_pack(pack, n, pop, &tag)).await {
                    Ok(_) => {
                        ok += 1;
                        n += 1;
                    }
                    // The same trigger again: refused, it was not recorded.
                    Err(s)
                        if s.code() == tonic::Code::ResourceExhausted
                            && s.get_details_retry_info().is_some() =>
                    {
                        refused += 1
                    }
                    Err(_) => {
                        errors += 1;
                        n += 1;
                    }
                }
            }
            (pack, ok, errors, refused)
        }));
    }
    let mut per: HashMap<usize, usize> = HashMap::new();
    let (mut errors, mut refused) = (0, 0);
    for t in tasks {
        if let Ok((pack, ok, e, r)) = t.await {
            *per.entry(pack).or_default() += ok;
            errors += e;
            refused += r;
        }
    }
    (per, errors, refused)
}

/// What one flood run measured.
pub struct Measured {
    pub quiet: Paced,
    /// The quiet pack's trigger to the no-op, beside it on the same connection.
    pub noop: Paced,
    pub health: Paced,
    /// Recorded per second per flooding pack.
    pub rates: HashMap<usize, f64>,
    pub errors: usize,
    /// Calls refused over a quota, with RetryInfo, per second.
    pub refused_per_sec: f64,
    /// Recorded triggers in all.
    pub recorded: usize,
}

/// Runs for `duration`: `callers` flooding `spread` packs (`pack_of`; none when 0),
/// with pack `quiet` (not flooded, when given) delivering and Health/Check called, each
/// every 20 ms.
pub async fn run(
    chs: &[Channel],
    duration: Duration,
    callers: usize,
    spread: usize,
    quiet: Option<usize>,
    pop: Population,
    tag: &str,
) -> Measured {
    let stop = Arc::new(AtomicBool::new(false));
    let every = Duration::from_millis(20);
    let q = quiet.map(|quiet| {
        tokio::spawn(paced(
            chs[0].clone(),
            Some(quiet),
            pop,
            every,
            stop.clone(),
            format!("{tag}-quiet"),
        ))
    });
    let noop = quiet.map(|quiet| {
        tokio::spawn(paced(
            chs[0].clone(),
            Call::Noop(quiet),
            pop,
            every,
            stop.clone(),
            format!("{tag}-noop"),
        ))
    });
    let h = health_every(chs, pop, every, stop.clone());
    let started = Instant::now();
    let f = {
        let (chs, stop, tag) = (chs.to_vec(), stop.clone(), tag.to_owned());
        tokio::spawn(async move { flood(&chs, callers, spread, pop, stop, &tag).await })
    };
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let (per, errors, refused) = f.await.unwrap_or_default();
    let secs = started.elapsed().as_secs_f64();
    Measured {
        quiet: match q {
            Some(q) => q.await.unwrap_or_default(),
            None => Paced::default(),
        },
        noop: match noop {
            Some(q) => q.await.unwrap_or_default(),
            None => Paced::default(),
        },
        health: h.await.unwrap_or_default(),
        recorded: per.values().sum(),
        rates: per.into_iter().map(|(p, n)| (p, n as f64 / secs)).collect(),
        errors,
        refused_per_sec: refused as f64 / secs,
    }
}

/// Two replicas on one store: what one replica's flood does to a quiet pack and to Health on
/// that replica and on the other.
pub struct Replicas {
    /// The quiet pack and Health on the replica taking the flood.
    pub quiet_flooded: Paced,
    pub health_flooded: Paced,
    /// The same on the other replica.
    pub quiet_other: Paced,
    pub health_other: Paced,
    /// Recorded per second by the flood.
    pub flood_rate: f64,
    pub errors: usize,
}

/// Runs for `duration`: `callers` flooding pack 0 on `flooded`, pack `quiet` delivering and
/// Health called every 20 ms on each replica.
pub async fn run_replicas(
    flooded: &[Channel],
    other: &Channel,
    duration: Duration,
    callers: usize,
    quiet: usize,
    pop: Population,
    tag: &str,
) -> Replicas {
    let stop = Arc::new(AtomicBool::new(false));
    let every = Duration::from_millis(20);
    let pace = |ch: &Channel, pack: Option<usize>, name: &str| {
        tokio::spawn(paced(
            ch.clone(),
            pack,
            pop,
            every,
            stop.clone(),
            format!("{tag}-{name}"),
        ))
    };
    let qa = pace(&flooded[0], Some(quiet), "quiet-a");
    let ha = pace(&flooded[flooded.len() - 1], None, "health-a");
    let qb = pace(other, Some(quiet), "quiet-b");
    let hb = pace(other, None, "health-b");
    let started = Instant::now();
    let f = {
        let (chs, stop, tag) = (flooded.to_vec(), stop.clone(), tag.to_owned());
        tokio::spawn(async move { flood(&chs, callers, 1, pop, stop, &tag).await })
    };
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let (per, errors, _) = f.await.unwrap_or_default();
    let secs = started.elapsed().as_secs_f64();
    let got = |h: tokio::task::JoinHandle<Paced>| async move {
        h.await.unwrap_or_else(|_| Paced {
            calls: 0,
            errors: 1,
            secs: 0.0,
            lat_us: Vec::new(),
        })
    };
    Replicas {
        quiet_flooded: got(qa).await,
        health_flooded: got(ha).await,
        quiet_other: got(qb).await,
        health_other: got(hb).await,
        flood_rate: per.get(&0).copied().unwrap_or(0) as f64 / secs,
        errors,
    }
}

/// Closed-loop callers sending `make(caller, n)` until `duration` is over: every answer per
/// second (recorded, dropped, or refused over a quota with RetryInfo), and the errors besides.
/// `to` Load::Noop sends each to BenchService's no-op instead: the transport's answer alone.
pub async fn answers(
    chs: &[Channel],
    (duration, callers): (Duration, usize),
    make: fn(usize, usize, Population) -> crate::pb::DeliverTriggerRequest,
    pop: Population,
    to: Load,
) -> (f64, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..callers {
        let ch = chs[w % chs.len()].clone();
        let mut ingest = IngestServiceClient::new(ch.clone());
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let (mut answered, mut errors, mut n) = (0usize, 0usize, 0usize);
            while !stop.load(Ordering::Relaxed) {
                if matches!(to, Load::Noop) {
                    if crate::load::call(&ch, make(w, n, pop), Load::Noop).await {
                        answered += 1;
                    } else {
                        errors += 1;
                    }
                    n += 1;
                    continue;
                }
                match ingest.deliver_trigger(make(w, n, pop)).await {
                    Ok(_) => answered += 1,
                    Err(s)
                        if s.code() == tonic::Code::ResourceExhausted
                            && s.get_details_retry_info().is_some() =>
                    {
                        answered += 1
                    }
                    Err(_) => errors += 1,
                }
                n += 1;
            }
            (answered, errors)
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let (mut answered, mut errors) = (0, 0);
    for t in tasks {
        if let Ok((a, e)) = t.await {
            answered += a;
            errors += e;
        }
    }
    (answered as f64 / start.elapsed().as_secs_f64(), errors)
}

/// A trigger of pack 0 for a principal never granted (dropped as no_grant), `id`: with a
/// trigger id of its own.
pub fn dropped(w: usize, n: usize, pop: Population, id: bool) -> crate::pb::DeliverTriggerRequest {
    let mut t = trigger(pop.packs * (w + n * 1024), pop, Load::Dropped);
    t.pack_id = "pack-0".into();
    if id {
        t.trigger_id = format!("drop-{w}-{n}");
    }
    t
}

/// A trigger of pack 0 for a principal granted on it, `id`: with a trigger id of its own.
pub fn of_pack_0(
    w: usize,
    n: usize,
    pop: Population,
    id: bool,
) -> crate::pb::DeliverTriggerRequest {
    let mut t = of_pack(0, w * 1_000_000 + n, pop, "refuse");
    if !id {
        t.trigger_id.clear();
    }
    t
}

/// Means of the sink's metrics between two scrapes: what a pack's records waited in the queue,
/// and the batches committed meanwhile.
pub struct SinkDuring {
    pub quiet_wait_ms: f64,
    /// From the quiet record's commit until its call ran again on the server's runtime.
    pub quiet_resume_ms: f64,
    pub batch_records: f64,
    pub commit_ms: f64,
}

impl SinkDuring {
    pub fn between(
        before: &HashMap<String, f64>,
        after: &HashMap<String, f64>,
        pack: &str,
    ) -> SinkDuring {
        let delta =
            |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
        let mean = |sum: &str, count: &str| delta(sum) / delta(count).max(1.0);
        let waited =
            |suffix: &str| format!("hcp_sense_sink_queue_wait_seconds_{suffix}{{pack=\"{pack}\"}}");
        SinkDuring {
            quiet_wait_ms: 1e3 * mean(&waited("sum"), &waited("count")),
            quiet_resume_ms: {
                let resumed = |suffix: &str| {
                    format!("hcp_sense_sink_resume_wait_seconds_{suffix}{{pack=\"{pack}\"}}")
                };
                1e3 * mean(&resumed("sum"), &resumed("count"))
            },
            batch_records: mean(
                "hcp_sense_sink_batch_records_sum",
                "hcp_sense_sink_batch_records_count",
            ),
            commit_ms: 1e3
                * mean(
                    "hcp_sense_sink_commit_duration_seconds_sum",
                    "hcp_sense_sink_commit_duration_seconds_count",
                ),
        }
    }
}

/// Fairness across two replicas on one PostgreSQL: one replica flooded (pack 0), the quiet pack
/// (pack 1) and Health measured on both at once.
pub async fn flood_replicas_phase(o: &Options) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, "postgres", "flood2", pop, &[]).await?;
    let other = Server::start(bin(o), &db.url, &[])?;
    let flooded = server.channels(o.channels).await?;
    let beside = other.channels(1).await?;
    let c = o.flood_callers;
    let r = run_replicas(&flooded, &beside[0], o.duration(), c, 1, pop, "replicas").await;
    let ratio = |q: &Paced, h: &Paced, p: f64| q.pct(p) / h.pct(p).max(1e-9);
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

/// Fairness on one store: pack 1 delivering every 20 ms beside Health/Check, with no flood and
/// while pack 0 floods, from this process and then from a probe process (`probed_flood`);
/// pack 0's rate alone and beside it; up to ten packs flooding at once, with as many callers
/// each. Then quotas (`quota_phase`).
pub async fn flood_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "flood", pop, &[]).await?;
    let chs = server.channels(o.channels).await?;
    let (d, c) = (o.duration(), o.flood_callers);
    anyhow::ensure!(pop.packs >= 2, "the flood phase needs --packs 2 or more");
    let spread = pop.packs.min(10);
    let calm = run(&chs, d, 0, 1, Some(1), pop, "calm").await;
    let alone = run(&chs, d, c, 1, None, pop, "alone").await;
    let scraped = server.scrape().await;
    let during = run(&chs, d, c, 1, Some(1), pop, "during").await;
    let sink = SinkDuring::between(&scraped, &server.scrape().await, "pack-1");
    let ten = run(&chs, d, c, spread, None, pop, "ten").await;
    let rate = |m: &Measured| m.rates.get(&0).copied().unwrap_or(0.0);
    let (q, h) = (&during.quiet, &during.health);
    println!(
        "{kind:<9} flood, measured in this process: quiet pack alone p50 {:.1} / p99 {:.1} ms; Health alone {:.1} / {:.1} ms",
        calm.quiet.pct(0.5),
        calm.quiet.pct(0.99),
        calm.health.pct(0.5),
        calm.health.pct(0.99)
    );
    println!(
        "{kind:<9} flood, measured in this process beside its own {c} callers on one pack: quiet pack p50 {:.1} / p99 {:.1} ms, Health {:.1} / {:.1} ms: {:.2}x / {:.2}x Health's ({} quiet errors)",
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
    let probed = probed_flood(o, &server, &chs, pop).await?;
    print_probed(kind, c, &probed);
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
    for (k, v) in probed_json(&probed).as_object().into_iter().flatten() {
        flooded[k] = v.clone();
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
pub struct Flooding<'a> {
    pub server: &'a Server,
    pub chs: &'a [Channel],
    pub kind: &'a str,
    pub duration: Duration,
    pub callers: usize,
    pub pop: Population,
}

/// Quotas on one store: what a refusal costs against a drop (the same callers, each sent
/// again at once), with the no-op as the floor under both, and a quota of a quarter of
/// `alone` (the flooding pack's rate alone) held while it floods beside the quiet pack. Each
/// with the CPU the server (and PostgreSQL) spent per answer: the cost on the service's side,
/// apart from the client's, which shares these cores.
pub async fn quota_phase(f: &Flooding<'_>, alone: f64) -> anyhow::Result<serde_json::Value> {
    let (server, chs, kind, pop) = (f.server, f.chs, f.kind, f.pop);
    let (d, c) = (f.duration, f.callers);
    let pid = server.pid();
    let costed = |m: fn(usize, usize, Population) -> pb::DeliverTriggerRequest| {
        let chs = &chs;
        async move {
            let before = cpu::sample(pid);
            let started = Instant::now();
            let (per_sec, errors) = answers(chs, (d, c), m, pop, Load::Recorded).await;
            let calls = (per_sec * started.elapsed().as_secs_f64()) as usize;
            let cost = before.per_call(&cpu::sample(pid), calls);
            (per_sec, errors, cost.server + cost.postgres)
        }
    };
    // The floor under both: the same triggers to the no-op, which only decodes and answers.
    let noop = {
        let before = cpu::sample(pid);
        let started = Instant::now();
        let dropped = |w, n, p| dropped(w, n, p, false);
        let (per_sec, errors) = answers(chs, (d, c), dropped, pop, Load::Noop).await;
        let calls = (per_sec * started.elapsed().as_secs_f64()) as usize;
        (
            per_sec,
            errors,
            before.per_call(&cpu::sample(pid), calls).server,
        )
    };
    let drops = [
        costed(|w, n, p| dropped(w, n, p, false)).await,
        costed(|w, n, p| dropped(w, n, p, true)).await,
    ];
    let mut admin = pb::policy_service_client::PolicyServiceClient::new(chs[0].clone());
    admin.put_quota(pack_0_quota(0.001, 1)).await?;
    let refusals = [
        costed(|w, n, p| of_pack_0(w, n, p, false)).await,
        costed(|w, n, p| of_pack_0(w, n, p, true)).await,
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
pub fn pack_0_quota(rate: f64, burst: u32) -> pb::PutQuotaRequest {
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
pub async fn quota_held(f: &Flooding<'_>, alone: f64) -> anyhow::Result<serde_json::Value> {
    let (server, chs, kind, pop) = (f.server, f.chs, f.kind, f.pop);
    let (d, c) = (f.duration, f.callers);
    let mut admin = pb::policy_service_client::PolicyServiceClient::new(chs[0].clone());
    let limit = (alone * 0.25).round().max(100.0);
    let before = server.scrape().await;
    admin
        .put_quota(pack_0_quota(limit, (limit / 10.0).ceil() as u32))
        .await?;
    let held = run(chs, d, c, 1, Some(1), pop, "quota").await;
    let after = server.scrape().await;
    admin
        .delete_quota(pb::DeleteQuotaRequest {
            pack_id: "pack-0".into(),
            principal: None,
        })
        .await?;
    // What the server counted for pack 0 meanwhile: decided as recorded or dropped.
    let counted = |disposition: &str| deliveries(&before, &after, "pack-0", disposition);
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

/// Triggers of `pack` the server counted as decided `disposition` (or any disposition it
/// begins: `recorded`) between two scrapes.
pub fn deliveries(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    pack: &str,
    disposition: &str,
) -> f64 {
    let (pack, disposition) = (
        format!(r#"pack="{pack}""#),
        // A prefix: "recorded" counts both routes (`recorded_inbox`, `recorded_silent`).
        format!(r#"disposition="{disposition}"#),
    );
    after
        .iter()
        .filter(|(k, _)| {
            k.starts_with("hcp_sense_deliveries_total{")
                && k.contains(&pack)
                && k.contains(&disposition)
        })
        .map(|(k, v)| v - before.get(k).copied().unwrap_or(0.0))
        .sum()
}

/// Seconds the flood runs before the probe starts, so that the probe meets it at full rate; and
/// h2load, told its span up front, as long again after the probe's, so that the probe's span ends
/// inside the flood whatever the probe process takes to start (the tonic callers stop when the
/// probe is done).
const RAMP_SECS: u64 = 1;

/// The client that flooded beside the probe, and what it counted.
pub struct Flooder {
    /// "h2load", or "tonic": this process's callers.
    pub client: &'static str,
    pub connections: usize,
    /// Callers on each connection (tonic: rounded up).
    pub streams: usize,
    /// Answers a second as the client counts them. h2load: every HTTP 200 over its measured
    /// span, a gRPC error in the trailers included (it reads no trailers); tonic: every
    /// recorded trigger over the whole flood.
    pub per_sec: f64,
    /// h2load: failed, errored, timed out or not 2xx; tonic: errors.
    pub errors: u64,
}

/// Health/Check and the quiet pack measured by the probe process, idle and beside a flood of
/// pack 0.
pub struct ProbedFlood {
    pub idle: Probed,
    pub during: Probed,
    pub flooder: Flooder,
    /// Pack 0's triggers the server counted as recorded, a second of the whole flood.
    pub counted_per_sec: f64,
    /// The server's own account of the quiet pack's records and the batches beside them.
    pub sink: SinkDuring,
}

/// The quiet pack (pack 1) and Health/Check, each every 20 ms, measured by a probe process of
/// its own: for `--duration-secs` alone, then as long while `--flood-callers` flood pack 0 —
/// from h2load when it is on PATH (and `--flood-h2load`), else from this process's tonic
/// callers on `chs`. Health beside the flood over Health alone is what the flood, and the
/// client driving it on the same cores, costs the floor.
pub async fn probed_flood(
    o: &Options,
    server: &Server,
    chs: &[Channel],
    pop: Population,
) -> anyhow::Result<ProbedFlood> {
    let (secs, callers, addr) = (o.duration_secs, o.flood_callers, server.addr.as_str());
    let idle = probe::spawn(addr, pop, 1, (secs, 20), "probe-idle").await?;
    let before = server.scrape().await;
    let started = Instant::now();
    let (during, flooder) = match o.flood_h2load.then(h2load::find).flatten() {
        Some(exe) => {
            let mut req = of_pack(0, 0, pop, "");
            // No trigger id: every call a new record (a repeated id is answered as a duplicate).
            req.trigger_id.clear();
            let flood = h2load::Flood::start(
                &exe,
                addr,
                &req,
                (callers, o.channels),
                (RAMP_SECS, secs + RAMP_SECS),
            )?;
            let (connections, streams) = (flood.connections, flood.streams);
            tokio::time::sleep(Duration::from_secs(RAMP_SECS)).await;
            let during = probe::spawn(addr, pop, 1, (secs, 20), "probe-during").await;
            let s = flood.finish().await?;
            let flooder = Flooder {
                client: "h2load",
                connections,
                streams,
                per_sec: s.per_sec,
                errors: s.failed + s.not_2xx,
            };
            (during, flooder)
        }
        None => {
            let stop = Arc::new(AtomicBool::new(false));
            let f = {
                let (chs, stop) = (chs.to_vec(), stop.clone());
                tokio::spawn(async move { flood(&chs, callers, 1, pop, stop, "probed").await })
            };
            tokio::time::sleep(Duration::from_secs(RAMP_SECS)).await;
            let during = probe::spawn(addr, pop, 1, (secs, 20), "probe-during").await;
            stop.store(true, Ordering::Relaxed);
            let (per, errors, _) = f.await.unwrap_or_default();
            let flooder = Flooder {
                client: "tonic",
                connections: chs.len(),
                streams: callers.div_ceil(chs.len().max(1)),
                per_sec: per.get(&0).copied().unwrap_or(0) as f64 / started.elapsed().as_secs_f64(),
                errors: errors as u64,
            };
            (during, flooder)
        }
    };
    // The server's own count cross-checks the client's: h2load counts a gRPC error as an
    // answer. Over the whole flood, ramps included, as the counter cannot tell them apart.
    let after = server.scrape().await;
    let counted = deliveries(&before, &after, "pack-0", "recorded");
    Ok(ProbedFlood {
        sink: SinkDuring::between(&before, &after, "pack-1"),
        idle,
        during: during?,
        flooder,
        counted_per_sec: counted / started.elapsed().as_secs_f64(),
    })
}

/// Prints what the probe process measured on `kind`, against the goals: the quiet pack within
/// 3× (p50) and 2× (p99) of Health/Check's during the same flood, Health near its idle value.
fn print_probed(kind: &str, callers: usize, p: &ProbedFlood) {
    let (hi, hf, qi, qf) = (
        &p.idle.health,
        &p.during.health,
        &p.idle.quiet,
        &p.during.quiet,
    );
    println!(
        "{kind:<9} flood, measured by a probe process of its own (each every 20 ms): Health idle p50 {:.1} / p99 {:.1} ms, during the flood {:.1} / {:.1} ms: {:.2}x / {:.2}x idle (the floor under the flood)",
        hi.p50, hi.p99, hf.p50, hf.p99, hf.p50 / hi.p50, hf.p99 / hi.p99
    );
    println!(
        "{kind:<9} flood, measured by the probe: quiet pack idle p50 {:.1} / p99 {:.1} ms, during the flood {:.1} / {:.1} ms: {:.2}x / {:.2}x Health's during the flood (goals 3x / 2x); {} probe errors",
        qi.p50, qi.p99, qf.p50, qf.p99, qf.p50 / hf.p50, qf.p99 / hf.p99,
        hi.errors + hf.errors + qi.errors + qf.errors
    );
    let s = &p.sink;
    println!(
        "{kind:<9} flood, where the probe's quiet records went (the server's metrics, means): {:.2} ms in the sink's queue, {:.2} ms from their commit until their calls ran again; the flood's batches {:.0} records committing in {:.2} ms",
        s.quiet_wait_ms, s.quiet_resume_ms, s.batch_records, s.commit_ms
    );
    let f = &p.flooder;
    match f.client {
        "h2load" => println!(
            "{kind:<9} flood beside the probe: h2load, {} connections x {} streams on pack 0: {:.0} answers/s as h2load counts them (every HTTP 200, a gRPC error in the trailers included), {:.0} recorded/s as the server counted them; {} h2load failures",
            f.connections, f.streams, f.per_sec, p.counted_per_sec, f.errors
        ),
        _ => println!(
            "{kind:<9} flood beside the probe: this process's {callers} tonic callers on pack 0 (no h2load): {:.0} recorded/s, {:.0}/s as the server counted them; {} errors",
            f.per_sec, p.counted_per_sec, f.errors
        ),
    }
}

/// What the probe process measured, for `--json`: the ratios against the goals flat, both
/// series of each run in full.
fn probed_json(p: &ProbedFlood) -> serde_json::Value {
    let (hi, hf, qf) = (&p.idle.health, &p.during.health, &p.during.quiet);
    json!({
        "probe_idle_health_p50_ms": hi.p50, "probe_idle_health_p99_ms": hi.p99,
        "probe_flood_health_p50_ms": hf.p50, "probe_flood_health_p99_ms": hf.p99,
        "probe_idle_quiet_p50_ms": p.idle.quiet.p50, "probe_idle_quiet_p99_ms": p.idle.quiet.p99,
        "probe_flood_quiet_p50_ms": qf.p50, "probe_flood_quiet_p99_ms": qf.p99,
        "probe_quiet_over_health_p50": qf.p50 / hf.p50,
        "probe_quiet_over_health_p99": qf.p99 / hf.p99,
        "probe_health_flood_over_idle_p50": hf.p50 / hi.p50,
        "probe_health_flood_over_idle_p99": hf.p99 / hi.p99,
        "probe_flood_client": p.flooder.client,
        "probe_flood_connections": p.flooder.connections,
        "probe_flood_streams": p.flooder.streams,
        "probe_flood_per_sec": p.flooder.per_sec,
        "probe_flood_counted_per_sec": p.counted_per_sec,
        "probe_flood_errors": p.flooder.errors,
        "probe_quiet_queue_wait_ms": p.sink.quiet_wait_ms,
        "probe_quiet_resume_wait_ms": p.sink.quiet_resume_ms,
        "probe_batch_records_mean": p.sink.batch_records,
        "probe_commit_ms_mean": p.sink.commit_ms,
        "probe": { "idle": p.idle.to_json(), "flood": p.during.to_json() },
    })
}
