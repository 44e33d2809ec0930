//! The decision log's cost: two servers on each store, one keeping the log and one not (`--decision-log false`), measured alternately — the server's CPU per call at a steady 1,000/s (recorded, dropped) and the recorded rate over the sweep's concurrencies — and the log's account checked against the answers.
use std::time::Duration;

use serde_json::json;
use tonic::transport::Channel;

use crate::filter::{in_order, measured, pair_changes, Measured, Pace};
use crate::load::{call, closed, open, trigger, Load, Population};
use crate::pb::decision_service_client::DecisionServiceClient;
use crate::pb::{DecisionOutcome, GetDecisionRequest, ListDecisionsRequest};
use crate::report::result;
use crate::seed::prepare;
use crate::server::Server;
use crate::Options;
use sea_orm::ConnectionTrait;

/// A server and the connections the load goes over.
type Served = (Server, Vec<Channel>);

/// Phases alternating between the server without the log (A) and with it (B).
async fn alternating(
    (off, on): (&Served, &Served),
    o: &Options,
    pace: Pace,
    pop: Population,
    load: Load,
) -> (Vec<Measured>, Vec<Measured>) {
    let duration = o.duration();
    let phases = in_order(o.ab_rounds, |logged| async move {
        let (s, chs) = if logged { on } else { off };
        Ok(measured(s, chs, duration, pace, pop, load).await)
    });
    phases.await.unwrap_or_default()
}

fn mean(ms: &[Measured], f: fn(&Measured) -> f64) -> f64 {
    ms.iter().map(f).sum::<f64>() / ms.len().max(1) as f64
}

/// Entries of the log, each counted with what was folded into it, by outcome.
async fn accounted(ch: &Channel) -> anyhow::Result<std::collections::BTreeMap<i32, i64>> {
    let mut client = DecisionServiceClient::new(ch.clone());
    let mut out = std::collections::BTreeMap::new();
    let mut req = ListDecisionsRequest {
        page_size: 1000,
        ..Default::default()
    };
    loop {
        let page = client.list_decisions(req.clone()).await?.into_inner();
        for d in &page.decisions {
            *out.entry(d.outcome).or_default() += 1 + d.folded;
        }
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        req.page_token = page.next_page_token;
    }
}

/// The decision log's cost and account on each store.
pub async fn decisions_phase(o: &Options) -> anyhow::Result<()> {
    for kind in &o.stores {
        let pop = o.population(o.principals);
        let (db_off, off) = prepare(o, kind, "logoff", pop, &["--decision-log", "false"]).await?;
        let (db_on, on) = prepare(o, kind, "logon", pop, &[]).await?;
        let off = {
            let chs = off.channels(o.channels).await?;
            (off, chs)
        };
        let on = {
            let chs = on.channels(o.channels).await?;
            (on, chs)
        };
        let mut paces: Vec<(Pace, Load, String)> = vec![
            (
                Pace::Open(1000.0),
                Load::Recorded,
                "recorded, 1000/s".into(),
            ),
            (Pace::Open(1000.0), Load::Dropped, "dropped, 1000/s".into()),
        ];
        for &c in &o.concurrency {
            paces.push((Pace::Closed(c), Load::Recorded, format!("recorded, C={c}")));
        }
        for (pace, load, label) in paces {
            let (a, b) = alternating((&off, &on), o, pace, pop, load).await;
            let (ca, cb) = (mean(&a, |m| m.server_cpu_us), mean(&b, |m| m.server_cpu_us));
            let (ra, rb) = (mean(&a, |m| m.phase.rate()), mean(&b, |m| m.phase.rate()));
            let errors: u64 = a.iter().chain(&b).map(|m| m.phase.errors as u64).sum();
            let pairs = pair_changes(&a, &b);
            println!(
                "{kind:<9} decision log at {label}: server CPU per call {ca:.1} us off, {cb:.1} us on ({:.3}x); {ra:.0}/s off, {rb:.0}/s on ({:.3}x; pair by pair {:+.1}% ± {:.1}%); {errors} errors",
                cb / ca,
                rb / ra,
                pairs.mean * 100.0,
                pairs.standard_error * 100.0,
            );
            result(json!({
                "store": kind, "phase": "decisions", "load": label,
                "off_server_cpu_us": ca, "on_server_cpu_us": cb, "cpu_ratio": cb / ca,
                "off_per_s": ra, "on_per_s": rb, "rate_ratio": rb / ra, "errors": errors,
            }));
        }
        for (name, server) in [("off", &off), ("on", &on)] {
            drop_flood(o, kind, name, server, pop).await;
        }
        // The account: entries and their folded counts against the answers the server counted.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let metrics = on.0.scrape().await;
        let answered = |disposition: &str| -> i64 {
            metrics
                .iter()
                .filter(|(k, _)| {
                    k.starts_with("hcp_sense_deliveries_total{")
                        && k.contains(&format!("disposition=\"{disposition}\""))
                })
                .map(|(_, v)| *v as i64)
                .sum()
        };
        let logged = accounted(&on.1[0]).await?;
        let total: i64 = logged.values().sum();
        println!("{kind:<9} decision log: {total} decisions answered over the phase, by outcome {logged:?}");
        let (inbox, dropped) = (
            logged
                .get(&(DecisionOutcome::Inbox as i32))
                .copied()
                .unwrap_or(0),
            logged
                .get(&(DecisionOutcome::Dropped as i32))
                .copied()
                .unwrap_or(0),
        );
        let (answered_inbox, answered_dropped) = (answered("recorded_inbox"), answered("dropped"));
        println!(
            "{kind:<9} decision log account: inbox {inbox} logged of {answered_inbox} answered, dropped {dropped} of {answered_dropped}: {}",
            if inbox == answered_inbox && dropped == answered_dropped { "exact" } else { "MISMATCH" }
        );
        result(json!({
            "store": kind, "phase": "decisions-account",
            "logged_inbox": inbox, "answered_inbox": answered_inbox,
            "logged_dropped": dropped, "answered_dropped": answered_dropped,
        }));
        off.0.stop();
        on.0.stop();
        db_off.drop_db().await;
        db_on.drop_db().await;
    }
    if o.decision_entries > 0 && o.stores.iter().any(|s| s == "postgres") {
        lookups(o, o.decision_entries).await?;
    }
    Ok(())
}

