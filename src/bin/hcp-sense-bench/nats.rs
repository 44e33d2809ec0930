//! The NATS phase: messages already in a JetStream stream drained into records by the server's consumers, one NATS route per pack.
use std::time::{Duration, Instant};

use async_nats::jetstream;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde_json::json;
use tonic::transport::Channel;

use crate::load::{stream, trigger, Load, Population};
use crate::pb::{
    ingress_service_client::IngressServiceClient, IngressKind, IngressRoute, PutIngressRouteRequest,
};
use crate::report::result;
use crate::seed::prepare;
use crate::Options;

async fn recorded(db: &DatabaseConnection) -> anyhow::Result<i64> {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n FROM records",
        ))
        .await?
        .ok_or_else(|| anyhow::anyhow!("no count"))?;
    Ok(row.try_get::<i64>("", "n")?)
}

/// Publishes `n` recorded-load messages (hcp-* headers, Nats-Msg-Id) into a fresh stream,
/// then routes it to the server and measures records per second from the first record to the
/// last. The stream is deleted after.
pub async fn drain(
    ch: &Channel,
    db: &DatabaseConnection,
    url: &str,
    pop: Population,
    n: usize,
    tag: &str,
) -> anyhow::Result<f64> {
    let client = async_nats::connect(url).await?;
    let js = jetstream::new(client);
    let name = format!("HCP_BENCH_{}_{tag}", std::process::id());
    let prefix = format!("hcpbench.{}.{tag}", std::process::id());
    let _ = js.delete_stream(&name).await;
    js.create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await?;
    let mut acks = Vec::with_capacity(1000);
    for i in 0..n {
        let t = trigger(i, pop, Load::Recorded);
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("bench-{i}").as_str());
        h.insert("hcp-ref", t.r#ref.as_str());
        h.insert("hcp-principal", t.principal.as_str());
        h.insert("hcp-land", t.land.as_str());
        let body = serde_json::json!({"issue": i, "title": "benchmark"}).to_string();
        acks.push(
            js.publish_with_headers(format!("{prefix}.{}", t.pack_id), h, body.into())
                .await?,
        );
        if acks.len() == 1000 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks {
        a.await?;
    }
    let before = recorded(db).await?;
    let mut admin = IngressServiceClient::new(ch.clone());
    for p in 0..pop.packs {
        admin
            .put_ingress_route(PutIngressRouteRequest {
                route: Some(IngressRoute {
                    route_id: format!("bench-{p}"),
                    pack_id: format!("pack-{p}"),
                    kind: IngressKind::Nats as i32,
                    nats_stream: name.clone(),
                    nats_subject: format!("{prefix}.pack-{p}"),
                    ..Default::default()
                }),
                secrets: Vec::new(),
            })
            .await?;
    }
    let want = before + n as i64;
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut first: Option<(Instant, i64)> = None;
    let rate = loop {
        let now = recorded(db).await?;
        if first.is_none() && now > before {
            first = Some((Instant::now(), now));
        }
        if now >= want {
            let (t0, at0) = first.unwrap_or((Instant::now(), before));
            break (now - at0) as f64 / t0.elapsed().as_secs_f64().max(1e-3);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of {n} recorded",
            now - before
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = js.delete_stream(&name).await;
    Ok(rate)
}

/// NATS ingress on one store: the DeliverTriggers streams' rate, then messages drained from a
/// JetStream stream by the server's consumers, on the same server.
pub async fn nats_phase(o: &Options, kind: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (db, server) = prepare(o, kind, "nats", pop, &["--nats-url", &o.nats_url]).await?;
    let chs = server.channels(o.channels).await?;
    let streamed = stream(&chs, o.duration(), pop, o.stream_in_flight)
        .await
        .rate();
    let conn = db.connect().await?;
    let drained = drain(&chs[0], &conn, &o.nats_url, pop, o.nats_messages, kind).await?;
    let _ = conn.close().await;
    println!(
        "{kind:<9} nats: {} messages drained at {drained:.0} recorded/s; DeliverTriggers streams {streamed:.0}/s on the same server: {:.2}",
        o.nats_messages,
        drained / streamed
    );
    result(json!({
        "store": kind, "phase": "nats", "messages": o.nats_messages,
        "nats_per_s": drained, "stream_per_s": streamed, "ratio": drained / streamed,
    }));
    server.stop();
    db.drop_db().await;
    Ok(())
}
