//! The cost of an activation filter on one server: recorded phases with every principal's
//! activation unfiltered and filtered, alternately; the decision's own time read from the
//! server's `hcp_sense_decision_duration_seconds` over each phase.
use std::time::Duration;

use serde_json::json;
use tonic::transport::Channel;

use crate::load::{closed, open, Load, Phase, Population};
use crate::pb::policy_service_client::PolicyServiceClient;
use crate::pb::{ActivateSenseRequest, Route as PbRoute};
use crate::report::{result, row};
use crate::seed::prepare;
use crate::server::Server;
use crate::{cpu, Options};

/// The filter measured: a typical one, over the benchmark triggers' payload and ref.
pub const TYPICAL: &str = "payload.repository.private == false && ref.startsWith(\"issue.\")";

/// One recorded phase, the server's mean decision time over it and the server's CPU time per
/// call (everything it does for a call, not only the decision), in microseconds.
pub struct Measured {
    pub phase: Phase,
    pub decision_us: f64,
    pub server_cpu_us: f64,
}

/// How a measured phase loads the server.
#[derive(Debug, Clone, Copy)]
pub enum Pace {
    /// `c` callers, each calling again as soon as answered.
    Closed(usize),
    /// This many calls a second, whatever the answers take.
    Open(f64),
}

pub async fn measured(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    pace: Pace,
    pop: Population,
    load: Load,
) -> Measured {
    let before = server.scrape().await;
    let cpu0 = cpu::sample(server.pid());
    let phase = match pace {
        Pace::Closed(c) => closed(chs, duration, c, pop, load).await,
        Pace::Open(rate) => open(chs, duration, pop, load, rate).await,
    };
    let cpu1 = cpu::sample(server.pid());
    let after = server.scrape().await;
    let d = |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    let n = d("hcp_sense_decision_duration_seconds_count");
    Measured {
        decision_us: d("hcp_sense_decision_duration_seconds_sum") * 1e6 / n.max(1.0),
        server_cpu_us: cpu0.per_call(&cpu1, phase.calls).server,
        phase,
    }
}

/// Sets every principal's activation (inbox) with `filter` (empty: none).
pub async fn activate_all(ch: &Channel, pop: Population, filter: &str) -> anyhow::Result<()> {
    let mut policy = PolicyServiceClient::new(ch.clone());
    for p in 0..pop.principals {
        policy
            .activate_sense(ActivateSenseRequest {
                principal: format!("principal-{p}"),
                pack_id: format!("pack-{}", p % pop.packs.max(1)),
                route: PbRoute::Inbox as i32,
                filter: filter.to_owned(),
            })
            .await?;
    }
    Ok(())
}

/// The order of the measured phases, unfiltered (A) and filtered (B): A B B A B A A B, so each
/// kind's phases sit at the same mean position, and a rate that drifts as records pile up
/// weighs on both alike.
const ORDER: [bool; 8] = [false, true, true, false, true, false, false, true];

/// Phases in the order ORDER, `rounds` times over, after one unmeasured phase of each kind;
/// `phase(false)` runs one of A, `phase(true)` one of B. Four of each kind a round.
pub async fn in_order<F, Fut>(
    rounds: usize,
    mut phase: F,
) -> anyhow::Result<(Vec<Measured>, Vec<Measured>)>
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Measured>>,
{
    phase(false).await?;
    phase(true).await?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for second in ORDER
        .iter()
        .copied()
        .cycle()
        .take(ORDER.len() * rounds.max(1))
    {
        let m = phase(second).await?;
        if second {
            b.push(m);
        } else {
            a.push(m);
        }
    }
    Ok((a, b))
}

/// Recorded phases at `pace` in the order ORDER on one server, with `set(false)` (A) or
/// `set(true)` (B) made before each.
pub async fn alternating<F, Fut>(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    pace: Pace,
    pop: Population,
    rounds: usize,
    set: F,
) -> anyhow::Result<(Vec<Measured>, Vec<Measured>)>
where
    F: Fn(bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let set = &set;
    in_order(rounds, |second| async move {
        set(second).await?;
        Ok(measured(server, chs, duration, pace, pop, Load::Recorded).await)
    })
    .await
}

/// The change of the recorded rate from A to B over the pairs of adjacent phases.
pub struct PairChanges {
    pub n: usize,
    pub mean: f64,
    pub standard_error: f64,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// `b`'s rate over `a`'s, less one, for the k-th phase of each kind: adjacent in ORDER (each
/// pair of ORDER holds one of each), so a drift over the run cancels within a pair.
pub fn pair_changes(a: &[Measured], b: &[Measured]) -> PairChanges {
    let mut changes: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(a, b)| b.phase.rate() / a.phase.rate() - 1.0)
        .filter(|c| c.is_finite())
        .collect();
    changes.sort_by(f64::total_cmp);
    let n = changes.len();
    let mean = changes.iter().sum::<f64>() / n.max(1) as f64;
    let variance =
        changes.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / n.saturating_sub(1).max(1) as f64;
    PairChanges {
        n,
        mean,
        standard_error: (variance / n.max(1) as f64).sqrt(),
        median: changes.get(n / 2).copied().unwrap_or(f64::NAN),
        min: changes.first().copied().unwrap_or(f64::NAN),
        max: changes.last().copied().unwrap_or(f64::NAN),
    }
}

/// An activation filter's cost on each store, at the sweep's first concurrency: recorded
/// phases with every activation unfiltered and filtered alternately (four of each), the
/// recorded rate and the server's own decision time of each.
pub async fn filter_phase(o: &Options) -> anyhow::Result<()> {
    ab_phase(o, "filter", ("no filter", "filtered"), |chs, pop, on| {
        let ch = chs[0].clone();
        async move { activate_all(&ch, pop, if on { TYPICAL } else { "" }).await }
    })
    .await
}

/// Phases A and B alternating on each store, at full load and at a steady 1,000/s, `set`
/// switching between them; the decision's time, the server's CPU per call and the rates.
pub async fn ab_phase<F, Fut>(
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
    let mean = |ms: &[Measured], f: fn(&Measured) -> f64| {
        ms.iter().map(f).sum::<f64>() / ms.len().max(1) as f64
    };
    for kind in &o.stores {
        let pop = o.population(o.principals);
        let (db, server) = prepare(o, kind, "filter", pop, &[]).await?;
        let chs = server.channels(o.channels).await?;
        // At full load for the rate; at a steady 1,000/s for the decision's own time, which
        // under full load also counts the time its thread waits for a core.
        for (pace, label) in [
            (Pace::Closed(c), format!("C={c}")),
            (Pace::Open(1000.0), "1000/s".to_owned()),
        ] {
            let (plain, filtered) =
                alternating(&server, &chs, o.duration(), pace, pop, o.ab_rounds, |on| {
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
            let pairs = pair_changes(&plain, &filtered);
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
