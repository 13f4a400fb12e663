//! The exact per-block index of one replica, built from its KV events: which blocks of token
//! ids it holds, and where (GPU, CPU). A block is named by a chain hash over token ids, ours:
//! block `i` of a prompt hashes its `block_size` tokens with block `i - 1`'s hash, so a prompt's
//! held blocks are a leading run, and a request's token ids give the same names the events
//! gave. The replica's own hashes (vLLM's, which hash with a per-process seed inferlb cannot
//! know) are mapped to ours as blocks are stored, so that its removals find their blocks.
//!
//! Only blocks whose chain is known from their first block on are kept: a block stored on a
//! parent this index never saw (stored before it joined, or in a batch it missed) is not
//! trusted, nor anything stored on it later. So what it holds was all seen stored, and every
//! removal since: it may know less than the replica holds, never more, as long as no batch was
//! missed. Bounded: past its block count, the least recently used blocks are forgotten (a
//! forgotten block is a miss, the safe side).

use std::collections::HashMap;
use std::sync::Mutex;

use inferlb_kvevents::{BlockHash, BlockRemoved, BlockStored, Medium};
use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The chain's seed before a prompt's first block.
const ROOT: u64 = 0x6b76_5f63_6861_696e;

/// A block held on the GPU weighs this many sixteenths of a token of prefill saved; on the CPU
/// (vLLM's offloading connector) half, since it must be copied back before use; in storage, a
/// quarter.
const GPU_CREDIT: u64 = 16;
const CPU_CREDIT: u64 = 8;
const STORAGE_CREDIT: u64 = 4;

/// The least number of blocks an index holds before forgetting any.
pub const MIN_BLOCKS: usize = 65_536;

/// A prompt's token ids, with its chain hashes per block size computed once for every replica
/// that is asked about it.
#[derive(Debug)]
pub struct PromptTokens {
    ids: Vec<u32>,
    chains: Mutex<Vec<(u32, std::sync::Arc<Vec<u64>>)>>,
}

impl PromptTokens {
    pub fn new(ids: Vec<u32>) -> PromptTokens {
        PromptTokens {
            ids,
            chains: Mutex::new(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The chain hashes of the blocks a replica of `block_size` could have cached for this
    /// prompt: the whole blocks before its last token (vLLM always computes the last one).
    fn chain(&self, block_size: u32) -> std::sync::Arc<Vec<u64>> {
        let mut memo = self.chains.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, c)) = memo.iter().find(|(b, _)| *b == block_size) {
            return c.clone();
        }
        let usable = &self.ids[..self.ids.len().saturating_sub(1)];
        let chain = std::sync::Arc::new(chain_hashes(ROOT, usable, block_size));
        memo.push((block_size, chain.clone()));
        chain
    }
}

/// The chain hashes of `tokens`' whole blocks of `block_size`, from `parent`.
fn chain_hashes(parent: u64, tokens: &[u32], block_size: u32) -> Vec<u64> {
    let size = block_size.max(1) as usize;
    let mut prev = parent;
    tokens
        .chunks_exact(size)
        .map(|block| {
            prev = block_hash(prev, block, 0);
            prev
        })
        .collect()
}

/// One block's chain hash: its tokens, its parent's hash, and what else the replica's hash
/// covers (`extra`, 0 for none: a LoRA adapter, multimodal inputs, a cache salt).
fn block_hash(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, parent ^ extra.rotate_left(17))
}

/// The replica's hash of a block as one integer (a 32-byte hash folded).
fn engine_key(h: &BlockHash) -> u64 {
    match h {
        BlockHash::Int(v) => *v,
        BlockHash::Bytes(b) => xxh3_64_with_seed(b, 1),
    }
}

fn tier(m: Option<&Medium>) -> u8 {
    match m {
        None | Some(Medium::Gpu) => 1,
        Some(Medium::Cpu) => 2,
        Some(Medium::Storage) => 4,
        Some(Medium::Other(_)) => 8,
    }
}

/// Tokens of a prompt's longest held prefix, by where its blocks are.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub gpu: u64,
    pub cpu: u64,
    pub storage: u64,
}

impl Held {
    /// The prefill it saves, in tokens, each tier weighed by its credit.
    pub fn credit(&self) -> u64 {
        (self.gpu * GPU_CREDIT + self.cpu * CPU_CREDIT + self.storage * STORAGE_CREDIT) / 16
    }

    pub fn tokens(&self) -> u64 {
        self.gpu + self.cpu + self.storage
    }
}

/// What a batch of events did to the index, for the counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    /// Blocks stored on a parent the index does not know: not kept.
    pub untrusted: u64,
    pub removed: u64,
}

struct Entry {
    engine: u64,
    tiers: u8,
}

struct Blocks {
    block_size: Option<u32>,
    /// Chain hash → the block.
    chain: LruCache<u64, Entry>,
    /// The replica's hash → the chain hash.
    engine: HashMap<u64, u64>,
}

pub struct BlockIndex {
    inner: Mutex<Blocks>,
    max_blocks: std::sync::atomic::AtomicUsize,
}

