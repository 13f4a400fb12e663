//! The affinity table: which replica served each message list (by its chained hash), an LRU
//! bounded in entries. Adaptive routing asks it where a conversation's earlier turn went.
//!
//! Sharded by hash, each shard behind its own lock and holding at most [`SHARD_ENTRIES`]
//! entries, so no lock is ever held for more than a bounded, small amount of work: a lookup or
//! an insert touches one shard, and a snapshot or a merge (state file, upgrades) goes shard by
//! shard, in slices. LRU order is kept per shard; with hashes spread evenly that evicts nearly
//! as a global LRU would.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use pingora_prometheus::prometheus::IntGauge;

/// Entries a shard holds at most, and so the most work done under one lock.
pub const SHARD_ENTRIES: usize = 2048;

type Shard = LruCache<u64, Arc<str>>;

pub struct AffinityTable {
    shards: Box<[Mutex<Shard>]>,
    /// `log2(shards.len())`: a hash's top bits pick its shard.
    shard_bits: u32,
    entries: AtomicI64,
    /// Where the size is reported.
    gauge: Option<IntGauge>,
    /// Bumped on every change, so the table is saved only when it changed.
    generation: AtomicU64,
    /// The most entries one bulk operation handled under a single lock (for the tests).
    most_under_one_lock: AtomicUsize,
}

impl AffinityTable {
    /// A table of at most about `capacity` entries that reports its size to `gauge`.
    pub fn new(capacity: usize, gauge: Option<IntGauge>) -> AffinityTable {
        let capacity = capacity.max(1);
        let shards = capacity.div_ceil(SHARD_ENTRIES).next_power_of_two();
        let per_shard = NonZeroUsize::new(capacity.div_ceil(shards)).unwrap_or(NonZeroUsize::MIN);
        AffinityTable {
            shards: (0..shards)
                .map(|_| Mutex::new(LruCache::new(per_shard)))
                .collect(),
            shard_bits: shards.trailing_zeros(),
            entries: AtomicI64::new(0),
            gauge,
            generation: AtomicU64::new(0),
            most_under_one_lock: AtomicUsize::new(0),
        }
    }

    fn shard_index(&self, h: u64) -> usize {
        h.checked_shr(64 - self.shard_bits).unwrap_or(0) as usize
    }

    fn shard(&self, h: u64) -> &Mutex<Shard> {
        &self.shards[self.shard_index(h)]
    }

    /// Which replica served the message list hashed `h` (does not refresh its LRU position).
    pub fn served_by(&self, h: u64) -> Option<Arc<str>> {
        self.shard(h).lock().ok()?.peek(&h).cloned()
    }

