//! DeliverTrigger: validate, decide on the policy view, then record or drop — traced and counted.
use crate::store::audit::Actor;
use std::time::Instant;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use super::checks::{Checks, INLINE_UNITS};
use super::decisions::{current_trace_id, DecisionLog};
use super::drops::DropLog;
use super::{Limits, PolicyState};
use crate::domain::decide::{binding_degraded, decide, validate};
use crate::domain::decision_log::{drop_deciding_check, Entry, Logged, Note};
use crate::domain::explain::{explain, Explanation};
use crate::domain::model::{Binding, Record};
use crate::domain::pack::schema::{PayloadSchema, PayloadViolation};
use crate::domain::policy::{BindingRef, PolicyView, Route};
use crate::domain::trigger::{Decision, DropReason, Outcome, RawTrigger, Trigger};
use crate::error::{Error, Result, Violation};
use crate::metrics::Metrics;
use crate::store::Stored;
use crate::store::{DeliveryTables, Sink};
use std::sync::Arc;

/// The ingress of a trigger handed over by DeliverTrigger(s).
pub const INGRESS_GRPC: &str = "grpc";
/// The ingress of the triggers the service produces itself as the runtime's hub (§7.7.3).
pub const INGRESS_HUB: &str = "hub";

/// Triggers of one message decided at once (a fan-out's, in chunks of this many).
const FAN_OUT_AT_ONCE: usize = 256;

/// What a door hands to the admission pipeline: the triggers of one message (a call, a
/// stream's item, a signed request, a NATS message), admitted whole or refused whole.
#[derive(Debug, Clone)]
pub struct Message {
    pub triggers: Vec<RawTrigger>,
    /// The door it came in by: the `hcp.ingress` span attribute and the `ingress` label of
    /// the delivery counts.
    pub ingress: &'static str,
    /// Every trigger carries one payload under one ref (a route's fan-out): its schema is
    /// checked once for all.
    pub one_payload: bool,
    /// Where it came from, as the decision log says: the door, and what within it
    /// (`grpc:DeliverTrigger`, `http:<route id>`).
    pub source: String,
}

impl Message {
    /// A message of one payload carried to each of `triggers` (one, or a route's fan-out).
    pub fn fanned(triggers: Vec<RawTrigger>, ingress: &'static str) -> Message {
        Message {
            triggers,
            ingress,
            one_payload: true,
            source: ingress.to_owned(),
        }
    }

    /// A message of one trigger.
    pub fn one(raw: RawTrigger, ingress: &'static str) -> Message {
        Message::fanned(vec![raw], ingress)
    }

    /// The message, from `source` within its door.
    pub fn from_source(mut self, source: impl Into<String>) -> Message {
        self.source = source.into();
        self
    }
}

/// The decision log's source of DeliverTrigger and of DeliverTriggers' items.
pub const SOURCE_DELIVER_TRIGGER: &str = "grpc:DeliverTrigger";
pub const SOURCE_DELIVER_TRIGGERS: &str = "grpc:DeliverTriggers";
/// The same, called through the JSON door (src/web).
pub const SOURCE_JSON_DELIVER_TRIGGER: &str = "json:DeliverTrigger";
pub const SOURCE_JSON_DELIVER_TRIGGERS: &str = "json:DeliverTriggers";

/// The span of one decision, made once the decision is known so that a sampler
/// can see a drop, with the attributes dashboards read under the `hcp.` prefix.
pub fn decision_span(t: &Trigger, d: &Decision, hash_principal: bool, ingress: &str) -> Span {
    let principal = if hash_principal {
        let digest = Sha256::digest(t.principal.as_bytes());
        digest
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    } else {
        t.principal.clone()
    };
    let disposition = d.disposition();
    let reason = match d {
        Decision::Drop(r) => r.as_str(),
        Decision::Record { .. } => "",
    };
    let span = tracing::info_span!(
        "sense.decision",
        hcp.pack_id = %t.pack_id,
        hcp.r#ref = %t.r#ref,
        hcp.principal = %principal,
        hcp.land = %t.land,
        hcp.disposition = disposition,
        hcp.ingress = ingress,
        hcp.drop_reason = Empty,
        hcp.record_id = Empty,
        hcp.queue_wait_us = Empty,
    );
    if !reason.is_empty() {
        span.record("hcp.drop_reason", reason);
    }
    span
}

