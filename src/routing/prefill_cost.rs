//! Least prefill cost: each replica's cost for a request is the tokens it must prefill for it
//! (the prompt minus the prefix it likely holds, weighted) plus the prefill already queued on
//! it plus its decode load, the KV its running requests hold; the cheapest live replica wins,
//! ties spread.
//!
//! This one sum pins a continuation (its home holds most of the prompt), moves it when the
//! home's queue costs more than a cold prefill elsewhere, and spreads a same-prefix burst by
//! itself: the second request of a burst sees the first one's queued prefill, and a replica
//! counts as holding a prompt only once its prefill is over (the caller records it then), or
//! for a request that would wait less behind that prefill than it would prefill elsewhere
//! (`holding`).

use std::sync::Arc;

use super::spread::least_busy;
use super::{Ask, Candidate, Policy, Route};

/// A token of KV held by the requests a replica runs weighs 1/this of a prefill token. Decode
/// is bound by memory: every step reads each running request's whole context, so a request
/// added to a replica whose decodes hold `k` tokens decodes slower by about `k` tokens' worth
/// of reads per step, for all its answer. With a 10k-token prompt, whose cold prefill weighs
/// 30k (`MISS_WEIGHT`), a same-prefix burst moves to a cold replica once about six of it run
/// on the warm one: 16 such requests split 10/6 or better (the table test), where a fixed
/// cost per running request left them 15/1. And 16 requests holding 90k tokens each weigh 90
/// times what 16 holding 1k do.
pub const KV_DIVISOR: u64 = 2;

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
    miss.saturating_mul(MISS_WEIGHT)
        .saturating_add(c.queued_tokens)
        .saturating_add(c.kv_tokens / KV_DIVISOR)
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

/// For each of `available`, in order, the tokens of the prompt it counts as holding: `held`,
/// or more where the request may ride on a pending prefill. That is where a request queued
/// earlier, whose prefill is not over, shares more of its prompt than the replica holds, and
/// where waiting for that prefill (the replica's whole queue) and then prefilling the rest
/// ends strictly sooner than a prefill of what it lacks on any other replica, after that
/// one's queue. There the shared prefix counts as held.
///
/// A follower that arrives while its leader still queues or prefills then finds the leader's
/// blocks in the cache (a replica looks its cache up when it schedules a request, after the
/// requests ahead of it) instead of prefilling them again elsewhere: a second copy that costs
/// prefill now and evicts what others would have found later. A same-prefix burst on idle
/// replicas still spreads: the second request's wait behind the first's prefill is at least
/// the cold prefill of the shared part elsewhere, never less, and the caller counts a rider's
/// queued prefill as a cold one, so the next request does not ride after it either.
fn holding(prompt_tokens: u64, available: &[&Candidate<'_>], held: &[u64]) -> Vec<u64> {
    debug_assert_eq!(available.len(), held.len());
    if available
        .iter()
        .zip(held)
        .all(|(c, h)| c.pending_tokens <= *h)
    {
        return held.to_vec();
    }
    let wait = |c: &Candidate<'_>, has: u64| {
        c.queued_tokens
            .saturating_add(prompt_tokens.saturating_sub(has))
    };
    // The soonest and second soonest cold ends, for the least over every other replica. (A
    // replica whose own cold end is the soonest rides whenever something is pending there,
    // as what it shares is at most the prompt: `second` only keeps the rule exact.)
    let (mut first, mut second) = ((u64::MAX, usize::MAX), u64::MAX);
    for (i, (c, h)) in available.iter().zip(held).enumerate() {
        let w = wait(c, *h);
        if w < first.0 {
            second = first.0;
            first = (w, i);
        } else if w < second {
            second = w;
        }
    }
    available
        .iter()
        .zip(held)
        .enumerate()
        .map(|(i, (c, h))| {
            let elsewhere = if i == first.1 { second } else { first.0 };
            if c.pending_tokens > *h && wait(c, c.pending_tokens) < elsewhere {
                c.pending_tokens
            } else {
                *h
            }
        })
        .collect()
}

