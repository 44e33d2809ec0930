//! BenchService: the no-op baseline of the benchmark, served only when asked for.
use tonic::{Request, Response, Status};

use super::pb::{self, bench_service_server::BenchService};

#[derive(Clone, Debug, Default)]
pub struct Baseline;

/// A record id of the length real ones have, so both answers weigh the same.
const RECORD_ID: &str = "00000000-0000-7000-8000-000000000000";

#[tonic::async_trait]
impl BenchService for Baseline {
    async fn deliver_trigger_noop(
        &self,
        req: Request<pb::DeliverTriggerNoopRequest>,
    ) -> Result<Response<pb::DeliverTriggerNoopResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(pb::DeliverTriggerNoopResponse {
            disposition: if r.pack_id.is_empty() {
                pb::Disposition::Dropped
            } else {
                pb::Disposition::RecordedInbox
            } as i32,
            drop_reason: 0,
            record_id: RECORD_ID.to_owned(),
            duplicate: false,
        }))
    }
}
