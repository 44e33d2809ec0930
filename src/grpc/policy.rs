//! PolicyService: grants, activation, Bindings, project members and the Execute-state mirror.
use tonic::{Request, Response, Status};

use super::actor_of;
use super::convert::{
    activation, binding, binding_state, binding_state_from, execute_state, grant, outcome, quota,
    route, route_from, timestamp,
};
use super::paging::{fingerprint, Page, PageTokens};
use super::pb::{self, policy_service_server::PolicyService};
use crate::domain::model::{ExecuteState, KeyPage};
use crate::domain::policy::Activation;
use crate::error::Error;
use crate::service::detached;

#[derive(Clone, Debug)]
pub struct PolicyApi {
    pub policy: crate::service::Policy,
    pub pages: PageTokens,
}

type Reply<T> = Result<Response<T>, Status>;

fn opt(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// One request's page of an AIP-158 listing keyed by two strings, filtered by each when set.
struct Listing<'p, 'r> {
    page: Page<'p>,
    first: &'r str,
    second: &'r str,
    after: Option<(String, String)>,
}

impl Listing<'_, '_> {
    /// What to fetch: one row past the page, to know whether another follows.
    fn page(&self) -> KeyPage<'_> {
        KeyPage {
            first: opt(self.first),
            second: opt(self.second),
            after: self.after.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
            limit: self.page.limit(),
        }
    }
}

impl PolicyApi {
    fn listing<'r>(
        &self,
        kind: &'static str,
        (first, second): (&'r str, &'r str),
        page_size: i32,
        page_token: &str,
    ) -> Result<Listing<'_, 'r>, Error> {
        let page = self
            .pages
            .page(kind, fingerprint(&[first, second]), page_size, page_token)?;
        let after = page
            .after::<2>()?
            .map(|[a, b]| (a.to_owned(), b.to_owned()));
        Ok(Listing {
            page,
            first,
            second,
            after,
        })
    }

    /// `rows` cut to the page and made messages, and the token of the next page (empty on
    /// the last).
    fn next_page<T, M: prost::Message>(
        &self,
        l: &Listing<'_, '_>,
        rows: &mut Vec<T>,
        key: impl Fn(&T) -> (&str, &str),
        message: impl FnMut(&T) -> M,
    ) -> (Vec<M>, String) {
        l.page.next(
            rows,
            |r| {
                let (a, b) = key(r);
                [a.to_owned(), b.to_owned()]
            },
            message,
        )
    }
}

