//! IngestService: DeliverTrigger and the DeliverTriggers stream, translated and handed to the decision.
use std::pin::Pin;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::convert::{disposition, drop_reason, struct_to_json_checked, trigger_source_from};
use super::guard::CallerBucket;
use super::pb::{
    self, deliver_trigger_request::PayloadSource, deliver_triggers_response,
    ingest_service_server::IngestService,
};
use crate::domain::explain::{Check, Verdict};
use crate::domain::quota::Rule;
use crate::domain::trigger::{Decision, Outcome, RawTrigger};
use crate::error::Error;
use crate::lifecycle::Signal;
use crate::service::deliver::{
    Delivery, SOURCE_DELIVER_TRIGGER, SOURCE_DELIVER_TRIGGERS, SOURCE_JSON_DELIVER_TRIGGER,
    SOURCE_JSON_DELIVER_TRIGGERS,
};

/// A call the JSON door made for its HTTP client (the decision log names that door).
fn through_json_door<T>(req: &Request<T>) -> bool {
    req.extensions()
        .get::<crate::grpc::guard::DoorPeer>()
        .is_some()
}
use crate::service::QuotaCheck;

/// Triggers of one DeliverTriggers stream being decided and written at once: enough to fill
/// the sink's batches from a single producer, bounded so a fast producer waits on HTTP/2 flow
/// control instead of growing the server's memory.
pub const STREAM_WINDOW: usize = 1024;

/// Stream triggers in flight across every stream of the server: what bounds memory however
/// many streams and connections there are (each trigger up to --max-payload-bytes).
pub const STREAM_TRIGGERS_IN_FLIGHT: usize = 4096;

#[derive(Clone, Debug)]
pub struct IngestApi {
    pub delivery: Delivery,
    /// Shared by every DeliverTriggers stream (STREAM_TRIGGERS_IN_FLIGHT permits).
    pub in_flight: Arc<Semaphore>,
    /// A DeliverTriggers stream that sends nothing for this long is ended (--idle-timeout-secs):
    /// an open stream is a call in flight, which keeps its connection from closing when idle.
    pub idle: Duration,
    /// Given once the server begins to stop: open streams stop reading triggers then.
    pub stopping: Signal,
}

impl IngestApi {
    pub fn new(delivery: Delivery, idle: Duration, stopping: Signal) -> IngestApi {
        IngestApi {
            delivery,
            in_flight: Arc::new(Semaphore::new(STREAM_TRIGGERS_IN_FLIGHT)),
            idle,
            stopping,
        }
    }
}

/// The trigger a request carries, or the field it breaks.
fn raw_trigger(r: pb::DeliverTriggerRequest) -> Result<RawTrigger, Error> {
    let payload = match r.payload_source {
        None => None,
        Some(PayloadSource::Payload(s)) => Some(struct_to_json_checked("payload", s)?),
        Some(PayloadSource::PayloadJson(text)) => Some(
            serde_json::from_str(&text)
                .map_err(|e| Error::invalid("payload_json", format!("is not JSON: {e}")))?,
        ),
    };
    Ok(RawTrigger {
        pack_id: r.pack_id,
        r#ref: r.r#ref,
        principal: r.principal,
        land: r.land,
        payload,
        project: r.project,
        trigger_id: r.trigger_id,
        source: trigger_source_from(r.source),
    })
}

fn check(c: &Check) -> pb::DecisionCheck {
    pb::DecisionCheck {
        name: c.name.to_owned(),
        verdict: match c.verdict {
            Verdict::Pass => pb::CheckVerdict::Pass,
            Verdict::Fail => pb::CheckVerdict::Fail,
            Verdict::NotReached => pb::CheckVerdict::NotReached,
        } as i32,
        drop_reason: drop_reason(c.reason) as i32,
        facts: c
            .facts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        detail: c.detail.clone(),
    }
}

fn response(o: Outcome) -> pb::DeliverTriggerResponse {
    pb::DeliverTriggerResponse {
        disposition: disposition(&o) as i32,
        drop_reason: o
            .drop_reason
            .map_or(pb::DropReason::Unspecified, drop_reason) as i32,
        record_id: o.record_id.unwrap_or_default(),
        duplicate: o.duplicate,
    }
}

/// One trigger of a stream, decided and written exactly as DeliverTrigger would.
async fn deliver_one(
    delivery: Delivery,
    r: Option<pb::DeliverTriggerRequest>,
    source: &'static str,
) -> deliver_triggers_response::Result {
    use deliver_triggers_response::Result as R;
    let outcome = match r {
        None => Err(Error::invalid("trigger", "is required")),
        Some(r) => match raw_trigger(r) {
            Ok(t) => delivery.deliver_from(t, source).await,
            Err(e) => Err(e),
        },
    };
    match outcome {
        Ok(o) => R::Outcome(response(o)),
        Err(e) => refused(e),
    }
}

