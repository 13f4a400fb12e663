//! Least prefill cost: each replica's cost for a request is the tokens it must prefill for it
//! (the prompt minus the prefix it likely holds) plus the prefill already queued on it plus a
//! term for the decodes it is running; the cheapest live replica wins, ties spread.
//!
//! This one sum pins a continuation (its home holds most of the prompt), moves it when the
//! home's queue costs more than a cold prefill elsewhere, and spreads a same-prefix burst by
//! itself: the second request of a burst sees the first one's queued prefill.

use super::spread::least_busy;
use super::{Candidate, Route};

/// What one running decode costs, in prefill tokens: decodes share each scheduler step with
/// prefill chunks, so a busy replica prefills a little slower.
pub const DECODE_TOKENS: u64 = 32;

/// A replica's cost for a prompt of `prompt_tokens`, of which it likely holds `cached`.
pub fn cost<H>(c: &Candidate<'_, H>, prompt_tokens: u64, cached: u64) -> u64 {
    prompt_tokens.saturating_sub(cached) + c.queued_tokens + c.running as u64 * DECODE_TOKENS
}

/// `home`: the replica an exact continuation (or the session) names, and the tokens of the
/// prefix it served; `available` is never empty.
pub fn decide<'c, 'a, H>(
    prompt_tokens: u64,
    home: Option<(&str, u64)>,
    available: &[&'c Candidate<'a, H>],
    tick: u64,
) -> (&'c Candidate<'a, H>, Route) {
    let cached = |c: &Candidate<'a, H>| match home {
        Some((id, tokens)) if id == c.id => c.cached_tokens.max(tokens),
        _ => c.cached_tokens,
    };
    let cheapest = available
        .iter()
        .map(|c| cost(c, prompt_tokens, cached(c)))
        .min()
        .unwrap_or(0);
    let tied: Vec<&'c Candidate<'a, H>> = available
        .iter()
        .copied()
        .filter(|c| cost(c, prompt_tokens, cached(c)) == cheapest)
        .collect();
    // Among equals, the warmest, then the least busy, ties in turn.
    let warmest = tied.iter().map(|c| cached(c)).max().unwrap_or(0);
    let warm: Vec<&'c Candidate<'a, H>> =
        tied.into_iter().filter(|c| cached(c) == warmest).collect();
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
