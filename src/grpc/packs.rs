//! PackService: registration, lint, reads and removal of packs.
use serde_json::Value;
use tonic::{Request, Response, Status};

use super::actor_of;
use super::convert::{finding, pack, struct_to_json_checked};
use super::paging::{fingerprint, PageTokens};
use super::pb::{self, pack_service_server::PackService};
use crate::auth::Caller;
use crate::domain::catalog::TriggerTypeView;
use crate::domain::pack::{parse_manifest_text, Severity};
use crate::error::Error;
use crate::service::{detached, reader_principal, Policy};

#[derive(Clone, Debug)]
pub struct PacksApi {
    pub policy: Policy,
    pub pages: PageTokens,
}

const PAGE_KIND: &str = "packs";
const TYPES_KIND: &str = "trigger-types";

fn trigger_type(t: &TriggerTypeView) -> pb::TriggerType {
    pb::TriggerType {
        pack_id: t.pack_id.clone(),
        r#ref: t.r#ref.clone(),
        land: t.land.clone().unwrap_or_default(),
        description: t.description.clone().unwrap_or_default(),
        payload_schema: t.schema.as_ref().map(|s| s.to_string()).unwrap_or_default(),
        receivability: t.receivable.as_ref().map(|r| pb::Receivability {
            principal: r.principal.clone(),
            receivable: r.now,
            drop_reasons: r.reasons.iter().map(|d| d.as_str().to_owned()).collect(),
        }),
    }
}

fn manifest_of(
    manifest: Option<prost_types::Struct>,
    text: Option<String>,
) -> Result<Value, Error> {
    match (manifest, text) {
        (Some(s), _) => struct_to_json_checked("manifest", s),
        (None, Some(t)) => parse_manifest_text(&t).map_err(|e| Error::invalid("manifest_text", e)),
        (None, None) => Err(Error::invalid(
            "manifest",
            "one of `manifest` (a JSON object) or `manifest_text` (JSON or YAML) is required",
        )),
    }
}

fn register_source(s: Option<pb::register_pack_request::Source>) -> Result<Value, Error> {
    use pb::register_pack_request::Source;
    match s {
        Some(Source::Manifest(m)) => manifest_of(Some(m), None),
        Some(Source::ManifestText(t)) => manifest_of(None, Some(t)),
        None => manifest_of(None, None),
    }
}

fn lint_source(s: Option<pb::lint_pack_request::Source>) -> Result<Value, Error> {
    use pb::lint_pack_request::Source;
    match s {
        Some(Source::Manifest(m)) => manifest_of(Some(m), None),
        Some(Source::ManifestText(t)) => manifest_of(None, Some(t)),
        None => manifest_of(None, None),
    }
}

#[tonic::async_trait]
impl PackService for PacksApi {
    async fn register_pack(
        &self,
        req: Request<pb::RegisterPackRequest>,
    ) -> Result<Response<pb::RegisterPackResponse>, Status> {
        let actor = actor_of(&req);
        let manifest = register_source(req.into_inner().source)?;
        let svc = self.policy.clone();
        let r = detached(self.policy.lifecycle(), async move {
            svc.register_pack(&actor, &manifest).await
        })
        .await?;
        Ok(Response::new(pb::RegisterPackResponse {
            pack: Some(pack(&r.pack)),
            warnings: r.report.warnings().map(finding).collect(),
            created: r.created,
        }))
    }

    async fn lint_pack(
        &self,
        req: Request<pb::LintPackRequest>,
    ) -> Result<Response<pb::LintPackResponse>, Status> {
        let manifest = lint_source(req.into_inner().source)?;
        let report = self.policy.lint(&manifest).await?;
        Ok(Response::new(pb::LintPackResponse {
            valid: report.is_valid(),
            // Errors first, then warnings, each in manifest order.
            findings: report
                .errors()
                .chain(
                    report
                        .findings
                        .iter()
                        .filter(|f| f.severity == Severity::Warning),
                )
                .map(finding)
                .collect(),
            pack_id: report.pack_id.clone().unwrap_or_default(),
        }))
    }

    async fn get_pack(
        &self,
        req: Request<pb::GetPackRequest>,
    ) -> Result<Response<pb::GetPackResponse>, Status> {
        let p = self.policy.get_pack(&req.into_inner().pack_id).await?;
        Ok(Response::new(pb::GetPackResponse {
            pack: Some(pack(&p)),
        }))
    }

    async fn list_packs(
        &self,
        req: Request<pb::ListPacksRequest>,
    ) -> Result<Response<pb::ListPacksResponse>, Status> {
        let req = req.into_inner();
        let page = self
            .pages
            .page(PAGE_KIND, String::new(), req.page_size, &req.page_token)?;
        let after = page.after::<1>()?.map(|[id]| id);
        let mut packs = self.policy.list_packs(after, page.limit()).await?;
        let (packs, next_page_token) =
            page.next(&mut packs, |last| [last.manifest.pack_id.clone()], pack);
        Ok(Response::new(pb::ListPacksResponse {
            packs,
            next_page_token,
        }))
    }

    async fn list_trigger_types(
        &self,
        req: Request<pb::ListTriggerTypesRequest>,
    ) -> Result<Response<pb::ListTriggerTypesResponse>, Status> {
        let caller = req.extensions().get::<Caller>().cloned();
        let req = req.into_inner();
        // A reader asks about its own principal, whatever it names.
        let principal = reader_principal(caller.as_ref(), &req.principal)?.unwrap_or(req.principal);
        let page = self.pages.page(
            TYPES_KIND,
            fingerprint(&[&req.pack_id, &principal]),
            req.page_size,
            &req.page_token,
        )?;
        let after = page.after::<2>()?.map(|[p, r]| (p, r));
        let pack_id = (!req.pack_id.is_empty()).then_some(req.pack_id.as_str());
        let mut types = self.policy.list_trigger_types(
            pack_id,
            after,
            usize::try_from(page.limit()).unwrap_or(usize::MAX),
            (!principal.is_empty()).then_some(principal.as_str()),
        )?;
        let (trigger_types, next_page_token) = page.next(
            &mut types,
            |last| [last.pack_id.clone(), last.r#ref.clone()],
            trigger_type,
        );
        Ok(Response::new(pb::ListTriggerTypesResponse {
            trigger_types,
            next_page_token,
        }))
    }

    async fn delete_pack(
        &self,
        req: Request<pb::DeletePackRequest>,
    ) -> Result<Response<pb::DeletePackResponse>, Status> {
        let svc = self.policy.clone();
        let actor = actor_of(&req);
        let pack_id = req.into_inner().pack_id;
        detached(self.policy.lifecycle(), async move {
            svc.delete_pack(&actor, &pack_id).await
        })
        .await?;
        Ok(Response::new(pb::DeletePackResponse {}))
    }
}
