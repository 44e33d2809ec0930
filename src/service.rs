//! The service's operations, between the gRPC edge and the store: lint, then store.
use serde_json::Value;

use crate::domain::names::check_pack_id;
use crate::domain::pack::{lint, LintReport, RegisteredPack};
use crate::error::{Error, Result, Violation};
use crate::store::{now_micros, Store};

/// Everything a request handler needs. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Service {
    pub store: Store,
}

/// A registered pack and what lint warned about.
pub struct Registered {
    pub pack: RegisteredPack,
    pub created: bool,
    pub report: LintReport,
}

impl Service {
    pub fn new(store: Store) -> Self {
        Service { store }
    }

    /// Lints and stores a manifest. Any lint error refuses the whole manifest
    /// and nothing is written.
    pub async fn register_pack(&self, manifest: &Value) -> Result<Registered> {
        let report = lint(manifest);
        let Some(m) = report.manifest.as_ref().filter(|_| report.is_valid()) else {
            return Err(lint_failure(&report));
        };
        let (pack, created) = self.store.put_pack(m, now_micros()).await?;
        tracing::info!(pack_id = %pack.manifest.pack_id, generation = pack.generation, created, "pack registered");
        Ok(Registered {
            pack,
            created,
            report,
        })
    }

    pub async fn get_pack(&self, pack_id: &str) -> Result<RegisteredPack> {
        check_id(pack_id)?;
        self.store
            .get_pack(pack_id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("pack `{pack_id}` is not registered")))
    }

    pub async fn delete_pack(&self, pack_id: &str) -> Result<()> {
        check_id(pack_id)?;
        if self.store.delete_pack(pack_id).await? {
            tracing::info!(pack_id, "pack deleted");
            Ok(())
        } else {
            Err(Error::NotFound(format!(
                "pack `{pack_id}` is not registered"
            )))
        }
    }
}

fn check_id(pack_id: &str) -> Result<()> {
    check_pack_id(pack_id).map_err(|e| Error::invalid("pack_id", e))
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
