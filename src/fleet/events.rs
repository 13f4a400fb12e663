//! What the fleet tells the layers above it, without knowing them: a replica's load changed,
//! or it prefilled a prompt. The cluster listens (to share both with the other instances); a
//! fleet alone has no listener and the calls cost one failed `OnceLock` read.
//!
//! Listeners never block and never allocate in these calls: they run on a request's path
//! (a guard's drop, a first byte).

use std::sync::Arc;

use crate::protocol::api::prompt::Link;

/// Something above the fleet that wants its changes as they happen.
pub trait Listener: Send + Sync {
    /// Some replica's load as this process sees it changed (a request started or ended, or
    /// a prefill was queued or released).
    fn load_changed(&self);

    /// `replica` prefilled the prompt `links`, sent from this process.
    fn prefilled(&self, replica: &Arc<str>, links: &[Link]);
}
