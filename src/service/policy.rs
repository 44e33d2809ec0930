//! Admin writes to Sense policy. Each commits to the store, then patches the view, under the writer's turn.
use crate::store::audit::{Actor, AuditEvent};
use std::sync::Arc;

use super::deliver::BindingChange;
use super::{unknown_pack, valid_id, valid_pack_id, Delivery, PolicyState};
use crate::domain::decide::deliverable;
use crate::domain::filter::Filter;
use crate::domain::model::{ActivationRow, Binding, ExecuteState, Grant, KeyPage, Member};
use crate::domain::policy::{Activation, BindingRef, BindingState, PolicyView, Route};
use crate::domain::trigger::{Outcome, PUBLIC_BINDING};
use crate::error::{Error, Result};
use crate::store::now_micros;
use crate::store::PolicyTables;

/// Sense and Execute state of a pack for a principal, side by side.
#[derive(Debug, Clone)]
pub struct PackState {
    pub granted: bool,
    pub activation: Activation,
    pub binding: Option<Binding>,
    /// A trigger for the principal could be recorded now.
    pub deliverable: bool,
    pub execute: ExecuteState,
}

/// Sense policy and its administration: packs, grants, activation, Bindings, project
/// members, the Execute-state mirror, quotas and the audit log they write; the policy view
/// decisions read, kept in step with the store and (PostgreSQL) with other replicas.
#[derive(Clone, Debug)]
pub struct Policy {
    pub(super) store: PolicyTables,
    pub(super) policy: Arc<PolicyState>,
    /// A Binding's change may produce `binding.degraded`, delivered as any trigger.
    pub(super) delivery: Delivery,
}

impl Policy {
    /// The current policy view.
    pub fn view(&self) -> Arc<PolicyView> {
        self.policy.view.load_full()
    }

    /// The lifecycle an admin write run to its end is started through.
    pub fn lifecycle(&self) -> &crate::lifecycle::Lifecycle {
        self.delivery.lifecycle()
    }

    /// Whether the policy view is known to be current. Decisions are refused while it is not.
    pub fn current(&self) -> bool {
        self.policy.is_current()
    }

    /// Counts Bindings of registered packs by state, for the gauges.
    pub fn binding_states(&self) -> Vec<(&'static str, i64)> {
        let view = self.policy.view.load();
        let mut counts: Vec<(&'static str, i64)> =
            BindingState::NAMES.iter().map(|n| (*n, 0)).collect();
        for id in view.pack_ids() {
            if let Some(p) = view.pack(id) {
                for b in p.principals.values().filter_map(|p| p.binding.as_ref()) {
                    if let Some(c) = counts.iter_mut().find(|(n, _)| *n == b.state.as_str()) {
                        c.1 += 1;
                    }
                }
            }
        }
        counts
    }

    /// The current view, checked to know the pack.
    fn view_with_pack(&self, pack_id: &str) -> Result<Arc<PolicyView>> {
        let view = self.policy.view.load_full();
        if view.pack(pack_id).is_none() {
            return Err(unknown_pack(pack_id));
        }
        Ok(view)
    }

    pub async fn grant(&self, actor: &Actor, principal: &str, pack_id: &str) -> Result<Grant> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;
        let g = self
            .store
            .put_grant(actor, principal, pack_id, now_micros())
            .await?;
        self.policy
            .publish(view.with_principal(pack_id, principal, |p| p.granted = true));
        tracing::info!(principal, pack_id, "sense.enable granted");
        Ok(g)
    }

