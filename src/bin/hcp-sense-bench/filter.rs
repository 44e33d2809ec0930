//! The cost of an activation filter on one server: recorded phases with every principal's
//! activation unfiltered and filtered, alternately; the decision's own time read from the
//! server's `hcp_sense_decision_duration_seconds` over each phase.
use std::time::Duration;

use tonic::transport::Channel;

use crate::cpu;
use crate::load::{closed, open, Load, Phase, Population};
use crate::pb::policy_service_client::PolicyServiceClient;
use crate::pb::{ActivateSenseRequest, Route as PbRoute};
use crate::server::Server;

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

async fn measured(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    pace: Pace,
    pop: Population,
) -> Measured {
    let before = server.scrape().await;
    let cpu0 = cpu::sample(server.pid());
    let phase = match pace {
        Pace::Closed(c) => closed(chs, duration, c, pop, Load::Recorded).await,
        Pace::Open(rate) => open(chs, duration, pop, Load::Recorded, rate).await,
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

/// Recorded phases at `pace` in the order ORDER, after one unmeasured phase, with `set(false)`
/// (A) or `set(true)` (B) made before each; four of each kind.
pub async fn alternating<F, Fut>(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    pace: Pace,
    pop: Population,
    set: F,
) -> anyhow::Result<(Vec<Measured>, Vec<Measured>)>
where
    F: Fn(bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    set(false).await?;
    measured(server, chs, duration, pace, pop).await;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for second in ORDER {
        set(second).await?;
        let m = measured(server, chs, duration, pace, pop).await;
        if second {
            b.push(m);
        } else {
            a.push(m);
        }
    }
    Ok((a, b))
}
