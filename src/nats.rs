//! NATS JetStream ingress: one durable pull consumer per NATS route, whose messages take `Service::route_message` and are acknowledged only once recorded or counted as dropped.
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::StreamExt;

use crate::domain::ingress::{IngressKind, Route};
use crate::error::Error;
use crate::service::Service;

/// How often the routes are read again, to start and stop consumers as admins change them.
const ROUTES_EVERY: Duration = Duration::from_secs(2);
/// Messages one pull asks for; they are decided concurrently, so the sink commits them together.
const FETCH: usize = 256;
/// Messages of one consumer being decided at once.
const IN_FLIGHT: usize = 1024;
/// The idle heartbeat of a pull: a consumer gone (a NATS restart) is noticed within a few.
const FETCH_WAIT: Duration = Duration::from_secs(5);
/// How long the NATS server waits for an acknowledgement before it redelivers a message:
/// what a message taken by a replica that died waits before another takes it. A batch slower
/// than this (a store in trouble) is delivered again while it commits, which costs a decision,
/// not a record: the trigger id makes the second delivery the first record.
const ACK_WAIT: Duration = Duration::from_secs(10);
/// The pause before a message the store could not take is delivered again.
const RETRY: Duration = Duration::from_secs(1);

/// The durable consumer of a route: every replica pulls from the same one, so each message
/// goes to one of them, and a restarted replica resumes where it was acknowledged.
pub fn consumer_name(route_id: &str) -> String {
    format!("hcp-sense-{}", route_id.replace('.', "_"))
}

/// Runs the NATS ingress until `stop`: connects (retrying), follows the NATS routes and keeps
/// one consumer task per route.
pub async fn run(service: Service, url: String, mut stop: watch::Receiver<bool>) {
    let client = loop {
        let attempt = async_nats::ConnectOptions::new()
            .name("hcp-sense")
            .retry_on_initial_connect()
            .connect(url.as_str());
        tokio::select! {
            c = attempt => match c {
                Ok(c) => break c,
                Err(e) => {
                    tracing::warn!(error = %e, "NATS not reachable; retrying");
                    tokio::time::sleep(RETRY).await;
                }
            },
            () = stopped(&mut stop) => return,
        }
    };
    // The URL may carry credentials: not logged.
    tracing::info!("NATS ingress connected");
    let js = jetstream::new(client);
    let mut running: HashMap<String, (Route, JoinHandle<()>)> = HashMap::new();
    loop {
        match nats_routes(&service).await {
            Ok(routes) => {
                running.retain(|id, (r, task)| {
                    let keep = routes.get(id) == Some(r) && !task.is_finished();
                    if !keep {
                        task.abort();
                    }
                    keep
                });
                for (id, route) in routes {
                    if running.contains_key(&id) {
                        continue;
                    }
                    let task = tokio::spawn(consume(service.clone(), js.clone(), route.clone()));
                    running.insert(id, (route, task));
                }
            }
            Err(e) => tracing::warn!(error = %e, "NATS routes not read; consumers keep running"),
        }
        tokio::select! {
            _ = tokio::time::sleep(ROUTES_EVERY) => {}
            () = stopped(&mut stop) => break,
        }
    }
    for (_, (_, task)) in running {
        task.abort();
    }
}

/// Completes when `stop` says so (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn nats_routes(service: &Service) -> crate::error::Result<HashMap<String, Route>> {
    let mut out = HashMap::new();
    let mut after: Option<String> = None;
    loop {
        let page = service.list_ingress_routes(after.as_deref(), 500).await?;
        let full = page.len() == 500;
        after = page.last().map(|r| r.route_id.clone());
        out.extend(
            page.into_iter()
                .filter(|r| r.kind == IngressKind::Nats)
                .map(|r| (r.route_id.clone(), r)),
        );
        if !full {
            return Ok(out);
        }
    }
}

/// Pulls a route's messages for as long as the route stands, re-creating its consumer after
/// a failure (a stream not there yet, a NATS restart).
async fn consume(service: Service, js: jetstream::Context, route: Route) {
    let mut pause = RETRY;
    loop {
        let started = tokio::time::Instant::now();
        if let Err(e) = consume_once(&service, &js, &route).await {
            tracing::warn!(route_id = %route.route_id, error = %e, retry_secs = pause.as_secs(), "NATS consumer stopped; starting again");
        }
        // A consumer that ran a while starts again at once; one that keeps failing (a
        // stream not created yet) is retried less and less often, up to every 30 s.
        if started.elapsed() > Duration::from_secs(60) {
            pause = RETRY;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}

async fn consume_once(
    service: &Service,
    js: &jetstream::Context,
    route: &Route,
) -> anyhow::Result<()> {
    let stream = js.get_stream(&route.nats_stream).await?;
    let name = consumer_name(&route.route_id);
    let consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: route.nats_subject.clone(),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                max_ack_pending: (IN_FLIGHT * 2) as i64,
                ..Default::default()
            },
        )
        .await?;
    tracing::info!(route_id = %route.route_id, stream = %route.nats_stream, consumer = %name, "NATS consumer started");
    // Messages stream in (pulled ahead, FETCH at a time) while earlier ones are decided;
    // at most IN_FLIGHT are being decided at once, so a slow store slows the pulling.
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(FETCH)
        .heartbeat(FETCH_WAIT)
        .expires(FETCH_WAIT * 10)
        .messages()
        .await?;
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut work = JoinSet::new();
    while let Some(m) = messages.next().await {
        let m = m.map_err(|e| anyhow::anyhow!("{e}"))?;
        let slot = slots.clone().acquire_owned().await?;
        let (service, route) = (service.clone(), route.clone());
        work.spawn(async move {
            let done = take(&service, &route, m).await;
            drop(slot);
            if let Err(e) = done {
                tracing::warn!(route_id = %route.route_id, error = %e, "NATS acknowledgement not sent");
            }
        });
        // Reap what has finished, so the set does not grow with the stream.
        while work.try_join_next().is_some() {}
    }
    while work.join_next().await.is_some() {}
    Ok(())
}

/// Decides one message and answers NATS: acknowledged once its triggers are recorded or
/// counted, terminated (never redelivered) when it is malformed, redelivered later when the
/// store could not take it.
async fn take(service: &Service, route: &Route, m: jetstream::Message) -> anyhow::Result<()> {
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    if let Some(h) = &m.headers {
        for (name, values) in h.iter() {
            let joined = values
                .iter()
                .map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            headers.insert(name.to_string().to_ascii_lowercase(), joined);
        }
    }
    let delivery_id = match headers.get("nats-msg-id").filter(|v| !v.is_empty()) {
        Some(id) => id.clone(),
        None => {
            let info = m.info().map_err(|e| anyhow::anyhow!("{e}"))?;
            format!("{}#{}", info.stream, info.stream_sequence)
        }
    };
    let decided = tokio::time::timeout(
        service.call_timeout(),
        service.route_message(route, &headers, &m.payload, delivery_id.clone()),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Error::Unavailable(
            "the store did not answer in time".into(),
        ))
    });
    let answer = match decided {
        Ok(_) => AckKind::Ack,
        Err(Error::Unavailable(e)) => {
            tracing::debug!(route_id = %route.route_id, error = %e, "NATS message to be redelivered");
            AckKind::Nak(Some(RETRY))
        }
        Err(e) => {
            tracing::warn!(route_id = %route.route_id, message = %delivery_id, reason = %e, "NATS message terminated");
            service.metrics.ingress_refused(IngressKind::Nats.as_str());
            AckKind::Term
        }
    };
    m.ack_with(answer).await.map_err(|e| anyhow::anyhow!("{e}"))
}