    /// Records that replica `id` served the message list hashed `h`.
    pub fn record(&self, h: u64, id: &Arc<str>) {
        if let Ok(mut s) = self.shard(h).lock() {
            let before = s.len();
            s.put(h, id.clone());
            self.count(s.len() as i64 - before as i64);
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// The gauge moves by the same delta as the count, never to a value read earlier: two
    /// concurrent changes setting what each read could leave it off for good.
    fn count(&self, delta: i64) {
        self.entries.fetch_add(delta, Ordering::Relaxed);
        if let Some(g) = &self.gauge {
            g.add(delta);
        }
    }

    fn held(&self, entries: usize) {
        self.most_under_one_lock
            .fetch_max(entries, Ordering::Relaxed);
    }

    pub fn len(&self) -> usize {
        self.entries.load(Ordering::Relaxed).max(0) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A copy of the table, each shard least recently used first, taken one shard at a time.
    pub fn snapshot(&self) -> Vec<(u64, Arc<str>)> {
        let mut out = Vec::with_capacity(self.len());
        for shard in self.shards.iter() {
            let Ok(s) = shard.lock() else { continue };
            self.held(s.len());
            out.extend(s.iter().rev().map(|(h, id)| (*h, id.clone())));
        }
        out
    }

    /// Adds pins another process made, least recently used first, one slice of one shard per
    /// lock. A pin this table already holds wins (it is at least as recent). `resolve` maps a
    /// written id to this process's replica id, or None for a replica no longer configured;
    /// it is called outside every lock.
    pub fn merge<'e>(
        &self,
        entries: impl IntoIterator<Item = (u64, &'e str)>,
        resolve: impl Fn(&str) -> Option<Arc<str>>,
    ) -> usize {
        let mut by_shard: Vec<Vec<(u64, Arc<str>)>> = vec![Vec::new(); self.shards.len()];
        for (h, id) in entries {
            if let Some(id) = resolve(id) {
                by_shard[self.shard_index(h)].push((h, id));
            }
        }
        let mut learnt = 0;
        for (shard, incoming) in self.shards.iter().zip(by_shard) {
            for slice in incoming.chunks(SHARD_ENTRIES) {
                let Ok(mut s) = shard.lock() else { break };
                self.held(slice.len());
                let before = s.len();
                for (h, id) in slice {
                    if !s.contains(h) {
                        s.put(*h, id.clone());
                        learnt += 1;
                    }
                }
                self.count(s.len() as i64 - before as i64);
            }
        }
        learnt
    }

    /// Forgets every pin to `replica`, one shard per lock: it restarted, and what it served is
    /// gone with its cache, so the conversations it served have no home until they are served
    /// again. How many pins went.
    pub fn forget_replica(&self, replica: &str) -> usize {
        let mut gone = 0;
        for shard in self.shards.iter() {
            let Ok(mut s) = shard.lock() else { continue };
            self.held(s.len());
            let pins: Vec<u64> = s
                .iter()
                .filter(|(_, id)| &***id == replica)
                .map(|(h, _)| *h)
                .collect();
            for h in &pins {
                s.pop(h);
            }
            self.count(-(pins.len() as i64));
            gone += pins.len();
        }
        if gone > 0 {
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
        gone
    }

    /// The most entries a snapshot or merge handled under one lock so far.
    pub fn most_under_one_lock(&self) -> usize {
        self.most_under_one_lock.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn id(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn records_and_answers_and_evicts_least_recent() {
        let t = AffinityTable::new(3, None);
        let (a, b) = (id("a"), id("b"));
        for h in 1..=3 {
            t.record(h, &a);
        }
        assert_eq!(t.len(), 3);
        t.record(4, &b);
        assert_eq!(t.len(), 3, "bounded");
        assert_eq!(t.served_by(1), None, "least recent went");
        assert_eq!(t.served_by(4).as_deref(), Some("b"));
        t.record(4, &a);
        assert_eq!(t.served_by(4).as_deref(), Some("a"), "the latest pin wins");
    }

    #[test]
    fn a_merge_keeps_own_pins_and_drops_unknown_replicas() {
        let t = AffinityTable::new(100, None);
        t.record(1, &id("mine"));
        let theirs = [(1, "theirs"), (2, "theirs"), (3, "gone")];
        let learnt = t.merge(theirs.iter().map(|(h, s)| (*h, *s)), |s| {
            (s != "gone").then(|| id(s))
        });
        assert_eq!(learnt, 1);
        assert_eq!(t.served_by(1).as_deref(), Some("mine"));
        assert_eq!(t.served_by(2).as_deref(), Some("theirs"));
        assert_eq!(t.served_by(3), None);
    }

    #[test]
    fn a_snapshot_merged_into_a_new_table_gives_the_same_answers() {
        let t = AffinityTable::new(10_000, None);
        let r = id("r");
        for h in 0..5_000u64 {
            t.record(xxhash_rust::xxh3::xxh3_64(&h.to_le_bytes()), &r);
        }
        let snap = t.snapshot();
        assert_eq!(snap.len(), 5_000);
        let u = AffinityTable::new(10_000, None);
        let learnt = u.merge(snap.iter().map(|(h, s)| (*h, &**s)), |s| Some(id(s)));
        assert_eq!(learnt, 5_000);
        assert!(snap.iter().all(|(h, _)| u.served_by(*h).is_some()));
    }

    /// A restarted replica's pins go, every shard's, the others' stay; the count and the
    /// generation follow, and no lock is held for more than a shard.
    #[test]
    fn a_restarted_replicas_pins_go_and_the_others_stay() {
        let t = AffinityTable::new(20_000, None);
        let (a, b) = (id("a"), id("b"));
        let h = |i: u64| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        for i in 0..10_000u64 {
            t.record(h(i), if i % 3 == 0 { &a } else { &b });
        }
        let generation = t.generation();
        assert_eq!(t.forget_replica("a"), 3_334);
        assert_eq!(t.len(), 6_666);
        assert!(t.generation() > generation);
        for i in 0..10_000u64 {
            let want = (i % 3 != 0).then_some("b");
            assert_eq!(t.served_by(h(i)).as_deref(), want, "{i}");
        }
        let generation = t.generation();
        assert_eq!(t.forget_replica("a"), 0);
        assert_eq!(
            t.generation(),
            generation,
            "nothing changed: nothing to save"
        );
        assert!(t.most_under_one_lock() <= SHARD_ENTRIES);
    }

    /// The request path shares these locks: a snapshot or a merge of a large table (state
    /// file writes, upgrades) must never hold one for more than a slice of work. A single
    /// lock over the whole table held it for all 100,000 entries (1-4 ms, and ~35 ms a merge).
    #[test]
    fn no_lock_is_held_for_more_than_a_slice_of_a_large_table() {
        let n = 100_000u64;
        let t = AffinityTable::new(n as usize, None);
        let r = id("r");
        for i in 0..n {
            t.record(xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()), &r);
        }
        let snap = t.snapshot();
        assert!(snap.len() as u64 > n * 9 / 10, "{}", snap.len());
        let incoming: Vec<(u64, &str)> = (n..2 * n)
            .map(|i| (xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()), "r"))
            .collect();
        t.merge(incoming, |s| Some(id(s)));
        let most = t.most_under_one_lock();
        assert!(most > 0 && most <= SHARD_ENTRIES, "held for {most} entries");
        assert!(
            t.len() <= n as usize + t.shards.len(),
            "bounded: {}",
            t.len()
        );
    }

    /// The size gauge moves with the count: after concurrent inserts it equals the table's
    /// size. Set from the count each insert read, the last write could be a stale one. Each
    /// round the threads insert together and the gauge is read after each round, so that a
    /// stale last write is seen.
    #[test]
    fn the_size_gauge_equals_the_size_after_concurrent_inserts() {
        const THREADS: u64 = 4;
        const ROUNDS: u64 = 20_000;
        const EACH: u64 = 4;
        let gauge = IntGauge::new("affinity_race", "test").expect("gauge");
        let t = AffinityTable::new(10_000_000, Some(gauge.clone()));
        let r = id("r");
        let n = (THREADS + 1) as usize;
        let (go, done) = (std::sync::Barrier::new(n), std::sync::Barrier::new(n));
        let stale = AtomicBool::new(false);
        let mut off = vec![];
        std::thread::scope(|s| {
            for thread in 0..THREADS {
                let (t, r, go, done, stale) = (&t, &r, &go, &done, &stale);
                s.spawn(move || {
                    for round in 0..ROUNDS {
                        go.wait();
                        if !stale.load(Ordering::Relaxed) {
                            for i in 0..EACH {
                                let key = (round << 32) | (thread << 16) | i;
                                t.record(xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes()), r);
                            }
                        }
                        done.wait();
                    }
                });
            }
            for round in 0..ROUNDS {
                go.wait();
                done.wait();
                if stale.load(Ordering::Relaxed) {
                    continue;
                }
                if gauge.get() != t.len() as i64 {
                    off.push((round, gauge.get(), t.len()));
                    stale.store(true, Ordering::Relaxed);
                }
            }
        });
        assert_eq!(off, vec![], "(round, gauge, size)");
        assert_eq!(t.len() as u64, ROUNDS * THREADS * EACH);
    }
}
