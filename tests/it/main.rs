//! The one integration test binary: the real gRPC API over both stores, and the real command-line tools.
#[macro_use]
mod helpers;

mod hostile;
mod identity;
mod layout;
mod transport;

mod bench;
mod catalog;
mod cli;
mod contract;
mod decision_log;
mod decisions;
mod deploy;
mod fair;
mod ingress;
mod lifecycle;
mod mcp;
mod migrations;
mod nats;
mod packs;
mod partitions;
mod position;
mod quota;
mod security;
mod sense;
mod slowloris;
mod streams;
mod support;
mod telemetry;
mod trace;
mod watch;
mod web;
