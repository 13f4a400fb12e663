//! inferlb: a load balancer for OpenAI-compatible LLM inference replicas, on Pingora.
//!
//! The modules are layers, and a layer imports only from the layers below it (checked by
//! `tests/layers.rs`; see docs/architecture.md). From the bottom:
//!
//! - [`telemetry`]: the Prometheus registry and the access log;
//! - [`protocol`]: what a request says: API families, the prompt model, bodies, the edge;
//! - [`conf`]: the conf as parsed and checked, its ids, and the secrets and certificates it names;
//! - [`fleet`]: the replicas (endpoint, health, load, cache model), their registry and pins;
//! - [`routing`]: the policies, pure over fleet snapshots;
//! - [`link`] and [`cluster`]: one Redis link, and the state instances share over it;
//! - [`history`]: the Responses store in the balancer, in memory and over the link;
//! - [`overload`]: admission, fair queueing and budgets;
//! - [`proxy`] and [`admin`]: a request's life through Pingora's hooks, and the admin plane.

pub mod telemetry;

pub mod protocol;

pub mod conf;

pub mod fleet;

pub mod routing;

pub mod link;

pub mod cluster;

pub mod history;

pub mod overload;

pub mod admin;
pub mod proxy;
