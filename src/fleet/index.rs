//! The prefix index: per replica, the chained chunk hashes of every prompt it was sent, bounded
//! by its cache capacity in tokens and evicted least recently used first, as the replica's own
//! prefix cache evicts. Lookup gives the tokens of the longest prefix of a prompt the replica
//! likely still holds.
//!
//! A link's hash names the whole prompt up to it (see `api::prompt`), so holding link `i`
//! means the replica was sent everything before it: the held links of a prompt are a leading
//! run, found by binary search. One lock per replica, held for that search or for one
//! prompt's links: work bounded by the prompt, never by the index.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use lru::LruCache;

use crate::protocol::api::prompt::Link;

/// Bytes of prompt per token, as the estimate everywhere else in inferlb: the index, the
/// shapes and the policies count a prompt's tokens as its bytes over this ("estimate
/// tokens"). What a replica's tokenizer really gives is learnt from its answers
/// ([`PrefixIndex::set_bytes_per_token_milli`]) and applied where a real count meets an
/// estimate: the capacity, and the KV it reports.
pub const BYTES_PER_TOKEN: u64 = 4;

pub struct PrefixIndex {
    inner: Mutex<Held>,
    /// The replica's cache in its own tokens.
    capacity_tokens: AtomicU64,
    /// Bytes of prompt per token of the replica's tokenizer, in thousandths.
    bytes_per_token_milli: AtomicU64,
    /// Prompts recorded so far: tells whether it changed since a given moment.
    records: AtomicU64,
}

struct Held {
    /// Link hash → what it covers, and when it was last recorded.
    links: LruCache<u64, Entry>,
    tokens: u64,
    /// The last stamp given: each link recorded gets the next, so the least recently used
    /// link has the smallest stamp.
    clock: u64,
}

#[derive(Clone, Copy)]
struct Entry {
    /// The tokens it covers beyond the previous link.
    tokens: u32,
    stamp: u64,
}

impl Held {
    /// Puts `hash` as the most recently used, with a new stamp; the tokens it covered, if held.
    fn put(&mut self, hash: u64, tokens: u32) -> Option<Entry> {
        self.clock += 1;
        let before = self.links.put(
            hash,
            Entry {
                tokens,
                stamp: self.clock,
            },
        );
        self.tokens = self.tokens + u64::from(tokens) - before.map_or(0, |e| u64::from(e.tokens));
        before
    }

    /// The least recently used go until it holds at most `capacity` tokens.
    fn bound(&mut self, capacity: u64) {
        while self.tokens > capacity {
            match self.links.pop_lru() {
                Some((_, e)) => self.tokens -= u64::from(e.tokens),
                None => break,
            }
        }
    }
}

/// When each link of a prompt's leading run held before a [`PrefixIndex::record`] of it was
/// last recorded (its stamps, from the first link on): what
/// [`PrefixIndex::forget_older_than`] takes once the replica says where its cache of that
/// prompt ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recency(Vec<u64>);

impl Recency {
    /// No link was held (or none recorded).
    pub const NONE: Recency = Recency(Vec::new());

    /// The stamp link `i` had, if it was held.
    pub fn stamp(&self, i: usize) -> Option<u64> {
        self.0.get(i).copied()
    }
}

impl PrefixIndex {
    pub fn new(capacity_tokens: u64) -> PrefixIndex {
        PrefixIndex {
            inner: Mutex::new(Held {
                links: LruCache::unbounded(),
                tokens: 0,
                clock: 0,
            }),
            capacity_tokens: AtomicU64::new(capacity_tokens),
            bytes_per_token_milli: AtomicU64::new(BYTES_PER_TOKEN * 1000),
            records: AtomicU64::new(0),
        }
    }

    /// Bytes per token of the replica's tokenizer, in thousandths (learnt from its usage).
    pub fn bytes_per_token_milli(&self) -> u64 {
        self.bytes_per_token_milli.load(Ordering::Relaxed)
    }

