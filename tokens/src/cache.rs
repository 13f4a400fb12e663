//! The per-conversation prefix cache: the token ids of a rendering up to a safe cut, found again
//! by the hashes of the leading messages, bounded in bytes (LRU).

use lru::LruCache;
use std::sync::Arc;

/// What one rendering left behind: its text up to `cut` (as a 128-bit hash and a length) and the
/// ids of that text, in segments that later entries of the conversation share. `cut` is the end
/// of an added token, where tokenization splits.
pub struct Entry {
    pub cut: usize,
    pub prefix_hash: u128,
    pub ids: Vec<Arc<[u32]>>,
}

impl Entry {
    /// Counted as if no segment were shared (an upper bound).
    fn bytes(&self) -> usize {
        self.ids.iter().map(|s| s.len() * 4 + 16).sum::<usize>() + 64
    }
}

pub struct PrefixCache {
    map: LruCache<u64, Entry>,
    bytes: usize,
    limit: usize,
}

impl PrefixCache {
    pub fn new(limit: usize) -> Self {
        Self {
            map: LruCache::unbounded(),
            bytes: 0,
            limit,
        }
    }

    /// The entry under the longest key (keys in order of leading-message count) that `check`
    /// accepts.
    pub fn longest(
        &mut self,
        keys: &[u64],
        check: impl Fn(&Entry) -> bool,
    ) -> Option<(usize, Vec<Arc<[u32]>>)> {
        for key in keys.iter().rev() {
            if let Some(e) = self.map.get(key) {
                if check(e) {
                    return Some((e.cut, e.ids.clone()));
                }
            }
        }
        None
    }

    pub fn insert(&mut self, key: u64, entry: Entry) {
        if entry.bytes() > self.limit {
            return;
        }
        self.bytes += entry.bytes();
        if let Some(old) = self.map.put(key, entry) {
            self.bytes -= old.bytes();
        }
        while self.bytes > self.limit {
            match self.map.pop_lru() {
                Some((_, e)) => self.bytes -= e.bytes(),
                None => break,
            }
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// Something whose size in bytes is known.
pub trait Weigh {
    fn weight(&self) -> usize;
}

impl<T> Weigh for (T, usize) {
    fn weight(&self) -> usize {
        self.1 + 64
    }
}

/// An LRU map bounded by the weight of its values (trimmed by the caller, after a batch of puts).
pub struct Sized<V> {
    map: LruCache<u64, V>,
    bytes: usize,
    limit: usize,
}

impl<V: Weigh> Sized<V> {
    pub fn new(limit: usize) -> Self {
        Self {
            map: LruCache::unbounded(),
            bytes: 0,
            limit,
        }
    }

    pub fn get(&mut self, key: &u64) -> Option<&V> {
        self.map.get(key)
    }

    /// Keeps `value`, unless it alone weighs more than the bound (it would push out the rest
    /// and then itself).
    pub fn put(&mut self, key: u64, value: V) {
        if value.weight() > self.limit {
            return;
        }
        self.bytes += value.weight();
        if let Some(old) = self.map.put(key, value) {
            self.bytes -= old.weight();
        }
    }

    pub fn trim(&mut self) {
        while self.bytes > self.limit {
            match self.map.pop_lru() {
                Some((_, v)) => self.bytes -= v.weight(),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: usize) -> Entry {
        Entry {
            cut: n,
            prefix_hash: n as u128,
            ids: vec![vec![0; n].into()],
        }
    }

    #[test]
    fn bounded_in_bytes_least_recent_out_first() {
        let mut c = PrefixCache::new(3 * (400 + 80));
        for k in 0..3 {
            c.insert(k, entry(100));
        }
        assert_eq!(c.len(), 3);
        assert!(c.longest(&[0], |_| true).is_some());
        c.insert(9, entry(100));
        assert_eq!(c.len(), 3);
        assert!(
            c.longest(&[1], |_| true).is_none(),
            "1 was the least recent"
        );
        assert!(c.longest(&[0], |_| true).is_some());
        assert!(c.bytes() <= 3 * 480);
        c.insert(10, entry(10_000));
        assert_eq!(c.len(), 3, "an entry over the whole bound is not kept");
    }

    #[test]
    fn sized_is_bounded_by_weight() {
        let mut s: Sized<((), usize)> = Sized::new(3 * 164);
        for k in 0..5 {
            s.put(k, ((), 100));
            s.trim();
        }
        assert!(s.get(&4).is_some() && s.get(&1).is_none());
        assert!(s.bytes <= 3 * 164);
    }

    #[test]
    fn the_longest_accepted_key_wins() {
        let mut c = PrefixCache::new(1 << 20);
        c.insert(1, entry(1));
        c.insert(2, entry(2));
        assert_eq!(c.longest(&[1, 2, 3], |_| true).unwrap().0, 2);
        assert_eq!(c.longest(&[1, 2, 3], |e| e.cut < 2).unwrap().0, 1);
    }
}
