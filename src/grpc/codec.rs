//! How a request that cannot be decoded is answered: INVALID_ARGUMENT naming its field, not prost's INTERNAL.
use crate::error::Error;

/// Makes the generated services of `hcp-sense-api` answer undecodable requests through
/// [`decode_error`] and the one error table.
pub fn install() {
    hcp_sense_api::codec::on_decode_error(|e| tonic::Status::from(decode_error(e)));
}

/// Oneofs with a Struct member (the only member that nests) and a string member: a failure
/// inside the oneof names the Struct, a string that is not UTF-8 names the string.
const ONEOFS: [(&str, &str, &str); 4] = [
    (
        "DeliverTriggerRequest.payload_source",
        "payload",
        "payload_json",
    ),
    (
        "DeliverTriggerNoopRequest.payload_source",
        "payload",
        "payload_json",
    ),
    ("RegisterPackRequest.source", "manifest", "manifest_text"),
    ("LintPackRequest.source", "manifest", "manifest_text"),
];

/// google.protobuf's messages: what is inside one is named by the field that holds it.
const WELL_KNOWN: [&str; 4] = ["Struct", "Value", "ListValue", "Timestamp"];

/// The message of a DeliverTriggers stream: its trigger's fields are named as DeliverTrigger
/// names them, as the stream answers each trigger as DeliverTrigger would.
const STREAM_TRIGGER: &str = "DeliverTriggersRequest.trigger";

/// The caller sent bytes that are not the message: the fault is the request's, so it is
/// INVALID_ARGUMENT naming the field where the decoder failed, from the request's own field
/// down through this service's messages (`principal`; `trigger.ref` in ExplainTrigger;
/// `route.mapping.ref`), never inside a Struct (a payload nested past protobuf's recursion
/// limit names `payload`). `request` when the message itself is broken.
pub fn decode_error(e: &prost::DecodeError) -> Error {
    let text = e.to_string();
    let mut rest = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    // Display lists `Message.field: ` from the innermost to the request's own field, then the
    // rule, which may itself hold `: ` ("invalid string value: data is not UTF-8 encoded").
    let mut stack = Vec::new();
    while let Some((at, after)) = rest.split_once(": ") {
        match at.split_once('.') {
            Some((m, f)) if is_name(m) && is_name(f.trim_start_matches("r#")) => {
                stack.push((at, m, f.trim_start_matches("r#")));
                rest = after;
            }
            _ => break,
        }
    }
    let rule = rest;
    let not_utf8 = rule.starts_with("invalid string value");
    let mut path = Vec::new();
    for (i, (at, message, field)) in stack.iter().enumerate().rev() {
        if WELL_KNOWN.contains(message) {
            break;
        }
        path.push(match ONEOFS.iter().find(|(oneof, _, _)| oneof == at) {
            Some((_, _, text)) if i == 0 && not_utf8 => *text,
            Some((_, nested, _)) => *nested,
            None => *field,
        });
    }
    if stack.last().is_some_and(|(at, _, _)| *at == STREAM_TRIGGER) && path.len() > 1 {
        path.remove(0);
    }
    let field = match path.is_empty() {
        true => "request".to_owned(),
        false => path.join("."),
    };
    let rule = if rule.contains("recursion limit") {
        "nests deeper than protobuf's recursion limit".to_owned()
    } else if not_utf8 {
        "is not valid UTF-8, which a protobuf string must be".to_owned()
    } else {
        format!("is not a valid protobuf encoding ({rule})")
    };
    Error::invalid(field, rule)
}

/// A protobuf identifier: a message's or a field's name.
fn is_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::grpc::pb;

    /// `msg` encoded with the 8 bytes of `MARK` in one string field made invalid UTF-8.
    fn broken(msg: &impl Message) -> Vec<u8> {
        let mut bytes = msg.encode_to_vec();
        let at = bytes
            .windows(MARK.len())
            .position(|w| w == MARK.as_bytes())
            .expect("the mark is encoded");
        bytes[at..at + MARK.len()].copy_from_slice(&[0xff; 8]);
        bytes
    }

    const MARK: &str = "zzzzzzzz";

    fn field_of<M: Message + Default + std::fmt::Debug>(bytes: &[u8]) -> String {
        match decode_error(&M::decode(bytes).expect_err("undecodable")) {
            Error::InvalidArgument(v) => v[0].field.clone(),
            other => panic!("{other:?}"),
        }
    }

    fn trigger() -> pb::DeliverTriggerRequest {
        pb::DeliverTriggerRequest {
            pack_id: "github".into(),
            r#ref: "issue.opened".into(),
            principal: "alice".into(),
            land: "user".into(),
            project: "web".into(),
            trigger_id: "t-1".into(),
            ..Default::default()
        }
    }

    /// Invalid UTF-8 in each string field names that field, as the request holds it.
    #[test]
    fn a_string_that_is_not_utf8_names_its_field() {
        type Set = fn(&mut pb::DeliverTriggerRequest);
        let cases: [(&str, Set); 7] = [
            ("pack_id", |t| t.pack_id = MARK.into()),
            ("ref", |t| t.r#ref = MARK.into()),
            ("principal", |t| t.principal = MARK.into()),
            ("land", |t| t.land = MARK.into()),
            ("project", |t| t.project = MARK.into()),
            ("trigger_id", |t| t.trigger_id = MARK.into()),
            ("payload_json", |t| {
                t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::PayloadJson(
                    MARK.into(),
                ))
            }),
        ];
        for (field, set) in cases {
            let mut t = trigger();
            set(&mut t);
            assert_eq!(
                field_of::<pb::DeliverTriggerRequest>(&broken(&t)),
                field,
                "DeliverTrigger"
            );
            let stream = pb::DeliverTriggersRequest {
                trigger: Some(t.clone()),
            };
            assert_eq!(
                field_of::<pb::DeliverTriggersRequest>(&broken(&stream)),
                field,
                "DeliverTriggers"
            );
            let explain = pb::ExplainTriggerRequest { trigger: Some(t) };
            assert_eq!(
                field_of::<pb::ExplainTriggerRequest>(&broken(&explain)),
                format!("trigger.{field}"),
                "ExplainTrigger"
            );
        }
        // Inside a Struct: the field that holds it.
        let mut t = trigger();
        t.payload_source = Some(pb::deliver_trigger_request::PayloadSource::Payload(
            crate::grpc::convert::json_to_struct(&serde_json::json!({ MARK: 1 })),
        ));
        assert_eq!(
            field_of::<pb::DeliverTriggerRequest>(&broken(&t)),
            "payload"
        );
        let explain = pb::ExplainTriggerRequest { trigger: Some(t) };
        assert_eq!(
            field_of::<pb::ExplainTriggerRequest>(&broken(&explain)),
            "trigger.payload"
        );
        // A message broken outside any field (a key of wire type 7), or in one (no length).
        assert_eq!(field_of::<pb::DeliverTriggerRequest>(&[0x0f]), "request");
        assert_eq!(field_of::<pb::DeliverTriggerRequest>(&[0x1a]), "principal");
        let t = pb::DeliverTriggerRequest {
            principal: MARK.into(),
            ..trigger()
        };
        let e = decode_error(&pb::DeliverTriggerRequest::decode(&broken(&t)[..]).expect_err("x"));
        assert!(
            e.to_string().contains("principal: is not valid UTF-8"),
            "{e}"
        );
    }
}
