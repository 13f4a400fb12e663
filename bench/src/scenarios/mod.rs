//! The scenarios, each against a [`crate::cluster::Cluster`] or a base URL.

pub mod agent;
pub mod agent_apis;
pub mod deploy;
pub mod failover;
pub mod fork;
pub mod instances;
pub mod kv_events;
pub mod overhead;
pub mod overhead_tls;
pub mod overload;
pub mod pd;
pub mod soak;
pub mod trace;