/// ExplainTrigger's quotas: the rules a trigger meets, as quotas, and whether they admit it now.
fn quota_check(pack_id: &str, principal: &str, q: &QuotaCheck) -> pb::QuotaCheck {
    let as_quota = |rule: Option<Rule>, principal: Option<&str>| {
        rule.map(|rule| pb::Quota {
            pack_id: pack_id.to_owned(),
            principal: principal.map(str::to_owned),
            rate_per_second: rule.rate,
            burst: rule.burst,
            update_time: None,
        })
    };
    pb::QuotaCheck {
        pack_quota: as_quota(q.pack, None),
        principal_quota: as_quota(q.principal, Some(principal)),
        admits: q.retry_after.is_zero(),
        retry_delay: (!q.retry_after.is_zero()).then(|| super::convert::duration(q.retry_after)),
    }
}

/// A trigger refused with the status DeliverTrigger would have answered.
fn refused(e: Error) -> deliver_triggers_response::Result {
    deliver_triggers_response::Result::Error(super::status::trigger_error(e))
}

type Outcomes = Pin<Box<dyn Stream<Item = Result<pb::DeliverTriggersResponse, Status>> + Send>>;

#[tonic::async_trait]
impl IngestService for IngestApi {
    async fn deliver_trigger(
        &self,
        req: Request<pb::DeliverTriggerRequest>,
    ) -> Result<Response<pb::DeliverTriggerResponse>, Status> {
        let source = if through_json_door(&req) {
            SOURCE_JSON_DELIVER_TRIGGER
        } else {
            SOURCE_DELIVER_TRIGGER
        };
        let raw = raw_trigger(req.into_inner())?;
        let o = self.delivery.deliver_from(raw, source).await?;
        Ok(Response::new(response(o)))
    }

    async fn explain_trigger(
        &self,
        req: Request<pb::ExplainTriggerRequest>,
    ) -> Result<Response<pb::ExplainTriggerResponse>, Status> {
        let r = req
            .into_inner()
            .trigger
            .ok_or_else(|| Error::invalid("trigger", "is required"))?;
        // Fields are named as this request holds them: `trigger.ref`, not `ref`.
        let under = |e: Error| match e {
            Error::InvalidArgument(v) => Error::InvalidArgument(
                v.into_iter()
                    .map(|mut x| {
                        x.field = format!("trigger.{}", x.field);
                        x
                    })
                    .collect(),
            ),
            e => e,
        };
        let raw = raw_trigger(r).map_err(under)?;
        let (pack_id, principal) = (raw.pack_id.clone(), raw.principal.clone());
        let e = self.delivery.explain(raw).await.map_err(under)?;
        let o = e.outcome();
        Ok(Response::new(pb::ExplainTriggerResponse {
            disposition: disposition(&o) as i32,
            drop_reason: o
                .drop_reason
                .map_or(pb::DropReason::Unspecified, drop_reason) as i32,
            checks: e.explanation.checks.iter().map(check).collect(),
            binding_id: match (&e.duplicate, &e.explanation.decision) {
                (Some(r), _) => r.binding_id.clone(),
                (None, Decision::Record { binding_id, .. }) => binding_id.clone(),
                (None, Decision::Drop(_)) => String::new(),
            },
            duplicate_record_id: e.duplicate.map(|r| r.record_id.clone()).unwrap_or_default(),
            quota: Some(quota_check(&pack_id, &principal, &e.quota)),
        }))
    }

    type DeliverTriggersStream = Outcomes;

    /// Each trigger read is started at once as a task of its own, so one stream fills the
    /// sink's batches; outcomes are sent in the order the triggers came, at most
    /// STREAM_WINDOW of them in flight per stream and STREAM_TRIGGERS_IN_FLIGHT in all. A
    /// trigger whose (pack, trigger id) an earlier one in flight carries waits for it, so the
    /// first sent is the one recorded. A request that cannot be decoded ends the stream with
    /// its status, after the outcomes of every trigger before it.
    async fn deliver_triggers(
        &self,
        req: Request<Streaming<pb::DeliverTriggersRequest>>,
    ) -> Result<Response<Self::DeliverTriggersStream>, Status> {
        // Under --rate-limit-per-sec each trigger after the first takes a token of its own, as
        // DeliverTrigger calls would; one refused is answered RESOURCE_EXHAUSTED in its place.
        let bucket = req.extensions().get::<CallerBucket>().cloned();
        let source = if through_json_door(&req) {
            SOURCE_JSON_DELIVER_TRIGGERS
        } else {
            SOURCE_DELIVER_TRIGGERS
        };
        // The caller's credential expiring ends the stream too: the guard's timer does that
        // for every stream (grpc/lifetime.rs).
        let inbound = req.into_inner();
        let (tx, pending) = mpsc::channel(STREAM_WINDOW);
        // The call's own task, not the lifecycle's: it ends with the call (at stopping it
        // answers what it read and ends the stream), which the server waits for.
        tokio::spawn(start_each(
            inbound,
            self.delivery.clone(),
            self.in_flight.clone(),
            self.idle,
            // The caller's rate-limit bucket, and the decision log's source.
            (bucket, source),
            self.stopping.clone(),
            tx,
        ));
        let outcomes = async_stream(move |out| answer_in_order(pending, out));
        Ok(Response::new(outcomes))
    }
}