fn note(span: &Span, o: &Outcome) {
    if let Some(id) = &o.record_id {
        span.record("hcp.record_id", id.as_str());
    }
}

fn conflict(trigger_id: &str) -> Error {
    Error::AlreadyExists(format!(
        "trigger_id `{trigger_id}` was already used for a different trigger of this pack (another principal, ref, land or payload): a retry carries the same, a new trigger a new id"
    ))
}

fn schema_of(view: &PolicyView, pack_id: &str, r#ref: &str) -> Option<Arc<PayloadSchema>> {
    view.pack(pack_id)?.trigger_types.schema_arc(r#ref)
}

/// Bytes of `v`'s JSON text, counted without writing it.
/// The violations of a payload against the schema of `ref` as INVALID_ARGUMENT; none: Ok.
fn refused(r#ref: &str, violations: Vec<PayloadViolation>) -> Result<()> {
    if violations.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(
        violations
            .into_iter()
            .map(|v| Violation {
                field: format!("payload{}", v.pointer),
                description: format!(
                    "fails `{}` of the payload schema of `{}` at `{}`: {}",
                    v.keyword,
                    r#ref,
                    if v.pointer.is_empty() {
                        "/"
                    } else {
                        &v.pointer
                    },
                    v.message
                ),
            })
            .collect(),
    ))
}

/// A decision log entry of `t`, decided now; the outcome's details are the caller's.
fn entry_of(t: &Trigger, source: &str, outcome: Logged) -> Entry {
    Entry {
        seq: 0,
        decided_time: crate::store::now_micros(),
        pack_id: t.pack_id.clone(),
        r#ref: t.r#ref.clone(),
        principal: t.principal.clone(),
        land: t.land.clone(),
        project: t.project.clone(),
        binding_id: String::new(),
        trigger_id: t.trigger_id.clone(),
        source: source.to_owned(),
        outcome,
        drop_reason: None,
        check: String::new(),
        detail: String::new(),
        record_id: None,
        trace_id: None,
        folded: 0,
    }
}

/// A record for a trigger; its id and receive time are stamped when it is written.
fn new_record(t: &Trigger, route: Route, binding_id: String) -> Record {
    Record {
        record_id: String::new(),
        principal: t.principal.clone(),
        binding_id,
        land: t.land.clone(),
        pack_id: t.pack_id.clone(),
        r#ref: t.r#ref.clone(),
        payload: t.payload.clone(),
        route,
        project: t.project.clone(),
        trigger_id: t.trigger_id.clone(),
        received_time: 0,
        position: Default::default(),
    }
}

/// DeliverTrigger(s) and ExplainTrigger: a trigger validated, checked against its payload
/// schema and quotas, decided on the policy view, then recorded through the sink or dropped,
/// traced and counted. Owns the sink, the drop log and the quota allowances.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub(super) store: DeliveryTables,
    pub(super) policy: Arc<PolicyState>,
    pub(super) drops: Arc<DropLog>,
    /// The decision log: an entry per decision answered.
    pub(super) log: Arc<DecisionLog>,
    pub(super) sink: Sink,
    pub(super) quotas: Arc<super::quota::Quotas>,
    pub(super) limits: Arc<Limits>,
    pub(super) checks: Arc<Checks>,
    /// Trigger ids recorded or answered lately: which deliveries to look up before the sink.
    pub(super) recent: Arc<super::recent::Recent>,
    pub metrics: Arc<Metrics>,
    /// What a door starts for a delivery (an ingress decision run to its end) is started here.
    pub(super) life: crate::lifecycle::Lifecycle,
}

impl Delivery {
    /// The lifecycle a door starts its tasks through.
    pub fn lifecycle(&self) -> &crate::lifecycle::Lifecycle {
        &self.life
    }

    /// Whether checking `payload` against `schema` is cheap enough to run on this thread:
    /// its reckoned work at the payload's size (or at the largest payload) is small.
    /// `bytes` is asked for only when the largest payload would not be cheap.
    fn inline(&self, schema: &PayloadSchema, bytes: impl FnOnce() -> usize) -> bool {
        schema.work.check_work(self.limits.max_payload_bytes) <= INLINE_UNITS
            || schema.work.check_work(bytes()) <= INLINE_UNITS
    }

