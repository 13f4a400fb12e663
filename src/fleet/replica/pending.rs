//! The prompts a replica was sent whose prefill is not over: what it will hold once they are
//! prefilled. The cache model learns a prompt only then (from this process or from the
//! replica's events); until then a request sharing its prefix would find it there once the
//! replica gets to it, after the one queued first. The policy weighs that
//! ([`crate::routing::prefill_cost`]).
//!
//! A prompt is its chained links (each names the prompt up to its end), so two prompts share
//! their first `k` links and no more: a binary search finds `k`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::fleet::index::BYTES_PER_TOKEN;
use crate::protocol::api::prompt::Link;

/// The most prompts a replica keeps pending: more than this without a first byte on one
/// replica (a request answered whole, not streamed, counts until its answer) is a queue no
/// follower would gain by joining, and the lookup stays short.
const MAX_PENDING: usize = 256;

#[derive(Default)]
pub struct Pending {
    next: AtomicU64,
    prompts: Mutex<Vec<(u64, Arc<[Link]>)>>,
}

impl Pending {
    /// A prompt was queued on the replica: its key, to [`Pending::remove`] it when its prefill
    /// ends or it fails; `None` when it has no links or the list is full (it is not counted).
    pub fn add(&self, links: &[Link]) -> Option<u64> {
        if links.is_empty() {
            return None;
        }
        let links: Arc<[Link]> = Arc::from(links);
        let mut prompts = self.prompts.lock().unwrap_or_else(PoisonError::into_inner);
        if prompts.len() >= MAX_PENDING {
            return None;
        }
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        prompts.push((key, links));
        Some(key)
    }

    /// The prompt `key` is prefilled, or will never be.
    pub fn remove(&self, key: u64) {
        let mut prompts = self.prompts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = prompts.iter().position(|(k, _)| *k == key) {
            prompts.swap_remove(i);
        }
    }

    /// Tokens (the estimate's: bytes over [`BYTES_PER_TOKEN`]) of the longest prefix of
    /// `links` that a pending prompt shares; 0 when none does.
    pub fn shared_tokens(&self, links: &[Link]) -> u64 {
        let prompts = self.prompts.lock().unwrap_or_else(PoisonError::into_inner);
        let longest = prompts
            .iter()
            .map(|(_, p)| shared_links(links, p))
            .max()
            .unwrap_or(0);
        longest
            .checked_sub(1)
            .map_or(0, |last| links[last].bytes / BYTES_PER_TOKEN)
    }

    /// How many prompts are pending.
    pub fn len(&self) -> usize {
        self.prompts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How many leading links `a` and `b` share. Each link's hash chains the ones before it, so
/// the links are equal up to some index and differ from there on.
fn shared_links(a: &[Link], b: &[Link]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    // Most pending prompts share nothing with a request: one compare says so.
    if hi == 0 || a[0].hash != b[0].hash {
        return 0;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid].hash == b[mid].hash {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::api::prompt::PromptHasher;

    /// The links of a chat of `parts`, each part its own message.
    fn links(parts: &[&str]) -> Vec<Link> {
        let mut h = PromptHasher::new("m");
        for p in parts {
            h.begin_part("user");
            h.text(p);
            h.end_part();
        }
        h.finish()
    }

    #[test]
    fn the_longest_shared_prefix_of_any_pending_prompt_counts_until_it_is_removed() {
        let pending = Pending::default();
        let shared = "x".repeat(8_000);
        let leader = links(&[&shared, "question one"]);
        let follower = links(&[&shared, "question two"]);
        let stranger = links(&["y".repeat(8_000).as_str(), "question two"]);
        assert_eq!(pending.shared_tokens(&follower), 0, "nothing pending");

        let key = pending.add(&leader).expect("counted");
        let tokens = pending.shared_tokens(&follower);
        // The shared message and no more: about 8,000 bytes of it.
        assert!((1_900..=2_100).contains(&tokens), "{tokens}");
        assert_eq!(pending.shared_tokens(&stranger), 0);
        assert_eq!(
            pending.shared_tokens(&leader),
            leader.last().expect("links").bytes / BYTES_PER_TOKEN,
            "the same prompt is shared whole"
        );

        // A longer one pending too: the longest counts.
        let longer = pending.add(&follower).expect("counted");
        assert_eq!(
            pending.shared_tokens(&follower),
            follower.last().expect("links").bytes / BYTES_PER_TOKEN
        );
        pending.remove(longer);
        assert_eq!(pending.shared_tokens(&follower), tokens);
        pending.remove(key);
        assert_eq!(pending.shared_tokens(&follower), 0);
        assert!(pending.is_empty());
    }

    #[test]
    fn the_list_is_bounded_and_an_empty_prompt_is_not_counted() {
        let pending = Pending::default();
        assert_eq!(pending.add(&[]), None);
        let l = links(&["a prompt"]);
        for _ in 0..MAX_PENDING {
            assert!(pending.add(&l).is_some());
        }
        assert_eq!(pending.add(&l), None);
        assert_eq!(pending.len(), MAX_PENDING);
    }

    /// Prompts of every length sharing a prefix of every length: the search finds exactly the
    /// links they share.
    #[test]
    fn shared_links_is_the_first_difference() {
        let base: Vec<String> = (0..40).map(|i| format!("part {i} ").repeat(50)).collect();
        for cut in 0..base.len() {
            for tail in 0..3 {
                let a: Vec<&str> = base.iter().map(String::as_str).collect();
                let mut b: Vec<String> = base[..cut].to_vec();
                b.extend((0..tail).map(|t| format!("other {t}")));
                let b: Vec<&str> = b.iter().map(String::as_str).collect();
                let (la, lb) = (links(&a), links(&b));
                let expect = la
                    .iter()
                    .zip(&lb)
                    .take_while(|(x, y)| x.hash == y.hash)
                    .count();
                assert_eq!(shared_links(&la, &lb), expect, "cut {cut} tail {tail}");
                assert_eq!(shared_links(&lb, &la), expect);
            }
        }
    }
}
