//! Adaptive routing: a continuation goes back to the replica that served its longest strict
//! prefix, unless that replica is gone or far busier than the least busy one; the rest spreads.

use super::spread::least_busy;
use super::{Candidate, Route};

/// `homes` are the keys that may name a home, strongest first (the session, then the longest
/// strict prefix); `available` is never empty.
pub fn decide<'c, 'a, H, S: AsRef<str>>(
    spill_margin: Option<usize>,
    mut homes: impl Iterator<Item = u64>,
    available: &[&'c Candidate<'a, H>],
    served_by: impl Fn(u64) -> Option<S>,
    tick: u64,
) -> (&'c Candidate<'a, H>, Route) {
    // The first key that was served names the warm replica.
    let Some(home) = homes.find_map(&served_by) else {
        return (least_busy(available, tick), Route::Spread);
    };
    let Some(home) = available.iter().find(|c| c.id == home.as_ref()) else {
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
