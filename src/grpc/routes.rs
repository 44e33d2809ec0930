//! IngressService: admin changes and reads of ingress routes; their secrets go in and never come out.
use tonic::{Request, Response, Status};

use super::actor_of;
use super::paging::PageTokens;
use super::pb::{self, ingress_service_server::IngressService};
use crate::domain::ingress::{IngressKind, Mapping, Route};
use crate::error::Error;
use crate::service::detached;

#[derive(Clone, Debug)]
pub struct IngressApi {
    pub ingress: crate::ingress::Ingress,
    pub pages: PageTokens,
}

const PAGE_KIND: &str = "ingress-routes";

fn kind_of(k: i32) -> Result<IngressKind, Error> {
    match pb::IngressKind::try_from(k) {
        Ok(pb::IngressKind::StandardWebhooks) => Ok(IngressKind::StandardWebhooks),
        Ok(pb::IngressKind::Github) => Ok(IngressKind::Github),
        Ok(pb::IngressKind::Cloudevents) => Ok(IngressKind::CloudEvents),
        Ok(pb::IngressKind::Nats) => Ok(IngressKind::Nats),
        Ok(pb::IngressKind::Unspecified) => Err(Error::invalid(
            "route.kind",
            "is required: INGRESS_KIND_STANDARD_WEBHOOKS, INGRESS_KIND_GITHUB, INGRESS_KIND_CLOUDEVENTS or INGRESS_KIND_NATS",
        )),
        Err(_) => Err(Error::invalid(
            "route.kind",
            format!("unknown ingress kind {k}"),
        )),
    }
}

fn to_pb(r: &Route) -> pb::IngressRoute {
    let m = &r.mapping;
    pb::IngressRoute {
        route_id: r.route_id.clone(),
        pack_id: r.pack_id.clone(),
        kind: match r.kind {
            IngressKind::StandardWebhooks => pb::IngressKind::StandardWebhooks,
            IngressKind::Github => pb::IngressKind::Github,
            IngressKind::CloudEvents => pb::IngressKind::Cloudevents,
            IngressKind::Nats => pb::IngressKind::Nats,
        } as i32,
        mapping: Some(pb::IngressMapping {
            r#ref: m.r#ref.clone(),
            principal: m.principal.clone(),
            binding_id: m.binding_id.clone(),
            project: m.project.clone(),
            trigger_id: m.trigger_id.clone(),
            land: m.land.clone(),
        }),
        secret_count: r.secrets.len() as i32,
        fan_out: r.fan_out,
        cloudevents_type_prefix: r.type_prefix.clone(),
        nats_stream: r.nats_stream.clone(),
        nats_subject: r.nats_subject.clone(),
    }
}

#[tonic::async_trait]
impl IngressService for IngressApi {
    async fn put_ingress_route(
        &self,
        req: Request<pb::PutIngressRouteRequest>,
    ) -> Result<Response<pb::PutIngressRouteResponse>, Status> {
        let actor = actor_of(&req);
        let req = req.into_inner();
        let r = req
            .route
            .ok_or_else(|| Error::invalid("route", "is required"))?;
        let m = r.mapping.unwrap_or_default();
        let route = Route {
            kind: kind_of(r.kind)?,
            route_id: r.route_id,
            pack_id: r.pack_id,
            mapping: Mapping {
                r#ref: m.r#ref,
                principal: m.principal,
                binding_id: m.binding_id,
                project: m.project,
                trigger_id: m.trigger_id,
                land: m.land,
            },
            secrets: req.secrets,
            fan_out: r.fan_out,
            type_prefix: r.cloudevents_type_prefix,
            nats_stream: r.nats_stream,
            nats_subject: r.nats_subject,
        };
        let svc = self.ingress.clone();
        let (created, route) = detached(self.ingress.lifecycle(), async move {
            let created = svc.put_ingress_route(&actor, &route).await?;
            Ok((created, route))
        })
        .await?;
        Ok(Response::new(pb::PutIngressRouteResponse {
            route: Some(to_pb(&route)),
            created,
        }))
    }

    async fn get_ingress_route(
        &self,
        req: Request<pb::GetIngressRouteRequest>,
    ) -> Result<Response<pb::GetIngressRouteResponse>, Status> {
        let r = self
            .ingress
            .get_ingress_route(&req.into_inner().route_id)
            .await?;
        Ok(Response::new(pb::GetIngressRouteResponse {
            route: Some(to_pb(&r)),
        }))
    }

    async fn list_ingress_routes(
        &self,
        req: Request<pb::ListIngressRoutesRequest>,
    ) -> Result<Response<pb::ListIngressRoutesResponse>, Status> {
        let req = req.into_inner();
        let page = self
            .pages
            .page(PAGE_KIND, String::new(), req.page_size, &req.page_token)?;
        let after = page.after::<1>()?.map(|[id]| id);
        let mut routes = self
            .ingress
            .list_ingress_routes(after, page.limit())
            .await?;
        let (routes, next_page_token) =
            page.next(&mut routes, |last| [last.route_id.clone()], to_pb);
        Ok(Response::new(pb::ListIngressRoutesResponse {
            routes,
            next_page_token,
        }))
    }

    async fn delete_ingress_route(
        &self,
        req: Request<pb::DeleteIngressRouteRequest>,
    ) -> Result<Response<pb::DeleteIngressRouteResponse>, Status> {
        let svc = self.ingress.clone();
        let actor = actor_of(&req);
        let route_id = req.into_inner().route_id;
        detached(self.ingress.lifecycle(), async move {
            svc.delete_ingress_route(&actor, &route_id).await
        })
        .await?;
        Ok(Response::new(pb::DeleteIngressRouteResponse {}))
    }
}
