//! The protobuf codec of every service: prost's, except that a request that cannot be decoded is INVALID_ARGUMENT naming its field, not INTERNAL.
use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstEncoder};

use crate::error::Error;

/// Used by the generated servers and clients (`codec_path` in build.rs).
#[derive(Debug, Clone)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RequestDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder(PhantomData)
    }
}

#[derive(Debug)]
pub struct RequestDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for RequestDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| Status::from(decode_error(&e)))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
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
