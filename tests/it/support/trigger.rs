//! The one builder of test triggers; each test file names the few it uses on top of it.
use hcp_sense::grpc::convert::json_to_struct;
use hcp_sense::grpc::pb::{deliver_trigger_request::PayloadSource, DeliverTriggerRequest};

/// A trigger with no payload, trigger id or project.
pub fn trigger(pack_id: &str, r#ref: &str, principal: &str, land: &str) -> DeliverTriggerRequest {
    DeliverTriggerRequest {
        pack_id: pack_id.into(),
        r#ref: r#ref.into(),
        principal: principal.into(),
        land: land.into(),
        ..Default::default()
    }
}

/// `t` carrying `payload` (a JSON object) as a google.protobuf.Struct.
pub fn with_payload(
    mut t: DeliverTriggerRequest,
    payload: serde_json::Value,
) -> DeliverTriggerRequest {
    t.payload_source = Some(PayloadSource::Payload(json_to_struct(&payload)));
    t
}
