//! PolicyService: grants, activation, Bindings, project members and the Execute-state mirror.
use tonic::{Request, Response, Status};

use super::actor_of;
use super::convert::{
    activation, binding, binding_state, binding_state_from, execute_state, grant, outcome, route,
    route_from,
};
use super::paging::{decode_token, encode_token, fingerprint, page_size, SEP};
use super::pb::{self, policy_service_server::PolicyService};
use crate::domain::model::ExecuteState;
use crate::domain::policy::Activation;
use crate::error::Error;
use crate::service::{detached, Service};

#[derive(Clone, Debug)]
pub struct Policy {
    pub service: Service,
}

type Reply<T> = Result<Response<T>, Status>;

fn opt(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

#[tonic::async_trait]
impl PolicyService for Policy {
    async fn grant_sense_enable(
        &self,
        req: Request<pb::GrantSenseEnableRequest>,
    ) -> Reply<pb::GrantSenseEnableResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        let g = detached(
            actor,
            async move { svc.grant(&r.principal, &r.pack_id).await },
        )
        .await?;
        Ok(Response::new(pb::GrantSenseEnableResponse {
            grant: Some(grant(&g)),
        }))
    }

    async fn revoke_sense_enable(
        &self,
        req: Request<pb::RevokeSenseEnableRequest>,
    ) -> Reply<pb::RevokeSenseEnableResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        let revoked = detached(
            actor,
            async move { svc.revoke(&r.principal, &r.pack_id).await },
        )
        .await?;
        Ok(Response::new(pb::RevokeSenseEnableResponse { revoked }))
    }

    async fn list_grants(
        &self,
        req: Request<pb::ListGrantsRequest>,
    ) -> Reply<pb::ListGrantsResponse> {
        const KIND: &str = "grants";
        let r = req.into_inner();
        let size = page_size(r.page_size)?;
        let fp = fingerprint(&[&r.pack_id, &r.principal]);
        let after = decode_token(KIND, &fp, &r.page_token)?;
        let after = match &after {
            Some(k) => Some(
                k.split_once(SEP)
                    .ok_or_else(|| Error::invalid("page_token", "is malformed"))?,
            ),
            None => None,
        };
        let mut grants = self
            .service
            .list_grants(opt(&r.pack_id), opt(&r.principal), after, size + 1)
            .await?;
        let next_page_token = next_token(&mut grants, size, |g| {
            encode_token(KIND, &fp, &format!("{}{SEP}{}", g.pack_id, g.principal))
        });
        Ok(Response::new(pb::ListGrantsResponse {
            grants: grants.iter().map(grant).collect(),
            next_page_token,
        }))
    }

    async fn activate_sense(
        &self,
        req: Request<pb::ActivateSenseRequest>,
    ) -> Reply<pb::ActivateSenseResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let route = route_from("route", r.route)?;
        let svc = self.service.clone();
        let a = detached(actor, async move {
            svc.set_activation(&r.principal, &r.pack_id, true, route)
                .await
        })
        .await?;
        Ok(Response::new(pb::ActivateSenseResponse {
            activation: Some(activation(&a)),
        }))
    }

    async fn deactivate_sense(
        &self,
        req: Request<pb::DeactivateSenseRequest>,
    ) -> Reply<pb::DeactivateSenseResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        let a = detached(actor, async move {
            svc.set_activation(&r.principal, &r.pack_id, false, None)
                .await
        })
        .await?;
        Ok(Response::new(pb::DeactivateSenseResponse {
            activation: Some(activation(&a)),
        }))
    }

    async fn put_execute_state(
        &self,
        req: Request<pb::PutExecuteStateRequest>,
    ) -> Reply<pb::PutExecuteStateResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        let e = detached(actor, async move {
            svc.put_execute_state(ExecuteState {
                principal: r.principal,
                pack_id: r.pack_id,
                installed: r.installed,
                activated: r.activated,
                connected: r.connected,
                update_time: 0,
            })
            .await
        })
        .await?;
        Ok(Response::new(pb::PutExecuteStateResponse {
            execute_state: Some(execute_state(&e)),
        }))
    }

    async fn get_pack_state(
        &self,
        req: Request<pb::GetPackStateRequest>,
    ) -> Reply<pb::GetPackStateResponse> {
        let r = req.into_inner();
        let s = self.service.pack_state(&r.principal, &r.pack_id).await?;
        let (enabled, on_route) = match s.activation {
            Activation::On(route) => (true, Some(route)),
            Activation::Off => (false, None),
        };
        Ok(Response::new(pb::GetPackStateResponse {
            sense: Some(pb::SenseState {
                granted: s.granted,
                enabled,
                route: on_route.map_or(pb::Route::Unspecified, route) as i32,
                binding: s.binding.as_ref().map(binding),
                deliverable: s.deliverable,
            }),
            execute: Some(execute_state(&s.execute)),
        }))
    }

    async fn put_binding(
        &self,
        req: Request<pb::PutBindingRequest>,
    ) -> Reply<pb::PutBindingResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let state = binding_state_from("state", r.state)?;
        let svc = self.service.clone();
        let (b, degraded) = detached(actor, async move {
            svc.put_binding(&r.principal, &r.pack_id, &r.binding_id, state)
                .await
        })
        .await?;
        Ok(Response::new(pb::PutBindingResponse {
            binding: Some(binding(&b)),
            binding_degraded: degraded.as_ref().map(outcome),
        }))
    }

    async fn delete_binding(
        &self,
        req: Request<pb::DeleteBindingRequest>,
    ) -> Reply<pb::DeleteBindingResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        detached(actor, async move {
            svc.delete_binding(&r.principal, &r.pack_id).await
        })
        .await?;
        Ok(Response::new(pb::DeleteBindingResponse {}))
    }

    async fn report_binding_health(
        &self,
        req: Request<pb::ReportBindingHealthRequest>,
    ) -> Reply<pb::ReportBindingHealthResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let state = binding_state_from("state", r.state)?.ok_or_else(|| {
            Error::invalid(
                "state",
                "is required: one of linked, stale, needs_reauth, pending, error",
            )
        })?;
        let svc = self.service.clone();
        let (b, previous, degraded) = detached(actor, async move {
            svc.report_binding_health(&r.principal, &r.pack_id, state)
                .await
        })
        .await?;
        Ok(Response::new(pb::ReportBindingHealthResponse {
            binding: Some(binding(&b)),
            previous_state: binding_state(previous) as i32,
            binding_degraded: degraded.as_ref().map(outcome),
        }))
    }

    async fn add_project_member(
        &self,
        req: Request<pb::AddProjectMemberRequest>,
    ) -> Reply<pb::AddProjectMemberResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        detached(actor, async move {
            svc.add_member(&r.project, &r.principal).await
        })
        .await?;
        Ok(Response::new(pb::AddProjectMemberResponse {}))
    }

    async fn remove_project_member(
        &self,
        req: Request<pb::RemoveProjectMemberRequest>,
    ) -> Reply<pb::RemoveProjectMemberResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        let removed = detached(actor, async move {
            svc.remove_member(&r.project, &r.principal).await
        })
        .await?;
        Ok(Response::new(pb::RemoveProjectMemberResponse { removed }))
    }
}

/// Trims a page fetched with one extra item and returns the token for the next page.
pub fn next_token<T>(items: &mut Vec<T>, size: u64, token: impl Fn(&T) -> String) -> String {
    let more = items.len() as u64 > size;
    items.truncate(usize::try_from(size).unwrap_or(usize::MAX));
    match (more, items.last()) {
        (true, Some(last)) => token(last),
        _ => String::new(),
    }
}
