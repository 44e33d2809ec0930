//! The gRPC edge: generated types, thin services that translate and delegate, and error mapping.
pub mod audit;
pub mod bench;
pub mod caller;
pub mod calls;
pub mod codec;
pub mod conn;
pub mod convert;
pub mod decisions;
pub mod flow;
pub mod guard;
pub mod ingest;
pub mod layer;
pub mod lifetime;
pub mod packs;
pub mod paging;
pub mod policy;
pub mod records;
pub mod routes;
pub mod status;
pub mod streams;

use crate::auth::{CalledMethod, Caller};
use crate::store::audit::Actor;

/// The caller of a gRPC request, as the audit names it.
pub fn actor_of<T>(req: &tonic::Request<T>) -> Actor {
    let rpc = req
        .extensions()
        .get::<CalledMethod>()
        .and_then(|m| m.0.rsplit('/').next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned());
    match req.extensions().get::<Caller>() {
        Some(Caller::Known(id)) => Actor {
            subject: id.subject.clone(),
            role: format!("{:?}", id.role).to_lowercase(),
            rpc,
        },
        _ => Actor {
            subject: "anonymous".into(),
            role: "open".into(),
            rpc,
        },
    }
}

/// The wire contract's generated types, clients and service traits (the `hcp-sense-api` crate).
pub use hcp_sense_api::v1 as pb;
