//! The request body: read whole (bounded), then handed to Pingora again on every attempt.

mod json_end;
mod replay;

pub use json_end::JsonEnd;
pub use replay::{BodyError, BodyLimits, BodyReplay};
