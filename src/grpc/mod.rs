//! The gRPC edge: generated types, thin services that translate and delegate, and error mapping.
pub mod bench;
pub mod convert;
pub mod guard;
pub mod ingest;
pub mod layer;
pub mod packs;
pub mod paging;
pub mod policy;
pub mod records;
pub mod status;

/// Code generated from `proto/hcp/sense/v1`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("hcp.sense.v1");

    /// The encoded descriptor set of every hcp-sense proto and its imports, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/hcp_sense_descriptor.bin"));
}
