//! NATS JetStream ingress: one durable pull consumer per NATS route and definition, whose messages take `Ingress::route_message` and are acknowledged only once recorded or counted as dropped.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{pull, DeliverPolicy},
    AckKind, ErrorCode,
};
use sha2::{Digest, Sha256};
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::StreamExt;

use super::Ingress;
use crate::domain::ingress::{IngressKind, Route};
use crate::error::Error;
use crate::lifecycle::Signal;
use backon::{BackoffBuilder, ConstantBuilder, ExponentialBuilder, Retryable};

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
/// The pause before a message the store could not take is delivered again, and the first
/// pause before a consumer that could not start is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// The longest pause between two attempts to start a route's consumer (a stream not created
/// yet is looked for again at least this often).
const MAX_RETRY: Duration = Duration::from_secs(30);
/// Longest a route pauses its pulling over a quota: well inside ACK_WAIT.
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// Most consumers of deleted or moved routes waiting to be removed while NATS does not answer.
const MAX_RETIRED: usize = 4096;
/// The description of every consumer of a route, followed by the route id: how a replica knows
/// a route's consumers (an earlier definition's among them) without parsing names.
const DESCRIPTION: &str = "hcp-sense route ";

/// The durable consumer of a route as it is defined now. Every replica derives the same name
/// from the route alone, so they all pull from one consumer with no coordination, and a route
/// whose stream or subject changes gets a consumer of its own (NATS cannot change a durable's
/// filter in place). The hash covers the route id too, so ids that differ only in `.` and `_`
/// never share a consumer.
pub fn consumer_name(route_id: &str, stream: &str, subject: &str) -> String {
    let mut h = Sha256::new();
    for part in [route_id, stream, subject] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!(
        "hcp-sense-{}-{}",
        route_id.replace('.', "_"),
        hex::encode(&h.finalize()[..4])
    )
}

fn consumer_of(route: &Route) -> String {
    consumer_name(&route.route_id, &route.nats_stream, &route.nats_subject)
}

/// The one name a route's consumer had before names carried a hash: such a consumer is an
/// earlier definition of the route, continued from and then removed like any other.
fn legacy_name(route_id: &str) -> String {
    format!("hcp-sense-{}", route_id.replace('.', "_"))
}

/// Whether the consumer `name` of a stream, with `description`, is one of `route_id`'s, of
/// this definition or an earlier one.
fn belongs_to(name: &str, description: Option<&str>, route_id: &str) -> bool {
    match description {
        Some(d) if !d.is_empty() => d.strip_prefix(DESCRIPTION) == Some(route_id),
        _ => name == legacy_name(route_id),
    }
}

// Where a route's consumer stands, shared by its task and the loop that reports it.
const STARTING: u8 = 0;
const CONSUMING: u8 = 1;
const FAILING: u8 = 2;

/// The task consuming one route, and the definition it consumes.
struct Running {
    route: Route,
    task: JoinHandle<()>,
    state: Arc<AtomicU8>,
}

/// Runs the NATS ingress, a task of the ingress's lifecycle, until stopping begins: connects
/// (retrying), then follows the NATS routes, keeping one consumer task per route and removing
/// the consumers of routes deleted or moved to another stream. At stopping, each consumer stops
/// pulling, answers the messages it took, and ends; this returns once they all have.
pub async fn run(ingress: Ingress, url: String) {
    let stopping = ingress.lifecycle().stopping();
    let Some(servers) = servers(&url) else {
        return;
    };
    let Some(client) = connect(servers, &stopping).await else {
        return;
    };
    // The URL may carry credentials: not logged.
    tracing::info!("NATS ingress connected");
    let mut consumers = Consumers {
        ingress,
        js: jetstream::new(client),
        running: HashMap::new(),
        retired: HashSet::new(),
    };
    loop {
        consumers.follow_routes().await;
        tokio::select! {
            _ = tokio::time::sleep(ROUTES_EVERY) => {}
            () = stopping.wait() => break,
        }
    }
    consumers.stopped().await;
}