/// A trigger of a DeliverTriggers stream by its index: its delivery started as a task, or the
/// status that ends the stream.
type Started = (
    u64,
    Result<tokio::task::JoinHandle<deliver_triggers_response::Result>, Status>,
);

/// Reads a stream's triggers and starts each one's delivery as a task of its own, in order,
/// until the stream ends, idles for `idle`, its answers are gone, or the server begins to
/// stop: then the triggers already read are answered and the stream ends UNAVAILABLE, so its
/// producer sends the rest to another replica at once rather than at the drain's deadline.
async fn start_each(
    mut inbound: Streaming<pb::DeliverTriggersRequest>,
    delivery: Delivery,
    in_flight: Arc<Semaphore>,
    idle: Duration,
    (bucket, source): (Option<CallerBucket>, &'static str),
    stopping: Signal,
    tx: mpsc::Sender<Started>,
) {
    let mut index: u64 = 0;
    // The last trigger in flight for each (pack, trigger id), and whether it is done.
    let mut keyed: HashMap<(String, String), watch::Receiver<bool>> = HashMap::new();
    loop {
        // Once the answers are gone (the caller left, or the stream was ended), the
        // triggers are no longer read.
        let item = tokio::select! {
            // Checked first: a stream that always has a trigger ready still ends.
            biased;
            // (Its guard is let go before the send below awaits.)
            () = stopping.wait() => {
                let stop = Error::Unavailable(format!(
                    "the server is shutting down: triggers from index {index} on were not read; send them to another replica"
                ));
                let _ = tx.send((index, Err(Status::from(stop)))).await;
                break;
            }
            item = tokio::time::timeout(idle, inbound.next()) => item,
            () = tx.closed() => break,
        };
        let Ok(item) = item else {
            // Answered after the outcomes of every trigger before it, like any end.
            let idle = Error::Unavailable(format!(
                "no trigger for {} s: the stream is closed as idle; open a new one",
                idle.as_secs()
            ));
            let _ = tx.send((index, Err(Status::from(idle)))).await;
            break;
        };
        let Some(item) = item else { break };
        // Each item after the first takes a token of the caller's, as a call would; a refusal
        // carries the bucket's wait.
        let limited = match (&item, &bucket) {
            (Ok(_), Some(b)) if index > 0 => b.take().err(),
            _ => None,
        };
        // Each trigger's delivery is a task of the lifecycle's, answered in order by
        // `answer_in_order`: a caller that leaves lets go of the answer, not of the delivery,
        // which shutdown still waits for.
        let next = match (item, limited) {
            (Ok(_), Some(refusal)) => Ok(tokio::spawn(async move { refused(refusal) })),
            (Ok(r), None) => {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let key = r
                    .trigger
                    .as_ref()
                    .filter(|t| !t.trigger_id.is_empty())
                    .map(|t| (t.pack_id.clone(), t.trigger_id.clone()));
                let (done, done_rx) = watch::channel(false);
                let before = key.and_then(|k| keyed.insert(k, done_rx));
                if keyed.len() > 2 * STREAM_WINDOW {
                    keyed.retain(|_, d| !*d.borrow());
                }
                let delivery = delivery.clone();
                Ok(delivery.lifecycle().clone().spawn(async move {
                    if let Some(mut before) = before {
                        let _ = before.wait_for(|d| *d).await;
                    }
                    let result = deliver_one(delivery, r.trigger, source).await;
                    let _ = done.send(true);
                    drop(permit);
                    result
                }))
            }
            (Err(status), _) => Err(status),
        };
        let end = next.is_err();
        if tx.send((index, next)).await.is_err() || end {
            break;
        }
        index += 1;
    }
}

/// Sends each started trigger's outcome, in the order the triggers came, until one ends the
/// stream or the caller is gone.
async fn answer_in_order(
    mut pending: mpsc::Receiver<Started>,
    out: mpsc::Sender<Result<pb::DeliverTriggersResponse, Status>>,
) {
    loop {
        // An answer stream that is gone (the caller left, or its credential expired)
        // lets go of the triggers, which stops their reading.
        let next = tokio::select! {
            next = pending.recv() => next,
            () = out.closed() => break,
        };
        let Some((index, next)) = next else { break };
        let item = match next {
            Ok(task) => match task.await {
                Ok(result) => Ok(pb::DeliverTriggersResponse {
                    index,
                    result: Some(result),
                }),
                Err(e) => {
                    tracing::error!(error = %e, index, "a trigger's delivery task failed");
                    Err(Error::internal_from("a trigger's delivery task failed", e).into())
                }
            },
            Err(status) => Err(status),
        };
        let end = item.is_err();
        if out.send(item).await.is_err() || end {
            break;
        }
    }
}

/// A stream fed by a task through a channel of one: the task waits for each item to be taken.
fn async_stream<F, Fut>(body: F) -> Outcomes
where
    F: FnOnce(mpsc::Sender<Result<pb::DeliverTriggersResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1);
    // The call's own task: it ends when the stream's reader (tonic) goes.
    tokio::spawn(body(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
