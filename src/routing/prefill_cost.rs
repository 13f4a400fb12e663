//! Least prefill cost: each replica's cost for a request is the tokens it must prefill for it
//! (the prompt minus the prefix it likely holds, weighted) plus the prefill already queued on
//! it plus a term for the decodes it is running; the cheapest live replica wins, ties spread.
//!
//! This one sum pins a continuation (its home holds most of the prompt), moves it when the
//! home's queue costs more than a cold prefill elsewhere, and spreads a same-prefix burst by
//! itself: the second request of a burst sees the first one's queued prefill, and a replica
//! counts as holding a prompt only once its prefill is over (the caller records it then).

use std::sync::Arc;

use super::spread::least_busy;
use super::{Ask, Candidate, Policy, Route};

/// What one running decode costs, in prefill tokens: decodes share each scheduler step with
/// prefill chunks, so a busy replica prefills a little slower.
pub const DECODE_TOKENS: u64 = 32;

/// How much a token prefilled because it is not cached weighs against a token of queue. A miss
/// is paid twice: now, in prefill time, and later, because the copy it puts in a second cache
/// evicts what other requests would have found there. With 1 (time alone), replaying the
/// Mooncake trace reached 0.78-0.82x the hit rate of one cache of the fleet's size; with 3,
/// 0.91-0.97x, and TTFT p90 within noise of 1 (`make bench`, trace replay, README).
pub const MISS_WEIGHT: u64 = 3;

/// A replica's cost for a prompt of `prompt_tokens`, of which it likely holds `cached`.
/// Saturating: the queue and running counts come partly from the replica, and a sum that
/// wrapped would make the busiest replica look the cheapest.
pub fn cost(c: &Candidate<'_>, prompt_tokens: u64, cached: u64) -> u64 {
    let miss = prompt_tokens.saturating_sub(cached);
    let running = u64::try_from(c.running).unwrap_or(u64::MAX);
    miss.saturating_mul(MISS_WEIGHT)
        .saturating_add(c.queued_tokens)
        .saturating_add(running.saturating_mul(DECODE_TOKENS))
}

#[derive(Debug)]
pub struct PrefillCost;

impl Policy for PrefillCost {
    fn name(&self) -> &'static str {
        "prefill_cost"
    }

    fn weighs_prefill(&self) -> bool {
        true
    }

    fn choose<'c, 'a, F: Fn(u64) -> Option<Arc<str>>>(
        &self,
        ask: &Ask<'_, F>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route) {
        let home = home(ask);
        let home = home.as_ref().map(|(id, tokens)| (&**id, *tokens));
        decide(ask.shape.prompt_tokens(), home, available, ask.tick)
    }
}

/// The replica the request's session names outright, or else the one that served the longest
/// prefix of it exactly, with the tokens of that prefix.
pub fn home<F: Fn(u64) -> Option<Arc<str>>>(ask: &Ask<'_, F>) -> Option<(Arc<str>, u64)> {
    let served_by = ask.served_by;
    let session_home = ask.session.and_then(served_by).map(|id| (id, 0));
    session_home.or_else(|| {
        ask.shape
            .strict_prefix_links()
            .find_map(|l| served_by(l.hash).map(|id| (id, l.bytes / 4)))
    })
}

/// `home`: the replica an exact continuation (or the session) names, and the tokens of the
/// prefix it served; `available` is never empty.
fn decide<'c, 'a>(
    prompt_tokens: u64,
    home: Option<(&str, u64)>,
    available: &[&'c Candidate<'a>],
    tick: u64,
) -> (&'c Candidate<'a>, Route) {
    let cached = |c: &Candidate<'a>| match home {
        Some((id, tokens)) if id == c.id => c.cached_tokens.max(tokens),
        _ => c.cached_tokens,
    };
    let cheapest = available
        .iter()
        .map(|c| cost(c, prompt_tokens, cached(c)))
        .min()
        .unwrap_or(0);
    let tied: Vec<&'c Candidate<'a>> = available
        .iter()
        .copied()
        .filter(|c| cost(c, prompt_tokens, cached(c)) == cheapest)
        .collect();
    // Among equals, the warmest, then the least busy, ties in turn.
    let warmest = tied.iter().map(|c| cached(c)).max().unwrap_or(0);
    let warm: Vec<&'c Candidate<'a>> = tied.into_iter().filter(|c| cached(c) == warmest).collect();
    let chosen = least_busy(&warm, tick);
    let best_cache = available.iter().map(|c| cached(c)).max().unwrap_or(0);
    let route = match home {
        Some((id, _)) if id == chosen.id => Route::Pinned,
        Some((id, _)) if !available.iter().any(|c| c.id == id) => Route::Repinned,
        Some(_) => Route::Spilled,
        None if best_cache == 0 => Route::Spread,
        None if cached(chosen) == best_cache => Route::Prefix,
        None => Route::Spilled,
    };
    (chosen, route)
}

#[cfg(test)]
mod tests {
    use super::super::Candidate;

    /// The cost saturates: the largest queue and running counts make the most expensive
    /// replica, never one whose sum wrapped below an idle one's.
    #[test]
    fn the_cost_of_absurd_counts_saturates() {
        let c = |queued_tokens: u64, running: usize| Candidate {
            id: "x",
            available: true,
            reachable: true,
            in_flight: 0,
            cached_tokens: 0,
            queued_tokens,
            running,
            kv_tokens: 0,
        };
        let idle = super::cost(&c(0, 0), 1000, 0);
        assert_eq!(idle, 3000);
        for (queued, running) in [
            (u64::MAX, 0),
            (u64::MAX - 1, 1),
            (0, usize::MAX),
            (u64::MAX, usize::MAX),
        ] {
            assert_eq!(
                super::cost(&c(queued, running), 1000, 0),
                u64::MAX,
                "{queued} {running}"
            );
        }
        assert_eq!(super::cost(&c(0, 0), u64::MAX, 0), u64::MAX);
    }
}
