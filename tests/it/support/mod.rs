//! What tests share beyond helpers.rs: the served binary, a private PostgreSQL, a freezing proxy.
pub mod postgres;
pub mod proxy;
pub mod served;
pub mod trigger;