/// `home`: the replica an exact continuation (or the session) names, and the tokens of the
/// prefix it served; `available` is never empty.
fn decide<'c, 'a>(
    prompt_tokens: u64,
    home: Option<(&str, u64)>,
    available: &[&'c Candidate<'a>],
    tick: u64,
) -> (&'c Candidate<'a>, Route) {
    // The home's served prefix counts unless the replica's own events speak for it: they
    // know what it evicted since.
    let held: Vec<u64> = available
        .iter()
        .map(|c| match home {
            Some((id, tokens)) if id == c.id && !c.cached_exact => c.cached_tokens.max(tokens),
            _ => c.cached_tokens,
        })
        .collect();
    let cached = holding(prompt_tokens, available, &held);
    let costs: Vec<u64> = available
        .iter()
        .zip(&cached)
        .map(|(c, h)| cost(c, prompt_tokens, *h))
        .collect();
    let cheapest = costs.iter().copied().min().unwrap_or(0);
    let tied = || (0..available.len()).filter(|i| costs[*i] == cheapest);
    // Among equals, the warmest, then the least busy, ties in turn.
    let warmest = tied().map(|i| cached[i]).max().unwrap_or(0);
    let warm: Vec<&'c Candidate<'a>> = tied()
        .filter(|i| cached[*i] == warmest)
        .map(|i| available[i])
        .collect();
    let chosen = least_busy(&warm, tick);
    let best_cache = cached.iter().copied().max().unwrap_or(0);
    let route = match home {
        Some((id, _)) if id == chosen.id => Route::Pinned,
        Some((id, _)) if !available.iter().any(|c| c.id == id) => Route::Repinned,
        Some(_) => Route::Spilled,
        None if best_cache == 0 => Route::Spread,
        None if warmest == best_cache => Route::Prefix,
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
        let c = |queued_tokens: u64, kv_tokens: u64| Candidate {
            id: "x",
            available: true,
            reachable: true,
            in_flight: 0,
            cached_tokens: 0,
            cached_exact: false,
            pending_tokens: 0,
            queued_tokens,
            running: 0,
            kv_tokens,
        };
        let idle = super::cost(&c(0, 0), 1000, 0);
        assert_eq!(idle, 3000);
        for (queued, kv) in [(u64::MAX, 0), (u64::MAX - 1, 2), (u64::MAX, u64::MAX)] {
            assert_eq!(
                super::cost(&c(queued, kv), 1000, 0),
                u64::MAX,
                "{queued} {kv}"
            );
        }
        assert_eq!(super::cost(&c(0, 0), u64::MAX, 0), u64::MAX);
    }

    fn replica(id: &'static str, cached: u64, kv_tokens: u64) -> Candidate<'static> {
        Candidate {
            id,
            available: true,
            reachable: true,
            in_flight: 0,
            cached_tokens: cached,
            cached_exact: false,
            pending_tokens: 0,
            queued_tokens: 0,
            running: 0,
            kv_tokens,
        }
    }

    /// The replica that served a prompt's prefix is its home, held warm by what it served,
    /// unless its own events speak for it: then their word (it evicted the prefix) stands.
    #[test]
    fn a_homes_served_prefix_counts_unless_its_events_say_otherwise() {
        let home = Some(("a", 8_000));
        let (a, b) = (replica("a", 0, 10_000), replica("b", 0, 0));
        let (chosen, route) = super::decide(10_000, home, &[&a, &b], 0);
        assert_eq!((chosen.id, route), ("a", super::Route::Pinned));
        let a = Candidate {
            cached_exact: true,
            ..a
        };
        let (chosen, route) = super::decide(10_000, home, &[&a, &b], 0);
        assert_eq!((chosen.id, route), ("b", super::Route::Spilled));
    }

    /// The decode term is the KV running requests hold: the same count of requests weighs by
    /// its contexts.
    #[test]
    fn long_contexts_weigh_more_than_short_ones() {
        let long = replica("a", 0, 16 * 90_000);
        let short = replica("b", 0, 16 * 1_000);
        assert!(super::cost(&long, 5_000, 0) > super::cost(&short, 5_000, 0));
        let (chosen, _) = super::decide(5_000, None, &[&long, &short], 0);
        assert_eq!(chosen.id, "b");
    }

    /// 16 requests sharing a 10k-token prefix, with 256-token answers, on replicas that
    /// prefill at once (no queue ever builds): the warm replica's running KV sends the rest
    /// of the burst to a cold one before the warm one takes more than 10.
    #[test]
    fn a_same_prefix_burst_splits_on_decode_load_alone() {
        const PROMPT: u64 = 10_000;
        const ANSWER: u64 = 256;
        let ids = ["a", "b"];
        let mut warm = [false; 2];
        let mut kv = [0u64; 2];
        let mut took = [0u32; 2];
        for tick in 0..16 {
            let cs: Vec<Candidate> = (0..2)
                .map(|i| replica(ids[i], if warm[i] { PROMPT } else { 0 }, kv[i]))
                .collect();
            let refs: Vec<&Candidate> = cs.iter().collect();
            let (chosen, _) = super::decide(PROMPT, None, &refs, tick);
            let i = ids.iter().position(|id| *id == chosen.id).expect("an id");
            warm[i] = true;
            kv[i] += PROMPT + ANSWER;
            took[i] += 1;
        }
        let (most, least) = (took[0].max(took[1]), took[0].min(took[1]));
        assert!(most <= 10 && most + least == 16, "split {took:?}");
    }

    /// Whether the replica `id` counts as holding more than its cache for this prompt.
    fn rides(prompt: u64, available: &[&Candidate], id: &str) -> bool {
        let held: Vec<u64> = available.iter().map(|c| c.cached_tokens).collect();
        let holding = super::holding(prompt, available, &held);
        let i = available.iter().position(|c| c.id == id).expect("an id");
        holding[i] > held[i]
    }

    fn queued(id: &'static str, queued_tokens: u64, pending_tokens: u64) -> Candidate<'static> {
        Candidate {
            queued_tokens,
            pending_tokens,
            ..replica(id, 0, 0)
        }
    }

    /// (replicas as (queued, pending), prompt) → the replica chosen and whether it rode: a
    /// follower rides on a pending prefill only where waiting for it ends strictly sooner than
    /// a cold prefill anywhere else.
    #[test]
    fn a_follower_rides_on_a_pending_prefill_only_when_that_is_sooner() {
        const P: u64 = 41_000;
        type Fleet = &'static [(&'static str, u64, u64)];
        let table: &[(Fleet, &str, bool)] = &[
            // Its leader (40k) is half done on a, b idle: waiting 20k then 1k beats 41k.
            (&[("a", 20_000, 40_000), ("b", 0, 0)], "a", true),
            // The leader was just queued: waiting for it is no sooner than a cold prefill on
            // b, so the burst spreads.
            (&[("a", 40_000, 40_000), ("b", 0, 0)], "b", false),
            // The leader queues behind another 100k: cold on b is sooner.
            (&[("a", 140_000, 40_000), ("b", 0, 0)], "b", false),
            // Every replica is as busy; the one with the leader is the one to wait at.
            (
                &[("a", 40_000, 0), ("b", 40_000, 40_000), ("c", 40_000, 0)],
                "b",
                true,
            ),
            // Two leaders: the sooner ends first.
            (
                &[
                    ("a", 40_000, 40_000),
                    ("b", 30_000, 40_000),
                    ("c", 80_000, 0),
                ],
                "b",
                true,
            ),
            // What it shares is no more than it holds: nothing to ride on.
            (&[("a", 0, 0), ("b", 20_000, 0)], "a", false),
            // Two others tie for the soonest cold end: the leader's replica is sooner still.
            (
                &[("a", 10_000, 0), ("b", 30_000, 40_000), ("c", 10_000, 0)],
                "b",
                true,
            ),
            // ...and not when it only ties with them.
            (
                &[("a", 0, 0), ("b", 40_000, 40_000), ("c", 5_000, 0)],
                "a",
                false,
            ),
            // Its own cold end is the soonest (the leader is credited as done): it rides, and
            // is weighed against the others, not against itself.
            (
                &[("a", 10_000, 0), ("b", 0, 40_000), ("c", 10_000, 0)],
                "b",
                true,
            ),
            // Alone, it rides on whatever is pending there.
            (&[("a", 40_000, 40_000)], "a", true),
        ];
        for (fleet, expect, rode) in table {
            let cs: Vec<Candidate> = fleet
                .iter()
                .map(|(id, q, pending)| queued(id, *q, *pending))
                .collect();
            let refs: Vec<&Candidate> = cs.iter().collect();
            let (chosen, route) = super::decide(P, None, &refs, 0);
            assert_eq!(chosen.id, *expect, "{fleet:?}");
            assert_eq!(rides(P, &refs, chosen.id), *rode, "{fleet:?}");
            if *rode {
                assert_eq!(route, super::Route::Prefix, "{fleet:?}");
            }
        }
    }

    /// A same-prefix burst sent before any prefill is over, each request queued as a cold
    /// prefill where it goes (as the caller does, riding or not), and the prompts pending: it
    /// spreads over 2, 3 and 4 replicas as evenly as 16 divides, and the requests after the
    /// first round ride on the first round's prefills.
    #[test]
    fn a_same_prefix_burst_spreads_and_the_rest_ride_on_the_first_round() {
        const PREFIX: u64 = 30_000;
        const PROMPT: u64 = 30_200;
        let ids = ["a", "b", "c", "d"];
        for n in 2..=4 {
            let mut queue = vec![0u64; n];
            let mut pending = vec![0u64; n];
            let mut took = vec![0u32; n];
            let mut rode = 0;
            for tick in 0..16 {
                let cs: Vec<Candidate> = (0..n)
                    .map(|i| queued(ids[i], queue[i], pending[i]))
                    .collect();
                let refs: Vec<&Candidate> = cs.iter().collect();
                let (chosen, _) = super::decide(PROMPT, None, &refs, tick);
                let i = ids.iter().position(|id| *id == chosen.id).expect("an id");
                if rides(PROMPT, &refs, chosen.id) {
                    rode += 1;
                }
                queue[i] += PROMPT;
                pending[i] = PREFIX;
                took[i] += 1;
            }
            let (most, least) = (took.iter().max(), took.iter().min());
            assert!(
                most.zip(least).is_some_and(|(m, l)| m - l <= 1),
                "{n} replicas: {took:?}"
            );
            assert!(rode >= 16 - n as u32 - 1, "{n} replicas: {rode} rode");
        }
    }
}
