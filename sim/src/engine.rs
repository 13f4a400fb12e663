//! The engine model: a vLLM-like prefix cache and the timing of prefill and decode.
//!
//! Not a language model: tokens are 4 bytes of rendered text, and "generation" emits
//! deterministic filler words. What is modelled faithfully is *cost*: only uncached prompt
//! tokens pay prefill, prefill is one shared resource served in arrival order, and decode
//! runs in a continuous batch of bounded size.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use lru::LruCache;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use xxhash_rust::xxh3::Xxh3;

/// Bytes per token: the simulator's tokenizer.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Debug, Clone)]
pub struct EngineConf {
    /// Prefill throughput, tokens per second, before the speed factor.
    pub prefill_tokens_per_s: f64,
    /// Time between two generated tokens of one request, before the speed factor.
    pub decode_interval: Duration,
    /// Requests decoding at once (vLLM's max_num_seqs); the rest wait.
    pub max_batch: usize,
    /// Tokens per cache block (vLLM's block_size).
    pub block_tokens: usize,
    /// Prefix-cache capacity in tokens.
    pub cache_tokens: usize,
    /// Divides every duration: 10.0 runs a scenario ten times faster.
    pub speed: f64,
}

#[derive(Default)]
pub struct Counters {
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub requests: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
}

pub struct Engine {
    pub conf: EngineConf,
    /// Chained block hash → (); LRU order is eviction order.
    cache: Mutex<LruCache<u64, ()>>,
    /// When the shared prefill resource is next free.
    prefill_free_at: Mutex<Instant>,
    batch: std::sync::Arc<Semaphore>,
    pub counters: Counters,
}

/// A request admitted to the batch: holding it counts as "running".
pub struct Running<'a> {
    engine: &'a Engine,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.engine.counters.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Chained hashes of the full blocks of `text`: block i's hash covers blocks 0..=i.
pub fn block_hashes(text: &[u8], block_tokens: usize) -> Vec<u64> {
    let block_bytes = block_tokens * BYTES_PER_TOKEN;
    let mut prev = 0u64;
    text.chunks_exact(block_bytes)
        .map(|block| {
            let mut h = Xxh3::new();
            h.update(&prev.to_le_bytes());
            h.update(block);
            prev = h.digest();
            prev
        })
        .collect()
}

pub fn tokens(text: &[u8]) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

impl Engine {
    pub fn new(conf: EngineConf) -> Engine {
        let blocks = (conf.cache_tokens / conf.block_tokens).max(1);
        Engine {
            cache: Mutex::new(LruCache::new(
                NonZeroUsize::new(blocks).unwrap_or(NonZeroUsize::MIN),
            )),
            prefill_free_at: Mutex::new(Instant::now()),
            batch: std::sync::Arc::new(Semaphore::new(conf.max_batch.max(1))),
            counters: Counters::default(),
            conf,
        }
    }

    pub fn scaled(&self, d: Duration) -> Duration {
        d.div_f64(self.conf.speed)
    }

    /// Waits for a batch slot (vLLM's "waiting" queue).
    pub async fn admit(&self) -> Running<'_> {
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = self.batch.clone().acquire_owned().await;
        self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        Running {
            engine: self,
            // The semaphore is never closed.
            _permit: permit.expect("batch semaphore open"),
        }
    }

    /// How many leading tokens of `prompt` are in the cache; refreshes their LRU position.
    pub fn lookup(&self, prompt: &[u8]) -> usize {
        let hashes = block_hashes(prompt, self.conf.block_tokens);
        let Ok(mut cache) = self.cache.lock() else {
            return 0;
        };
        let hit = hashes
            .iter()
            .take_while(|h| cache.get(*h).is_some())
            .count();
        hit * self.conf.block_tokens
    }

    /// Puts the full blocks of `text` into the cache.
    pub fn insert(&self, text: &[u8]) {
        let hashes = block_hashes(text, self.conf.block_tokens);
        if let Ok(mut cache) = self.cache.lock() {
            for h in hashes {
                cache.put(h, ());
            }
        }
    }

    pub fn cache_usage(&self) -> f64 {
        self.cache
            .lock()
            .map(|c| c.len() as f64 / c.cap().get() as f64)
            .unwrap_or(0.0)
    }

    /// Books `uncached` tokens of prefill on the shared resource; returns when it completes.
    pub fn book_prefill(&self, uncached: usize) -> Instant {
        let cost = self.scaled(Duration::from_secs_f64(
            uncached as f64 / self.conf.prefill_tokens_per_s,
        ));
        let now = Instant::now();
        let Ok(mut free_at) = self.prefill_free_at.lock() else {
            return now + cost;
        };
        let start = (*free_at).max(now);
        *free_at = start + cost;
        *free_at
    }

    pub fn decode_interval(&self) -> Duration {
        self.scaled(self.conf.decode_interval)
    }
}

/// Deterministic filler text: token `i` of a reply, 4 bytes each.
pub fn token_text(seed: u64, i: usize) -> &'static str {
    const WORDS: [&str; 16] = [
        "the ", "cat ", "sat ", "on ", "a ", "mat ", "and ", "ran ", "far ", "off ", "to ", "see ",
        "new ", "sky ", "at ", "sun ",
    ];
    // Mixing the seed keeps different requests' replies apart in the cache.
    WORDS[((seed as usize).wrapping_mul(31).wrapping_add(i * 7)) % WORDS.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(cache_tokens: usize) -> Engine {
        Engine::new(EngineConf {
            prefill_tokens_per_s: 1000.0,
            decode_interval: Duration::from_millis(10),
            max_batch: 2,
            block_tokens: 4,
            cache_tokens,
            speed: 1.0,
        })
    }

    #[test]
    fn a_prefix_hits_only_whole_leading_blocks() {
        let e = engine(1000);
        let text = vec![b'a'; 160]; // 40 tokens = 10 blocks
        assert_eq!(e.lookup(&text), 0);
        e.insert(&text);
        assert_eq!(e.lookup(&text), 40);
        let mut longer = text.clone();
        longer.extend_from_slice(&[b'b'; 64]);
        assert_eq!(e.lookup(&longer), 40);
        let mut changed = text.clone();
        changed[20] = b'z'; // inside block 1
        assert_eq!(e.lookup(&changed), 4);
    }

    #[test]
    fn lru_eviction_bounds_the_cache() {
        let e = engine(16); // 4 blocks
        e.insert(&[b'x'; 64]);
        e.insert(&[b'y'; 64]);
        assert_eq!(e.lookup(&[b'x'; 64]), 0, "evicted by the newer entry");
        assert_eq!(e.lookup(&[b'y'; 64]), 16);
        assert!(e.cache_usage() <= 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_is_one_shared_resource() {
        let e = engine(1000);
        let start = Instant::now();
        let a = e.book_prefill(1000);
        let b = e.book_prefill(500);
        assert_eq!(a - start, Duration::from_secs(1));
        assert_eq!(b - start, Duration::from_millis(1500));
    }
}