#[tonic::async_trait]
impl PolicyService for PolicyApi {
    async fn grant_sense_enable(
        &self,
        req: Request<pb::GrantSenseEnableRequest>,
    ) -> Reply<pb::GrantSenseEnableResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.policy.clone();
        let g = detached(self.policy.lifecycle(), async move {
            svc.grant(&actor, &r.principal, &r.pack_id).await
        })
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
        let svc = self.policy.clone();
        let revoked = detached(self.policy.lifecycle(), async move {
            svc.revoke(&actor, &r.principal, &r.pack_id).await
        })
        .await?;
        Ok(Response::new(pb::RevokeSenseEnableResponse { revoked }))
    }

    async fn list_grants(
        &self,
        req: Request<pb::ListGrantsRequest>,
    ) -> Reply<pb::ListGrantsResponse> {
        let r = req.into_inner();
        let l = self.listing(
            "grants",
            (&r.pack_id, &r.principal),
            r.page_size,
            &r.page_token,
        )?;
        let mut grants = self.policy.list_grants(&l.page()).await?;
        let (grants, next_page_token) = self.next_page(
            &l,
            &mut grants,
            |g| (g.pack_id.as_str(), g.principal.as_str()),
            grant,
        );
        Ok(Response::new(pb::ListGrantsResponse {
            grants,
            next_page_token,
        }))
    }

    async fn list_bindings(
        &self,
        req: Request<pb::ListBindingsRequest>,
    ) -> Reply<pb::ListBindingsResponse> {
        let r = req.into_inner();
        let l = self.listing(
            "bindings",
            (&r.pack_id, &r.principal),
            r.page_size,
            &r.page_token,
        )?;
        let mut bindings = self.policy.list_bindings(&l.page()).await?;
        let (bindings, next_page_token) = self.next_page(
            &l,
            &mut bindings,
            |b| (b.pack_id.as_str(), b.principal.as_str()),
            binding,
        );
        Ok(Response::new(pb::ListBindingsResponse {
            bindings,
            next_page_token,
        }))
    }

    async fn list_activations(
        &self,
        req: Request<pb::ListActivationsRequest>,
    ) -> Reply<pb::ListActivationsResponse> {
        let r = req.into_inner();
        let l = self.listing(
            "activations",
            (&r.pack_id, &r.principal),
            r.page_size,
            &r.page_token,
        )?;
        let mut rows = self.policy.list_activations(&l.page()).await?;
        let (activations, next_page_token) = self.next_page(
            &l,
            &mut rows,
            |a| (a.pack_id.as_str(), a.principal.as_str()),
            activation,
        );
        Ok(Response::new(pb::ListActivationsResponse {
            activations,
            next_page_token,
        }))
    }

    async fn list_project_members(
        &self,
        req: Request<pb::ListProjectMembersRequest>,
    ) -> Reply<pb::ListProjectMembersResponse> {
        let r = req.into_inner();
        let l = self.listing(
            "members",
            (&r.project, &r.principal),
            r.page_size,
            &r.page_token,
        )?;
        let mut members = self.policy.list_members(&l.page()).await?;
        let (members, next_page_token) = self.next_page(
            &l,
            &mut members,
            |m| (m.project.as_str(), m.principal.as_str()),
            |m| pb::ProjectMember {
                project: m.project.clone(),
                principal: m.principal.clone(),
                create_time: Some(timestamp(m.create_time)),
            },
        );
        Ok(Response::new(pb::ListProjectMembersResponse {
            members,
            next_page_token,
        }))
    }

    async fn put_quota(&self, req: Request<pb::PutQuotaRequest>) -> Reply<pb::PutQuotaResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.policy.clone();
        let q = detached(self.policy.lifecycle(), async move {
            svc.put_quota(
                &actor,
                &r.pack_id,
                r.principal.as_deref(),
                r.rate_per_second,
                r.burst,
            )
            .await
        })
        .await?;
        Ok(Response::new(pb::PutQuotaResponse {
            quota: Some(quota(&q)),
        }))
    }

    async fn get_quota(&self, req: Request<pb::GetQuotaRequest>) -> Reply<pb::GetQuotaResponse> {
        let r = req.into_inner();
        let q = self
            .policy
            .get_quota(&r.pack_id, r.principal.as_deref())
            .await?;
        Ok(Response::new(pb::GetQuotaResponse {
            quota: Some(quota(&q)),
        }))
    }

    async fn list_quotas(
        &self,
        req: Request<pb::ListQuotasRequest>,
    ) -> Reply<pb::ListQuotasResponse> {
        let r = req.into_inner();
        let l = self.listing(
            "quotas",
            (&r.pack_id, &r.principal),
            r.page_size,
            &r.page_token,
        )?;
        let mut rows = self.policy.list_quotas(&l.page()).await?;
        let (quotas, next_page_token) = self.next_page(
            &l,
            &mut rows,
            |q| (q.pack_id.as_str(), q.principal.as_deref().unwrap_or("")),
            quota,
        );
        Ok(Response::new(pb::ListQuotasResponse {
            quotas,
            next_page_token,
        }))
    }

    async fn delete_quota(
        &self,
        req: Request<pb::DeleteQuotaRequest>,
    ) -> Reply<pb::DeleteQuotaResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let svc = self.policy.clone();
        detached(self.policy.lifecycle(), async move {
            svc.delete_quota(&actor, &r.pack_id, r.principal.as_deref())
                .await
        })
        .await?;
        Ok(Response::new(pb::DeleteQuotaResponse {}))
    }

    async fn activate_sense(
        &self,
        req: Request<pb::ActivateSenseRequest>,
    ) -> Reply<pb::ActivateSenseResponse> {
        let actor = actor_of(&req);
        let r = req.into_inner();
        let route = route_from("route", r.route)?;
        let svc = self.policy.clone();
        let a = detached(self.policy.lifecycle(), async move {
            svc.set_activation(&actor, &r.principal, &r.pack_id, true, route, &r.filter)
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
        let svc = self.policy.clone();
        let a = detached(self.policy.lifecycle(), async move {
            svc.set_activation(&actor, &r.principal, &r.pack_id, false, None, "")
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
        let svc = self.policy.clone();
        let e = detached(self.policy.lifecycle(), async move {
            svc.put_execute_state(
                &actor,
                ExecuteState {
                    principal: r.principal,
                    pack_id: r.pack_id,
                    installed: r.installed,
                    activated: r.activated,
                    connected: r.connected,
                    update_time: 0,
                },
            )
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
        let s = self.policy.pack_state(&r.principal, &r.pack_id).await?;
        let (enabled, on_route, filter) = match &s.activation {
            Activation::On(route, filter) => (
                true,
                Some(*route),
                filter.as_ref().map(|f| f.source().to_owned()),
            ),
            Activation::Off => (false, None, None),
        };
        Ok(Response::new(pb::GetPackStateResponse {
            sense: Some(pb::SenseState {
                granted: s.granted,
                enabled,
                route: on_route.map_or(pb::Route::Unspecified, route) as i32,
                binding: s.binding.as_ref().map(binding),
                deliverable: s.deliverable,
                filter: filter.unwrap_or_default(),
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
        let svc = self.policy.clone();
        let (b, degraded) = detached(self.policy.lifecycle(), async move {
            svc.put_binding(&actor, &r.principal, &r.pack_id, &r.binding_id, state)
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
        let svc = self.policy.clone();
        let degraded = detached(self.policy.lifecycle(), async move {
            svc.delete_binding(&actor, &r.principal, &r.pack_id).await
        })
        .await?;
        Ok(Response::new(pb::DeleteBindingResponse {
            binding_degraded: degraded.as_ref().map(outcome),
        }))
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
        let svc = self.policy.clone();
        let (b, previous, degraded) = detached(self.policy.lifecycle(), async move {
            svc.report_binding_health(&actor, &r.principal, &r.pack_id, state)
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
        let svc = self.policy.clone();
        detached(self.policy.lifecycle(), async move {
            svc.add_member(&actor, &r.project, &r.principal).await
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
        let svc = self.policy.clone();
        let removed = detached(self.policy.lifecycle(), async move {
            svc.remove_member(&actor, &r.project, &r.principal).await
        })
        .await?;
        Ok(Response::new(pb::RemoveProjectMemberResponse { removed }))
    }
}