impl BlockIndex {
    pub fn new(max_blocks: usize) -> BlockIndex {
        BlockIndex {
            inner: Mutex::new(Blocks {
                block_size: None,
                chain: LruCache::unbounded(),
                engine: HashMap::new(),
            }),
            max_blocks: std::sync::atomic::AtomicUsize::new(max_blocks.max(MIN_BLOCKS)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Blocks> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// At most this many blocks are held (at least [`MIN_BLOCKS`]).
    pub fn set_max_blocks(&self, n: usize) {
        self.max_blocks
            .store(n.max(MIN_BLOCKS), std::sync::atomic::Ordering::Relaxed);
    }

    /// (blocks held, block size).
    pub fn size(&self) -> (usize, Option<u32>) {
        let b = self.lock();
        (b.chain.len(), b.block_size)
    }

    /// The replica's cache is empty.
    pub fn clear(&self) {
        let mut b = self.lock();
        b.chain.clear();
        b.engine.clear();
        b.engine.shrink_to_fit();
    }

    /// Blocks entered a tier of the replica's cache.
    pub fn stored(&self, e: &BlockStored) -> Applied {
        let mut out = Applied::default();
        // Hybrid models publish a group per KV cache kind; group 0 is the full attention one.
        if e.group_idx.is_some_and(|g| g != 0) || e.block_size == 0 {
            return out;
        }
        let size = e.block_size as usize;
        let n = e.block_hashes.len();
        let mut b = self.lock();
        if b.block_size.is_some_and(|s| s != e.block_size) {
            // A replica restarted with another block size: nothing before holds.
            b.chain.clear();
            b.engine.clear();
        }
        b.block_size = Some(e.block_size);
        let parent = match &e.parent_block_hash {
            None => Some(match &e.lora_name {
                None => ROOT,
                Some(name) => xxh3_64_with_seed(name.as_bytes(), ROOT),
            }),
            Some(p) => b.engine.get(&engine_key(p)).copied(),
        };
        let Some(mut prev) = parent else {
            out.untrusted = n as u64;
            return out;
        };
        if e.token_ids.len() < n * size {
            out.untrusted = n as u64;
            return out;
        }
        let bit = tier(e.medium.as_ref());
        let max = self.max_blocks.load(std::sync::atomic::Ordering::Relaxed);
        for (i, h) in e.block_hashes.iter().enumerate() {
            let extra = e
                .extra_keys
                .as_ref()
                .and_then(|k| k.get(i))
                .and_then(Option::as_ref)
                .filter(|k| !k.is_empty())
                .map_or(0, |k| {
                    let text: String = k.iter().map(|v| v.to_string()).collect();
                    xxh3_64_with_seed(text.as_bytes(), 2) | 1
                });
            let ours = block_hash(prev, &e.token_ids[i * size..(i + 1) * size], extra);
            let key = engine_key(h);
            b.engine.insert(key, ours);
            match b.chain.get_mut(&ours) {
                Some(entry) => {
                    entry.tiers |= bit;
                    entry.engine = key;
                }
                None => {
                    b.chain.put(
                        ours,
                        Entry {
                            engine: key,
                            tiers: bit,
                        },
                    );
                }
            }
            while b.chain.len() > max {
                if let Some((_, old)) = b.chain.pop_lru() {
                    b.engine.remove(&old.engine);
                }
            }
            out.stored += 1;
            prev = ours;
        }
        out
    }

    /// Blocks left a tier of the replica's cache; one that is in no tier any more is gone.
    pub fn removed(&self, e: &BlockRemoved) -> Applied {
        let mut out = Applied::default();
        if e.group_idx.is_some_and(|g| g != 0) {
            return out;
        }
        let bit = tier(e.medium.as_ref());
        let mut b = self.lock();
        for h in &e.block_hashes {
            let key = engine_key(h);
            let Some(&ours) = b.engine.get(&key) else {
                continue;
            };
            let gone = match b.chain.peek_mut(&ours) {
                Some(entry) => {
                    entry.tiers &= !bit;
                    entry.tiers == 0
                }
                None => true,
            };
            if gone {
                b.chain.pop(&ours);
                b.engine.remove(&key);
            }
            out.removed += 1;
        }
        out
    }

    /// The longest prefix of `prompt` the replica holds, by tier.
    pub fn held(&self, prompt: &PromptTokens) -> Held {
        let Some(size) = self.lock().block_size else {
            return Held::default();
        };
        let chain = prompt.chain(size);
        let mut b = self.lock();
        let mut held = Held::default();
        for h in chain.iter() {
            let Some(entry) = b.chain.get(h) else { break };
            let t = u64::from(size);
            match entry.tiers {
                t1 if t1 & 1 != 0 => held.gpu += t,
                t1 if t1 & 2 != 0 => held.cpu += t,
                _ => held.storage += t,
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        medium: Option<Medium>,
    ) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 4,
            medium,
            ..Default::default()
        }
    }

    fn removed(hashes: &[u64], medium: Option<Medium>) -> BlockRemoved {
        BlockRemoved {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            medium,
            ..Default::default()
        }
    }

    fn prompt(n: u32) -> PromptTokens {
        PromptTokens::new((0..n).collect())
    }

    /// (events, in order) → the tokens of a 17-token prompt (0..17) held, by tier. Blocks of
    /// 4: the prompt's first 16 tokens are its cacheable blocks (its last token never is).
    #[test]
    fn the_index_holds_what_the_events_say_and_no_more() {
        let t: Vec<u32> = (0..16).collect();
        enum Ev {
            S(BlockStored),
            R(BlockRemoved),
            Clear,
        }
        use Ev::*;
        let rows: Vec<(&str, Vec<Ev>, Held)> = vec![
            ("nothing stored", vec![], Held::default()),
            (
                "all four blocks in one event",
                vec![S(stored(&[1, 2, 3, 4], None, &t, None))],
                Held {
                    gpu: 16,
                    ..Held::default()
                },
            ),
            (
                "blocks chained over two events",
                vec![
                    S(stored(&[1, 2], None, &t[..8], None)),
                    S(stored(&[3], Some(2), &t[8..12], None)),
                ],
                Held {
                    gpu: 12,
                    ..Held::default()
                },
            ),
            (
                "a parent never seen: not trusted, nor its children",
                vec![
                    S(stored(&[3], Some(2), &t[8..12], None)),
                    S(stored(&[4], Some(3), &t[12..16], None)),
                ],
                Held::default(),
            ),
            (
                "a removal in the middle cuts the run there",
                vec![
                    S(stored(&[1, 2, 3, 4], None, &t, None)),
                    R(removed(&[2], None)),
                ],
                Held {
                    gpu: 4,
                    ..Held::default()
                },
            ),
            (
                "offloaded to the CPU, then evicted from the GPU",
                vec![
                    S(stored(&[1, 2, 3, 4], None, &t, None)),
                    S(stored(&[1, 2], None, &t[..8], Some(Medium::Cpu))),
                    R(removed(&[1, 2, 3, 4], Some(Medium::Gpu))),
                ],
                Held {
                    cpu: 8,
                    ..Held::default()
                },
            ),
            (
                "other tokens under the same parent are other blocks",
                vec![S(stored(&[1, 2], None, &[9; 8], None))],
                Held::default(),
            ),
            (
                "a clear empties it",
                vec![S(stored(&[1, 2, 3, 4], None, &t, None)), Clear],
                Held::default(),
            ),
            (
                "a LoRA adapter's blocks are not the base model's",
                vec![S(BlockStored {
                    lora_name: Some("sql".into()),
                    ..stored(&[1, 2], None, &t[..8], None)
                })],
                Held::default(),
            ),
            (
                "a block whose hash covers more than its tokens (a cache salt) is not matched",
                vec![S(BlockStored {
                    extra_keys: Some(vec![Some(vec![rmpv::Value::from("salt")]), None]),
                    ..stored(&[1, 2], None, &t[..8], None)
                })],
                Held::default(),
            ),
            (
                "another KV cache group (a hybrid model's) is not read",
                vec![S(BlockStored {
                    group_idx: Some(1),
                    ..stored(&[1, 2], None, &t[..8], None)
                })],
                Held::default(),
            ),
        ];
        for (name, events, want) in rows {
            let idx = BlockIndex::new(0);
            for e in events {
                match e {
                    S(s) => {
                        idx.stored(&s);
                    }
                    R(r) => {
                        idx.removed(&r);
                    }
                    Clear => idx.clear(),
                }
            }
            assert_eq!(idx.held(&prompt(17)), want, "{name}");
        }
    }

    #[test]
    fn a_prompts_last_token_is_never_counted_and_tiers_weigh_by_credit() {
        let t: Vec<u32> = (0..16).collect();
        let idx = BlockIndex::new(0);
        idx.stored(&stored(&[1, 2, 3, 4], None, &t, None));
        // A 16-token prompt: its last block holds its last token, which vLLM computes.
        assert_eq!(idx.held(&prompt(16)).gpu, 12);
        assert_eq!(
            Held {
                gpu: 16,
                cpu: 16,
                storage: 16
            }
            .credit(),
            16 + 8 + 4
        );
    }

    #[test]
    fn the_index_is_bounded_and_forgets_the_least_recently_used() {
        let idx = BlockIndex::new(0);
        let n = MIN_BLOCKS as u64 + 100;
        let tokens: Vec<u32> = (0..(n as u32) * 4).collect();
        let hashes: Vec<u64> = (1..=n).collect();
        let a = idx.stored(&stored(&hashes, None, &tokens, None));
        assert_eq!(a.stored, n);
        assert_eq!(idx.size().0, MIN_BLOCKS);
        // The first blocks went first: the prompt from the start is not held any more.
        assert_eq!(idx.held(&PromptTokens::new(tokens.clone())).tokens(), 0);
        // Their removals find nothing and break nothing.
        assert_eq!(idx.removed(&removed(&[1, 2], None)).removed, 0);
    }
}
