//! What tests share beyond helpers.rs: the served binary, a private PostgreSQL, a freezing proxy, the Python clients.
pub mod postgres;
pub mod proxy;
pub mod python;
pub mod served;
pub mod trigger;
