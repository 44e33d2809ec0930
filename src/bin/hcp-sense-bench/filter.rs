//! The cost of an activation filter on one server: recorded phases with every principal's
//! activation unfiltered and filtered, alternately; the decision's own time read from the
//! server's `hcp_sense_decision_duration_seconds` over each phase.
use std::time::Duration;

use tonic::transport::Channel;

use crate::load::{closed, Load, Phase, Population};
use crate::pb::policy_service_client::PolicyServiceClient;
use crate::pb::{ActivateSenseRequest, Route as PbRoute};
use crate::server::Server;

/// The filter measured: a typical one, over the benchmark triggers' payload and ref.
pub const TYPICAL: &str = "payload.repository.private == false && ref.startsWith(\"issue.\")";

/// One recorded phase and the server's mean decision time over it, in microseconds.
pub struct Measured {
    pub phase: Phase,
    pub decision_us: f64,
}

async fn measured(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    c: usize,
    pop: Population,
) -> Measured {
    let before = server.scrape().await;
    let phase = closed(chs, duration, c, pop, Load::Recorded).await;
    let after = server.scrape().await;
    let d = |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    let n = d("hcp_sense_decision_duration_seconds_count");
    Measured {
        phase,
        decision_us: d("hcp_sense_decision_duration_seconds_sum") * 1e6 / n.max(1.0),
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

/// Recorded phases at `c` callers, unfiltered and filtered in turn, `rounds` of each.
pub async fn recorded_rates(
    server: &Server,
    chs: &[Channel],
    duration: Duration,
    c: usize,
    pop: Population,
    rounds: usize,
) -> anyhow::Result<(Vec<Measured>, Vec<Measured>)> {
    let (mut plain, mut filtered) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        activate_all(&chs[0], pop, "").await?;
        plain.push(measured(server, chs, duration, c, pop).await);
        activate_all(&chs[0], pop, TYPICAL).await?;
        filtered.push(measured(server, chs, duration, c, pop).await);
    }
    Ok((plain, filtered))
}
