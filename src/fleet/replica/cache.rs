//! A replica's cache model: one question, "how many tokens of this prompt does it likely
//! hold", answered from a source. Today the source is always the estimate: the prefix index
//! of what this process (and its cluster) sent it. The replica's own word on its cache (vLLM's
//! KV events) is the other source; while it is stale (its stream broke, or a sequence number
//! was missed and not yet replayed) the estimate answers instead.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::fleet::index::PrefixIndex;
use crate::protocol::api::prompt::Link;

/// The cache capacity assumed for a replica that neither the conf nor its `/metrics` sizes.
pub const DEFAULT_CACHE_TOKENS: u64 = 1_000_000;

/// A prompt as the cache model reads it: its chained chunk hashes, and its token ids when a
/// tokenizer is configured (none is yet).
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    pub links: &'a [Link],
    pub token_ids: Option<&'a [u32]>,
}

impl<'a> Prompt<'a> {
    pub fn of_links(links: &'a [Link]) -> Prompt<'a> {
        Prompt {
            links,
            token_ids: None,
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

/// Whether the source can be believed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    Live,
    /// Behind: the estimate answers until the source catches up.
    Stale,
}

pub struct CacheModel {
    /// What it was sent, bounded by its cache capacity.
    pub index: PrefixIndex,
    /// The conf fixed `cache_tokens`: never replaced by what the replica says.
    pub configured: bool,
    source: CacheSource,
    stale: AtomicBool,
}

impl CacheModel {
    /// A model from inferlb's own estimate, `capacity_tokens` from the conf or the default.
    pub fn estimate(capacity_tokens: Option<u64>) -> CacheModel {
        CacheModel {
            index: PrefixIndex::new(capacity_tokens.unwrap_or(DEFAULT_CACHE_TOKENS)),
            configured: capacity_tokens.is_some(),
            source: CacheSource::Estimate,
            stale: AtomicBool::new(false),
        }
    }

    /// Tokens of `prompt`'s longest prefix the replica likely holds.
    pub fn likely_cached(&self, prompt: Prompt<'_>) -> u64 {
        // The estimate answers for every source today: no event source exists yet, and a
        // stale one falls back to it.
        self.index.cached_tokens(prompt.links)
    }

    /// Its prefill of `links` is over: it holds them now (the estimate's only input).
    pub fn prefilled(&self, links: &[Link]) {
        self.index.record(links);
    }

    pub fn source(&self) -> CacheSource {
        self.source
    }

    /// The estimate is always live; an event source is stale while marked so.
    pub fn freshness(&self) -> Freshness {
        if self.source == CacheSource::Events && self.stale.load(Ordering::Relaxed) {
            Freshness::Stale
        } else {
            Freshness::Live
        }
    }

    /// The source fell behind (`true`) or caught up.
    pub fn set_stale(&self, stale: bool) {
        self.stale.store(stale, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::api::prompt::{PromptHasher, CHUNK_BYTES};

    #[test]
    fn the_estimate_answers_what_was_prefilled_and_is_always_live() {
        let m = CacheModel::estimate(Some(1_000_000));
        let mut h = PromptHasher::new("m");
        h.begin_part("user");
        h.text(&"x".repeat(CHUNK_BYTES * 3));
        let links = h.finish();
        assert_eq!(m.likely_cached(Prompt::of_links(&links)), 0);
        m.prefilled(&links);
        assert!(m.likely_cached(Prompt::of_links(&links)) > 0);
        assert_eq!(
            (m.source(), m.freshness()),
            (CacheSource::Estimate, Freshness::Live)
        );
        m.set_stale(true);
        assert_eq!(
            m.freshness(),
            Freshness::Live,
            "an estimate is never behind"
        );
        assert!(m.configured);
        assert!(!CacheModel::estimate(None).configured);
    }
}
