//! Pack registration: lint, store, then refresh the pack's policy in the view.
use crate::store::audit::Actor;
use std::sync::Arc;

use serde_json::Value;

use super::{unknown_pack, valid_pack_id, Service};
use crate::domain::pack::{lint, LintReport, RegisteredPack};
use crate::domain::policy::PackPolicy;
use crate::error::{Error, Result, Violation};
use crate::store::now_micros;

/// A registered pack and what lint warned about.
pub struct Registered {
    pub pack: RegisteredPack,
    pub created: bool,
    pub report: LintReport,
}

impl Service {
    /// Registered packs in id order, after `after`.
    pub async fn list_packs(&self, after: Option<&str>, limit: u64) -> Result<Vec<RegisteredPack>> {
        self.store.list_packs(after, limit).await
    }

    /// Lints and stores a manifest. Any lint error refuses the whole manifest and nothing is written.
    pub async fn register_pack(&self, actor: &Actor, manifest: &Value) -> Result<Registered> {
        let report = lint(manifest);
        let Some(m) = report.manifest.as_ref().filter(|_| report.is_valid()) else {
            return Err(lint_failure(&report));
        };
        let _turn = self.policy.writer.lock().await;
        let (pack, created) = self.store.put_pack(actor, m, now_micros()).await?;
        let view = self.policy.view.load_full();
        match view.pack(&m.pack_id) {
            // Known pack: its principals are unchanged, only the declaration is new.
            Some(old) => {
                let mut p = PackPolicy::from_manifest(m);
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
