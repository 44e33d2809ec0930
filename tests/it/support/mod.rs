//! What tests share beyond helpers.rs: the served binary, a plain HTTP client, a private PostgreSQL, a freezing proxy, the Python clients.
pub mod http1;
pub mod postgres;
pub mod proxy;
pub mod python;
pub mod served;
pub mod trigger;
