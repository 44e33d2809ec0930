//! The cost of an activation filter: the decision alone, in this process, with and without a
//! typical filter; then the recorded rate of one server with every principal's activation
//! unfiltered and filtered, alternately.
use std::hint::black_box;
use std::time::{Duration, Instant};

use hcp_sense::domain::decide::{decide, Decision, Trigger};
use hcp_sense::domain::filter::Filter;
use hcp_sense::domain::pack::BindingMode;
use hcp_sense::domain::policy::{
    Activation, BindingRef, BindingState, PackPolicy, PolicyView, PrincipalPolicy, Route,
};
use tonic::transport::Channel;

use crate::load::{closed, Load, Phase, Population};
use crate::pb::policy_service_client::PolicyServiceClient;
use crate::pb::{ActivateSenseRequest, Route as PbRoute};

/// The filter measured: the typical one.
pub const TYPICAL: &str = "payload.repository.private == false && ref.startsWith(\"issue.\")";

/// A GitHub-like issue payload, as the benchmark's triggers carry (see `load::trigger`).
fn payload() -> serde_json::Map<String, serde_json::Value> {
    serde_json::json!({
        "issue": 7,
        "title": "benchmark",
        "repository": { "private": false, "full_name": "acme/widgets" },
    })
    .as_object()
    .cloned()
    .unwrap_or_default()
}

fn view(filter: Option<std::sync::Arc<Filter>>, principals: usize) -> PolicyView {
    let mut pack = PackPolicy::declared(
        BindingMode::User,
        &["issue.opened"],
        [("issue.opened".to_owned(), "user".to_owned())],
    );
    for p in 0..principals {
        pack.principals.insert(
            format!("principal-{p}"),
            PrincipalPolicy {
                granted: true,
                binding: Some(BindingRef {
                    binding_id: format!("b-{p}"),
                    state: BindingState::Linked,
                }),
                activation: Some(Activation::On(Route::Inbox, filter.clone())),
            },
        );
    }
    PolicyView::from_packs([("pack-0".to_owned(), pack)])
}

/// Nanoseconds per decision, the best of `rounds` rounds of `n` decisions.
fn per_decision(view: &PolicyView, triggers: &[Trigger], n: usize, rounds: usize) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..rounds {
        let start = Instant::now();
        for i in 0..n {
            let d = decide(black_box(view), black_box(&triggers[i % triggers.len()]));
            debug_assert!(matches!(d, Decision::Record { .. }));
            black_box(d);
        }
        best = best.min(start.elapsed().as_nanos() as f64 / n as f64);
    }
    best
}

/// (ns per decision without a filter, with TYPICAL), in this process.
pub fn decision_cost(principals: usize) -> anyhow::Result<(f64, f64)> {
    let filter = Filter::compile(TYPICAL).map_err(|e| anyhow::anyhow!("{TYPICAL}: {e}"))?;
    let triggers: Vec<Trigger> = (0..principals.max(1))
        .map(|p| Trigger {
            pack_id: "pack-0".into(),
            r#ref: "issue.opened".into(),
            principal: format!("principal-{p}"),
            land: "user".into(),
            payload: payload(),
            project: None,
            trigger_id: None,
        })
        .collect();
    let plain = view(None, principals.max(1));
    let filtered = view(Some(filter), principals.max(1));
    let check = decide(&filtered, &triggers[0]);
    anyhow::ensure!(
        matches!(check, Decision::Record { .. }),
        "the typical filter must pass the benchmark's trigger, not {check:?}"
    );
    const N: usize = 200_000;
    // Alternated, so a change of the machine's speed meets both alike.
    let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        a = a.min(per_decision(&plain, &triggers, N, 2));
        b = b.min(per_decision(&filtered, &triggers, N, 2));
    }
    Ok((a, b))
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
    chs: &[Channel],
    duration: Duration,
    c: usize,
    pop: Population,
    rounds: usize,
) -> anyhow::Result<(Vec<Phase>, Vec<Phase>)> {
    let (mut plain, mut filtered) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        activate_all(&chs[0], pop, "").await?;
        plain.push(closed(chs, duration, c, pop, Load::Recorded).await);
        activate_all(&chs[0], pop, TYPICAL).await?;
        filtered.push(closed(chs, duration, c, pop, Load::Recorded).await);
    }
    Ok((plain, filtered))
}
