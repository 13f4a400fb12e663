//! A replica's cache model: one question, "how many tokens of this prompt does it likely
//! hold", answered from a source. The estimate is the prefix index of what this process (and
//! its cluster) sent it. The replica's own word on its cache (vLLM's KV events, kept in a
//! [`BlockIndex`]) answers instead for a prompt whose token ids are known, while its stream is
//! live. While it is partial, the larger of the two answers: after a gap the block index holds
//! only what was stored since, or on a first connect what the replay buffer still had (less than
//! the replica may hold, never more). While the publisher is gone the estimate answers alone:
//! the block index may still hold blocks evicted meanwhile, until the reconnect's replay tells.
//! Beside both, the prompts it was sent whose prefill is not over ([`Pending`]): what it will
//! hold.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use super::pending::Pending;
use super::ratio::{slot, Ratio, MIN_RATIO_BYTES, MIN_RATIO_TOKENS, RATIO_MILLI};
use crate::fleet::blocks::BlockIndex;
use crate::fleet::chain::PromptTokens;
use crate::fleet::index::{PrefixIndex, Recency, BYTES_PER_TOKEN};
use crate::protocol::api::prompt::Link;
use crate::protocol::api::Family;

/// The cache capacity assumed for a replica that neither the conf nor its `/metrics` sizes.
pub const DEFAULT_CACHE_TOKENS: u64 = 1_000_000;

/// The block size assumed when checking a prediction (vLLM's default): a replica caches whole
/// blocks only, and never a prompt's last token, so it may report up to a block and a token
/// fewer than the index predicted without the index being wrong.
pub const CHECK_BLOCK_TOKENS: u64 = 16;

/// The least capacity an guessed replica's estimate shrinks to.
pub const MIN_GUESSED_CACHE_TOKENS: u64 = 16_384;

/// The blocks a replica's block index holds at most, for a cache of `tokens`: four times the
/// blocks of 16 tokens it holds (room for a CPU tier and smaller blocks).
fn max_blocks(tokens: u64) -> usize {
    usize::try_from(tokens / CHECK_BLOCK_TOKENS * 4).unwrap_or(usize::MAX)
}

/// Evictions in a row that shrink an unsized replica's bound.
const EVICTIONS_TO_SHRINK: u64 = 3;

/// What an answer's usage said of the index's prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The replica reported no cached count (vLLM without `--enable-prompt-tokens-details`).
    Unreported,
    /// It cached what the index predicted, within a block and a token, or more.
    Confirmed,
    /// It cached less. `evicted`: part of the prompt was still there, as when its cache
    /// evicted the tail (a replica that restarted holds none).
    Wrong { evicted: bool },
}

/// A prompt as the cache model reads it: its chained chunk hashes, and its token ids when its
/// model has a tokenizer in the conf.
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    pub links: &'a [Link],
    pub tokens: Option<&'a PromptTokens>,
}

impl<'a> Prompt<'a> {
    pub fn of_links(links: &'a [Link]) -> Prompt<'a> {
        Prompt {
            links,
            tokens: None,
        }
    }
}

/// Where the answer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSource {
    /// What was sent to it, bounded by its capacity: inferlb's own estimate.
    Estimate,
    /// What the replica reports it stores and evicts.
    Events,
}

/// What a request was routed on, for the check of its answer ([`CacheModel::answered`]).
#[derive(Debug, Clone, Copy)]
pub struct Prediction<'a> {
    /// Tokens of the prompt the replica was said to hold, in estimate tokens.
    pub tokens: u64,
    /// Said by the replica's KV events, not the estimate.
    pub exact: bool,
    /// When the links the estimate held of the prompt were last recorded, before its prefill
    /// recorded them again ([`PrefixIndex::record`]).
    pub recency: &'a Recency,
}

