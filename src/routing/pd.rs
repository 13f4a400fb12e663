//! The decode side of a disaggregated pool: which decode replica takes a request, and whether
//! it goes through the prefill pool at all.
//!
//! A decode replica's cost is the KV it must pull (vLLM's decode side reuses its own prefix
//! cache and pulls only the rest) plus its decode load: the KV its running requests
//! hold. All in the cost policy's unit, prefill tokens, so that one sum keeps a conversation
//! on the decode replica that holds its history until that replica is far busier than a pull
//! elsewhere costs. A turn whose uncached part there is small is prefilled there, whole.

use super::spread::least_busy;
use super::Candidate;

/// What pulling one token of KV weighs against prefilling one: the transfer is far faster
/// than the compute, but the pulled copy takes cache room on the decode replica as a miss
/// does. Below `prefill_cost::MISS_WEIGHT` (3): a pull is cheaper than a cold prefill.
pub const PULL_WEIGHT: u64 = 1;

/// A token of KV held by running decodes weighs 1/this of a prefill token: attention reads
/// it at every step of every decode.
pub const KV_SHARE: u64 = 64;

/// A decode replica's cost for a prompt of `prompt_tokens`, of which it likely holds `cached`.
pub fn decode_cost(c: &Candidate<'_>, prompt_tokens: u64, cached: u64) -> u64 {
    let pull = prompt_tokens.saturating_sub(cached);
    pull.saturating_mul(PULL_WEIGHT)
        .saturating_add(c.kv_tokens / KV_SHARE)
}

/// The cheapest decode replica among `available` (never empty) for a prompt of
/// `prompt_tokens`; `home` is the replica an exact continuation or the session names, with
/// the tokens of its prefix. Ties go to the warmest, then the least busy, in turn.
pub fn choose_decode<'c, 'a>(
    prompt_tokens: u64,
    home: Option<(&str, u64)>,
    available: &[&'c Candidate<'a>],
    tick: u64,
) -> &'c Candidate<'a> {
    let cached = |c: &Candidate<'a>| held(c, home);
    let cost = |c: &Candidate<'a>| decode_cost(c, prompt_tokens, cached(c));
    let cheapest = available.iter().map(|c| cost(c)).min().unwrap_or(0);
    let tied: Vec<&'c Candidate<'a>> = available
        .iter()
        .copied()
        .filter(|c| cost(c) == cheapest)
        .collect();
    let warmest = tied.iter().map(|c| cached(c)).max().unwrap_or(0);
    let warm: Vec<&'c Candidate<'a>> = tied.into_iter().filter(|c| cached(c) == warmest).collect();
    least_busy(&warm, tick)
}

/// Tokens of the prompt `c` likely holds, the home's served prefix counted (unless the
/// replica's own events speak for it).
pub fn held(c: &Candidate<'_>, home: Option<(&str, u64)>) -> u64 {
    match home {
        Some((id, tokens)) if id == c.id && !c.cached_exact => c.cached_tokens.max(tokens),
        _ => c.cached_tokens,
    }
}

/// How a disaggregated request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Served whole on the decode replica: what it lacks is less than a prefill hop is worth.
    Local,
    /// Prefilled in the prefill pool, then decoded.
    Handover,
}

/// When a turn is prefilled on its decode replica instead of going through the prefill pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Local {
    /// An uncached part below this is prefilled there whatever it runs: a short prefill
    /// stalls its streams for less than a hop and a pull cost the turn.
    pub tokens: u64,
    /// Below this (when more than `tokens`), where the decode replica runs nothing: there is
    /// no stream there for the prefill to stall, and the turn skips the hop and the pull.
    pub idle_tokens: u64,
}

/// `uncached`: the prompt tokens the chosen decode replica lacks; `idle`: it runs no request
/// (nothing reported running, nothing of inferlb's in flight there).
pub fn path(uncached: u64, idle: bool, local: Local) -> Path {
    let limit = if idle {
        local.tokens.max(local.idle_tokens)
    } else {
        local.tokens
    };
    if uncached < limit {
        Path::Local
    } else {
        Path::Handover
    }
}

