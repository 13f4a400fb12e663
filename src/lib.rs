//! inferlb: a load balancer for OpenAI-compatible LLM inference replicas, on Pingora.
//!
//! Data flows one way: [`body`] → [`shape`] → [`routing`] decision over the [`registry`] →
//! the chosen [`replica`]'s peer → outcome → [`affinity`] table and metrics.

pub mod access;
pub mod admin;
pub mod admin_auth;
pub mod affinity;
pub mod api;
pub mod body;
pub mod cluster;
pub mod config;
pub mod discovery;
pub mod edge;
pub mod health;
pub mod index;
pub mod load;
pub mod metrics;
pub mod netpolicy;
pub mod overload;
pub mod probe;
pub mod proxy;
pub mod registry;
pub mod replica;
pub mod routing;
pub mod secrets;
pub mod shape;
pub mod state;
pub mod tls;
pub mod usage;