/// The servers of `--nats-url`: a cluster's nodes, comma-separated (the client tries each, and
/// learns the rest from the one it reaches); `None`, logged, when it is not a list of them.
fn servers(url: &str) -> Option<Vec<async_nats::ServerAddr>> {
    match url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()
    {
        Ok(s) => Some(s),
        Err(e) => {
            // The URL may carry credentials: only the reason is logged.
            tracing::error!(error = %e, "--nats-url is not a NATS URL (or a comma-separated list of them); the NATS ingress stops");
            None
        }
    }
}

/// Connects to NATS, retrying while it is unreachable; `None` when stopping begins first (or
/// the client gives up, logged).
async fn connect(
    servers: Vec<async_nats::ServerAddr>,
    stopping: &Signal,
) -> Option<async_nats::Client> {
    let connect = || {
        async_nats::ConnectOptions::new()
            .name("hcp-sense")
            .retry_on_initial_connect()
            .connect(servers.clone())
    };
    let attempts = connect
        .retry(ConstantBuilder::new().with_delay(RETRY).without_max_times())
        .notify(|e, _| tracing::warn!(error = %e, "NATS not reachable; retrying"));
    tokio::select! {
        c = attempts => match c {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(error = %e, "NATS not reachable; the NATS ingress stops");
                None
            }
        },
        () = stopping.wait() => None,
    }
}

/// The consumer task of each NATS route, and the consumers of routes gone still to remove.
struct Consumers {
    ingress: Ingress,
    js: jetstream::Context,
    running: HashMap<String, Running>,
    /// (stream, consumer) of routes deleted or moved to another stream, still to be removed.
    retired: HashSet<(String, String)>,
}

impl Consumers {
    /// Reads the NATS routes and brings the consumers in line: ends those of routes changed or
    /// gone (and of tasks that ended), removes retired consumers, starts one for each new
    /// route, and reports how many consume and how many fail.
    async fn follow_routes(&mut self) {
        let routes = match nats_routes(&self.ingress).await {
            Ok(routes) => routes,
            Err(e) => {
                return tracing::warn!(error = %e, "NATS routes not read; consumers keep running")
            }
        };
        self.end_changed(&routes).await;
        // A consumer whose definition is back (a route changed and changed back) stays.
        let wanted: HashSet<(String, String)> = routes
            .values()
            .map(|r| (r.nats_stream.clone(), consumer_of(r)))
            .collect();
        self.retired.retain(|c| !wanted.contains(c));
        remove_retired(&self.js, &mut self.retired).await;
        self.start_new(routes);
        let count = |s: u8| {
            self.running
                .values()
                .filter(|r| r.state.load(Ordering::Relaxed) == s)
                .count() as i64
        };
        self.ingress
            .delivery
            .metrics
            .set_nats_routes(count(CONSUMING), count(FAILING));
    }