/// Whether the source can be believed now (the replica's event stream, as
/// [`crate::fleet::kv_events`] keeps it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Every event since the publisher's first (or its last reset) was seen: it answers alone.
    Live,
    /// Some were missed, and the block index holds only blocks whose chain it saw stored: a
    /// part of what the replica holds. The larger of it and the estimate answers.
    Partial,
    /// The publisher cannot be reached (or was never read): removals may be missed, so the
    /// block index may hold more than the replica. The estimate answers alone.
    Gone,
}

pub struct CacheModel {
    /// What it was sent, bounded by its cache capacity.
    pub index: PrefixIndex,
    /// The conf fixed `cache_tokens`: never replaced by what the replica says.
    pub configured: bool,
    /// The replica's KV events, when its conf names their endpoint.
    pub blocks: Option<BlockIndex>,
    /// Its event stream's [`Freshness`], as a `u8` (see [`crate::fleet::kv_events`]).
    freshness: AtomicU8,
    /// Its `/metrics` gave its size: never shrunk by a guess.
    size_reported: AtomicBool,
    /// Its ratio of bytes to tokens over every answer (the index's, which bounds it by its
    /// capacity: what it holds is of every family).
    ratio: Ratio,
    /// The same ratio per API family ([`slot`]): their bodies and templates differ, so one
    /// family's prompt is counted in its replica's tokens by its own.
    family_ratios: [Ratio; 4],
    /// Evictions seen since the last confirmed prediction.
    evictions_seen: AtomicU64,
    /// Prompts sent to it whose prefill is not over: what it will hold.
    pub pending: Pending,
}

impl CacheModel {
    /// A model from inferlb's own estimate, `capacity_tokens` from the conf or the default.
    pub fn estimate(capacity_tokens: Option<u64>) -> CacheModel {
        CacheModel {
            index: PrefixIndex::new(capacity_tokens.unwrap_or(DEFAULT_CACHE_TOKENS)),
            configured: capacity_tokens.is_some(),
            blocks: None,
            freshness: AtomicU8::new(Freshness::Gone as u8),
            size_reported: AtomicBool::new(false),
            ratio: Ratio::default(),
            family_ratios: Default::default(),
            evictions_seen: AtomicU64::new(0),
            pending: Pending::default(),
        }
    }

    /// A model that also reads the replica's KV events (an estimate until its stream is live).
    pub fn with_events(mut self) -> CacheModel {
        let tokens = self.index.capacity_tokens();
        self.blocks = Some(BlockIndex::new(max_blocks(tokens)));
        self
    }

    /// The capacity changed: the block index's bound follows it.
    pub fn resized(&self) {
        if let Some(b) = &self.blocks {
            b.set_max_blocks(max_blocks(self.index.capacity_tokens()));
        }
    }

    /// The replica's cache is empty (a reset, a restart): both sources forget it all.
    pub fn clear(&self) {
        self.index.clear();
        if let Some(b) = &self.blocks {
            b.clear();
        }
    }

    /// The replica restarted ([`Replica::started`](super::Replica::started)): both sources
    /// forget it all, and the emptied block index is no live word on the new process's cache
    /// until its subscriber reads the new publisher's stream whole.
    pub fn restarted(&self) {
        self.clear();
        if self.blocks.is_some() {
            self.set_freshness(Freshness::Partial);
        }
    }

    /// Its `/metrics` reported its cache's size.
    pub fn capacity_reported(&self) {
        self.size_reported.store(true, Ordering::Relaxed);
    }

