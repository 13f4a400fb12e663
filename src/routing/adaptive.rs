//! Adaptive routing: a continuation goes back to the replica that served its longest strict
//! prefix, unless that replica is gone or far busier than the least busy one; the rest spreads.

use std::sync::Arc;

use super::spread::least_busy;
use super::{Ask, Candidate, Policy, Route};

#[derive(Debug)]
pub struct Adaptive {
    /// A pinned continuation spills when its replica has at least this many more requests in
    /// flight than the least busy available one. `None`: never spill.
    pub spill_margin: Option<usize>,
}

impl Policy for Adaptive {
    fn name(&self) -> &'static str {
        "adaptive"
    }

    fn choose<'c, 'a, F: Fn(u64) -> Option<Arc<str>>>(
        &self,
        ask: &Ask<'_, F>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route) {
        // The keys that may name a home, strongest first: the session, then the longest
        // strict prefix.
        let homes = ask.session.into_iter().chain(ask.shape.strict_prefixes());
        decide(self.spill_margin, homes, available, ask.served_by, ask.tick)
    }
}

/// `available` is never empty.
fn decide<'c, 'a>(
    spill_margin: Option<usize>,
    mut homes: impl Iterator<Item = u64>,
    available: &[&'c Candidate<'a>],
    served_by: &impl Fn(u64) -> Option<Arc<str>>,
    tick: u64,
) -> (&'c Candidate<'a>, Route) {
    // The first key that was served names the warm replica.
    let Some(home) = homes.find_map(served_by) else {
        return (least_busy(available, tick), Route::Spread);
    };
    let Some(home) = available.iter().find(|c| c.id == &*home) else {
        return (least_busy(available, tick), Route::Repinned);
    };
    let least = available.iter().map(|c| c.in_flight).min().unwrap_or(0);
    match spill_margin {
        Some(margin) if home.in_flight >= least.saturating_add(margin.max(1)) => {
            (least_busy(available, tick), Route::Spilled)
        }
        _ => (home, Route::Pinned),
    }
}
