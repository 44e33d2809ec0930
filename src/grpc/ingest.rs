//! IngestService: DeliverTrigger, translated and handed to the decision.
use tonic::{Request, Response, Status};

use super::convert::{disposition, drop_reason, struct_to_json_checked, trigger_source_from};
use super::pb::{
    self, deliver_trigger_request::PayloadSource, ingest_service_server::IngestService,
};
use crate::domain::decide::RawTrigger;
use crate::error::Error;
use crate::service::Service;

#[derive(Clone, Debug)]
pub struct Ingest {
    pub service: Service,
}

#[tonic::async_trait]
impl IngestService for Ingest {
    async fn deliver_trigger(
        &self,
        req: Request<pb::DeliverTriggerRequest>,
    ) -> Result<Response<pb::DeliverTriggerResponse>, Status> {
        let r = req.into_inner();
        let payload = match r.payload_source {
            None => None,
            Some(PayloadSource::Payload(s)) => Some(struct_to_json_checked("payload", s)?),
            Some(PayloadSource::PayloadJson(text)) => Some(
                serde_json::from_str(&text)
                    .map_err(|e| Error::invalid("payload_json", format!("is not JSON: {e}")))?,
            ),
        };
        let o = self
            .service
            .deliver(RawTrigger {
                pack_id: r.pack_id,
                r#ref: r.r#ref,
                principal: r.principal,
                land: r.land,
                payload,
                project: r.project,
                trigger_id: r.trigger_id,
                source: trigger_source_from(r.source),
            })
            .await?;
        Ok(Response::new(pb::DeliverTriggerResponse {
            disposition: disposition(&o) as i32,
            drop_reason: o
                .drop_reason
                .map_or(pb::DropReason::Unspecified, drop_reason) as i32,
            record_id: o.record_id.unwrap_or_default(),
            duplicate: o.duplicate,
        }))
    }
}
