//! `affinity`: every request pinned by a hash of its first message (rendezvous hashing, so
//! keys stay put when another replica leaves). Kept to re-measure its failure with bursts: a
//! same-prefix burst all lands on one card.

use std::sync::Arc;

use super::{spread, Ask, Candidate, Policy, Route};

#[derive(Debug)]
pub struct Hashed;

impl Policy for Hashed {
    fn name(&self) -> &'static str {
        "affinity"
    }

    fn choose<'c, 'a, F: Fn(u64) -> Option<Arc<str>>>(
        &self,
        ask: &Ask<'_, F>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route) {
        let key = ask.shape.affinity_key();
        (spread::rendezvous(available, key), Route::Hashed)
    }
}
