//! The replicas: each one's endpoint, health, load and cache model ([`replica`]), the
//! [`registry`] that holds them, the background tasks that watch them ([`health`], [`poll`],
//! [`discovery`], the replicas' own KV events in [`kv_events`]), and the conversation pins ([`affinity`], kept across restarts by
//! [`pins_file`]). Changes other layers care about leave through [`events`].

pub mod affinity;
pub mod blocks;
pub mod chain;
pub mod discovery;
pub mod events;
pub mod health;
pub mod index;
pub mod kv_events;
pub mod pins_file;
pub mod poll;
pub mod pool;
pub mod probe;
pub mod registry;
pub mod replica;
