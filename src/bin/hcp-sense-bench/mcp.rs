//! The MCP phase: how long after its delivery a record reaches an MCP client subscribed to its inbox (`subscriptions/listen` on the door's Streamable HTTP), at a fixed rate, and what idle subscriptions cost the server in memory.
//!
//! The client is the wire protocol itself, as small as it gets: one HTTP/1.0 POST per
//! subscription (the answer is a Server-Sent Events stream that ends with the connection),
//! read line by line. An SDK's own cost would only add to the client's side.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::load::{trigger, Load};
use crate::pb::ingest_service_client::IngestServiceClient;
use crate::report::result;
use crate::seed::prepare;
use crate::Options;

/// A subscription's event stream, past its acknowledgement.
type Events = tokio::io::Lines<BufReader<TcpStream>>;

/// Opens `subscriptions/listen` of the inbox on the door at `addr` and waits for its
/// acknowledgement.
async fn listen(addr: &str, id: usize) -> anyhow::Result<Events> {
    let body = json!({
        "jsonrpc": "2.0", "id": format!("listen-{id}"), "method": "subscriptions/listen",
        "params": {
            "notifications": { "resourceSubscriptions": ["hcp-sense://records"] },
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientInfo": { "name": "hcp-sense-bench", "version": "1" },
                "io.modelcontextprotocol/clientCapabilities": {}
            }
        }
    })
    .to_string();
    let mut io = TcpStream::connect(addr).await?;
    io.set_nodelay(true)?;
    let head = format!(
        "POST /mcp HTTP/1.0\r\nHost: {addr}\r\nAccept: application/json, text/event-stream\r\n\
         Content-Type: application/json\r\nMCP-Protocol-Version: 2026-07-28\r\n\
         Mcp-Method: subscriptions/listen\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    io.write_all(head.as_bytes()).await?;
    io.write_all(body.as_bytes()).await?;
    let mut lines = BufReader::new(io).lines();
    let status = lines.next_line().await?.unwrap_or_default();
    if !status.contains(" 200 ") {
        anyhow::bail!("subscriptions/listen answered `{status}`");
    }
    while let Some(line) = lines.next_line().await? {
        if let Some(v) = data(&line) {
            if v["method"] == "notifications/subscriptions/acknowledged" {
                return Ok(lines);
            }
            anyhow::bail!("subscriptions/listen: {v}");
        }
    }
    anyhow::bail!("subscriptions/listen ended before its acknowledgement")
}

/// The JSON of an event's `data:` line.
fn data(line: &str) -> Option<Value> {
    let d = line.strip_prefix("data:")?.trim();
    (!d.is_empty())
        .then(|| serde_json::from_str(d).ok())
        .flatten()
}

/// The percentile `q` of sorted microseconds, in milliseconds.
fn pct(sorted: &[u64], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
        .map_or(f64::NAN, |us| *us as f64 / 1000.0)
}

/// The MCP door on one store: send-to-client latency of a subscribed client at each
/// --mcp-rate, then the memory of --mcp-idle idle subscriptions.
pub async fn mcp_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let door = format!("127.0.0.1:{port}");
    // One caller (no authentication here) holds every subscription: the caps are raised so
    // the measure is the cost, not the refusal.
    let room = (o.mcp_idle + 16).to_string();
    let (db, server) = prepare(
        o,
        kind,
        "mcp",
        pop,
        &[
            "--mcp-listen",
            &door,
            "--mcp-max-subscriptions",
            &room,
            "--mcp-max-subscriptions-per-caller",
            &room,
            "--http-max-connections-per-peer",
            &room,
        ],
    )
    .await?;
    let chs = server.channels(o.channels).await?;
    for &rate in &o.mcp_rate {
        let heard: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let mut events = listen(&door, 0).await?;
        let reader = tokio::spawn({
            let heard = heard.clone();
            async move {
                while let Ok(Some(line)) = events.next_line().await {
                    let at = Instant::now();
                    let Some(v) = data(&line) else { continue };
                    if let Some(uri) = v["params"]["_meta"]["recordUri"].as_str() {
                        let id = uri.rsplit('/').next().unwrap_or_default().to_owned();
                        heard
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(id, at);
                    }
                }
            }
        });
        let total = (rate * o.duration().as_secs_f64()) as usize;
        let gap = Duration::from_secs_f64(1.0 / rate.max(1.0));
        let start = Instant::now();
        let mut calls = Vec::with_capacity(total);
        for i in 0..total {
            tokio::time::sleep_until((start + gap.mul_f64(i as f64)).into()).await;
            let ch = chs[i % chs.len()].clone();
            calls.push(tokio::spawn(async move {
                let sent = Instant::now();
                let r = IngestServiceClient::new(ch)
                    .deliver_trigger(trigger(i, pop, Load::Recorded))
                    .await
                    .ok()?;
                Some((r.into_inner().record_id, sent, Instant::now()))
            }));
        }
        let mut acked = Vec::with_capacity(total);
        for c in calls {
            if let Ok(Some(a)) = c.await {
                acked.push(a);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let have = {
                let h = heard
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                acked.iter().filter(|(id, _, _)| h.contains_key(id)).count()
            };
            if have == acked.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        reader.abort();
        let h = heard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut from_send, mut from_ack) = (Vec::new(), Vec::new());
        for (id, sent, ack) in &acked {
            if let Some(at) = h.get(id) {
                from_send.push(at.saturating_duration_since(*sent).as_micros() as u64);
                from_ack.push(at.saturating_duration_since(*ack).as_micros() as u64);
            }
        }
        from_send.sort_unstable();
        from_ack.sort_unstable();
        let missing = acked.len() - from_send.len();
        println!(
            "{kind:<9} mcp: delivery sent to MCP client p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (ack to client p99 {:.2} ms) at {rate:.0} recorded/s ({} records, {missing} not heard)",
            pct(&from_send, 0.5),
            pct(&from_send, 0.99),
            pct(&from_send, 1.0),
            pct(&from_ack, 0.99),
            from_send.len(),
        );
        result(json!({
            "store": kind, "phase": "mcp", "rate": rate, "records": from_send.len(),
            "missing": missing, "p50_ms": pct(&from_send, 0.5), "p99_ms": pct(&from_send, 0.99),
            "max_ms": pct(&from_send, 1.0), "ack_p99_ms": pct(&from_ack, 0.99),
        }));
    }
    // Idle subscriptions: the server's resident memory with them open, over before. Twice:
    // the first time from a server that never held as many (what an operator sees first),
    // then again once those are closed and their memory given back (the steady cost).
    for round in ["first", "again"] {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (before, _) = server.rss_kib();
        let mut open = Vec::with_capacity(o.mcp_idle);
        for i in 0..o.mcp_idle {
            open.push(listen(&door, i + 1).await?);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (after, _) = server.rss_kib();
        let mib = after.saturating_sub(before) as f64 / 1024.0;
        println!(
            "{kind:<9} mcp: {} idle subscriptions ({round}): +{mib:.1} MiB RSS ({:.1} KiB each)",
            o.mcp_idle,
            mib * 1024.0 / o.mcp_idle.max(1) as f64
        );
        result(json!({
            "store": kind, "phase": "idle mcp subscriptions", "round": round,
            "idle_subscriptions": o.mcp_idle, "idle_rss_mib": mib,
        }));
        drop(open);
    }
    server.stop();
    db.drop_db().await;
    Ok(())
}
