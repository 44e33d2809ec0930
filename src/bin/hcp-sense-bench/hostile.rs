//! The hostile-payload phase: the costliest payload schema lint accepts, fed the worst payload by closed-loop callers, against Health/Check and a quiet pack's DeliverTrigger measured idle and meanwhile on the same server.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost_types::{value::Kind, Struct, Value};
use serde_json::json;
use tonic::transport::Channel;

use crate::flood::{health_every, paced, Paced};
use crate::load::Population;
use crate::pb::ingest_service_client::IngestServiceClient;
use crate::pb::pack_service_client::PackServiceClient;
use crate::pb::{
    deliver_trigger_request, lint_pack_request, register_pack_request, DeliverTriggerRequest,
    LintPackRequest, RegisterPackRequest,
};
use crate::report::result;
use crate::seed::prepare;
use crate::Options;

/// The hostile pack's id.
const PACK: &str = "hostile";

/// The manifest of the hostile pack: `issue.opened` whose payload's `text` must match
/// `pattern`.
fn manifest(pattern: &str) -> String {
    json!({
        "id": PACK,
        "stimulusTriggers": [{
            "ref": "issue.opened",
            "payloadSchema": {
                "type": "object",
                "properties": { "text": { "type": "string", "pattern": pattern } }
            }
        }],
        "policy": { "stimuli": [{ "ref": "issue.opened", "operation": "read", "land": "user" }] },
        "binding": { "mode": "user", "hub": "bench" }
    })
    .to_string()
}

/// `a[ab]{n}c`: its DFA has about 2^n states, so past a few dozen the lazy DFA gives up and
/// the match runs on the NFA, whose cost per byte grows with n.
fn pattern(n: usize) -> String {
    format!("a[ab]{{{n}}}c")
}

/// The largest `n` whose pattern the server's lint accepts, by bisection over LintPack (its
/// bound is reckoned at the server's payload limit).
pub async fn worst_accepted(ch: &Channel) -> anyhow::Result<usize> {
    let mut packs = PackServiceClient::new(ch.clone());
    let accepted = |n: usize| {
        let text = manifest(&pattern(n));
        let mut packs = packs.clone();
        async move {
            let r = packs
                .lint_pack(LintPackRequest {
                    source: Some(lint_pack_request::Source::ManifestText(text)),
                })
                .await?
                .into_inner();
            anyhow::Ok(r.valid)
        }
    };
    let (mut lo, mut hi) = (1usize, 4096usize);
    anyhow::ensure!(accepted(lo).await?, "lint refuses even {}", pattern(lo));
    if accepted(hi).await? {
        return Ok(hi);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if accepted(mid).await? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    packs
        .register_pack(RegisterPackRequest {
            source: Some(register_pack_request::Source::ManifestText(manifest(
                &pattern(lo),
            ))),
        })
        .await?;
    Ok(lo)
}

/// The worst payload for the pattern: `text` of random a's and b's (no `c`, so every start
/// scans to the end; random, so the lazy DFA meets new states all along), the payload within
/// `max_bytes` of JSON.
pub fn worst_payload(max_bytes: usize) -> DeliverTriggerRequest {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let text: String = (0..max_bytes.saturating_sub(64))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x & 1 == 0 {
                'a'
            } else {
                'b'
            }
        })
        .collect();
    DeliverTriggerRequest {
        pack_id: PACK.into(),
        r#ref: "issue.opened".into(),
        principal: "principal-0".into(),
        land: "user".into(),
        payload_source: Some(deliver_trigger_request::PayloadSource::Payload(Struct {
            fields: [(
                "text".to_owned(),
                Value {
                    kind: Some(Kind::StringValue(text)),
                },
            )]
            .into(),
        })),
        ..Default::default()
    }
}

/// What the hostile callers were answered, by gRPC code, and how long each answer took.
pub struct Hostile {
    pub codes: BTreeMap<String, usize>,
    pub answers: Paced,
}

/// Health/Check and pack `quiet`'s DeliverTrigger, each every 20 ms for `duration`, with
/// `callers` closed-loop callers sending `worst` meanwhile (none when 0).
pub async fn run(
    chs: &[Channel],
    duration: Duration,
    callers: usize,
    worst: &DeliverTriggerRequest,
    quiet: usize,
    pop: Population,
    tag: &str,
) -> (Paced, Paced, Hostile) {
    let stop = Arc::new(AtomicBool::new(false));
    let every = Duration::from_millis(20);
    let q = tokio::spawn(paced(
        chs[0].clone(),
        Some(quiet),
        pop,
        every,
        stop.clone(),
        format!("{tag}-quiet"),
    ));
    let h = health_every(chs, pop, every, stop.clone());
    let mut tasks = Vec::new();
    for w in 0..callers {
        let mut ingest = IngestServiceClient::new(chs[w % chs.len()].clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        let (stop, worst) = (stop.clone(), worst.clone());
        tasks.push(tokio::spawn(async move {
            let (mut codes, mut lat) = (BTreeMap::<String, usize>::new(), Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let at = Instant::now();
                let code = match ingest.deliver_trigger(worst.clone()).await {
                    Ok(_) => "OK".to_owned(),
                    Err(s) => format!("{:?}", s.code()),
                };
                lat.push(at.elapsed().as_micros() as u64);
                *codes.entry(code).or_default() += 1;
            }
            (codes, lat)
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let (mut codes, mut lat) = (BTreeMap::new(), Vec::new());
    for t in tasks {
        if let Ok((c, l)) = t.await {
            for (k, v) in c {
                *codes.entry(k).or_default() += v;
            }
            lat.extend(l);
        }
    }
    lat.sort_unstable();
    let quiet = q.await.unwrap_or_default();
    let health = h.await.unwrap_or_default();
    let answers = Paced {
        calls: lat.len(),
        errors: 0,
        secs: started.elapsed().as_secs_f64(),
        lat_us: lat,
    };
    (quiet, health, Hostile { codes, answers })
}

/// The costliest payload schema lint accepts (a pattern whose DFA blows up, at the largest size
/// the budget allows at the payload limit), fed its worst payload by closed-loop callers:
/// Health/Check and pack 1's DeliverTrigger, every 20 ms, idle and meanwhile, as ratios of
/// the same series idle in the same run.
pub async fn hostile_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "hostile", pop, &[]).await?;
    let chs = server.channels(o.channels).await?;
    anyhow::ensure!(pop.packs >= 2, "the hostile phase needs --packs 2 or more");
    let n = worst_accepted(&chs[0]).await?;
    // The server's default payload limit (the benchmark starts servers with it).
    let worst = worst_payload(64 * 1024);
    let (d, c) = (o.duration(), o.hostile_callers);
    let (quiet_idle, health_idle, _) = run(&chs, d, 0, &worst, 1, pop, "idle").await;
    let (quiet, health, h) = run(&chs, d, c, &worst, 1, pop, "hostile").await;
    let ratio =
        |a: &crate::load::Phase, b: &crate::load::Phase, p: f64| a.pct(p) / b.pct(p).max(1e-9);
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