    /// Estimate tokens of a prompt of `family` in the replica's own tokens: by that family's
    /// ratio once an answer taught it, else by the replica's.
    pub fn to_replica_tokens(&self, family: Family, estimate: u64) -> u64 {
        let milli = self.family_ratios[slot(family)]
            .get()
            .unwrap_or_else(|| self.index.bytes_per_token_milli());
        let scaled =
            u128::from(estimate) * u128::from(BYTES_PER_TOKEN * 1000) / u128::from(milli.max(1));
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// The bytes per token learnt from `family`'s answers, in thousandths.
    pub fn bytes_per_token_milli(&self, family: Family) -> Option<u64> {
        self.family_ratios[slot(family)].get()
    }

    /// An answer to a `family` prompt of `links` reported `prompt_tokens` (its tokenizer's count) and,
    /// when the replica reports it, `cached` of them from its cache, where the index had
    /// predicted the [`Prediction`]'s tokens. Called once the answer
    /// ended, so the replica holds this prompt now whatever it held before.
    ///
    /// The ratio of bytes to the replica's tokens is learnt from every long enough prompt (a
    /// mean over about the last 8), for the replica and for the family. A replica that cached
    /// less than predicted shows the index wrong, and why:
    /// - the first link it no longer held was evicted, and with it (the replica evicting the
    ///   least recently used first) whatever the index last recorded before that link: those
    ///   go from the index at once, sized replica or not;
    /// - the index was near its bound: the replica evicted sooner than the bound says, so an
    ///   unsized replica's capacity shrinks to what the index held, less a sixteenth, after
    ///   three such answers in a row (the least recently used links go at the next record);
    ///   a replica whose size the conf or its `/metrics` gives keeps it;
    /// - it held none of the prompt while the index was far from its bound: it lost its cache
    ///   (a restart between two health checks, a cache reset), so the index forgets all it
    ///   held there but this prompt.
    ///
    /// A prediction from the replica's KV events (`exact`) is checked the same way, for the
    /// metrics, but corrects nothing: what is wrong then is the events' view, not the
    /// estimate's.
    pub fn answered(
        &self,
        family: Family,
        links: &[Link],
        prediction: Prediction<'_>,
        prompt_tokens: u64,
        cached: Option<u64>,
    ) -> Check {
        let Prediction {
            tokens: predicted,
            exact,
            recency,
        } = prediction;
        let index = &self.index;
        let bytes = links.last().map_or(0, |l| l.bytes);
        let sample = (bytes >= MIN_RATIO_BYTES && prompt_tokens >= MIN_RATIO_TOKENS)
            .then(|| bytes.saturating_mul(1000) / prompt_tokens)
            .filter(|s| RATIO_MILLI.contains(s));
        if let Some(sample) = sample {
            index.set_bytes_per_token_milli(self.ratio.learn(sample));
            self.family_ratios[slot(family)].learn(sample);
        }
        let Some(cached) = cached else {
            return Check::Unreported;
        };
        // The prediction in this answer's own tokens (its ratio, template tokens included),
        // at most the prompt less its last token; a sixteenth of slack for the rest.
        let expected = match sample {
            Some(_) => {
                let scaled =
                    u128::from(predicted) * u128::from(BYTES_PER_TOKEN) * u128::from(prompt_tokens)
                        / u128::from(bytes.max(1));
                u64::try_from(scaled)
                    .unwrap_or(u64::MAX)
                    .min(prompt_tokens.saturating_sub(1))
            }
            None => self.to_replica_tokens(family, predicted),
        };
        let slack = CHECK_BLOCK_TOKENS + 1 + expected / 16;
        if cached.saturating_add(slack) >= expected {
            self.evictions_seen.store(0, Ordering::Relaxed);
            return Check::Confirmed;
        }
        if exact {
            return Check::Wrong {
                evicted: cached > 0,
            };
        }
        // Where its cache of the prompt ended, in the prompt's bytes (by this answer's ratio
        // when it has one), the slack on top: the first link past it was not held.
        let held_tokens = cached.saturating_add(slack);
        let held_bytes = match sample {
            Some(_) => u128::from(held_tokens) * u128::from(bytes) / u128::from(prompt_tokens),
            None => u128::from(index.to_estimate(held_tokens)) * u128::from(BYTES_PER_TOKEN),
        };
        let first_missing = links.partition_point(|l| u128::from(l.bytes) <= held_bytes);
        if let Some(stamp) = recency.stamp(first_missing) {
            index.forget_older_than(stamp);
        }
        let (_, held) = index.size();
        let held = index.to_replica_tokens(held);
        let capacity = index.capacity_tokens();
        let near_bound = held >= capacity / 2;
        let sized = self.configured || self.size_reported.load(Ordering::Relaxed);
        // One eviction is a hint; three in a row, with no confirmed prediction between,
        // are the evidence that shrinks the bound.
        let seen = self.evictions_seen.fetch_add(1, Ordering::Relaxed) + 1;
        if near_bound && !sized && seen >= EVICTIONS_TO_SHRINK {
            self.evictions_seen.store(0, Ordering::Relaxed);
            let shrunk = (held - held / 16).max(MIN_GUESSED_CACHE_TOKENS);
            if shrunk < capacity {
                index.set_capacity_tokens(shrunk);
            }
        }
        if cached == 0 && !near_bound {
            index.clear();
            index.record(links);
        }
        Check::Wrong {
            evicted: cached > 0,
        }
    }

    /// Tokens of `prompt`'s longest prefix the replica likely holds, in estimate tokens, and
    /// where the answer came from.
    pub fn likely_cached(&self, prompt: Prompt<'_>) -> (u64, CacheSource) {
        let estimate = || self.index.cached_tokens(prompt.links);
        let (Some(blocks), Some(tokens)) = (&self.blocks, prompt.tokens) else {
            return (estimate(), CacheSource::Estimate);
        };
        if tokens.is_empty() {
            return (estimate(), CacheSource::Estimate);
        }
        // The share of the prompt's tokens held, of the prompt in estimate tokens: the unit
        // every other term of the cost is in.
        let held = blocks.held(tokens).credit();
        let prompt_tokens = prompt.links.last().map_or(0, |l| l.bytes) / BYTES_PER_TOKEN;
        let exact = u128::from(prompt_tokens) * u128::from(held) / tokens.len() as u128;
        let exact = u64::try_from(exact).unwrap_or(u64::MAX);
        match self.freshness() {
            Freshness::Live => (exact, CacheSource::Events),
            Freshness::Partial => {
                let e = estimate();
                if exact > e {
                    (exact, CacheSource::Events)
                } else {
                    (e, CacheSource::Estimate)
                }
            }
            Freshness::Gone => (estimate(), CacheSource::Estimate),
        }
    }

    /// Its prefill of `links` is over: it holds them now (the estimate's only input). Gives
    /// when the links it held were last recorded, for [`Self::answered`].
    pub fn prefilled(&self, links: &[Link]) -> Recency {
        self.index.record(links)
    }

    /// Events when the replica's conf names them, else the estimate.
    pub fn source(&self) -> CacheSource {
        if self.blocks.is_some() {
            CacheSource::Events
        } else {
            CacheSource::Estimate
        }
    }

    /// The estimate is always live; the events are while their stream is.
    pub fn freshness(&self) -> Freshness {
        if self.blocks.is_none() {
            return Freshness::Live;
        }
        match self.freshness.load(Ordering::Relaxed) {
            s if s == Freshness::Live as u8 => Freshness::Live,
            s if s == Freshness::Partial as u8 => Freshness::Partial,
            _ => Freshness::Gone,
        }
    }

    /// The event stream became live, partial or gone.
    pub fn set_freshness(&self, f: Freshness) {
        self.freshness.store(f as u8, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static NO_RECENCY: Recency = Recency::NONE;

    /// A prediction of the estimate's, without the stamps of its links.
    fn estimated(tokens: u64) -> Prediction<'static> {
        Prediction {
            tokens,
            exact: false,
            recency: &NO_RECENCY,
        }
    }

    fn from_events(tokens: u64) -> Prediction<'static> {
        Prediction {
            exact: true,
            ..estimated(tokens)
        }
    }
    use crate::protocol::api::prompt::{PromptHasher, CHUNK_BYTES};

    #[test]
    fn the_estimate_answers_what_was_prefilled_and_is_always_live() {
        let m = CacheModel::estimate(Some(1_000_000));
        let mut h = PromptHasher::new("m");
        h.begin_part("user");
        h.text(&"x".repeat(CHUNK_BYTES * 3));
        let links = h.finish();
        assert_eq!(m.likely_cached(Prompt::of_links(&links)).0, 0);
        m.prefilled(&links);
        assert!(m.likely_cached(Prompt::of_links(&links)).0 > 0);
        assert_eq!(
            (m.source(), m.freshness()),
            (CacheSource::Estimate, Freshness::Live)
        );
        m.set_freshness(Freshness::Gone);
        assert_eq!(
            m.freshness(),
            Freshness::Live,
            "an estimate is never behind"
        );
        assert!(m.configured);
        assert!(!CacheModel::estimate(None).configured);
    }

    /// With events and token ids, a live stream answers alone (what the estimate says does
    /// not matter); a partial one, the larger of the two; a gone one (or one never read), the
    /// estimate alone. Without token ids, the estimate.
    #[test]
    fn the_events_answer_for_a_prompt_whose_tokens_are_known_while_live() {
        use inferlb_kvevents::{BlockHash, BlockStored};
        let m = CacheModel::estimate(Some(1_000_000)).with_events();
        let links = prompt_of("abcd", 4);
        let all = links.last().expect("links").bytes / BYTES_PER_TOKEN;
        // 65 token ids, of which the events hold the first 32 (two blocks of 16).
        let tokens = PromptTokens::new((0..65).collect::<Vec<u32>>());
        m.blocks.as_ref().expect("events").stored(&BlockStored {
            block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
            token_ids: (0..32).collect(),
            block_size: 16,
            ..Default::default()
        });
        let with_tokens = Prompt {
            links: &links,
            tokens: Some(&tokens),
        };
        let half = all * 32 / 65;
        assert_eq!(
            m.freshness(),
            Freshness::Gone,
            "not live before its stream is"
        );
        assert_eq!(
            m.likely_cached(with_tokens),
            (0, CacheSource::Estimate),
            "a stream never read is not believed"
        );
        m.set_freshness(Freshness::Partial);
        assert_eq!(m.likely_cached(with_tokens), (half, CacheSource::Events));
        m.prefilled(&links);
        assert_eq!(m.likely_cached(with_tokens), (all, CacheSource::Estimate));
        m.set_freshness(Freshness::Live);
        assert_eq!(m.likely_cached(with_tokens), (half, CacheSource::Events));
        m.set_freshness(Freshness::Gone);
        assert_eq!(m.likely_cached(with_tokens), (all, CacheSource::Estimate));
        assert_eq!(
            m.likely_cached(Prompt::of_links(&links)),
            (all, CacheSource::Estimate)
        );
        m.set_freshness(Freshness::Live);
        m.clear();
        assert_eq!(m.likely_cached(with_tokens), (0, CacheSource::Events));
        // Gone: blocks the index still holds may have been evicted meanwhile.
        m.blocks.as_ref().expect("events").stored(&BlockStored {
            block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
            token_ids: (0..32).collect(),
            block_size: 16,
            ..Default::default()
        });
        m.set_freshness(Freshness::Gone);
        assert_eq!(m.likely_cached(with_tokens), (0, CacheSource::Estimate));
    }

    fn long_prompt(text: &str) -> Vec<Link> {
        prompt_of(text, 8)
    }

    fn prompt_of(text: &str, chunks: usize) -> Vec<Link> {
        let mut h = PromptHasher::new("m");
        h.begin_part("user");
        h.text(&text.repeat(CHUNK_BYTES * chunks / text.len()));
        h.finish()
    }

    #[test]
    fn the_ratio_of_bytes_to_tokens_is_learnt_from_usage() {
        let m = CacheModel::estimate(None);
        let links = long_prompt("abcd");
        let bytes = links.last().expect("links").bytes;
        // 1.8 bytes a token, as one real tokenizer gave.
        for _ in 0..3 {
            m.answered(Family::Chat, &links, estimated(0), bytes * 10 / 18, None);
        }
        assert!((1790..=1810).contains(&m.index.bytes_per_token_milli()));
        // Short prompts teach nothing, nor a body that held a fraction of its prompt.
        let short = long_prompt("ab")[..1].to_vec();
        m.answered(Family::Chat, &short, estimated(0), 1, None);
        m.answered(Family::Chat, &links, estimated(0), bytes * 20, None);
        assert!((1790..=1810).contains(&m.index.bytes_per_token_milli()));
    }

    /// Chat answers at 1.8 bytes a token and Responses at 3.2 (their bodies differ): each
    /// family counts its prompts by its own ratio, the replica (what bounds its index) by the
    /// mix, and a family no answer taught by the replica's.
    #[test]
    fn each_api_family_learns_its_own_ratio_beside_the_replicas() {
        let m = CacheModel::estimate(None);
        let links = long_prompt("abcd");
        let bytes = links.last().expect("links").bytes;
        for _ in 0..20 {
            m.answered(Family::Chat, &links, estimated(0), bytes * 10 / 18, None);
            m.answered(
                Family::Responses,
                &links,
                estimated(0),
                bytes * 10 / 32,
                None,
            );
        }
        let near = |got: Option<u64>, want: u64| got.is_some_and(|g| g.abs_diff(want) <= 15);
        assert!(near(m.bytes_per_token_milli(Family::Chat), 1800));
        assert!(near(m.bytes_per_token_milli(Family::Responses), 3200));
        assert_eq!(m.bytes_per_token_milli(Family::Messages), None);
        let mix = m.index.bytes_per_token_milli();
        assert!((1800..3200).contains(&mix), "{mix}");
        // 1000 estimate tokens are 4000 bytes.
        let tokens = |f| m.to_replica_tokens(f, 1000);
        assert!(
            tokens(Family::Chat).abs_diff(2222) <= 20,
            "{}",
            tokens(Family::Chat)
        );
        assert!(tokens(Family::Responses).abs_diff(1250) <= 10);
        assert_eq!(tokens(Family::Messages), m.index.to_replica_tokens(1000));
    }

    /// (predicted estimate tokens, reported cached) → the check, at 4 bytes a token.
    #[test]
    fn a_reported_count_checks_the_prediction() {
        let links = long_prompt("abcd");
        let all = links.last().expect("links").bytes / 4;
        let rows: &[(u64, Option<u64>, Check)] = &[
            (all, None, Check::Unreported),
            (all, Some(all), Check::Confirmed),
            // vLLM caches whole blocks and never the last token; the ratio is a mean
            (
                all,
                Some(all - CHECK_BLOCK_TOKENS - 1 - all / 16),
                Check::Confirmed,
            ),
            (all, Some(all / 2), Check::Wrong { evicted: true }),
            (all, Some(0), Check::Wrong { evicted: false }),
            (0, Some(100), Check::Confirmed),
        ];
        for &(predicted, cached, want) in rows {
            let m = CacheModel::estimate(None);
            m.prefilled(&links);
            assert_eq!(
                m.answered(Family::Chat, &links, estimated(predicted), all, cached),
                want,
                "{predicted} {cached:?}"
            );
            // It prefilled this prompt just now: held, whatever it held before.
            assert_eq!(m.likely_cached(Prompt::of_links(&links)).0, all);
        }
    }

    /// A replica that held none of a prompt the index said it held, with the index far from
    /// its bound, lost its cache: the index forgets the rest too.
    #[test]
    fn a_replica_that_lost_its_cache_is_forgotten_but_for_the_prompt_it_just_served() {
        let m = CacheModel::estimate(None);
        let other = prompt_of("wxyz", 8);
        let links = long_prompt("abcd");
        let all = links.last().expect("links").bytes / 4;
        m.prefilled(&other);
        m.prefilled(&links);
        assert_eq!(
            m.answered(Family::Chat, &links, estimated(all), all, Some(0)),
            Check::Wrong { evicted: false }
        );
        assert_eq!(m.likely_cached(Prompt::of_links(&other)).0, 0);
        assert_eq!(m.likely_cached(Prompt::of_links(&links)).0, all);
        assert_eq!(
            m.index.capacity_tokens(),
            DEFAULT_CACHE_TOKENS,
            "no eviction: kept"
        );
        // The same answer to a prediction the replica's events made corrects no estimate.
        let m = CacheModel::estimate(None);
        m.prefilled(&other);
        m.prefilled(&links);
        assert_eq!(
            m.answered(Family::Chat, &links, from_events(all), all, Some(0)),
            Check::Wrong { evicted: false }
        );
        assert_eq!(m.likely_cached(Prompt::of_links(&other)).0, all);
    }

    /// A replica that held part of a prompt the index said it held whole evicted the rest,
    /// and whatever it last used before the first link it lacked: the index forgets those at
    /// once (sized or not), and keeps what was sent since.
    #[test]
    fn what_was_used_before_the_first_link_the_replica_lacked_is_forgotten() {
        let (older, newer) = (prompt_of("wxyz", 8), prompt_of("qrst", 8));
        let links = long_prompt("abcd");
        let all = links.last().expect("links").bytes / 4;
        for exact in [false, true] {
            let m = CacheModel::estimate(Some(1_000_000));
            m.prefilled(&older);
            m.prefilled(&links);
            m.prefilled(&newer);
            let recency = m.prefilled(&links);
            assert_eq!(
                m.answered(
                    Family::Chat,
                    &links,
                    Prediction {
                        tokens: all,
                        exact,
                        recency: &recency
                    },
                    all,
                    Some(all / 2)
                ),
                Check::Wrong { evicted: true }
            );
            let held = |l: &[Link]| m.likely_cached(Prompt::of_links(l)).0;
            // A prediction the replica's events made corrects no estimate.
            let want = if exact { all } else { 0 };
            assert_eq!(held(&older), want, "exact: {exact}");
            assert_eq!((held(&links), held(&newer)), (all, all));
        }
        // Without the stamps of the prompt's links (it was not recorded), nothing goes.
        let m = CacheModel::estimate(Some(1_000_000));
        m.prefilled(&older);
        m.prefilled(&links);
        m.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        assert_eq!(m.likely_cached(Prompt::of_links(&older)).0, all);
    }

    #[test]
    fn an_eviction_shrinks_an_unsized_replicas_capacity_only() {
        let links = prompt_of("abcd", 200);
        let all = links.last().expect("links").bytes / 4;
        // An index near its bound that held the whole prompt; the replica kept half.
        let guessed = CacheModel::estimate(None);
        guessed.index.set_capacity_tokens(all + 10);
        guessed.prefilled(&links);
        guessed.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        assert_eq!(guessed.index.capacity_tokens(), all + 10, "one is a hint");
        guessed.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        guessed.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        let c = guessed.index.capacity_tokens();
        assert!(c < all + 10 && c >= MIN_GUESSED_CACHE_TOKENS, "{c}");
        // Sized by the conf: kept.
        let sized = CacheModel::estimate(Some(all + 10));
        sized.prefilled(&links);
        sized.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        assert_eq!(sized.index.capacity_tokens(), all + 10);
        // Sized by its /metrics: kept.
        let reported = CacheModel::estimate(None);
        reported.capacity_reported();
        reported.index.set_capacity_tokens(all + 10);
        reported.prefilled(&links);
        reported.answered(Family::Chat, &links, estimated(all), all, Some(all / 2));
        assert_eq!(reported.index.capacity_tokens(), all + 10);
    }
}