    /// Revokes; every delivery that starts after this returns sees it (§7.3.1).
    pub async fn revoke(&self, actor: &Actor, principal: &str, pack_id: &str) -> Result<bool> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let revoked = self.store.delete_grant(actor, principal, pack_id).await?;
        let view = self.policy.view.load_full();
        self.policy
            .publish(view.with_principal(pack_id, principal, |p| p.granted = false));
        tracing::info!(principal, pack_id, revoked, "sense.enable revoked");
        Ok(revoked)
    }

    /// Grants; `first` filters by pack, `second` by principal.
    pub async fn list_grants(&self, p: &KeyPage<'_>) -> Result<Vec<Grant>> {
        valid_pack_filters(p)?;
        self.store.list_grants(p).await
    }

    /// Bindings; `first` filters by pack, `second` by principal.
    pub async fn list_bindings(&self, p: &KeyPage<'_>) -> Result<Vec<Binding>> {
        valid_pack_filters(p)?;
        self.store.list_bindings(p).await
    }

    /// Sense activations; `first` filters by pack, `second` by principal.
    pub async fn list_activations(&self, p: &KeyPage<'_>) -> Result<Vec<ActivationRow>> {
        valid_pack_filters(p)?;
        self.store.list_activations(p).await
    }

    /// Audit events, newest first, before the (time, id) position `before`; of one pack and
    /// one principal when given. Reading is not audited.
    pub async fn list_audit_events(
        &self,
        pack_id: Option<&str>,
        principal: Option<&str>,
        before: Option<(i64, &str)>,
        limit: u64,
    ) -> Result<Vec<AuditEvent>> {
        self.store
            .list_audit_events(pack_id, principal, before, limit)
            .await
    }

    /// Project members; `first` filters by project, `second` by principal.
    pub async fn list_members(&self, p: &KeyPage<'_>) -> Result<Vec<Member>> {
        p.first.map(|v| valid_id("project", v)).transpose()?;
        p.second.map(|v| valid_id("principal", v)).transpose()?;
        self.store.list_members(p).await
    }

    /// Switches Sense on or off for a principal, or pack-wide when the principal
    /// is empty. Without a route the route is `inbox`, whatever was chosen before: an
    /// admin who leaves it out expects records to surface. Likewise without a filter there
    /// is none, whatever was set before; switching off clears the filter. The filter is
    /// compiled and checked before anything is written. Never touches Execute state (§7.4.1).
    pub async fn set_activation(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
        on: bool,
        route: Option<Route>,
        filter: &str,
    ) -> Result<ActivationRow> {
        if !principal.is_empty() {
            valid_id("principal", principal)?;
        }
        valid_pack_id(pack_id)?;
        let compiled = if filter.is_empty() {
            None
        } else {
            Some(Filter::shared(filter).map_err(|e| Error::invalid("filter", e))?)
        };
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;

        let row = ActivationRow {
            principal: principal.to_owned(),
            pack_id: pack_id.to_owned(),
            enabled: on,
            route: route.unwrap_or(Route::Inbox),
            filter: filter.to_owned(),
            update_time: now_micros(),
        };
        self.store.put_activation(actor, &row).await?;
        let activation = if on {
            Activation::On(row.route, compiled)
        } else {
            Activation::Off
        };
        self.policy.publish(if principal.is_empty() {
            view.with_pack_activation(pack_id, Some(activation))
        } else {
            view.with_principal(pack_id, principal, |p| p.activation = Some(activation))
        });
        tracing::info!(principal, pack_id, enabled = row.enabled, route = %row.route, filter = row.filter, "sense activation set");
        Ok(row)
    }

    /// Mirrors Execute's state. It is never read by a decision. Like every per-pack
    /// admin write, it needs the pack registered.
    pub async fn put_execute_state(&self, actor: &Actor, e: ExecuteState) -> Result<ExecuteState> {
        valid_id("principal", &e.principal)?;
        valid_pack_id(&e.pack_id)?;
        self.view_with_pack(&e.pack_id)?;
        let e = ExecuteState {
            update_time: now_micros(),
            ..e
        };
        self.store.put_execute_state(actor, &e).await?;
        Ok(e)
    }

    pub async fn pack_state(&self, principal: &str, pack_id: &str) -> Result<PackState> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let view = self.view_with_pack(pack_id)?;
        let pack = view.pack(pack_id).ok_or_else(|| unknown_pack(pack_id))?;
        let own = pack.principals.get(principal);
        let granted = own.is_some_and(|p| p.granted);
        let activation = pack.activation_for(own).clone();
        let binding = self.store.get_binding(principal, pack_id).await?;
        let execute = self
            .store
            .get_execute_state(principal, pack_id)
            .await?
            .unwrap_or_else(|| ExecuteState {
                principal: principal.to_owned(),
                pack_id: pack_id.to_owned(),
                ..Default::default()
            });
        Ok(PackState {
            granted,
            deliverable: deliverable(&view, pack_id, principal),
            activation,
            binding,
            execute,
        })
    }

    /// Creates or replaces a Binding. `None` state means linked.
    pub async fn put_binding(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
        binding_id: &str,
        state: Option<BindingState>,
    ) -> Result<(Binding, Option<Outcome>)> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        valid_id("binding_id", binding_id)?;
        if binding_id == PUBLIC_BINDING {
            return Err(Error::invalid(
                "binding_id",
                "`public` is the identity of records of public packs and cannot name a Binding",
            ));
        }
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;
        let (b, _, outcome) = self
            .change_binding(
                actor,
                &view,
                principal,
                pack_id,
                Some(binding_id),
                state.unwrap_or(BindingState::Linked),
            )
            .await?;
        Ok((b, outcome))
    }

    /// Records a Binding's health reported by the runtime.
    pub async fn report_binding_health(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
        state: BindingState,
    ) -> Result<(Binding, BindingState, Option<Outcome>)> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;
        let (b, before, outcome) = self
            .change_binding(actor, &view, principal, pack_id, None, state)
            .await?;
        Ok((b, before.state, outcome))
    }

    /// Stores a Binding's new state; without `binding_id` the Binding must exist and keeps
    /// its id.
    async fn change_binding(
        &self,
        actor: &Actor,
        view: &PolicyView,
        principal: &str,
        pack_id: &str,
        binding_id: Option<&str>,
        state: BindingState,
    ) -> Result<(Binding, Binding, Option<Outcome>)> {
        let mode = view
            .pack(pack_id)
            .map(|p| p.binding_mode)
            .ok_or_else(|| unknown_pack(pack_id))?;
        let binding_id = match binding_id {
            Some(id) => id.to_owned(),
            // The id of the Binding as stored now; the write below rereads it under lock.
            None => {
                self.store
                    .get_binding(principal, pack_id)
                    .await?
                    .ok_or_else(|| no_binding(principal, pack_id))?
                    .binding_id
            }
        };
        let b = Binding {
            principal: principal.to_owned(),
            pack_id: pack_id.to_owned(),
            binding_id,
            mode,
            state,
            update_time: now_micros(),
        };
        let (before, outcome) = self
            .delivery
            .store_binding(actor, view, BindingChange::Put(&b))
            .await?;
        // A new Binding had no state before: the log says so.
        let previous = before
            .as_ref()
            .map_or_else(|| "none".to_owned(), |p| p.state.to_string());
        let before = before.unwrap_or_else(|| Binding { state, ..b.clone() });
        self.policy
            .publish(view.with_principal(pack_id, principal, |p| {
                p.binding = Some(BindingRef {
                    binding_id: b.binding_id.clone(),
                    state,
                });
            }));
        tracing::info!(principal, pack_id, state = %state, previous = %previous, "binding stored");
        Ok((b, before, outcome))
    }

    /// Deletes a Binding. A linked Binding that goes away has left `linked`: it produces
    /// `binding.degraded` like any other departure.
    pub async fn delete_binding(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
    ) -> Result<Option<Outcome>> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.policy.view.load_full();
        let (before, outcome) = self
            .delivery
            .store_binding(actor, &view, BindingChange::Delete { principal, pack_id })
            .await?;
        if before.is_none() {
            return Err(no_binding(principal, pack_id));
        }
        self.policy
            .publish(view.with_principal(pack_id, principal, |p| p.binding = None));
        tracing::info!(principal, pack_id, "binding deleted");
        Ok(outcome)
    }

    pub async fn add_member(&self, actor: &Actor, project: &str, principal: &str) -> Result<()> {
        valid_id("project", project)?;
        valid_id("principal", principal)?;
        self.store
            .add_member(actor, project, principal, now_micros())
            .await
    }

    pub async fn remove_member(
        &self,
        actor: &Actor,
        project: &str,
        principal: &str,
    ) -> Result<bool> {
        valid_id("project", project)?;
        valid_id("principal", principal)?;
        self.store.remove_member(actor, project, principal).await
    }
}

/// The pack and principal filters of a listing, checked when given.
fn valid_pack_filters(p: &KeyPage<'_>) -> Result<()> {
    p.first.map(valid_pack_id).transpose()?;
    p.second.map(|v| valid_id("principal", v)).transpose()?;
    Ok(())
}

fn no_binding(principal: &str, pack_id: &str) -> Error {
    Error::NotFound(format!(
        "principal `{principal}` has no Binding to pack `{pack_id}`"
    ))
}
