//! The Sense domain: names, pack manifests and their lint, the policy view and the decision. No gRPC, no SQL.
pub mod decide;
pub mod model;
pub mod names;
pub mod pack;
pub mod policy;
#[cfg(test)]
mod props;