/// A flood of drops from --flood-callers callers while a quiet pack's recorded triggers go on
/// at 100/s: the quiet pack's latency, and the rate the log's entries were written at (its
/// documented bound: --decision-fold-in-all + 1,001 a second).
async fn drop_flood(o: &Options, kind: &str, name: &str, (server, chs): &Served, pop: Population) {
    let before = server.scrape().await;
    let started = std::time::Instant::now();
    let quiet = Population {
        packs: 1,
        principals: 1,
    };
    let (flood, calm) = tokio::join!(
        closed(chs, o.duration(), o.flood_callers, pop, Load::Dropped),
        open(chs, o.duration(), quiet, Load::Recorded, 100.0)
    );
    // Held entries of the flood's last second are written within the next flush.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let secs = started.elapsed().as_secs_f64();
    let after = server.scrape().await;
    let d = |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    let written = d("hcp_sense_decision_log_entries_total{state=\"written\"}");
    println!(
        "{kind:<9} decision log {name}, drop flood of {} callers: {:.0} drops/s, quiet pack recorded p50 {:.2} ms p99 {:.2} ms ({} errors); log entries written {:.0}/s (bound 2001/s)",
        o.flood_callers,
        flood.rate(),
        calm.pct(0.5),
        calm.pct(0.99),
        calm.errors + flood.errors,
        written / secs,
    );
    result(json!({
        "store": kind, "phase": "decisions-flood", "log": name,
        "drops_per_s": flood.rate(), "quiet_p50_ms": calm.pct(0.5),
        "quiet_p99_ms": calm.pct(0.99), "errors": calm.errors + flood.errors,
        "written_per_s": written / secs,
    }));
}

