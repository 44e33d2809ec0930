//! Admin writes to Sense policy. Each commits to the store, then patches the view, under the writer's turn.
use std::sync::Arc;

use super::{unknown_pack, valid_id, valid_pack_id, Service};
use crate::domain::decide::{Outcome, PUBLIC_BINDING};
use crate::domain::model::{ActivationRow, Binding, ExecuteState, Grant};
use crate::domain::pack::BindingMode;
use crate::domain::policy::{Activation, BindingRef, BindingState, PolicyView, Route};
use crate::error::{Error, Result};
use crate::store::now_micros;

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

impl Service {
    fn publish(&self, view: PolicyView) {
        self.policy.view.store(Arc::new(view));
    }

    /// The current view, checked to know the pack.
    fn view_with_pack(&self, pack_id: &str) -> Result<Arc<PolicyView>> {
        let view = self.policy.view.load_full();
        if view.pack(pack_id).is_none() {
            return Err(unknown_pack(pack_id));
        }
        Ok(view)
    }

    pub async fn grant(&self, principal: &str, pack_id: &str) -> Result<Grant> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;
        let g = self
            .store
            .put_grant(principal, pack_id, now_micros())
            .await?;
        self.publish(view.with_principal(pack_id, principal, |p| p.granted = true));
        tracing::info!(principal, pack_id, "sense.enable granted");
        Ok(g)
    }

    /// Revokes; every delivery that starts after this returns sees it (§7.3.1).
    pub async fn revoke(&self, principal: &str, pack_id: &str) -> Result<bool> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let revoked = self.store.delete_grant(principal, pack_id).await?;
        let view = self.policy.view.load_full();
        self.publish(view.with_principal(pack_id, principal, |p| p.granted = false));
        tracing::info!(principal, pack_id, revoked, "sense.enable revoked");
        Ok(revoked)
    }

    pub async fn list_grants(
        &self,
        pack_id: Option<&str>,
        principal: Option<&str>,
        after: Option<(&str, &str)>,
        limit: u64,
    ) -> Result<Vec<Grant>> {
        if let Some(p) = pack_id {
            valid_pack_id(p)?;
        }
        if let Some(p) = principal {
            valid_id("principal", p)?;
        }
        self.store
            .list_grants(pack_id, principal, after, limit)
            .await
    }

    /// Switches Sense on or off for a principal, or pack-wide when the principal
    /// is empty. Without a route, the last one chosen is kept (`inbox` at
    /// first). Never touches Execute state (§7.4.1).
    pub async fn set_activation(
        &self,
        principal: &str,
        pack_id: &str,
        on: bool,
        route: Option<Route>,
    ) -> Result<ActivationRow> {
        if !principal.is_empty() {
            valid_id("principal", principal)?;
        }
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;

        let keep = match route {
            Some(r) => r,
            None => self
                .store
                .get_activation(principal, pack_id)
                .await?
                .map_or(Route::Inbox, |a| a.route),
        };
        let row = ActivationRow {
            principal: principal.to_owned(),
            pack_id: pack_id.to_owned(),
            enabled: on,
            route: keep,
            update_time: now_micros(),
        };
        self.store.put_activation(&row).await?;
        let activation = row.activation();
        self.publish(if principal.is_empty() {
            view.with_pack_activation(pack_id, Some(activation))
        } else {
            view.with_principal(pack_id, principal, |p| p.activation = Some(activation))
        });
        tracing::info!(principal, pack_id, enabled = row.enabled, route = %row.route, "sense activation set");
        Ok(row)
    }

    /// Mirrors Execute's state. It is never read by a decision.
    pub async fn put_execute_state(&self, e: ExecuteState) -> Result<ExecuteState> {
        valid_id("principal", &e.principal)?;
        valid_pack_id(&e.pack_id)?;
        let e = ExecuteState {
            update_time: now_micros(),
            ..e
        };
        self.store.put_execute_state(&e).await?;
        Ok(e)
    }

    pub async fn pack_state(&self, principal: &str, pack_id: &str) -> Result<PackState> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let view = self.view_with_pack(pack_id)?;
        let pack = view.pack(pack_id).ok_or_else(|| unknown_pack(pack_id))?;
        let own = pack.principals.get(principal);
        let granted = own.is_some_and(|p| p.granted);
        let activation = pack.activation_for(own);
        let connected = pack.binding_mode == BindingMode::Public
            || own
                .and_then(|p| p.binding.as_ref())
                .is_some_and(|b| b.state == BindingState::Linked);
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
            deliverable: granted && connected && matches!(activation, Activation::On(_)),
            activation,
            binding,
            execute,
        })
    }

    /// Creates or replaces a Binding. `None` state means linked.
    pub async fn put_binding(
        &self,
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
        let previous = self
            .store
            .get_binding(principal, pack_id)
            .await?
            .map(|b| b.state);
        self.change_binding(
            &view,
            principal,
            pack_id,
            binding_id,
            state.unwrap_or(BindingState::Linked),
            previous,
        )
        .await
    }

    /// Records a Binding's health reported by the runtime.
    pub async fn report_binding_health(
        &self,
        principal: &str,
        pack_id: &str,
        state: BindingState,
    ) -> Result<(Binding, BindingState, Option<Outcome>)> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        let view = self.view_with_pack(pack_id)?;
        let Some(existing) = self.store.get_binding(principal, pack_id).await? else {
            return Err(Error::NotFound(format!(
                "principal `{principal}` has no Binding to pack `{pack_id}`"
            )));
        };
        let (b, outcome) = self
            .change_binding(
                &view,
                principal,
                pack_id,
                &existing.binding_id,
                state,
                Some(existing.state),
            )
            .await?;
        Ok((b, existing.state, outcome))
    }

    async fn change_binding(
        &self,
        view: &PolicyView,
        principal: &str,
        pack_id: &str,
        binding_id: &str,
        state: BindingState,
        previous: Option<BindingState>,
    ) -> Result<(Binding, Option<Outcome>)> {
        let mode = view
            .pack(pack_id)
            .map(|p| p.binding_mode)
            .ok_or_else(|| unknown_pack(pack_id))?;
        let b = Binding {
            principal: principal.to_owned(),
            pack_id: pack_id.to_owned(),
            binding_id: binding_id.to_owned(),
            mode,
            state,
            update_time: now_micros(),
        };
        let outcome = self.store_binding(view, &b, previous).await?;
        self.publish(view.with_principal(pack_id, principal, |p| {
            p.binding = Some(BindingRef {
                binding_id: b.binding_id.clone(),
                state,
            });
        }));
        tracing::info!(principal, pack_id, state = %state, previous = ?previous.map(BindingState::as_str), "binding stored");
        Ok((b, outcome))
    }

    pub async fn delete_binding(&self, principal: &str, pack_id: &str) -> Result<()> {
        valid_id("principal", principal)?;
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        if !self.store.delete_binding(principal, pack_id).await? {
            return Err(Error::NotFound(format!(
                "principal `{principal}` has no Binding to pack `{pack_id}`"
            )));
        }
        let view = self.policy.view.load_full();
        self.publish(view.with_principal(pack_id, principal, |p| p.binding = None));
        Ok(())
    }

    pub async fn add_member(&self, project: &str, principal: &str) -> Result<()> {
        valid_id("project", project)?;
        valid_id("principal", principal)?;
        self.store
            .add_member(project, principal, now_micros())
            .await
    }

    pub async fn remove_member(&self, project: &str, principal: &str) -> Result<bool> {
        valid_id("project", project)?;
        valid_id("principal", principal)?;
        self.store.remove_member(project, principal).await
    }
}
