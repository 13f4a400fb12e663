//! `roundrobin`: shape ignored, a plain counter over the available replicas.

use std::sync::Arc;

use super::{spread, Ask, Candidate, Policy, Route};

#[derive(Debug)]
pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "roundrobin"
    }

    fn choose<'c, 'a, F: Fn(u64) -> Option<Arc<str>>>(
        &self,
        ask: &Ask<'_, F>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route) {
        (spread::round_robin(available, ask.tick), Route::RoundRobin)
    }
}
