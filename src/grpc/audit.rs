//! AuditService: the admin mutation log, newest first.
use tonic::{Request, Response, Status};

use super::convert::timestamp;
use super::paging::{fingerprint, PageTokens};
use super::pb::{self, audit_service_server::AuditService};
use crate::error::Error;
use crate::service::{valid_id, valid_pack_id, Policy};

#[derive(Clone, Debug)]
pub struct AuditApi {
    pub policy: Policy,
    pub pages: PageTokens,
}

#[tonic::async_trait]
impl AuditService for AuditApi {
    async fn list_audit_events(
        &self,
        req: Request<pb::ListAuditEventsRequest>,
    ) -> Result<Response<pb::ListAuditEventsResponse>, Status> {
        const KIND: &str = "audit";
        let r = req.into_inner();
        let pack = (!r.pack_id.is_empty()).then_some(r.pack_id.as_str());
        let principal = (!r.principal.is_empty()).then_some(r.principal.as_str());
        if let Some(p) = pack {
            valid_pack_id(p)?;
        }
        if let Some(p) = principal {
            valid_id("principal", p)?;
        }
        let page = self.pages.page(
            KIND,
            fingerprint(&[&r.pack_id, &r.principal]),
            r.page_size,
            &r.page_token,
        )?;
        let before = match page.after::<2>()? {
            None => None,
            Some([t, id]) => {
                let t: i64 = t
                    .parse()
                    .map_err(|_| Error::invalid("page_token", "is malformed"))?;
                Some((t, id))
            }
        };
        let mut events = self
            .policy
            .list_audit_events(pack, principal, before, page.limit())
            .await?;
        let (audit_events, next_page_token) = page.next(
            &mut events,
            |e| [e.time.to_string(), e.event_id.clone()],
            |e| pb::AuditEvent {
                event_id: e.event_id.clone(),
                event_time: Some(timestamp(e.time)),
                actor: e.actor.clone(),
                role: e.role.clone(),
                rpc: e.rpc.clone(),
                pack_id: e.pack_id.clone().unwrap_or_default(),
                principal: e.principal.clone().unwrap_or_default(),
                before: e.before.clone().unwrap_or_default(),
                after: e.after.clone().unwrap_or_default(),
            },
        );
        Ok(Response::new(pb::ListAuditEventsResponse {
            audit_events,
            next_page_token,
        }))
    }
}
