//! The scenarios, each against a [`crate::cluster::Cluster`] or a base URL.

pub mod agent;
pub mod deploy;
pub mod failover;
pub mod overhead;
pub mod soak;