/// Whether a turn served whole on its decode replica is prefilled again, off the client's
/// path, on the prefill replica a handover would take. Without it that replica falls a turn
/// behind the conversation, and the next turn handed over prefills both (the agent loop's
/// slowest turns, docs/pd.md). `lacking`: the prompt tokens that replica lacks; `idle`: it
/// runs and queues nothing, so no handover waits behind the copy. A lag below
/// `local.tokens` is left: a handover prefills that much more at most.
pub fn warm_prefill(lacking: u64, idle: bool, local: Local) -> bool {
    idle && lacking > 0 && lacking >= local.tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: &'static str, cached: u64, running: usize, kv: u64) -> Candidate<'static> {
        Candidate {
            id,
            available: true,
            reachable: true,
            in_flight: running,
            cached_tokens: cached,
            cached_exact: false,
            pending_tokens: 0,
            queued_tokens: 0,
            running,
            kv_tokens: kv,
        }
    }

    /// (candidates, prompt, home) → chosen
    #[test]
    fn the_decode_replica_is_the_one_with_least_to_pull_and_least_load() {
        type Row = (
            &'static [(&'static str, u64, usize, u64)],
            u64,
            Option<(&'static str, u64)>,
            &'static str,
        );
        let rows: &[Row] = &[
            // a conversation's next turn: the replica holding its 90k history
            (
                &[("d1", 90_000, 4, 200_000), ("d2", 0, 0, 0)],
                90_300,
                None,
                "d1",
            ),
            // idle and cold against busy and warm: the pull is cheaper than the load
            (
                &[("d1", 2_000, 40, 400_000), ("d2", 0, 0, 0)],
                2_100,
                None,
                "d2",
            ),
            // cold everywhere: the least loaded
            (
                &[("d1", 0, 3, 30_000), ("d2", 0, 1, 10_000)],
                5_000,
                None,
                "d2",
            ),
            // KV held counts, not only the number of decodes
            (
                &[("d1", 0, 2, 300_000), ("d2", 0, 2, 20_000)],
                5_000,
                None,
                "d2",
            ),
            // the home's served prefix counts as held
            (
                &[("d1", 0, 1, 0), ("d2", 0, 1, 0)],
                8_000,
                Some(("d2", 7_900)),
                "d2",
            ),
        ];
        for (cands, prompt, home, want) in rows {
            let cs: Vec<Candidate> = cands
                .iter()
                .map(|&(id, ca, r, kv)| c(id, ca, r, kv))
                .collect();
            let refs: Vec<&Candidate> = cs.iter().collect();
            for tick in 0..4 {
                assert_eq!(
                    choose_decode(*prompt, *home, &refs, tick).id,
                    *want,
                    "{cands:?} {prompt}"
                );
            }
        }
    }

    #[test]
    fn ties_spread() {
        let cs = [c("d1", 0, 0, 0), c("d2", 0, 0, 0)];
        let refs: Vec<&Candidate> = cs.iter().collect();
        let picks: Vec<&str> = (0..4)
            .map(|t| choose_decode(1000, None, &refs, t).id)
            .collect();
        assert!(picks.contains(&"d1") && picks.contains(&"d2"), "{picks:?}");
    }

    #[test]
    fn absurd_loads_saturate() {
        let big = c("d1", 0, usize::MAX, u64::MAX);
        assert_eq!(decode_cost(&big, u64::MAX, 0), u64::MAX);
    }

    #[test]
    fn a_small_uncached_part_is_prefilled_on_the_decode_replica_a_larger_one_where_it_is_idle() {
        let local = |tokens, idle_tokens| Local {
            tokens,
            idle_tokens,
        };
        // (uncached, idle, tokens, idle_tokens) -> path
        let rows = [
            (300, false, 1024, 8192, Path::Local),
            (1024, false, 1024, 8192, Path::Handover),
            // an agent's +2000-token turn: prefilled where nothing runs, handed over where
            // its prefill would stall other streams
            (2032, true, 1024, 8192, Path::Local),
            (2032, false, 1024, 8192, Path::Handover),
            (8192, true, 1024, 8192, Path::Handover),
            // an idle bound below the other one takes nothing away
            (300, true, 1024, 0, Path::Local),
            (2032, true, 1024, 0, Path::Handover),
            // both 0: always through the prefill pool
            (0, true, 0, 0, Path::Handover),
            (0, false, 0, 0, Path::Handover),
        ];
        for (uncached, idle, tokens, idle_tokens, want) in rows {
            assert_eq!(
                path(uncached, idle, local(tokens, idle_tokens)),
                want,
                "{uncached} idle={idle} {tokens}/{idle_tokens}"
            );
        }
    }

    #[test]
    fn a_local_turn_is_copied_to_an_idle_prefill_replica_that_lags_by_a_bound() {
        let local = Local {
            tokens: 1024,
            idle_tokens: 8192,
        };
        // (lacking, idle) -> copied
        let rows = [
            // an agent's +2000-token turn served on its idle decode replica
            (2032, true, true),
            // a handover arriving would wait behind the copy
            (2032, false, false),
            // a short lag: the next handover prefills it with its own turn
            (1023, true, false),
            (1024, true, true),
            (0, true, false),
        ];
        for (lacking, idle, want) in rows {
            assert_eq!(
                warm_prefill(lacking, idle, local),
                want,
                "{lacking} idle={idle}"
            );
        }
        let always_pooled = Local {
            tokens: 0,
            idle_tokens: 0,
        };
        assert!(warm_prefill(1, true, always_pooled));
        assert!(!warm_prefill(0, true, always_pooled));
    }
}
