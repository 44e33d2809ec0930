//! The protobuf codec of every generated client and service: prost's, except that how an undecodable message is answered is the server's to say.
use std::marker::PhantomData;
use std::sync::OnceLock;

use prost::Message;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstEncoder};

/// How an undecodable message becomes a status; prost's INTERNAL until a server sets it.
static ON_DECODE_ERROR: OnceLock<fn(&prost::DecodeError) -> Status> = OnceLock::new();

/// Sets, once for the process, the status an undecodable message is answered with. The
/// server names the faulty field as INVALID_ARGUMENT: the fault is the caller's.
pub fn on_decode_error(f: fn(&prost::DecodeError) -> Status) {
    // A second server in the same process (tests) sets the same function.
    let _ = ON_DECODE_ERROR.set(f);
}

/// Used by the generated services and clients (`codec_path` in build.rs).
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
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder(PhantomData)
    }
}

#[derive(Debug)]
pub struct MessageDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| match ON_DECODE_ERROR.get() {
                Some(f) => f(&e),
                None => Status::internal(e.to_string()),
            })
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
