//! The hcp-sense wire contract: the generated types, clients and service traits of `hcp.sense.v1`, and nothing of the server or its store.
//!
//! A Rust runtime talks to hcp-sense with `v1::ingest_service_client::IngestServiceClient` and
//! the other clients; the server implements the `v1::*_service_server` traits.
pub mod codec;

/// Code generated from `proto/hcp/sense/v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("hcp.sense.v1");

    /// The encoded descriptor set of every hcp-sense proto and its imports, for reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/hcp_sense_descriptor.bin"));
}
