//! Packs: registration (lint, store, then refresh the pack's policy in the view), reads, and the trigger catalog.
use crate::store::audit::Actor;
use std::sync::Arc;

use serde_json::Value;

use super::{unknown_pack, valid_id, valid_pack_id, Policy};
use crate::domain::catalog::{trigger_types, TriggerTypeView};
use crate::domain::pack::{lint_within, Bounds, LintReport, RegisteredPack};
use crate::domain::policy::PackPolicy;
use crate::error::{Error, Result, Violation};
use crate::store::now_micros;

/// A registered pack and what lint warned about.
pub struct Registered {
    pub pack: RegisteredPack,
    pub created: bool,
    pub report: LintReport,
}

impl Policy {
    /// The declared triggers of registered packs (`pack_id` only, when given) after `after`,
    /// at most `limit`, from this replica's policy view; with whether `principal` could
    /// receive each now, when given.
    pub fn list_trigger_types(
        &self,
        pack_id: Option<&str>,
        after: Option<(&str, &str)>,
        limit: usize,
        principal: Option<&str>,
    ) -> Result<Vec<TriggerTypeView>> {
        if let Some(p) = pack_id {
            valid_pack_id(p)?;
        }
        if let Some(p) = principal {
            valid_id("principal", p)?;
        }
        self.policy.current_or_unavailable()?;
        let view = self.policy.view.load_full();
        if let Some(p) = pack_id.filter(|p| view.pack(p).is_none()) {
            return Err(unknown_pack(p));
        }
        Ok(trigger_types(&view, pack_id, after, limit, principal))
    }

    /// Lints a manifest against this service's limits (the payload limit its schemas'
    /// patterns are reckoned at), on the check pool: compiling a pack's schemas and reckoning
    /// its patterns is work that grows with the manifest.
    pub async fn lint(&self, manifest: &Value) -> Result<LintReport> {
        let bounds = Bounds {
            max_payload_bytes: self.delivery.max_payload_bytes(),
        };
        let manifest = manifest.clone();
        self.delivery
            .checks()
            // Lint's own lane: an admin's registration waits behind no pack's payloads.
            .run("", "the manifest", move || lint_within(&manifest, bounds))
            .await
    }

    /// Lints and stores a manifest. Any lint error refuses the whole manifest and nothing is written.
    pub async fn register_pack(&self, actor: &Actor, manifest: &Value) -> Result<Registered> {
        let report = self.lint(manifest).await?;
        let Some(m) = report.manifest.as_ref().filter(|_| report.is_valid()) else {
            return Err(lint_failure(&report));
        };
        let _turn = self.policy.writer.lock().await;
        let (pack, created) = self.store.put_pack(actor, m, now_micros()).await?;
        let view = self.policy.view.load_full();
        match view.pack(&m.pack_id) {
            // Known pack: its principals are unchanged, only the declaration is new.
            Some(old) => {
                let trigger_types = self.store.trigger_types(&m.pack_id, &m.raw.to_string())?;
                let mut p = PackPolicy::with_trigger_types(m, trigger_types);
                p.activation = old.activation.clone();
                p.principals = old.principals.clone();
                self.policy
                    .view
                    .store(Arc::new(view.with_pack(&m.pack_id, Some(p))));
            }
            // New (or re-added) pack: Bindings may have outlived an earlier registration.
            None => self.refresh_pack(&m.pack_id).await?,
        }
        tracing::info!(pack_id = %pack.manifest.pack_id, generation = pack.generation, created, "pack registered");
        Ok(Registered {
            pack,
            created,
            report,
        })
    }

    pub async fn get_pack(&self, pack_id: &str) -> Result<RegisteredPack> {
        valid_pack_id(pack_id)?;
        self.store
            .get_pack(pack_id)
            .await?
            .ok_or_else(|| unknown_pack(pack_id))
    }

    /// Registered packs by id, a page of `limit` after `after`.
    pub async fn list_packs(&self, after: Option<&str>, limit: u64) -> Result<Vec<RegisteredPack>> {
        self.store.list_packs(after, limit).await
    }

    pub async fn delete_pack(&self, actor: &Actor, pack_id: &str) -> Result<()> {
        valid_pack_id(pack_id)?;
        let _turn = self.policy.writer.lock().await;
        if !self.store.delete_pack(actor, pack_id).await? {
            return Err(unknown_pack(pack_id));
        }
        let view = self.policy.view.load().with_pack(pack_id, None);
        self.policy.view.store(Arc::new(view));
        tracing::info!(pack_id, "pack deleted");
        Ok(())
    }

    /// Reloads one pack's policy from the store into the view. The caller holds the writer's turn.
    pub(super) async fn refresh_pack(&self, pack_id: &str) -> Result<()> {
        let pack = self.store.load_pack_policy(pack_id).await?;
        let view = self.policy.view.load().with_pack(pack_id, pack);
        self.policy.view.store(Arc::new(view));
        Ok(())
    }
}

/// Every lint error as one field violation, prefixed by the clause it enforces.
fn lint_failure(report: &LintReport) -> Error {
    Error::InvalidArgument(
        report
            .errors()
            .map(|f| Violation {
                field: f.field.clone(),
                description: format!("{}: {}", f.rule, f.message),
            })
            .collect(),
    )
}
