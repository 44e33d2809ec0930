//! The flood phase: one pack floods while a quiet pack delivers at a steady pace, measured against gRPC Health on the same server at the same moment, and ten packs flooding at once.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
use tonic_types::StatusExt;

use crate::load::{trigger, Load, Population};
use crate::pb::ingest_service_client::IngestServiceClient;

/// One paced series: `Phase`'s latencies (sorted, µs) and errors; its `pct` reads them.
pub use crate::load::Phase as Paced;

/// The `n`th trigger of `pack` (principal `pack + packs·k` is on pack `pack`), with an id of
/// its own so every one is a new record.
fn of_pack(pack: usize, n: usize, pop: Population, tag: &str) -> crate::pb::DeliverTriggerRequest {
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
