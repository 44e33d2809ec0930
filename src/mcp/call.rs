//! A unary gRPC call of any method of the API, by its descriptor: the request and the answer as dynamic messages, read from and written as protobuf JSON.
use prost::Message;
use prost_reflect::{DynamicMessage, MessageDescriptor, MethodDescriptor, SerializeOptions};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::AsciiMetadataValue;
use tonic::Status;

use crate::error::Error;

/// The API the door calls: the server's own services in process (through the same layers
/// as its listener: authentication, roles, rate limits, stream caps, deadlines), or a
/// running server's listener (`hcp-sense mcp`).
pub type Api = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    Unreachable,
>;

/// A call that reached no server (a type of its own, not a boxed error: what the API's
/// futures hold stays `Send` for every lifetime).
#[derive(Debug)]
pub struct Unreachable(String);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreachable {}

/// The API of a running server, over `channel`.
pub fn remote(channel: tonic::transport::Channel) -> Api {
    Api::new(tower::ServiceExt::map_err(
        channel,
        |e: tonic::transport::Error| {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                why = format!("{why}: {s}");
                source = s.source();
            }
            Unreachable(why)
        },
    ))
}

/// The API of this server's own `services` (its layered routes), called in process: each
/// call is marked as the door's (crate::grpc::guard::OwnCall).
pub fn in_process<S>(services: S) -> Api
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let marked = tower::ServiceBuilder::new()
        .map_request(|mut r: http::Request<tonic::body::Body>| {
            r.extensions_mut().insert(crate::grpc::guard::OwnCall);
            r
        })
        .map_err(|e: std::convert::Infallible| -> Unreachable { match e {} })
        .service(services);
    Api::new(marked)
}

/// Encodes a dynamic message; decodes the method's answer type.
#[derive(Clone)]
struct DynamicCodec {
    output: MessageDescriptor,
}

impl DynamicCodec {
    fn of(method: &MethodDescriptor) -> DynamicCodec {
        DynamicCodec {
            output: method.output(),
        }
    }
}

impl Codec for DynamicCodec {
    type Encode = DynamicMessage;
    type Decode = DynamicMessage;
    type Encoder = DynamicEncoder;
    type Decoder = DynamicDecoder;

    fn encoder(&mut self) -> DynamicEncoder {
        DynamicEncoder
    }

    fn decoder(&mut self) -> DynamicDecoder {
        DynamicDecoder(self.output.clone())
    }
}

struct DynamicEncoder;

impl Encoder for DynamicEncoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn encode(&mut self, item: DynamicMessage, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Error::internal_from("request not encoded", e).into())
    }
}

struct DynamicDecoder(MessageDescriptor);

impl Decoder for DynamicDecoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<DynamicMessage>, Status> {
        DynamicMessage::decode(self.0.clone(), src)
            .map(Some)
            .map_err(|e| Error::internal_from("answer not decoded", e).into())
    }

    /// A small first buffer: a subscription's watch holds its buffer while idle, and the
    /// buffer grows to the messages that come.
    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        tonic::codec::BufferSettings::new(1024, 32 * 1024)
    }
}

/// Opens the server stream `method` with `request` (protobuf JSON of its input type),
/// carrying `authorization`: each message comes as protobuf JSON, as `unary` answers.
pub async fn server_stream(
    api: &Api,
    method: &MethodDescriptor,
    request: serde_json::Value,
    authorization: Option<AsciiMetadataValue>,
) -> Result<Messages, Status> {
    let input = message_of(&method.input(), request, Some("arguments"))?;
    let from = Origin {
        authorization,
        peer: None,
    };
    Ok(Messages(
        server_stream_messages(api, method, input, &from).await?,
    ))
}

/// The messages of a server stream, as protobuf JSON.
pub struct Messages(tonic::Streaming<DynamicMessage>);

impl Messages {
    /// The next message; `None` when the stream has ended.
    pub async fn next(&mut self) -> Result<Option<serde_json::Value>, Status> {
        match self.0.message().await? {
            Some(m) => as_json(&m).map(Some),
            None => Ok(None),
        }
    }
}

/// The client and path to call `method` with.
async fn client(
    api: &Api,
    method: &MethodDescriptor,
) -> Result<(tonic::client::Grpc<Api>, PathAndQuery), Status> {
    let path = PathAndQuery::try_from(format!(
        "/{}/{}",
        method.parent_service().full_name(),
        method.name()
    ))
    .map_err(|e| Status::from(Error::internal_from("method path", e)))?;
    let mut grpc = tonic::client::Grpc::new(api.clone());
    grpc.ready().await.map_err(|e| {
        Status::from(Error::Unavailable(format!(
            "hcp-sense is not reachable: {e}"
        )))
    })?;
    Ok((grpc, path))
}

/// A request carrying `authorization`.
fn with_authorization<T>(
    message: T,
    authorization: Option<AsciiMetadataValue>,
) -> tonic::Request<T> {
    let mut call = tonic::Request::new(message);
    if let Some(a) = authorization {
        call.metadata_mut().insert("authorization", a);
    }
    call
}

/// Who a call is from: its `Authorization`, and the address of the door's own client.
#[derive(Clone, Debug, Default)]
pub struct Origin {
    pub authorization: Option<AsciiMetadataValue>,
    /// The address of the door's own client.
    pub peer: Option<std::net::IpAddr>,
}

impl Origin {
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut call = with_authorization(message, self.authorization.clone());
        if let Some(ip) = self.peer {
            call.extensions_mut().insert(crate::grpc::guard::DoorPeer {
                key: format!("peer:{ip}").into(),
                ip,
            });
        }
        call
    }
}

