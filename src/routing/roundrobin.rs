//! `roundrobin`: shape ignored, a plain counter over the available replicas.

use super::{spread, Ask, Candidate, Policy, Route};

#[derive(Debug)]
pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "roundrobin"
    }

    fn choose<'c, 'a>(
        &self,
        ask: &Ask<'_>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route) {
        (spread::round_robin(available, ask.tick), Route::RoundRobin)
    }
}
