//! The load: triggers as a runtime sends them, driven closed-loop, open-loop or as DeliverTriggers streams.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost_types::{value::Kind, Struct, Value};
use tonic::transport::Channel;

use crate::pb::{
    bench_service_client::BenchServiceClient, deliver_trigger_noop_request,
    deliver_trigger_request, deliver_triggers_response, ingest_service_client::IngestServiceClient,
    DeliverTriggerNoopRequest, DeliverTriggerRequest, DeliverTriggersRequest,
};

/// Latency samples and throughput of one phase.
#[derive(Default)]
pub struct Phase {
    pub calls: usize,
    pub errors: usize,
    pub secs: f64,
    /// Sorted, in microseconds.
    pub lat_us: Vec<u64>,
}

impl Phase {
    pub fn rate(&self) -> f64 {
        self.calls as f64 / self.secs
    }

    /// The `q` quantile of the latencies, in milliseconds.
    pub fn pct(&self, q: f64) -> f64 {
        if self.lat_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_us.len() as f64) * q) as usize;
        self.lat_us[i.min(self.lat_us.len() - 1)] as f64 / 1000.0
    }
}

/// What each call sends.
#[derive(Clone, Copy)]
pub enum Load {
    /// BenchService's no-op: the server's gRPC cost alone.
    Noop,
    /// Granted, bound and activated: recorded.
    Recorded,
    /// Never granted: dropped with no_grant after the pack and ref are found.
    Dropped,
    /// As Recorded, each with a trigger id never sent before: the idempotency ledger's path.
    RecordedKeyed,
    /// As Dropped, each with a trigger id never sent before: the drop looks the id up first.
    DroppedKeyed,
}

/// Trigger ids of the keyed loads: unique within the run (and across runs, by its start).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static RUN: std::sync::OnceLock<u128> = std::sync::OnceLock::new();

/// The shape of the population the load addresses: principal `p` is on pack `p % packs`.
#[derive(Clone, Copy)]
pub struct Population {
    pub packs: usize,
    pub principals: usize,
}

/// The `i`th trigger of a phase.
pub fn trigger(i: usize, pop: Population, load: Load) -> DeliverTriggerRequest {
    let p = i % pop.principals.max(1);
    let principal = match load {
        Load::Dropped | Load::DroppedKeyed => format!("stranger-{p}"),
        _ => format!("principal-{p}"),
    };
    let trigger_id = match load {
        Load::RecordedKeyed | Load::DroppedKeyed => format!(
            "k-{:x}-{}",
            RUN.get_or_init(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_micros())
                    .unwrap_or(0)
            }),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        ),
        _ => String::new(),
    };
    let field = |k: Kind| Value { kind: Some(k) };
    DeliverTriggerRequest {
        pack_id: format!("pack-{}", p % pop.packs.max(1)),
        r#ref: "issue.opened".into(),
        principal,
        land: "user".into(),
        payload_source: Some(deliver_trigger_request::PayloadSource::Payload(Struct {
            fields: [
                ("issue".to_owned(), field(Kind::NumberValue(i as f64))),
                (
                    "title".to_owned(),
                    field(Kind::StringValue("benchmark".into())),
                ),
                (
                    // Read by the filter phase's typical filter.
                    "repository".to_owned(),
                    field(Kind::StructValue(Struct {
                        fields: [
                            ("private".to_owned(), field(Kind::BoolValue(false))),
                            (
                                "full_name".to_owned(),
                                field(Kind::StringValue("acme/widgets".into())),
                            ),
                        ]
                        .into_iter()
                        .collect(),
                    })),
                ),
            ]
            .into_iter()
            .collect(),
        })),
        trigger_id,
        ..Default::default()
    }
}

/// A google.protobuf.Struct as the JSON object it carries.
pub fn json_of_struct(s: Struct) -> serde_json::Value {
    fn json(v: Value) -> serde_json::Value {
        match v.kind {
            Some(Kind::NumberValue(n)) => serde_json::json!(n),
            Some(Kind::StringValue(s)) => serde_json::Value::String(s),
            Some(Kind::BoolValue(b)) => serde_json::Value::Bool(b),
            Some(Kind::StructValue(s)) => json_of_struct(s),
            Some(Kind::ListValue(l)) => l.values.into_iter().map(json).collect(),
            Some(Kind::NullValue(_)) | None => serde_json::Value::Null,
        }
    }
    s.fields.into_iter().map(|(k, v)| (k, json(v))).collect()
}

/// The same trigger in the no-op's message, so both calls weigh the same on the wire.
pub fn noop(t: DeliverTriggerRequest) -> DeliverTriggerNoopRequest {
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

pub async fn call(ch: &Channel, req: DeliverTriggerRequest, load: Load) -> bool {
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
pub async fn closed(
    chs: &[Channel],
    duration: Duration,
    concurrency: usize,
    pop: Population,
    load: Load,
) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let ch = chs[w % chs.len()].clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut errors, mut i) = (Vec::new(), 0, w);
            while !stop.load(Ordering::Relaxed) {
                let req = trigger(i, pop, load);
                let t = Instant::now();
                if call(&ch, req, load).await {
                    lat.push(t.elapsed().as_micros() as u64);
                } else {
                    errors += 1;
                }
                i += concurrency;
            }
            (lat, errors)
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    gather(tasks, start).await
}

/// Open loop at a fixed rate; latency counts from the scheduled start, so queueing shows.
pub async fn open(
    chs: &[Channel],
    duration: Duration,
    pop: Population,
    load: Load,
    rate: f64,
) -> Phase {
    let start = Instant::now();
    let total = (rate * duration.as_secs_f64()) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + gap.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let ch = chs[i % chs.len()].clone();
        tasks.push(tokio::spawn(async move {
            let ok = call(&ch, trigger(i, pop, load), load).await;
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

/// DeliverTriggers: one stream per connection, each keeping `in_flight` triggers sent and
/// unanswered, as a relay does; latency counts from each trigger's send.
pub async fn stream(
    chs: &[Channel],
    duration: Duration,
    pop: Population,
    in_flight: usize,
) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (k, ch) in chs.iter().enumerate() {
        let (ch, stop) = (ch.clone(), stop.clone());
        let streams = chs.len();
        tasks.push(tokio::spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<DeliverTriggersRequest>(64);
            let sent = Arc::new(std::sync::Mutex::new(VecDeque::new()));
            let window = Arc::new(tokio::sync::Semaphore::new(in_flight));
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
                            trigger: Some(trigger(i, pop, Load::Recorded)),
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
                            (Some(deliver_triggers_response::Result::Outcome(_)), Some(t)) => {
                                lat.push(t.elapsed().as_micros() as u64)
                            }
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
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    gather(tasks, start).await
}
