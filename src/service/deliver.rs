//! DeliverTrigger: validate, decide on the policy view, then record or drop — traced and counted.
use std::time::Instant;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use super::Service;
use crate::domain::decide::{decide, validate, Decision, Outcome, RawTrigger, Trigger, BRAIN};
use crate::domain::model::{Binding, Record};
use crate::domain::pack::BINDING_DEGRADED;
use crate::domain::policy::{BindingState, PolicyView, Route};
use crate::error::{Error, Result, Violation};
use crate::store::Stored;

/// The span of one decision, made once the decision is known so that a sampler
/// can see a drop, with the attributes dashboards read under the `hcp.` prefix.
pub fn decision_span(t: &Trigger, d: &Decision, hash_principal: bool) -> Span {
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
    let (disposition, reason) = match d {
        Decision::Drop(r) => ("dropped", r.as_str()),
        Decision::Record {
            route: Route::Inbox,
            ..
        } => ("recorded_inbox", ""),
        Decision::Record {
            route: Route::Silent,
            ..
        } => ("recorded_silent", ""),
    };
    let span = tracing::info_span!(
        "sense.decision",
        hcp.pack_id = %t.pack_id,
        hcp.r#ref = %t.r#ref,
        hcp.principal = %principal,
        hcp.land = %t.land,
        hcp.disposition = disposition,
        hcp.drop_reason = Empty,
        hcp.record_id = Empty,
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
    }
}

impl Service {
    /// Validates, decides and records or drops one trigger. A well-formed
    /// trigger is always answered with an outcome (§7.3.2); only malformed input
    /// or an unreachable store is an error.
    pub async fn deliver(&self, raw: RawTrigger) -> Result<Outcome> {
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
        if !self.policy_current() {
            // Fail closed: another replica's change may not have reached this one.
            return Err(Error::Unavailable(
                "policy is being reloaded on this replica; retry".into(),
            ));
        }
        let started = Instant::now();
        let decision = decide(&self.policy.view.load(), &t);
        let decided = started.elapsed();
        let span = decision_span(&t, &decision, self.limits.hash_principals);
        async {
            let outcome = match decision {
                Decision::Drop(reason) => {
                    self.drops.count(&t.pack_id, &t.r#ref, reason);
                    Outcome::dropped(reason)
                }
                Decision::Record { route, binding_id } => {
                    self.record(new_record(&t, route, binding_id)).await?
                }
            };
            note(&Span::current(), &outcome);
            self.metrics.delivered(&t.pack_id, &outcome, decided);
            if let Some(reason) = outcome.drop_reason {
                tracing::debug!(reason = reason.as_str(), "trigger dropped");
            }
            Ok(outcome)
        }
        .instrument(span)
        .await
    }

    /// Stores a record through group commit, answering a repeated trigger id with the first record.
    async fn record(&self, r: Record) -> Result<Outcome> {
        let route = r.route;
        let trigger_id = r.trigger_id.clone().unwrap_or_default();
        Ok(match self.sink.write(r).await? {
            Stored::Inserted { record_id } => Outcome::recorded(route, record_id, false),
            Stored::Duplicate { record_id, route } => Outcome::recorded(route, record_id, true),
            Stored::Conflict => {
                return Err(Error::AlreadyExists(format!(
                "trigger_id `{trigger_id}` was already used for a different trigger of this pack"
            )))
            }
        })
    }

    /// Stores a Binding and, when it moves away from `linked` in a pack that
    /// declares `binding.degraded`, the trigger the service produces for it as
    /// the runtime's hub (§7.7.3). The trigger is decided on the view in which
    /// the Binding is still linked: the moment it degrades is when the
    /// principal must hear of it. The record, if any, is written in the
    /// Binding's transaction. The caller holds the writer's turn.
    pub(super) async fn store_binding(
        &self,
        view: &PolicyView,
        b: &Binding,
        previous: Option<BindingState>,
    ) -> Result<Option<Outcome>> {
        let degraded = previous == Some(BindingState::Linked) && b.state != BindingState::Linked;
        let trigger = if degraded {
            view.pack(&b.pack_id)
                .and_then(|p| p.lands.get(BINDING_DEGRADED))
                // A brain land needs a project, which a Binding does not have.
                .filter(|land| land.as_str() != BRAIN)
                .map(|land| Trigger {
                    pack_id: b.pack_id.clone(),
                    r#ref: BINDING_DEGRADED.to_owned(),
                    principal: b.principal.clone(),
                    land: land.clone(),
                    payload: match json!({
                        "state": b.state.as_str(),
                        "previous_state": BindingState::Linked.as_str(),
                        "binding_id": b.binding_id,
                    }) {
                        Value::Object(m) => m,
                        _ => serde_json::Map::new(),
                    },
                    project: None,
                    trigger_id: None,
                })
        } else {
            None
        };
        let Some(t) = trigger else {
            self.store.put_binding(b, None).await?;
            return Ok(None);
        };
        let started = Instant::now();
        let decision = decide(view, &t);
        let decided = started.elapsed();
        let span = decision_span(&t, &decision, self.limits.hash_principals);
        async {
            let outcome = match decision {
                Decision::Drop(reason) => {
                    self.store.put_binding(b, None).await?;
                    self.drops.count(&t.pack_id, &t.r#ref, reason);
                    Outcome::dropped(reason)
                }
                Decision::Record { route, binding_id } => {
                    let mut r = new_record(&t, route, binding_id);
                    self.store.put_binding(b, Some(&mut r)).await?;
                    Outcome::recorded(route, r.record_id, false)
                }
            };
            note(&Span::current(), &outcome);
            self.metrics.delivered(&t.pack_id, &outcome, decided);
            Ok(Some(outcome))
        }
        .instrument(span)
        .await
    }
}