/// `json` read as a `input` (protobuf JSON: lowerCamelCase or proto names). What does not
/// fit is INVALID_ARGUMENT naming the field, under `named` (`arguments.page_size`) or alone.
pub fn message_of(
    input: &MessageDescriptor,
    json: serde_json::Value,
    named: Option<&str>,
) -> Result<DynamicMessage, Status> {
    match DynamicMessage::deserialize(input.clone(), json.clone()) {
        Ok(m) => Ok(m),
        Err(e) => Err(refusal(input, &json, &e, named).into()),
    }
}

/// Calls `method` with `input`, carrying `authorization`: its answer.
pub async fn unary_message(
    api: &Api,
    method: &MethodDescriptor,
    input: DynamicMessage,
    from: &Origin,
) -> Result<DynamicMessage, Status> {
    let (mut grpc, path) = client(api, method).await?;
    let answer = grpc
        .unary(from.request(input), path, DynamicCodec::of(method))
        .await?;
    Ok(answer.into_inner())
}

/// Opens the server stream `method` with `input`, carrying `authorization`.
pub async fn server_stream_messages(
    api: &Api,
    method: &MethodDescriptor,
    input: DynamicMessage,
    from: &Origin,
) -> Result<tonic::Streaming<DynamicMessage>, Status> {
    let (mut grpc, path) = client(api, method).await?;
    let answer = grpc
        .server_streaming(from.request(input), path, DynamicCodec::of(method))
        .await?;
    Ok(answer.into_inner())
}

/// Calls the streaming method `method` with `inputs`, carrying `authorization`: its answers
/// as they come.
pub async fn streaming_messages(
    api: &Api,
    method: &MethodDescriptor,
    inputs: Vec<DynamicMessage>,
    from: &Origin,
) -> Result<tonic::Streaming<DynamicMessage>, Status> {
    let (mut grpc, path) = client(api, method).await?;
    let answer = grpc
        .streaming(
            from.request(tokio_stream::iter(inputs)),
            path,
            DynamicCodec::of(method),
        )
        .await?;
    Ok(answer.into_inner())
}

/// Calls `method` with `request` (protobuf JSON of its input type), carrying `authorization`;
/// answers the output in protobuf JSON (field names in lowerCamelCase, as grpcurl prints
/// them, 64-bit integers as numbers). A request that is not the input type is
/// INVALID_ARGUMENT naming what did not fit.
pub async fn unary(
    api: &Api,
    method: &MethodDescriptor,
    request: serde_json::Value,
    authorization: Option<AsciiMetadataValue>,
) -> Result<serde_json::Value, Status> {
    let input = message_of(&method.input(), request, Some("arguments"))?;
    let from = Origin {
        authorization,
        peer: None,
    };
    let answer = unary_message(api, method, input, &from).await?;
    as_json(&answer)
}

/// A message as protobuf JSON: lowerCamelCase names, 64-bit integers as numbers, whole
/// doubles as integers.
fn as_json(m: &DynamicMessage) -> Result<serde_json::Value, Status> {
    to_json(m, false)
}

/// A message as protobuf JSON, lowerCamelCase names, whole doubles as integers; 64-bit
/// integers as strings (`stringify_64`, the proto3 JSON mapping) or as numbers.
pub fn to_json(m: &DynamicMessage, stringify_64: bool) -> Result<serde_json::Value, Status> {
    let mut json = m
        .serialize_with_options(
            serde_json::value::Serializer,
            &SerializeOptions::new().stringify_64_bit_integers(stringify_64),
        )
        .map_err(|e| Status::from(Error::internal_from("answer not written as JSON", e)))?;
    whole_numbers(&mut json);
    Ok(json)
}

/// Why `arguments` are not a `input`, naming the argument that does not fit: the first one
/// refused on its own, else the whole.
fn refusal(
    input: &MessageDescriptor,
    arguments: &serde_json::Value,
    whole: &serde_json::Error,
    named: Option<&str>,
) -> Error {
    let of = input.full_name();
    let (named, what) = match named {
        Some(n) => (format!("{n}."), n),
        None => (String::new(), "request"),
    };
    if let serde_json::Value::Object(fields) = arguments {
        for (name, value) in fields {
            let alone =
                serde_json::Value::Object([(name.clone(), value.clone())].into_iter().collect());
            if let Err(e) = DynamicMessage::deserialize(input.clone(), alone) {
                return Error::invalid(
                    format!("{named}{name}"),
                    format!("{e} ({what}: the protobuf JSON of {of})"),
                );
            }
        }
    }
    Error::invalid(what, format!("{whole} ({what}: the protobuf JSON of {of})"))
}

/// Writes a whole double as an integer (`42`, not `42.0`), as grpcurl prints a payload's
/// numbers: a payload travels as a google.protobuf.Struct, whose numbers are all doubles.
fn whole_numbers(v: &mut serde_json::Value) {
    use serde_json::Value;
    /// Doubles hold every integer up to 2^53 exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match v {
        Value::Number(n) => {
            if let Some(f) = n
                .as_f64()
                .filter(|f| n.is_f64() && f.fract() == 0.0 && f.abs() <= EXACT)
            {
                // Exact by the bound above.
                #[allow(clippy::cast_possible_truncation)]
                let whole = f as i64;
                *v = Value::from(whole);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers),
        Value::Object(fields) => fields.values_mut().for_each(whole_numbers),
        _ => {}
    }
}