    /// Whether a validated trigger's payload conforms to the schema its pack declares for its
    /// ref (none: it does): a violation is INVALID_ARGUMENT naming `payload` and the
    /// instance's JSON pointer. The payload is lent to the validator as a JSON value and
    /// given back (no copy); lost only when the check is refused as UNAVAILABLE. A check too
    /// large to run inline runs on the check pool (UNAVAILABLE when it is full or slow).
    async fn conforms_trigger(&self, view: &PolicyView, t: &mut Trigger) -> Result<()> {
        // A ref without a schema leaves the payload untouched.
        let Some(schema) = schema_of(view, &t.pack_id, &t.r#ref) else {
            return Ok(());
        };
        let payload = Value::Object(std::mem::take(&mut t.payload));
        let (payload, violations) = if self.inline(&schema, || t.payload_bytes) {
            let v = schema.check(&payload);
            (payload, v)
        } else {
            self.checks
                .run(
                    &t.pack_id,
                    &format!("the payload of `{}`", t.r#ref),
                    move || {
                        let v = schema.check(&payload);
                        (payload, v)
                    },
                )
                .await?
        };
        if let Value::Object(m) = payload {
            t.payload = m;
        }
        refused(&t.r#ref, violations)
    }

    /// The check pool, for other work that grows with a request's input (lint).
    pub fn checks(&self) -> &Checks {
        &self.checks
    }

    /// Longest a call may wait on the store (`--request-timeout-secs`); an ingress request or
    /// message that takes longer is answered as the store being unavailable.
    pub fn call_timeout(&self) -> std::time::Duration {
        self.limits.batch_timeout
    }

    /// The current policy view.
    pub fn view(&self) -> Arc<PolicyView> {
        self.policy.view.load_full()
    }

    /// Largest trigger payload accepted, in bytes (also the largest ingress request body).
    pub fn max_payload_bytes(&self) -> usize {
        self.limits.max_payload_bytes
    }

    /// Validates, decides and records or drops one trigger handed over by DeliverTrigger(s).
    /// A well-formed trigger is always answered with an outcome (§7.3.2); only malformed
    /// input, a refusal before the decision or an unreachable store is an error.
    pub async fn deliver(&self, raw: RawTrigger) -> Result<Outcome> {
        self.deliver_from(raw, SOURCE_DELIVER_TRIGGER).await
    }

    /// `deliver`, the decision log saying `source` (one of DeliverTriggers' items).
    pub async fn deliver_from(&self, raw: RawTrigger, source: &str) -> Result<Outcome> {
        let mut outcomes = self
            .deliver_message(Message::one(raw, INGRESS_GRPC).from_source(source))
            .await?;
        outcomes
            .pop()
            .ok_or_else(|| Error::internal("a trigger was delivered without an outcome"))
    }

    /// The one admission pipeline, whatever door a message came in by: each trigger is
    /// validated, then the message is checked against its payload schema, its trigger ids
    /// and its quotas — all or none — and each trigger decided, then recorded or dropped.
    /// The outcomes are in the triggers' order; an error refuses the whole message and
    /// nothing of it was decided (a store that fails mid-way is the exception: what was
    /// recorded stays, and a retry is answered with it).
    ///
    /// A refusal before the decision (a payload its schema refuses, over quota) gives way to
    /// idempotency: a message whose every trigger was recorded before is answered with those
    /// records, whatever the schema or the quota says now.
    pub async fn deliver_message(&self, m: Message) -> Result<Vec<Outcome>> {
        let started = Instant::now();
        let mut triggers = m
            .triggers
            .into_iter()
            .map(|raw| self.validated(raw))
            .collect::<Result<Vec<_>>>()?;
        let Some(pack_id) = triggers.first().map(|t| t.pack_id.clone()) else {
            return Ok(Vec::new());
        };
        if triggers.iter().any(|t| t.pack_id != pack_id) {
            return Err(Error::invalid(
                "pack_id",
                "differs between the triggers of one message: a message is of one pack",
            ));
        }
        self.policy.current_or_unavailable()?;
        let view = self.policy.view.load_full();
        let conformed = self
            .conforms_message(&view, &mut triggers, m.one_payload)
            .await;
        // Validation (the payload's schema with it) counts in the decision's time.
        let checked = started.elapsed();
        let refused = |e: Error, check: &str| {
            self.log_refused(&triggers, &m.source, check, &e);
            e
        };
        self.unless_recorded(&triggers, conformed)
            .await
            .map_err(|e| refused(e, "schema"))?;
        let principals: Vec<&str> = triggers.iter().map(|t| t.principal.as_str()).collect();
        let taken = self.admit(&view, &pack_id, &principals).await;
        self.unless_recorded(&triggers, taken)
            .await
            .map_err(|e| refused(e, "quota"))?;
        let source: Arc<str> = m.source.into();
        self.decide_message(view, triggers, (m.ingress, source), checked)
            .await
    }

    /// The decision log's entries of a message refused before the decision: a payload its
    /// schema refuses, or over a quota. Anything else (the store unavailable) decided nothing.
    fn log_refused(&self, triggers: &[Trigger], source: &str, check: &str, e: &Error) {
        if !matches!(e, Error::InvalidArgument(_) | Error::Throttled { .. }) {
            return;
        }
        let trace_id = current_trace_id();
        for t in triggers {
            let mut entry = entry_of(t, source, Logged::Refused);
            entry.check = check.to_owned();
            entry.detail = e.to_string();
            entry.trace_id.clone_from(&trace_id);
            self.log.take(entry);
        }
    }

    /// Whether a message's payloads conform to their refs' schemas: once for a message whose
    /// triggers carry one payload under one ref (a fan-out), else each trigger's.
    async fn conforms_message(
        &self,
        view: &PolicyView,
        triggers: &mut [Trigger],
        one_payload: bool,
    ) -> Result<()> {
        let checked = if one_payload {
            &mut triggers[..1]
        } else {
            triggers
        };
        for t in checked {
            self.conforms_trigger(view, t).await?;
        }
        Ok(())
    }

    /// A refusal before the decision, unless every trigger of the message names its id and
    /// was recorded before: idempotency comes first, and a retry of a recorded message is
    /// answered with its records.
    async fn unless_recorded(&self, triggers: &[Trigger], refused: Result<()>) -> Result<()> {
        let Err(e) = refused else {
            return Ok(());
        };
        for t in triggers {
            let Some(id) = &t.trigger_id else {
                return Err(e);
            };
            // Only a retry of the recorded trigger is answered with its record; another
            // message reusing the id has its own refusal.
            if !self
                .store
                .record_for_trigger(&t.pack_id, id)
                .await?
                .is_some_and(|r| r.same_trigger(t.identity()))
            {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Decides a message's admitted triggers, then records or drops each; the outcomes in the
    /// triggers' order. A wide message is decided FAN_OUT_AT_ONCE at a time, each trigger a
    /// task of its own, so the sink commits a fan-out's records together instead of one
    /// batch each.
    async fn decide_message(
        &self,
        view: Arc<PolicyView>,
        mut triggers: Vec<Trigger>,
        ingress: (&'static str, Arc<str>),
        checked: std::time::Duration,
    ) -> Result<Vec<Outcome>> {
        if triggers.len() == 1 {
            let t = triggers.remove(0);
            return Ok(vec![self.decide_one(&view, t, &ingress, checked).await?]);
        }
        let mut out = Vec::with_capacity(triggers.len());
        let mut rest = triggers.into_iter().peekable();
        while rest.peek().is_some() {
            let mut set = tokio::task::JoinSet::new();
            for (n, t) in rest.by_ref().take(FAN_OUT_AT_ONCE).enumerate() {
                let (this, view, ingress) = (self.clone(), view.clone(), ingress.clone());
                set.spawn(async move { (n, this.decide_one(&view, t, &ingress, checked).await) });
            }
            let mut chunk = Vec::with_capacity(set.len());
            while let Some(done) = set.join_next().await {
                let (n, outcome) =
                    done.map_err(|e| Error::internal_from("a trigger's decision failed", e))?;
                chunk.push((n, outcome?));
            }
            chunk.sort_by_key(|(n, _)| *n);
            out.extend(chunk.into_iter().map(|(_, o)| o));
        }
        Ok(out)
    }

    /// Decides an admitted trigger, then records or drops it.
    async fn decide_one(
        &self,
        view: &PolicyView,
        t: Trigger,
        (ingress, source): &(&'static str, Arc<str>),
        validated: std::time::Duration,
    ) -> Result<Outcome> {
        let ingress = *ingress;
        let started = Instant::now();
        let mut decision = decide(view, &t);
        let decided = validated + started.elapsed();
        // Idempotency comes before policy: a retry of a trigger that was recorded is answered
        // with its record, even if policy has changed since (a grant revoked meanwhile must
        // not turn an acknowledged record into a drop). A dropped trigger with an id looks its
        // first record up here. So does one to record whose id this replica recorded or
        // answered lately (see `recent`): a retry is answered from that read, without the
        // writer's transaction; any other meets its first record in the sink, which decides.
        let mut first = None;
        let look = |id: &str| match decision {
            Decision::Drop(_) => true,
            Decision::Record { .. } => self.recent.seen(&t.pack_id, id),
        };
        if let Some(id) = t.trigger_id.as_deref().filter(|id| look(id)) {
            if let Some(r) = self.store.record_for_trigger(&t.pack_id, id).await? {
                if !r.same_trigger(t.identity()) {
                    return Err(conflict(id));
                }
                decision = Decision::Record {
                    route: r.route,
                    binding_id: r.binding_id.clone(),
                };
                first = Some(r);
            }
        }
        let span = decision_span(&t, &decision, self.limits.hash_principals, ingress);
        async {
            let outcome = match decision {
                Decision::Record { route, .. } if first.is_some() => {
                    let first = first.map(|r| r.record_id.clone()).unwrap_or_default();
                    if let Some(id) = &t.trigger_id {
                        self.recent.note(&t.pack_id, id);
                    }
                    self.log_duplicate(&t, source, &first);
                    Outcome::recorded(route, first, true)
                }
                Decision::Drop(reason) => {
                    self.drops.count(&t.pack_id, &t.r#ref, reason);
                    self.log_dropped(view, &t, source, reason);
                    Outcome::dropped(reason)
                }
                Decision::Record { route, binding_id } => {
                    let note = self.log.on().then(|| Note {
                        source: source.to_string(),
                        trace_id: current_trace_id(),
                    });
                    let outcome = self.record(new_record(&t, route, binding_id), note).await?;
                    if let Some(id) = &t.trigger_id {
                        self.recent.note(&t.pack_id, id);
                    }
                    if outcome.duplicate {
                        self.log_duplicate(
                            &t,
                            source,
                            outcome.record_id.as_deref().unwrap_or_default(),
                        );
                    }
                    outcome
                }
            };
            note(&Span::current(), &outcome);
            self.metrics
                .delivered(&t.pack_id, &outcome, decided, ingress);
            if let Some(reason) = outcome.drop_reason {
                tracing::debug!(reason = reason.as_str(), "trigger dropped");
            }
            Ok(outcome)
        }
        .instrument(span)
        .await
    }

    /// A drop's entry, with the check that decided it in ExplainTrigger's words (worked out
    /// only for an entry the fold rule keeps).
    fn log_dropped(&self, view: &PolicyView, t: &Trigger, source: &str, reason: DropReason) {
        if !self.log.on() {
            return;
        }
        let mut e = entry_of(t, source, Logged::Dropped);
        e.drop_reason = Some(reason);
        e.trace_id = current_trace_id();
        self.log.take_with(e, |e| {
            let (check, detail) = drop_deciding_check(view, t);
            e.check = check;
            e.detail = detail;
        });
    }

    /// A duplicate's entry: answered with its first record.
    fn log_duplicate(&self, t: &Trigger, source: &str, first: &str) {
        if !self.log.on() {
            return;
        }
        let mut e = entry_of(t, source, Logged::Duplicate);
        e.check = "idempotency".into();
        e.detail = format!(
            "trigger_id was recorded before for this pack: answered with its first record `{first}`"
        );
        e.record_id = Some(first.to_owned());
        e.trace_id = current_trace_id();
        self.log.take(e);
    }

    /// A received trigger validated against the limits.
    fn validated(&self, raw: RawTrigger) -> Result<Trigger> {
        validate(
            raw,
            self.limits.max_payload_bytes,
            self.limits.max_json_depth,
        )
        .map_err(|v| {
            Error::InvalidArgument(
                v.into_iter()
                    .map(|(field, description)| Violation {
                        field: field.to_owned(),
                        description,
                    })
                    .collect(),
            )
        })
    }

    /// ExplainTrigger: what `deliver` would answer now, and every check behind it, with
    /// nothing recorded, counted or traced as a delivery. The same validation, the same
    /// policy view and the same idempotency: a trigger id recorded before for the pack is
    /// answered with that record (or refused as a conflict) whatever the checks say now.
    pub async fn explain(&self, raw: RawTrigger) -> Result<Explained> {
        let mut t = self.validated(raw)?;
        self.policy.current_or_unavailable()?;
        let view = self.policy.view.load_full();
        let conformed = self.conforms_trigger(&view, &mut t).await;
        self.unless_recorded(std::slice::from_ref(&t), conformed)
            .await?;
        let explanation = explain(&view, &t);
        let quota = self.quota_check(&view, &t.pack_id, &t.principal).await?;
        let mut duplicate = None;
        if let Some(id) = &t.trigger_id {
            if let Some(r) = self.store.record_for_trigger(&t.pack_id, id).await? {
                if !r.same_trigger(t.identity()) {
                    return Err(conflict(id));
                }
                duplicate = Some(r);
            }
        }
        Ok(Explained {
            explanation,
            duplicate,
            quota,
        })
    }

    /// Stores a record through group commit, answering a repeated trigger id with the first record.
    async fn record(&self, r: Record, note: Option<Note>) -> Result<Outcome> {
        let route = r.route;
        let trigger_id = r.trigger_id.clone().unwrap_or_default();
        let pack = r.pack_id.clone();
        let written = self.sink.write(r, note).await?;
        self.metrics.resumed(&pack, written.answered.elapsed());
        // The time this record waited for a writer behind others (its lane's, or its turn).
        Span::current().record(
            "hcp.queue_wait_us",
            u64::try_from(written.waited.as_micros()).unwrap_or(u64::MAX),
        );
        Ok(match written.stored {
            Stored::Inserted { record_id } => Outcome::recorded(route, record_id, false),
            Stored::Duplicate { record_id, route } => Outcome::recorded(route, record_id, true),
            Stored::Conflict => return Err(conflict(&trigger_id)),
        })
    }

    /// Stores a Binding (or deletes it, when `b.state` is `None`) and, when it leaves
    /// `linked` in a pack that declares `binding.degraded`, decides the trigger the service
    /// produces for it as the runtime's hub (§7.7.3). The Binding as it was is read inside
    /// the write's transaction, so two replicas flipping one Binding produce the trigger
    /// once; a record is written in that same transaction, with its decision log entry. The drop or record is traced
    /// and counted like any delivery. Returns the state before and the outcome, if any.
    /// The caller holds the writer's turn.
    pub(super) async fn store_binding(
        &self,
        actor: &Actor,
        view: &PolicyView,
        change: BindingChange<'_>,
    ) -> Result<(Option<Binding>, Option<Outcome>)> {
        let produce = |before: Option<&Binding>| {
            let before_ref = before.map(|b| BindingRef {
                binding_id: b.binding_id.clone(),
                state: b.state,
            });
            let (pack_id, principal, after) = match change {
                BindingChange::Put(b) => (b.pack_id.as_str(), b.principal.as_str(), Some(b.state)),
                BindingChange::Delete { principal, pack_id } => (pack_id, principal, None),
            };
            let produced = binding_degraded(view, pack_id, principal, before_ref.as_ref(), after);
            let (record, note) = match &produced {
                Some((t, Decision::Record { route, binding_id })) => (
                    Some(new_record(t, *route, binding_id.clone())),
                    self.log.on().then(|| Note {
                        source: INGRESS_HUB.to_string(),
                        trace_id: current_trace_id(),
                    }),
                ),
                _ => (None, None),
            };
            ((before.cloned(), produced), record, note)
        };
        let started = Instant::now();
        let ((before, produced), record) = match change {
            BindingChange::Put(b) => self.store.put_binding(actor, b, produce).await?,
            BindingChange::Delete { principal, pack_id } => {
                self.store
                    .delete_binding(actor, principal, pack_id, produce)
                    .await?
            }
        };
        let Some((t, decision)) = produced else {
            return Ok((before, None));
        };
        let decided = started.elapsed();
        let span = decision_span(&t, &decision, self.limits.hash_principals, INGRESS_HUB);
        let outcome = match (decision, record) {
            // Its decision log entry was written in the Binding's transaction, with the record.
            (Decision::Record { route, .. }, Some(r)) => {
                Outcome::recorded(route, r.record_id, false)
            }
            (Decision::Drop(reason), _) => {
                self.drops.count(&t.pack_id, &t.r#ref, reason);
                self.log_dropped(view, &t, INGRESS_HUB, reason);
                Outcome::dropped(reason)
            }
            (Decision::Record { .. }, None) => {
                return Err(Error::internal("a produced record was not stored"))
            }
        };
        span.in_scope(|| {
            note(&Span::current(), &outcome);
            if let Some(reason) = outcome.drop_reason {
                tracing::debug!(reason = reason.as_str(), "binding.degraded dropped");
            }
        });
        self.metrics
            .delivered(&t.pack_id, &outcome, decided, INGRESS_HUB);
        Ok((before, Some(outcome)))
    }
}

/// ExplainTrigger's answer: the checks, and the record a repeated trigger id is answered with.
#[derive(Debug, Clone)]
pub struct Explained {
    pub explanation: Explanation,
    pub duplicate: Option<Arc<Record>>,
    /// The quotas the trigger meets, and whether they would admit it now.
    pub quota: super::QuotaCheck,
}

impl Explained {
    /// What DeliverTrigger would answer, when its quotas admit it (see `quota`).
    pub fn outcome(&self) -> Outcome {
        match (&self.duplicate, &self.explanation.decision) {
            (Some(r), _) => Outcome::recorded(r.route, r.record_id.clone(), true),
            (None, Decision::Record { route, .. }) => Outcome {
                route: Some(*route),
                drop_reason: None,
                record_id: None,
                duplicate: false,
            },
            (None, Decision::Drop(reason)) => Outcome::dropped(*reason),
        }
    }
}

/// A change to a Binding, as `store_binding` applies it.
#[derive(Debug, Clone, Copy)]
pub(super) enum BindingChange<'a> {
    Put(&'a Binding),
    Delete {
        principal: &'a str,
        pack_id: &'a str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Most bytes a delivery's future may take. Every move of it is a copy (into its task, into
    /// the box of the service's future); a store future on its path (a sea-orm query, a quota
    /// lease: thousands of bytes each) makes every delivery pay for it, taken or not. Such
    /// paths are boxed where they are awaited.
    const DELIVERY_FUTURE_BYTES: usize = 8 * 1024;

    #[tokio::test]
    async fn a_deliverys_future_stays_small_whatever_rare_paths_it_may_take() {
        let dir = tempfile::tempdir().expect("a directory");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let config = crate::config::Config::for_database(url);
        let store = crate::store::Store::connect(&config.database)
            .await
            .expect("a store");
        store.migrate_up().await.expect("the schema");
        let hub = super::super::Hub::start(
            store,
            super::super::Limits::default(),
            Arc::new(Metrics::new(16)),
        )
        .await
        .expect("a hub");
        let raw = RawTrigger {
            pack_id: "p".into(),
            r#ref: "r".into(),
            principal: "u".into(),
            land: "l".into(),
            ..Default::default()
        };
        let future = hub.delivery.deliver(raw);
        let bytes = std::mem::size_of_val(&future);
        assert!(
            bytes <= DELIVERY_FUTURE_BYTES,
            "a delivery's future takes {bytes} bytes, over {DELIVERY_FUTURE_BYTES}"
        );
        drop(future);
        hub.close(tokio::time::Instant::now() + std::time::Duration::from_secs(5))
            .await;
    }
}
