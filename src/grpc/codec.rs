//! How a request that cannot be decoded is answered: INVALID_ARGUMENT naming its field, not prost's INTERNAL.
use crate::error::Error;

/// Makes the generated services of `hcp-sense-api` answer undecodable requests through
/// [`decode_error`] and the one error table.
pub fn install() {
    hcp_sense_api::codec::on_decode_error(|e| tonic::Status::from(decode_error(e)));
}

/// Oneofs whose only nesting member is a Struct, and that member's name.
const ONEOF_STRUCTS: [(&str, &str); 4] = [
    ("DeliverTriggerRequest.payload_source", "payload"),
    ("DeliverTriggerNoopRequest.payload_source", "payload"),
    ("RegisterPackRequest.source", "manifest"),
    ("LintPackRequest.source", "manifest"),
];

/// The caller sent bytes that are not the message: the fault is the request's, so it is
/// INVALID_ARGUMENT, naming the request's top-level field where the decoder failed (a
/// payload nested past protobuf's recursion limit names `payload`).
pub fn decode_error(e: &prost::DecodeError) -> Error {
    let text = e.to_string();
    let rest = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    // Display lists `Message.field: ` from the innermost to the request's own field.
    let parts: Vec<&str> = rest.split(": ").collect();
    let (stack, rule) = parts.split_at(parts.len().saturating_sub(1));
    let field = stack.last().map_or("request", |m| {
        // A oneof is reported by its name; of its members only the Struct can nest.
        ONEOF_STRUCTS
            .iter()
            .find(|(oneof, _)| oneof == m)
            .map_or_else(
                || m.rsplit_once('.').map_or("request", |(_, f)| f),
                |(_, f)| f,
            )
    });
    let rule = rule.first().copied().unwrap_or("malformed");
    let rule = if rule.contains("recursion limit") {
        "nests deeper than protobuf's recursion limit".to_owned()
    } else {
        format!("is not a valid protobuf encoding ({rule})")
    };
    Error::invalid(field, rule)
}