    /// A new ratio of bytes to the replica's tokens; takes effect at the next record.
    pub fn set_bytes_per_token_milli(&self, milli: u64) {
        self.bytes_per_token_milli
            .store(milli.clamp(100, 100_000), Ordering::Relaxed);
    }

    /// `tokens` of the replica's own tokenizer, in estimate tokens (bytes over 4).
    pub fn to_estimate(&self, tokens: u64) -> u64 {
        let scaled = u128::from(tokens) * u128::from(self.bytes_per_token_milli())
            / u128::from(BYTES_PER_TOKEN * 1000);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// Estimate tokens in the replica's own tokens.
    pub fn to_replica_tokens(&self, estimate: u64) -> u64 {
        let scaled = u128::from(estimate) * u128::from(BYTES_PER_TOKEN * 1000)
            / u128::from(self.bytes_per_token_milli().max(1));
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// What it may hold, in estimate tokens: the capacity in the replica's tokens, scaled.
    fn bound(&self) -> u64 {
        self.to_estimate(self.capacity_tokens())
    }

    pub fn capacity_tokens(&self) -> u64 {
        self.capacity_tokens.load(Ordering::Relaxed)
    }

    /// A new capacity (learnt from the replica); takes effect at the next record.
    pub fn set_capacity_tokens(&self, tokens: u64) {
        self.capacity_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Forgets everything: the replica lost its cache.
    pub fn clear(&self) {
        // Changed: the cluster's save loop saves it again.
        self.records.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut held) = self.inner.lock() {
            held.links.clear();
            held.tokens = 0;
        }
    }

    /// Tokens of the longest prefix of `links` this replica likely holds.
    ///
    /// Most replicas of a large fleet hold none of a prompt, and the one that served it holds
    /// all of it: the first link and the last answer those in one lookup each, and only a
    /// partial hit pays for the binary search.
    pub fn cached_tokens(&self, links: &[Link]) -> u64 {
        let Ok(held) = self.inner.lock() else {
            return 0;
        };
        let tokens = |n: usize| links[n - 1].bytes / BYTES_PER_TOKEN;
        match (links.first(), links.last()) {
            (Some(first), _) if !held.links.contains(&first.hash) => 0,
            (_, Some(last)) if held.links.contains(&last.hash) => tokens(links.len()),
            (None, _) => 0,
            _ => tokens(1 + links[1..].partition_point(|l| held.links.contains(&l.hash))),
        }
    }

    /// The replica was sent the prompt `links`: each link becomes most recently used, and the
    /// least recently used go while over capacity. Links are touched from the last to the
    /// first, so a prompt's tail goes before its beginning, as vLLM evicts a sequence's later
    /// blocks first. Gives when the links it held already were last recorded.
    pub fn record(&self, links: &[Link]) -> Recency {
        self.records.fetch_add(1, Ordering::Relaxed);
        let capacity = self.bound();
        let Ok(mut held) = self.inner.lock() else {
            return Recency::default();
        };
        let mut stamps = Vec::with_capacity(links.len());
        for (i, l) in links.iter().enumerate().rev() {
            let before = i.checked_sub(1).map_or(0, |p| links[p].bytes);
            let tokens = (l.bytes.saturating_sub(before) / BYTES_PER_TOKEN).max(1) as u32;
            // A link held already covers the same tokens, unless another instance's index
            // (or a save) counted it otherwise: the total follows whichever is put last.
            stamps.push(held.put(l.hash, tokens).map(|e| e.stamp));
        }
        held.bound(capacity);
        stamps.reverse();
        Recency(stamps.into_iter().map_while(|s| s).collect())
    }

    /// The replica no longer held a link last recorded at `stamp`: it evicted it, and (its
    /// cache evicting the least recently used first, as this index does) everything used
    /// before it too. Those go; the tokens they covered.
    pub fn forget_older_than(&self, stamp: u64) -> u64 {
        self.records.fetch_add(1, Ordering::Relaxed);
        let Ok(mut held) = self.inner.lock() else {
            return 0;
        };
        let mut forgotten = 0;
        while let Some((_, e)) = held.links.peek_lru() {
            if e.stamp > stamp {
                break;
            }
            let tokens = u64::from(e.tokens);
            held.links.pop_lru();
            held.tokens -= tokens;
            forgotten += tokens;
        }
        forgotten
    }

    /// Prompts recorded since it was made; a different count means it changed.
    pub fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// Up to `most` of the most recently used links, least recent first, as (hash, tokens):
    /// what [`Self::restore`] takes. The lock is held for `most` entries at most.
    pub fn recent(&self, most: usize) -> Vec<(u64, u32)> {
        let Ok(held) = self.inner.lock() else {
            return vec![];
        };
        let mut v: Vec<(u64, u32)> = held
            .links
            .iter()
            .take(most)
            .map(|(h, e)| (*h, e.tokens))
            .collect();
        v.reverse();
        v
    }

    /// Adds links another instance's [`Self::recent`] gave, least recent first, under the same
    /// capacity.
    pub fn restore(&self, links: &[(u64, u32)]) {
        let capacity = self.bound();
        let Ok(mut held) = self.inner.lock() else {
            return;
        };
        for &(hash, tokens) in links {
            held.put(hash, tokens);
        }
        held.bound(capacity);
    }

    /// (links held, tokens they cover).
    pub fn size(&self) -> (usize, u64) {
        self.inner
            .lock()
            .map_or((0, 0), |h| (h.links.len(), h.tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::api::prompt::{PromptHasher, CHUNK_BYTES};

    fn prompt(parts: &[&str]) -> Vec<Link> {
        let mut h = PromptHasher::new("m");
        for p in parts {
            h.begin_part("user");
            h.text(p);
        }
        h.finish()
    }

    #[test]
    fn the_longest_held_prefix_in_tokens() {
        let idx = PrefixIndex::new(1_000_000);
        let history = "h".repeat(8 * CHUNK_BYTES);
        let a = prompt(&[&history, "question a"]);
        assert_eq!(idx.cached_tokens(&a), 0);
        idx.record(&a);
        assert_eq!(idx.cached_tokens(&a), a.last().expect("links").bytes / 4);
        // A sibling that shares the history: held up to the history's end.
        let b = prompt(&[&history, "question b"]);
        let history_end = a.iter().find(|l| l.part_end).expect("a part end").bytes / 4;
        assert_eq!(idx.cached_tokens(&b), history_end);
        // An edit inside the history: held up to the last whole chunk before it.
        let mut edited = history.clone();
        edited.replace_range(5 * CHUNK_BYTES..5 * CHUNK_BYTES + 1, "X");
        let c = prompt(&[&edited, "question a"]);
        let held = idx.cached_tokens(&c);
        assert!(
            held >= 4 * CHUNK_BYTES as u64 / 4 && held <= 5 * CHUNK_BYTES as u64 / 4,
            "{held}"
        );
    }

    #[test]
    fn what_one_index_holds_restores_into_another_in_the_same_order() {
        let a = PrefixIndex::new(1_000_000);
        let p: Vec<Vec<Link>> = (0..3)
            .map(|i| prompt(&[&format!("{i}").repeat(3 * CHUNK_BYTES)]))
            .collect();
        p.iter().for_each(|l| {
            a.record(l);
        });
        let b = PrefixIndex::new(1_000_000);
        b.restore(&a.recent(usize::MAX));
        assert_eq!(b.size(), a.size());
        for l in &p {
            assert_eq!(b.cached_tokens(l), a.cached_tokens(l));
        }
        // Restored least recent first: with room for two prompts, the oldest goes.
        let small = PrefixIndex::new(2 * 3 * CHUNK_BYTES as u64 / 4 + 10);
        small.restore(&a.recent(usize::MAX));
        assert_eq!(small.cached_tokens(&p[0]), 0);
        assert!(small.cached_tokens(&p[2]) > 0);
        // A bounded read takes the most recent.
        let last = a.recent(p[2].len());
        let c = PrefixIndex::new(1_000_000);
        c.restore(&last);
        assert_eq!(c.cached_tokens(&p[2]), a.cached_tokens(&p[2]));
        assert_eq!(c.cached_tokens(&p[0]), 0);
    }

    #[test]
    fn capacity_bounds_it_and_the_least_recent_go_first() {
        // Room for about two 4-chunk prompts.
        let idx = PrefixIndex::new(2 * 4 * CHUNK_BYTES as u64 / 4 + 10);
        let p: Vec<Vec<Link>> = (0..3)
            .map(|i| prompt(&[&format!("{i}").repeat(4 * CHUNK_BYTES - 8)]))
            .collect();
        idx.record(&p[0]);
        idx.record(&p[1]);
        idx.record(&p[0]); // p0 used again: p1 is now the least recent
        idx.record(&p[2]);
        assert!(idx.cached_tokens(&p[0]) > 0);
        assert_eq!(idx.cached_tokens(&p[1]), 0);
        assert!(idx.cached_tokens(&p[2]) > 0);
        let (_, tokens) = idx.size();
        assert!(tokens <= idx.capacity_tokens(), "{tokens}");
    }

    /// A replica that no longer held a link evicted everything used before it: those go from
    /// the index, what was recorded since stays.
    #[test]
    fn what_was_used_before_an_evicted_link_is_forgotten_with_it() {
        let idx = PrefixIndex::new(1_000_000);
        let p: Vec<Vec<Link>> = (0..3)
            .map(|i| prompt(&[&format!("{i}").repeat(4 * CHUNK_BYTES)]))
            .collect();
        assert_eq!(idx.record(&p[0]), Recency::default(), "nothing held before");
        idx.record(&p[1]);
        idx.record(&p[2]);
        // p1 sent again: all of it was held, its first link used last.
        let again = idx.record(&p[1]);
        let stamps: Vec<u64> = (0..p[1].len()).filter_map(|i| again.stamp(i)).collect();
        assert_eq!(stamps.len(), p[1].len());
        assert!(stamps.windows(2).all(|w| w[0] > w[1]), "{stamps:?}");
        // Its replica says its cache of p1 ended before link 2: link 2 was evicted, and p0,
        // used before it, too; p2, used since, and p1, recorded again, stay.
        let forgotten = idx.forget_older_than(again.stamp(2).expect("held"));
        assert_eq!(forgotten, p[0].last().expect("links").bytes / 4);
        assert_eq!(idx.cached_tokens(&p[0]), 0);
        for l in [&p[1], &p[2]] {
            assert_eq!(idx.cached_tokens(l), l.last().expect("links").bytes / 4);
        }
        // A prompt held in part gives the stamps of its held run only.
        let longer = prompt(&[&"2".repeat(4 * CHUNK_BYTES), "and more"]);
        let part = idx.record(&longer);
        assert!(part.stamp(0).is_some());
        assert_eq!(part.stamp(longer.len() - 1), None);
    }

    /// A tokenizer that makes more tokens of the same bytes fills the same capacity sooner.
    #[test]
    fn the_capacity_is_in_the_replicas_tokens() {
        let p: Vec<Vec<Link>> = (0..2)
            .map(|i| prompt(&[&format!("{i}").repeat(4 * CHUNK_BYTES - 8)]))
            .collect();
        // Room for two prompts at 4 bytes a token...
        let idx = PrefixIndex::new(2 * 4 * CHUNK_BYTES as u64 / 4 + 10);
        idx.record(&p[0]);
        idx.record(&p[1]);
        assert!(idx.cached_tokens(&p[0]) > 0);
        // ...for one at 2 bytes a token: the same text is twice the tokens.
        idx.set_bytes_per_token_milli(2000);
        idx.record(&p[1]);
        assert_eq!(idx.cached_tokens(&p[0]), 0);
        assert!(idx.cached_tokens(&p[1]) > 0);
        assert_eq!(idx.to_estimate(1000), 500);
        assert_eq!(idx.to_replica_tokens(500), 1000);
    }
}
