//! What a request says, read without I/O: the API families and their prompt model ([`api`]),
//! bounded bodies and their replay for retries ([`body`]), the request target as normalised
//! at the edge ([`edge`]), the token usage replicas report ([`usage`]) and asked for on a
//! stream's behalf ([`stream_usage`]), and server-sent events as they pass ([`sse`]).

pub mod api;
pub mod body;
pub mod conversation;
pub mod edge;
pub mod handover;
pub mod members;
pub mod sse;
pub mod stream_usage;
pub mod tokens;
pub mod usage;
