//! inferlb: a load balancer for OpenAI-compatible LLM inference replicas, on Pingora.
//!
//! Data flows one way: body → [`shape`] → [`routing`] decision → peer → outcome → [`replicas`].

pub mod access;
pub mod admin;
pub mod body;
pub mod config;
pub mod health;
pub mod metrics;
pub mod proxy;
pub mod replicas;
pub mod routing;
pub mod shape;
pub mod state;
pub mod usage;
