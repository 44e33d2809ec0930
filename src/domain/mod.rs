//! The Sense domain: names, pack manifests and their lint. No gRPC, no SQL.
pub mod names;
pub mod pack;