    /// Ends the consumer task of each route changed or gone since it started (and forgets
    /// those that ended); a consumer of a route deleted or moved to another stream is retired.
    async fn end_changed(&mut self, routes: &HashMap<String, Route>) {
        let changed: Vec<String> = self
            .running
            .iter()
            .filter(|(id, r)| routes.get(*id) != Some(&r.route) || r.task.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        for id in changed {
            let Some(old) = self.running.remove(&id) else {
                continue;
            };
            old.task.abort();
            // Stopped for good before its consumer is removed, so it cannot make it again.
            let _ = old.task.await;
            // A change within the stream is the new definition's task's to finish: it
            // starts where the old consumer stopped, then removes it. A route deleted
            // or moved to another stream leaves its consumer to be removed here.
            let moved = routes
                .get(&id)
                .is_none_or(|now| now.nats_stream != old.route.nats_stream);
            if !moved {
                continue;
            }
            if self.retired.len() < MAX_RETIRED {
                self.retired
                    .insert((old.route.nats_stream.clone(), consumer_of(&old.route)));
            } else {
                tracing::warn!(route_id = %id, stream = %old.route.nats_stream, consumer = %consumer_of(&old.route), "too many NATS consumers waiting to be removed; this one is left in place");
            }
        }
    }

    /// Starts a consumer task, of the ingress's lifecycle, for each route without one.
    fn start_new(&mut self, routes: HashMap<String, Route>) {
        for (id, route) in routes {
            if self.running.contains_key(&id) {
                continue;
            }
            let state = Arc::new(AtomicU8::new(STARTING));
            let task = self.ingress.lifecycle().spawn(consume(
                self.ingress.clone(),
                self.js.clone(),
                route.clone(),
                state.clone(),
            ));
            self.running.insert(id, Running { route, task, state });
        }
    }

    /// Waits, once stopping has begun, for every consumer to answer what it took and end.
    async fn stopped(self) {
        for (_, r) in self.running {
            let _ = r.task.await;
        }
    }
}

/// Removes the consumers in `retired`, keeping those not removed yet for the next round.
async fn remove_retired(js: &jetstream::Context, retired: &mut HashSet<(String, String)>) {
    let mut removed = Vec::new();
    for (stream, name) in retired.iter() {
        match js.delete_consumer_from_stream(name, stream).await {
            Ok(_) => {
                tracing::info!(stream = %stream, consumer = %name, "NATS consumer of a deleted or moved route removed");
                removed.push((stream.clone(), name.clone()));
            }
            Err(e) if gone_already(&e) => removed.push((stream.clone(), name.clone())),
            Err(e) => {
                tracing::warn!(stream = %stream, consumer = %name, error = %e, "NATS consumer of a deleted or moved route not removed; trying again");
                // NATS is likely unreachable: the rest waits for the next round rather than
                // holding the routes' refresh for a timeout each.
                break;
            }
        }
    }
    for c in removed {
        retired.remove(&c);
    }
}

/// A consumer removed already: by another replica, or with its stream.
fn gone_already(e: &jetstream::stream::ConsumerError) -> bool {
    matches!(
        e.kind(),
        jetstream::stream::ConsumerErrorKind::JetStream(j)
            if j.error_code() == ErrorCode::CONSUMER_NOT_FOUND || j.error_code() == ErrorCode::STREAM_NOT_FOUND
    )
}

async fn nats_routes(ingress: &Ingress) -> crate::error::Result<HashMap<String, Route>> {
    let mut out = HashMap::new();
    let mut after: Option<String> = None;
    loop {
        let page = ingress.list_ingress_routes(after.as_deref(), 500).await?;
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

/// Pulls a route's messages for as long as the route stands, starting its consumer again after
/// a failure (a stream not there yet, a NATS restart) with a growing pause; every failure is
/// logged with the route id and counted, and the route reported failing until it consumes. A
/// consumer stopped because the route changed meanwhile is no failure.
/// When stopping begins it stops pulling, answers the messages it took, and ends.
async fn consume(ingress: Ingress, js: jetstream::Context, route: Route, state: Arc<AtomicU8>) {
    let stopping = ingress.lifecycle().stopping();
    let mut pauses = restart_pauses();
    loop {
        let started = tokio::time::Instant::now();
        let failed = consume_once(&ingress, &js, &route, &state, &stopping)
            .await
            .err();
        if stopping.is_given() {
            return;
        }
        // A consumer that ran a while starts again at once; one that keeps failing (a
        // stream not created yet) is retried less and less often, up to every MAX_RETRY.
        if started.elapsed() > Duration::from_secs(60) {
            pauses = restart_pauses();
        }
        let pause = pauses.next().unwrap_or(MAX_RETRY);
        if let Some(e) = failed {
            if matches!(still_defined(&ingress, &route).await, Ok(false)) {
                // Removed by a replica that saw the route change first: no failure; this
                // replica stops the task at its next refresh.
                state.store(STARTING, Ordering::Relaxed);
                tracing::info!(route_id = %route.route_id, stream = %route.nats_stream, reason = %e, "NATS consumer stopped: the route changed");
            } else {
                state.store(FAILING, Ordering::Relaxed);
                ingress.delivery.metrics.nats_consumer_failed();
                tracing::warn!(route_id = %route.route_id, stream = %route.nats_stream, error = %e, retry_secs = pause.as_secs(), "NATS consumer not running; trying again");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            () = stopping.wait() => return,
        }
    }
}

/// The pauses before a route's consumer is started again: RETRY, doubling up to MAX_RETRY.
fn restart_pauses() -> backon::ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(RETRY)
        .with_max_delay(MAX_RETRY)
        .with_factor(2.0)
        .without_max_times()
        .build()
}

/// The route as the store holds it now is still `route`'s definition (same stream, subject,
/// hence consumer): what a replica checks before it makes or removes a consumer, so that one
/// still running an older definition (for up to one refresh) undoes nothing a newer one did.
async fn still_defined(ingress: &Ingress, route: &Route) -> anyhow::Result<bool> {
    match ingress.get_ingress_route(&route.route_id).await {
        Ok(now) => Ok(now.kind == IngressKind::Nats && consumer_of(&now) == consumer_of(route)),
        Err(Error::NotFound(_)) => Ok(false),
        Err(e) => Err(anyhow::anyhow!("the route was not read: {e}")),
    }
}

/// The consumers of `stream` that are `route_id`'s.
async fn consumers_of(
    stream: &jetstream::stream::Stream,
    route_id: &str,
) -> anyhow::Result<Vec<jetstream::consumer::Info>> {
    let mut out = Vec::new();
    let mut all = stream.consumers();
    while let Some(info) = all.next().await {
        let info = info?;
        if belongs_to(&info.name, info.config.description.as_deref(), route_id) {
            out.push(info);
        }
    }
    Ok(out)
}

/// Makes the route's consumer. After an earlier definition on the same stream it starts just
/// past the lowest acknowledgement floor of that definition's consumers, so what they
/// acknowledged is not delivered again and what they had not reached yet is not lost; a new
/// route (or one moved to this stream) starts at the stream's first message.
async fn create(
    ingress: &Ingress,
    stream: &jetstream::stream::Stream,
    route: &Route,
    name: &str,
) -> anyhow::Result<jetstream::consumer::PullConsumer> {
    if !still_defined(ingress, route).await? {
        anyhow::bail!("the route changed; its new definition takes over");
    }
    let earlier = consumers_of(stream, &route.route_id).await?;
    let deliver_policy = match earlier
        .iter()
        .filter(|c| c.name != name)
        .map(|c| c.ack_floor.stream_sequence)
        .min()
    {
        Some(floor) => DeliverPolicy::ByStartSequence {
            start_sequence: floor + 1,
        },
        None => DeliverPolicy::All,
    };
    let config = pull::Config {
        durable_name: Some(name.to_owned()),
        description: Some(format!("{DESCRIPTION}{}", route.route_id)),
        filter_subject: route.nats_subject.clone(),
        deliver_policy,
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        max_ack_pending: (IN_FLIGHT * 2) as i64,
        ..Default::default()
    };
    match stream.create_consumer(config).await {
        Ok(c) => {
            tracing::info!(route_id = %route.route_id, stream = %route.nats_stream, consumer = %name, deliver = ?deliver_policy, "NATS consumer created");
            Ok(c)
        }
        // Another replica made it at the same moment (perhaps from a later floor): theirs it is.
        Err(e) => stream
            .get_consumer(name)
            .await
            .map_err(|_| anyhow::anyhow!("{e}")),
    }
}

/// Removes the route's other consumers on its stream (earlier definitions'), once its own is
/// in place and only while the store still defines the route this way.
async fn remove_earlier(
    ingress: &Ingress,
    stream: &jetstream::stream::Stream,
    route: &Route,
    name: &str,
) -> anyhow::Result<()> {
    let earlier: Vec<String> = consumers_of(stream, &route.route_id)
        .await?
        .into_iter()
        .map(|c| c.name)
        .filter(|n| n != name)
        .collect();
    if earlier.is_empty() || !still_defined(ingress, route).await? {
        return Ok(());
    }
    for old in earlier {
        match stream.delete_consumer(&old).await {
            Ok(_) => {
                tracing::info!(route_id = %route.route_id, stream = %route.nats_stream, consumer = %old, "NATS consumer of the route's earlier definition removed")
            }
            Err(e) if gone_already(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Opens the route's consumer (made, or continued) and pulls its messages until the stream
/// ends or stopping begins, deciding them concurrently; returns once those taken are answered.
async fn consume_once(
    ingress: &Ingress,
    js: &jetstream::Context,
    route: &Route,
    state: &AtomicU8,
    stopping: &Signal,
) -> anyhow::Result<()> {
    // Opening only asks NATS: given up at stopping, nothing taken yet.
    let mut messages = tokio::select! {
        m = open_messages(ingress, js, route) => m?,
        () = stopping.wait() => return Ok(()),
    };
    state.store(CONSUMING, Ordering::Relaxed);
    tracing::info!(route_id = %route.route_id, stream = %route.nats_stream, consumer = %consumer_of(route), "NATS consumer started");
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    // Over a quota the route pulls nothing until the quota would admit again: what it would
    // pull stays in the stream.
    let paused = std::sync::Arc::new(std::sync::Mutex::new(None::<tokio::time::Instant>));
    // The messages being decided: this consumer's own, joined before it returns (and ended
    // with it when its route changes), so the lifecycle need not track them one by one.
    let mut work = JoinSet::new();
    loop {
        let next = tokio::select! {
            m = messages.next() => m,
            () = stopping.wait() => None,
        };
        let Some(m) = next else { break };
        let m = m.map_err(|e| anyhow::anyhow!("{e}"))?;
        let until = *paused.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
        let slot = slots.clone().acquire_owned().await?;
        let (ingress, route, paused) = (ingress.clone(), route.clone(), paused.clone());
        work.spawn(async move {
            let done = take(&ingress, &route, m, &paused).await;
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

/// The route's consumer, made or continued (earlier definitions' removed once it stands), as a
/// stream of messages pulled ahead, FETCH at a time.
async fn open_messages(
    ingress: &Ingress,
    js: &jetstream::Context,
    route: &Route,
) -> anyhow::Result<pull::Stream> {
    let stream = js.get_stream(&route.nats_stream).await?;
    let name = consumer_of(route);
    let consumer: jetstream::consumer::PullConsumer = match stream.consumer_info(&name).await {
        Ok(_) => stream
            .get_consumer(&name)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => {
            create(ingress, &stream, route, &name).await?
        }
        Err(e) => return Err(e.into()),
    };
    // Consuming matters more than tidying: an earlier consumer left in place is removed at the
    // next start, and consumes nothing meanwhile (no replica pulls from it).
    if let Err(e) = remove_earlier(ingress, &stream, route, &name).await {
        tracing::warn!(route_id = %route.route_id, stream = %route.nats_stream, error = %e, "NATS consumers of the route's earlier definition not removed");
    }
    // Messages stream in (pulled ahead, FETCH at a time) while earlier ones are decided;
    // at most IN_FLIGHT are being decided at once, so a slow store slows the pulling.
    Ok(consumer
        .stream()
        .max_messages_per_batch(FETCH)
        .heartbeat(FETCH_WAIT)
        .expires(FETCH_WAIT * 10)
        .messages()
        .await?)
}

/// Decides one message and answers NATS: acknowledged once its triggers are recorded or
/// counted, terminated (never redelivered) when it is malformed, redelivered later when the
/// store could not take it.
async fn take(
    ingress: &Ingress,
    route: &Route,
    m: jetstream::Message,
    paused: &std::sync::Mutex<Option<tokio::time::Instant>>,
) -> anyhow::Result<()> {
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
        ingress.delivery.call_timeout(),
        ingress.route_message(route, &headers, &m.payload, delivery_id.clone()),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Error::Unavailable(
            "the store did not answer in time".into(),
        ))
    });
    let answer = match decided {
        Ok(_) => AckKind::Ack,
        Err(Error::Throttled { retry_after, .. }) => {
            // Redelivered once the quota would admit it; nothing of it was decided. The pause
            // stays below the ack wait, so messages pulled meanwhile are not redelivered.
            let delay = retry_after.clamp(Duration::from_millis(1), MAX_PAUSE);
            let until = tokio::time::Instant::now() + delay;
            let mut p = paused.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_none_or(|u| u < until) {
                *p = Some(until);
            }
            AckKind::Nak(Some(delay))
        }
        Err(Error::Unavailable(e)) => {
            tracing::debug!(route_id = %route.route_id, error = %e, "NATS message to be redelivered");
            AckKind::Nak(Some(RETRY))
        }
        Err(e) => {
            // The delivery id and the reason carry the publisher's text (its Nats-Msg-Id, a
            // ref it sent): written quoted and escaped, so no space or `=` in them can forge a
            // field of the line.
            tracing::warn!(route_id = %route.route_id, delivery_id = ?delivery_id, reason = ?e.to_string(), "NATS message terminated");
            ingress
                .delivery
                .metrics
                .ingress_refused(IngressKind::Nats.as_str());
            AckKind::Term
        }
    };
    m.ack_with(answer).await.map_err(|e| anyhow::anyhow!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_name_follows_the_route_its_stream_and_subject() {
        let name = consumer_name("storms", "STORMS", "storms.>");
        assert_eq!(
            name,
            consumer_name("storms", "STORMS", "storms.>"),
            "every replica agrees"
        );
        assert!(name.starts_with("hcp-sense-storms-"), "{name}");
        for other in [
            consumer_name("storms", "STORMS", "storms.north.>"),
            consumer_name("storms", "GALES", "storms.>"),
            consumer_name("gales", "STORMS", "storms.>"),
        ] {
            assert_ne!(name, other);
        }
        // Ids that differ only in '.' and '_' read alike in the name, but never share a consumer.
        assert_ne!(
            consumer_name("a.b", "S", "s.>"),
            consumer_name("a_b", "S", "s.>")
        );
        // The longest route id (128 characters) makes a valid JetStream name, under its 255.
        let longest = consumer_name(&"a.".repeat(64), "S", "s.>");
        assert_eq!(longest.len(), "hcp-sense-".len() + 128 + 1 + 8);
        assert!(!longest.contains(['.', '*', '>', ' ']), "{longest}");
    }

    #[test]
    fn a_route_knows_its_consumers_by_description_or_by_its_unhashed_name() {
        let mine = format!("{DESCRIPTION}storms");
        assert!(belongs_to(
            "hcp-sense-storms-00000000",
            Some(&mine),
            "storms"
        ));
        assert!(!belongs_to(
            "hcp-sense-storms-00000000",
            Some(&mine),
            "storm"
        ));
        assert!(!belongs_to(
            "x",
            Some(&format!("{DESCRIPTION}storms.north")),
            "storms"
        ));
        assert!(!belongs_to(
            "hcp-sense-storms",
            Some("someone else's"),
            "storms"
        ));
        // Made before names carried a hash: no description, the old name.
        assert!(belongs_to("hcp-sense-storms", None, "storms"));
        assert!(belongs_to("hcp-sense-a_b", Some(""), "a.b"));
        assert!(!belongs_to("hcp-sense-storms-1", None, "storms"));
    }
}