/// GetDecision and ListDecisions by trigger id over `n` entries on PostgreSQL, one caller,
/// against the no-op's latency in the same run.
async fn lookups(o: &Options, n: usize) -> anyhow::Result<()> {
    let pop = o.population(10);
    let (db, server) = prepare(o, "postgres", "loglookup", pop, &[]).await?;
    let conn = db.connect().await?;
    let t0 = std::time::Instant::now();
    let now = crate::seed::now_micros();
    conn.execute_unprepared(&format!(
        "INSERT INTO decisions (decided_time, pack_id, ref, principal, land, trigger_id, source, \
           outcome, drop_reason, check_name, detail) \
         SELECT {now} - (g % 1000000), 'pack-' || (g % 10), 'issue.opened', 'stranger-' || (g % 100000), \
           'user', 'seed-' || g, 'grpc:DeliverTrigger', 'dropped', 'no_grant', 'grant', \
           'stranger holds no sense.enable' \
         FROM generate_series(1, {n}) AS g"
    ))
    .await?;
    // One principal with HEAVY recorded triggers, beside 1,000 others with four times as many
    // in all: a principal's recorded entries are found through its records.
    let heavy = (n / 100).clamp(1, 100_000);
    conn.execute_unprepared(&format!(
        "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, \
           received_time, commit_txid, stored_time) \
         SELECT 'other-' || lpad(g::text, 9, '0'), 'reader-' || (g % 1000), 'b', 'user', 'pack-0', \
           'issue.opened', '{{}}', 'inbox', {now} - g * 2, 1, {now} - g * 2 \
         FROM generate_series(1, {}) AS g; \
         INSERT INTO decisions (decided_time, pack_id, ref, principal, land, source, outcome, check_name, \
           detail, record_id) \
         SELECT {now} - g * 2, 'pack-0', 'issue.opened', 'reader-' || (g % 1000), 'user', \
           'grpc:DeliverTrigger', 'inbox', '', '', 'other-' || lpad(g::text, 9, '0') \
         FROM generate_series(1, {}) AS g",
        heavy * 4,
        heavy * 4
    ))
    .await?;
    conn.execute_unprepared(&format!(
        "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, \
           received_time, commit_txid, stored_time) \
         SELECT 'heavy-' || lpad(g::text, 9, '0'), 'heavy', 'b', 'user', 'pack-0', 'issue.opened', '{{}}', \
           'inbox', {now} - g * 10, 1, {now} - g * 10 \
         FROM generate_series(1, {heavy}) AS g; \
         INSERT INTO decisions (decided_time, pack_id, ref, principal, land, source, outcome, check_name, \
           detail, record_id) \
         SELECT {now} - g * 10, 'pack-0', 'issue.opened', 'heavy', 'user', 'grpc:DeliverTrigger', 'inbox', \
           '', '', 'heavy-' || lpad(g::text, 9, '0') \
         FROM generate_series(1, {heavy}) AS g"
    ))
    .await?;
    conn.execute_unprepared("ANALYZE decisions").await?;
    conn.execute_unprepared("ANALYZE records").await?;
    let _ = conn.close().await;
    println!(
        "postgres  decision log: {n} entries seeded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let ch = server.channels(1).await?.remove(0);
    let mut client = DecisionServiceClient::new(ch.clone());
    let calls = 2_000usize;
    let mut get = Vec::with_capacity(calls);
    let mut list = Vec::with_capacity(calls);
    let mut noop = Vec::with_capacity(calls);
    let mut errors = 0;
    for i in 0..calls {
        // Spread over the table: a stride coprime with most sizes.
        let g = 1 + (i * 7_919_393) % n;
        let id = format!("seed-{g}");
        let t = std::time::Instant::now();
        let found = client
            .get_decision(GetDecisionRequest {
                pack_id: format!("pack-{}", g % 10),
                trigger_id: id.clone(),
                viewer: String::new(),
            })
            .await;
        get.push(t.elapsed().as_micros() as u64);
        errors += usize::from(found.is_err());
        let t = std::time::Instant::now();
        let listed = client
            .list_decisions(ListDecisionsRequest {
                trigger_id: id,
                page_size: 10,
                ..Default::default()
            })
            .await;
        list.push(t.elapsed().as_micros() as u64);
        errors += usize::from(listed.map_or(true, |r| r.into_inner().decisions.is_empty()));
        let t = std::time::Instant::now();
        errors += usize::from(!call(&ch, trigger(i, pop, Load::Noop), Load::Noop).await);
        noop.push(t.elapsed().as_micros() as u64);
    }
    // A principal's newest page: one with HEAVY records (through its records), and one of
    // the seeded strangers (drops, through the principal index).
    let by_principal = |who: String| {
        let mut client = client.clone();
        async move {
            let mut took = Vec::with_capacity(200);
            let mut errors = 0usize;
            for _ in 0..200 {
                let t = std::time::Instant::now();
                let page = client
                    .list_decisions(ListDecisionsRequest {
                        principal: who.clone(),
                        page_size: 10,
                        ..Default::default()
                    })
                    .await;
                took.push(t.elapsed().as_micros() as u64);
                errors += usize::from(page.map_or(true, |r| r.into_inner().decisions.is_empty()));
            }
            (took, errors)
        }
    };
    let (mut heavy_took, e1) = by_principal("heavy".into()).await;
    let (mut stranger_took, e2) = by_principal("stranger-7".into()).await;
    errors += e1 + e2;
    let pct = |v: &mut Vec<u64>, q: f64| {
        v.sort_unstable();
        v.get(((v.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    let (g50, g99) = (pct(&mut get, 0.5), pct(&mut get, 0.99));
    let (l50, l99) = (pct(&mut list, 0.5), pct(&mut list, 0.99));
    let (n50, n99) = (pct(&mut noop, 0.5), pct(&mut noop, 0.99));
    println!(
        "postgres  decision log over {n} entries, one caller: GetDecision p50 {g50:.2} ms p99 {g99:.2} ms; ListDecisions by trigger id p50 {l50:.2} ms p99 {l99:.2} ms; no-op p50 {n50:.2} ms p99 {n99:.2} ms ({:.1}x, {:.1}x at p99); {errors} errors",
        g99 / n99.max(0.001),
        l99 / n99.max(0.001),
    );
    let (h50, h99) = (pct(&mut heavy_took, 0.5), pct(&mut heavy_took, 0.99));
    let (s50, s99) = (pct(&mut stranger_took, 0.5), pct(&mut stranger_took, 0.99));
    println!(
        "postgres  decision log, ListDecisions by principal (a page of 10): {heavy} recorded entries p50 {h50:.2} ms p99 {h99:.2} ms; {} dropped entries p50 {s50:.2} ms p99 {s99:.2} ms",
        n / 100_000
    );
    result(json!({
        "store": "postgres", "phase": "decisions-lookup", "entries": n,
        "heavy_records": heavy, "heavy_p50_ms": h50, "heavy_p99_ms": h99,
        "stranger_p50_ms": s50, "stranger_p99_ms": s99,
        "get_p50_ms": g50, "get_p99_ms": g99, "list_p50_ms": l50, "list_p99_ms": l99,
        "noop_p50_ms": n50, "noop_p99_ms": n99, "errors": errors,
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}
