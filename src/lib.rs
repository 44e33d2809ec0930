//! hcp-sense: the control plane of the Sense loop (HCP §7).
pub mod app;
pub mod auth;
pub mod cli;
pub mod config;
pub mod domain;
pub mod error;
pub mod fair;
pub mod grpc;
pub mod http;
pub mod ingress;
pub mod lifecycle;
pub mod metrics;
pub mod reply;
pub mod service;
pub mod sockets;
pub mod store;
pub mod telemetry;
