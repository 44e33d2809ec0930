//! DeliverTrigger: validate, decide on the policy view, then record or drop — traced and counted.
use crate::store::audit::Actor;
use std::time::Instant;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use super::checks::{Checks, INLINE_UNITS};
use super::drops::DropLog;
use super::{Limits, PolicyState};
use crate::domain::decide::{binding_degraded, decide, validate};
use crate::domain::explain::{explain, Explanation};
use crate::domain::model::{Binding, Record};
use crate::domain::pack::schema::{PayloadSchema, PayloadViolation};
use crate::domain::policy::{BindingRef, PolicyView, Route};
use crate::domain::trigger::{json_len, Decision, Outcome, RawTrigger, Trigger};
use crate::error::{Error, Result, Violation};
use crate::metrics::Metrics;
use crate::store::Stored;
use crate::store::{DeliveryTables, Sink};
use std::sync::Arc;

/// The ingress of a trigger handed over by DeliverTrigger(s).
pub const INGRESS_GRPC: &str = "grpc";
/// The ingress of the triggers the service produces itself as the runtime's hub (§7.7.3).
pub const INGRESS_HUB: &str = "hub";

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
        "trigger_id `{trigger_id}` was already used for a different trigger of this pack"
    ))
}

fn schema_of(view: &PolicyView, pack_id: &str, r#ref: &str) -> Option<Arc<PayloadSchema>> {
    view.pack(pack_id)?.catalog.schema_arc(r#ref)
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
/// traced and counted. Owns the sink, the drop log and the quota lanes.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub(super) store: DeliveryTables,
    pub(super) policy: Arc<PolicyState>,
    pub(super) drops: Arc<DropLog>,
    pub(super) sink: Sink,
    pub(super) quotas: Arc<super::quota::Quotas>,
    pub(super) limits: Arc<Limits>,
    pub(super) checks: Arc<Checks>,
    pub metrics: Arc<Metrics>,
}

impl Delivery {
    /// Whether `payload` conforms to the schema its pack declares for `ref` (none: it does): a
    /// violation is INVALID_ARGUMENT naming `payload` and the instance's JSON pointer. A
    /// check too large to run inline runs on the check pool (UNAVAILABLE when it is full or
    /// slow).
    pub async fn conforms(
        &self,
        view: &PolicyView,
        pack_id: &str,
        r#ref: &str,
        payload: &Value,
    ) -> Result<()> {
        let Some(schema) = schema_of(view, pack_id, r#ref) else {
            return Ok(());
        };
        let violations = if self.inline(&schema, || json_len(payload)) {
            schema.check(payload)
        } else {
            let payload = payload.clone();
            self.checks
                .run(pack_id, &format!("the payload of `{ref}`"), move || {
                    schema.check(&payload)
                })
                .await?
        };
        refused(r#ref, violations)
    }

    /// Whether checking `payload` against `schema` is cheap enough to run on this thread:
    /// its reckoned work at the payload's size (or at the largest payload) is small.
    /// `bytes` is asked for only when the largest payload would not be cheap.
    fn inline(&self, schema: &PayloadSchema, bytes: impl FnOnce() -> usize) -> bool {
        schema.work.check_work(self.limits.max_payload_bytes) <= INLINE_UNITS
            || schema.work.check_work(bytes()) <= INLINE_UNITS
    }

    /// `conforms` for a validated trigger, whose payload is lent to the validator as a JSON
    /// value and given back (no copy); lost only when the check is refused as UNAVAILABLE.
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

    /// Validates, decides and records or drops one trigger. A well-formed
    /// trigger is always answered with an outcome (§7.3.2); only malformed input
    /// or an unreachable store is an error.
    pub async fn deliver(&self, raw: RawTrigger) -> Result<Outcome> {
        self.deliver_from(raw, INGRESS_GRPC).await
    }

    /// `deliver`, for a trigger that came in through `ingress` (the `hcp.ingress` span
    /// attribute and the `ingress` label of the delivery counts).
    pub async fn deliver_from(&self, raw: RawTrigger, ingress: &'static str) -> Result<Outcome> {
        let started = Instant::now();
        let mut t = self.admissible(raw)?;
        let view = self.policy.view.load_full();
        let conformed = self.conforms_trigger(&view, &mut t).await;
        // Validation (the payload's schema with it) counts in the decision's time.
        let checked = started.elapsed();
        self.unless_recorded(&t, conformed).await?;
        self.admitted(&view, &t).await?;
        self.decide_one(&view, t, ingress, checked).await
    }

    /// `deliver_from`, for a trigger whose quotas were taken already (with the rest of the
    /// message it came in).
    pub(crate) async fn deliver_admitted(
        &self,
        raw: RawTrigger,
        ingress: &'static str,
    ) -> Result<Outcome> {
        let started = Instant::now();
        let t = self.admissible(raw)?;
        let view = self.policy.view.load_full();
        self.decide_one(&view, t, ingress, started.elapsed()).await
    }

    /// Takes the trigger's tokens from its quotas. Over quota it is refused (`Throttled`)
    /// unless its trigger id was recorded before: idempotency comes first, and a retry of a
    /// recorded trigger is answered with its record whatever the quota.
    async fn admitted(&self, view: &PolicyView, t: &Trigger) -> Result<()> {
        let taken = self.admit(view, &t.pack_id, &[t.principal.as_str()]).await;
        self.unless_recorded(t, taken).await
    }

    /// A refusal before the decision (over quota, or a payload its schema refuses), unless
    /// the trigger's id was recorded before: idempotency comes first, and a retry of a
    /// recorded trigger is answered with its record.
    async fn unless_recorded(&self, t: &Trigger, refused: Result<()>) -> Result<()> {
        match refused {
            Err(e @ (Error::Throttled { .. } | Error::InvalidArgument(_))) => match &t.trigger_id {
                Some(id)
                    if self
                        .store
                        .record_for_trigger(&t.pack_id, id)
                        .await?
                        .is_some() =>
                {
                    Ok(())
                }
                _ => Err(e),
            },
            other => other,
        }
    }

    /// Whether every trigger names its id and was recorded before: a redelivered message whose
    /// triggers were all recorded is answered with its records whatever the quota.
    pub(crate) async fn all_recorded(&self, triggers: &[RawTrigger]) -> Result<bool> {
        for t in triggers {
            if t.trigger_id.is_empty()
                || self
                    .store
                    .record_for_trigger(&t.pack_id, &t.trigger_id)
                    .await?
                    .is_none()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Decides an admitted trigger, then records or drops it.
    async fn decide_one(
        &self,
        view: &PolicyView,
        t: Trigger,
        ingress: &'static str,
        validated: std::time::Duration,
    ) -> Result<Outcome> {
        let started = Instant::now();
        let mut decision = decide(view, &t);
        let decided = validated + started.elapsed();
        // Idempotency comes before policy: a retry of a trigger that was recorded is answered
        // with its record, even if policy has changed since (a grant revoked meanwhile must
        // not turn an acknowledged record into a drop). Recorded triggers meet their first
        // record in the sink; dropped ones look it up here.
        let mut first = None;
        if let (Decision::Drop(_), Some(id)) = (&decision, &t.trigger_id) {
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
                    Outcome::recorded(route, first.map(|r| r.record_id).unwrap_or_default(), true)
                }
                Decision::Drop(reason) => {
                    self.drops.count(&t.pack_id, &t.r#ref, reason);
                    Outcome::dropped(reason)
                }
                Decision::Record { route, binding_id } => {
                    self.record(new_record(&t, route, binding_id)).await?
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

    /// A received trigger validated against the limits, on a replica whose policy is current.
    fn admissible(&self, raw: RawTrigger) -> Result<Trigger> {
        let t = validate(
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
        })?;
        self.policy.current_or_unavailable()?;
        Ok(t)
    }

    /// ExplainTrigger: what `deliver` would answer now, and every check behind it, with
    /// nothing recorded, counted or traced as a delivery. The same validation, the same
    /// policy view and the same idempotency: a trigger id recorded before for the pack is
    /// answered with that record (or refused as a conflict) whatever the checks say now.
    pub async fn explain(&self, raw: RawTrigger) -> Result<Explained> {
        let mut t = self.admissible(raw)?;
        let view = self.policy.view.load_full();
        let conformed = self.conforms_trigger(&view, &mut t).await;
        self.unless_recorded(&t, conformed).await?;
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
    async fn record(&self, r: Record) -> Result<Outcome> {
        let route = r.route;
        let trigger_id = r.trigger_id.clone().unwrap_or_default();
        let written = self.sink.write(r).await?;
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
    /// once; a record is written in that same transaction. The drop or record is traced
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
            let record = match &produced {
                Some((t, Decision::Record { route, binding_id })) => {
                    Some(new_record(t, *route, binding_id.clone()))
                }
                _ => None,
            };
            ((before.cloned(), produced), record)
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
            (Decision::Record { route, .. }, Some(r)) => {
                Outcome::recorded(route, r.record_id, false)
            }
            (Decision::Drop(reason), _) => {
                self.drops.count(&t.pack_id, &t.r#ref, reason);
                Outcome::dropped(reason)
            }
            (Decision::Record { .. }, None) => {
                return Err(Error::Internal("a produced record was not stored".into()))
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
    pub duplicate: Option<Record>,
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
