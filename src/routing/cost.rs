//! Least prefill cost: each replica's cost for a request is the tokens it must prefill for it
//! (the prompt minus the prefix it likely holds, weighted) plus the prefill already queued on
//! it plus a term for the decodes it is running; the cheapest live replica wins, ties spread.
//!
//! This one sum pins a continuation (its home holds most of the prompt), moves it when the
//! home's queue costs more than a cold prefill elsewhere, and spreads a same-prefix burst by
//! itself: the second request of a burst sees the first one's queued prefill, and a replica
//! counts as holding a prompt only once its prefill is over (the caller records it then).

use super::spread::least_busy;
use super::{Candidate, Route};

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
pub fn cost<H>(c: &Candidate<'_, H>, prompt_tokens: u64, cached: u64) -> u64 {
    let miss = prompt_tokens.saturating_sub(cached);
    let running = u64::try_from(c.running).unwrap_or(u64::MAX);
    miss.saturating_mul(MISS_WEIGHT)
        .saturating_add(c.queued_tokens)
        .saturating_add(running.saturating_mul(DECODE_TOKENS))
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::{Candidate, Mode, Policy, Route};
    use crate::routing::tests::{chat, classify};

    /// A stand-in for the balancer under `prefill_cost`: each replica's prefix index and queued
    /// prefill, updated as the balancer does after each decision.
    struct CostBench {
        policy: Policy,
        ids: Vec<String>,
        index: Vec<crate::index::PrefixIndex>,
        queued: Vec<u64>,
        running: Vec<usize>,
        served: HashMap<u64, String>,
        /// Prompts sent whose prefill is not over: recorded in the index at `drain`.
        prefilling: Vec<(usize, Vec<crate::api::prompt::Link>)>,
        tick: u64,
    }

    impl CostBench {
        fn new(n: usize) -> CostBench {
            CostBench {
                policy: Policy {
                    mode: Mode::PrefillCost,
                    spill_margin: None,
                },
                ids: (0..n).map(|i| format!("gpu{i}")).collect(),
                index: (0..n)
                    .map(|_| crate::index::PrefixIndex::new(2_000_000))
                    .collect(),
                queued: vec![0; n],
                running: vec![0; n],
                served: HashMap::new(),
                prefilling: vec![],
                tick: 0,
            }
        }

        /// Routes a request that stays queued (no first byte yet); returns (replica, route).
        fn route(&mut self, body: &[u8]) -> (usize, Route) {
            let info = classify(body);
            let links = info.shape.links();
            let candidates: Vec<Candidate<usize>> = self
                .ids
                .iter()
                .enumerate()
                .map(|(i, id)| Candidate {
                    handle: i,
                    id,
                    available: true,
                    reachable: true,
                    in_flight: self.running[i],
                    cached_tokens: self.index[i].cached_tokens(links),
                    queued_tokens: self.queued[i],
                    running: 0,
                })
                .collect();
            let served = &self.served;
            let d = self
                .policy
                .decide(
                    &info.shape,
                    None,
                    &candidates,
                    |h| served.get(&h).cloned(),
                    self.tick,
                )
                .expect("a replica");
            self.tick += 1;
            let i = d.replica;
            self.queued[i] += info.shape.prompt_tokens() - candidates[i].cached_tokens;
            self.running[i] += 1;
            self.prefilling.push((i, links.to_vec()));
            if let Some(k) = info.shape.served_key() {
                self.served.insert(k, self.ids[i].clone());
            }
            (i, d.route)
        }

        /// Every request's prefill is done: each replica now holds what it was sent.
        fn drain(&mut self) {
            for (i, links) in self.prefilling.drain(..) {
                self.index[i].record(&links);
            }
            self.queued.iter_mut().for_each(|q| *q = 0);
            self.running.iter_mut().for_each(|r| *r = 0);
        }
    }

    /// About `tokens` tokens (4 bytes each) of text distinct per `seed`.
    fn history(tokens: usize, seed: &str) -> String {
        let mut text = String::with_capacity(tokens * 4 + 16);
        let mut i = 0;
        while text.len() < tokens * 4 {
            text.push_str(&format!("{seed}{i} "));
            i += 1;
        }
        text.truncate(tokens * 4);
        text
    }

    #[test]
    fn prefill_cost_splits_a_same_prefix_burst_evenly() {
        let mut b = CostBench::new(2);
        let mut count = [0; 2];
        for i in 0..16 {
            count[b.route(&chat(&[&format!("task {i}")])).0] += 1;
        }
        assert_eq!(count, [8, 8]);
    }

    #[test]
    fn a_burst_sharing_a_long_prefix_spreads_while_the_first_prefill_runs() {
        // Sixteen sub-agents sharing a 90k-token prompt, all sent before any prefill is over:
        // no replica holds the prefix yet, so none is cheaper for it.
        let mut b = CostBench::new(2);
        let prefix = history(90_000, "shared");
        let mut count = [0; 2];
        for i in 0..16 {
            count[b.route(&chat(&[&prefix, &format!("subtask {i}")])).0] += 1;
        }
        assert_eq!(count, [8, 8]);
        // Once it is over, both hold it, and the next one goes to either, warm.
        b.drain();
        let (_, route) = b.route(&chat(&[&prefix, "subtask 16"]));
        assert_eq!(route, Route::Prefix);
    }

    #[test]
    fn prefill_cost_keeps_an_agent_loop_home_while_home_is_not_much_busier() {
        let mut b = CostBench::new(2);
        let big = history(20_000, "ctx");
        let mut turns = vec![big.clone()];
        let (home, route) = b.route(&chat(&[&big]));
        assert_eq!(route, Route::Spread);
        b.drain();
        for t in 1..5 {
            turns.push(format!("answer {t}"));
            turns.push(format!("turn {t}"));
            let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
            // Home has some work queued, far less than re-reading 20k tokens elsewhere.
            b.queued[home] = 5_000;
            let (r, route) = b.route(&chat(&refs));
            assert_eq!((r, route), (home, Route::Pinned), "turn {t}");
            b.drain();
        }
        // Home is now buried under more queued prefill than a cold start elsewhere is worth.
        turns.push("answer x".into());
        turns.push("turn x".into());
        let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
        b.queued[home] = 100_000;
        let (r, route) = b.route(&chat(&refs));
        assert_eq!((r == home, route), (false, Route::Spilled));
    }

    #[test]
    fn prefill_cost_sends_a_fork_home_when_idle_and_spreads_it_when_home_is_busy() {
        for (home_queue, expect_home) in [(0u64, 8usize), (400_000, 0)] {
            let mut b = CostBench::new(4);
            let long = history(60_000, "hist");
            let (home, _) = b.route(&chat(&[&long, "a0", "q0"]));
            b.drain();
            b.queued[home] = home_queue;
            let mut at_home = 0;
            for s in 0..8 {
                // Siblings: the same history, a different last question.
                let (r, route) = b.route(&chat(&[&long, "a0", &format!("sibling {s}")]));
                if r == home {
                    at_home += 1;
                    assert_ne!(route, Route::Spread);
                }
            }
            assert_eq!(at_home, expect_home, "home queue {home_queue}");
        }
    }

    /// The cost saturates: the largest queue and running counts make the most expensive
    /// replica, never one whose sum wrapped below an idle one's.
    #[test]
    fn the_cost_of_absurd_counts_saturates() {
        let c = |queued_tokens: u64, running: usize| Candidate {
            handle: (),
            id: "x",
            available: true,
            reachable: true,
            in_flight: 0,
            cached_tokens: 0,
            queued_tokens,
            running,
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
