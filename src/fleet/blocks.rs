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

use super::chain::{block_hash, PromptTokens, ROOT};
use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A block held on the GPU weighs this many sixteenths of a token of prefill saved; on the CPU
/// (vLLM's offloading connector) half, since it must be copied back before use; in storage, a
/// quarter.
const GPU_CREDIT: u64 = 16;
const CPU_CREDIT: u64 = 8;
const STORAGE_CREDIT: u64 = 4;

/// The least number of blocks an index holds before forgetting any.
pub const MIN_BLOCKS: usize = 65_536;

/// The replica's hash of a block as one integer (a 32-byte hash folded).
fn engine_key(h: &BlockHash) -> u64 {
    match h {
        BlockHash::Int(v) => *v,
        BlockHash::Bytes(b) => xxh3_64_with_seed(b, 1),
    }
}

/// Tiers, in the order a lookup falls through them.
const GPU: usize = 0;
const CPU: usize = 1;
const STORAGE: usize = 2;
const TIERS: usize = 3;

fn tier(m: Option<&Medium>) -> usize {
    match m {
        None | Some(Medium::Gpu) => GPU,
        Some(Medium::Cpu) => CPU,
        // Disk, remote stores and tiers vLLM may add: slower than the CPU.
        Some(Medium::Storage) | Some(Medium::Other(_)) => STORAGE,
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
    /// Blocks stored on a parent the index does not know, or without their tokens: not kept.
    pub untrusted: u64,
    pub removed: u64,
}

struct Entry {
    /// The replica's hash that named it first (aliases map to it too, see `stored`).
    engine: u64,
    /// Copies per tier: the replica may announce one block stored twice (two physical
    /// copies), and removes each copy apart.
    copies: [u16; TIERS],
}

struct Blocks {
    block_size: Option<u32>,
    /// Chain hash → the block.
    chain: LruCache<u64, Entry>,
    /// The replica's hash → the chain hash.
    engine: HashMap<u64, u64>,
}

impl Blocks {
    fn clear(&mut self) {
        self.chain.clear();
        self.engine.clear();
        self.engine.shrink_to_fit();
    }

    /// Forgets the least recently used blocks beyond `max`, and names that no longer lead to
    /// a block (kept in check at twice `max`).
    fn bound(&mut self, max: usize) {
        while self.chain.len() > max {
            let Some((ours, old)) = self.chain.pop_lru() else {
                break;
            };
            if self.engine.get(&old.engine) == Some(&ours) {
                self.engine.remove(&old.engine);
            }
        }
        if self.engine.len() > max.saturating_mul(2) {
            let chain = &self.chain;
            self.engine.retain(|_, ours| chain.contains(ours));
        }
    }
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
        self.lock().clear();
    }

    /// Blocks entered a tier of the replica's cache.
    ///
    /// A block the index already knows by the replica's hash gains a copy in that tier, its
    /// tokens not needed: vLLM's offloading connector announces CPU copies without tokens, and
    /// at its own block size. A block it does not know is named from its parent and tokens,
    /// and is kept only when the parent is known (or it is a prompt's first) and its tokens
    /// are all there; otherwise it, and the rest of the event after it, is not trusted.
    pub fn stored(&self, e: &BlockStored) -> Applied {
        let mut out = Applied::default();
        // Hybrid models publish a group per KV cache kind; group 0 is the full attention one.
        if e.group_idx.is_some_and(|g| g != 0) {
            return out;
        }
        let n = e.block_hashes.len();
        let t = tier(e.medium.as_ref());
        let mut b = self.lock();
        // The GPU's blocks set the block size; a replica restarted with another one holds
        // nothing from before.
        if t == GPU && e.block_size > 0 {
            if b.block_size.is_some_and(|s| s != e.block_size) {
                b.clear();
            }
            b.block_size = Some(e.block_size);
        }
        let size = e.block_size as usize;
        // Tokens usable to name new blocks: at the index's block size, exactly one block's
        // worth per hash (vLLM skips null blocks, which would misalign a longer list).
        let tokens =
            (size > 0 && b.block_size == Some(e.block_size) && e.token_ids.len() == n * size)
                .then_some(&e.token_ids[..]);
        let mut prev = match &e.parent_block_hash {
            None => Some(match (&e.lora_name, e.lora_id) {
                (Some(name), _) => xxh3_64_with_seed(name.as_bytes(), ROOT),
                (None, Some(id)) => xxh3_64_with_seed(&id.to_le_bytes(), ROOT ^ 1),
                (None, None) => ROOT,
            }),
            Some(p) => b.engine.get(&engine_key(p)).copied(),
        };
        let mut buf = Vec::with_capacity(size * 4);
        for (i, h) in e.block_hashes.iter().enumerate() {
            let key = engine_key(h);
            if let Some(&ours) = b.engine.get(&key) {
                if let Some(entry) = b.chain.get_mut(&ours) {
                    entry.copies[t] = entry.copies[t].saturating_add(1);
                    out.stored += 1;
                    prev = Some(ours);
                    continue;
                }
            }
            let (Some(parent), Some(tokens)) = (prev, tokens) else {
                out.untrusted += 1;
                prev = None;
                continue;
            };
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
            let ours = block_hash(&mut buf, parent, &tokens[i * size..(i + 1) * size], extra);
            b.engine.insert(key, ours);
            match b.chain.get_mut(&ours) {
                // Another of the replica's hashes for the same chain: an alias.
                Some(entry) => entry.copies[t] = entry.copies[t].saturating_add(1),
                None => {
                    let mut copies = [0; TIERS];
                    copies[t] = 1;
                    b.chain.put(
                        ours,
                        Entry {
                            engine: key,
                            copies,
                        },
                    );
                }
            }
            out.stored += 1;
            prev = Some(ours);
        }
        b.bound(self.max_blocks.load(std::sync::atomic::Ordering::Relaxed));
        out
    }

    /// A copy of blocks left a tier of the replica's cache; a block with no copy left in any
    /// tier is gone.
    pub fn removed(&self, e: &BlockRemoved) -> Applied {
        let mut out = Applied::default();
        if e.group_idx.is_some_and(|g| g != 0) {
            return out;
        }
        let t = tier(e.medium.as_ref());
        let mut b = self.lock();
        for h in &e.block_hashes {
            let key = engine_key(h);
            let Some(&ours) = b.engine.get(&key) else {
                continue;
            };
            let gone = match b.chain.peek_mut(&ours) {
                Some(entry) => {
                    entry.copies[t] = entry.copies[t].saturating_sub(1);
                    entry.copies.iter().all(|c| *c == 0)
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

    /// The longest prefix of `prompt` the replica holds, by tier. As vLLM looks a prompt up:
    /// on the GPU first, then (its offloading connector) the blocks after the GPU's run on the
    /// CPU or in storage, each block at the fastest tier holding it from there on.
    pub fn held(&self, prompt: &PromptTokens) -> Held {
        let Some(size) = self.lock().block_size else {
            return Held::default();
        };
        let chain = prompt.chain(size);
        let mut b = self.lock();
        let mut held = Held::default();
        let mut from = GPU;
        let t = u64::from(size);
        for h in chain.iter() {
            let Some(entry) = b.chain.get(h) else { break };
            let Some(tier) = (from..TIERS).find(|&i| entry.copies[i] > 0) else {
                break;
            };
            from = tier;
            match tier {
                GPU => held.gpu += t,
                CPU => held.cpu += t,
                _ => held.storage += t,
            }
        }
        held
    }

    /// It holds every block of `prompt`'s known ids (so a leading part cannot tell how much
    /// more of the prompt it holds).
    pub fn holds_all(&self, prompt: &PromptTokens) -> bool {
        let Some(size) = self.lock().block_size else {
            return false;
        };
        let most = prompt.coverable(size);
        most > 0 && self.held(prompt).tokens() >= most
    }

    /// The replica's hashes the index can name (bounded with the blocks).
    #[cfg(test)]
    fn names(&self) -> usize {
        self.lock().engine.len()
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

    /// A CPU copy as vLLM's offloading connector announces it: hashes alone, no parent, no
    /// tokens, the block size of its own (0 when unset).
    fn cpu_copy(hashes: &[u64], block_size: u32) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            block_size,
            medium: Some(Medium::Cpu),
            ..Default::default()
        }
    }

    fn prompt(n: u32) -> PromptTokens {
        PromptTokens::new((0..n).collect::<Vec<u32>>())
    }

    /// A leading part of a prompt (its first 12 of about 400 tokens): its blocks are all
    /// cacheable (no last token among them), it counts as the whole prompt's length, and a
    /// replica holding all of its blocks is told apart from one holding fewer.
    #[test]
    fn a_leading_part_is_held_all_or_in_part() {
        let part = PromptTokens::partial((0..12).collect::<Vec<u32>>(), 400);
        assert!(!part.is_whole());
        assert_eq!((part.len(), part.coverable(4)), (400, 12));
        assert_eq!(
            prompt(13).coverable(4),
            12,
            "the whole prompt's last token never is"
        );
        assert_eq!(
            PromptTokens::partial((0..8).collect::<Vec<u32>>(), 3).len(),
            8
        );
        let idx = BlockIndex::new(MIN_BLOCKS);
        assert!(
            !idx.holds_all(&part),
            "no events yet: no block size, nothing held"
        );
        let t: Vec<u32> = (0..8).collect();
        idx.stored(&stored(&[1, 2], None, &t, None));
        assert_eq!(idx.held(&part).tokens(), 8);
        assert!(!idx.holds_all(&part));
        idx.stored(&stored(&[3], Some(2), &[8, 9, 10, 11], None));
        assert!(idx.holds_all(&part));
        assert!(idx.holds_all(&prompt(13)));
        assert!(!idx.holds_all(&prompt(17)));
        assert!(!idx.holds_all(&PromptTokens::new(Vec::new())));
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
        let rows: Vec<(&str, Vec<Ev>, Held)> =
            vec![
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
                "offloaded to the CPU as vLLM's connector says it (no tokens, its own block \
                 size), then evicted from the GPU",
                vec![
                    S(stored(&[1, 2, 3, 4], None, &t, None)),
                    S(cpu_copy(&[1, 2], 0)),
                    S(cpu_copy(&[3], 16)),
                    R(removed(&[1, 2, 3, 4], Some(Medium::Gpu))),
                ],
                Held { cpu: 12, ..Held::default() },
            ),
            (
                "a CPU copy at another block size leaves the GPU's blocks alone",
                vec![
                    S(stored(&[1, 2, 3, 4], None, &t, None)),
                    S(cpu_copy(&[9], 16)),
                ],
                Held { gpu: 16, ..Held::default() },
            ),
            (
                "a CPU copy of a block never seen is not trusted",
                vec![S(cpu_copy(&[1, 2], 4))],
                Held::default(),
            ),
            (
                "after the GPU's run, the CPU's run: a block only on the GPU after it is not \
                 looked up there again",
                vec![
                    S(stored(&[1, 2, 3, 4], None, &t, None)),
                    S(cpu_copy(&[2], 0)),
                    R(removed(&[2], Some(Medium::Gpu))),
                ],
                Held { gpu: 4, cpu: 4, ..Held::default() },
            ),
            (
                "a block stored twice (two copies) and removed once is still held",
                vec![
                    S(stored(&[1, 2], None, &t[..8], None)),
                    S(stored(&[1, 2], None, &t[..8], None)),
                    R(removed(&[2], None)),
                    S(stored(&[3], Some(2), &t[8..12], None)),
                ],
                Held { gpu: 12, ..Held::default() },
            ),
            (
                "a salted block's CPU copy (no extra keys) is still the salted block",
                vec![
                    S(BlockStored {
                        extra_keys: Some(vec![Some(vec![rmpv::Value::from("salt")]), None]),
                        ..stored(&[1, 2], None, &t[..8], None)
                    }),
                    S(cpu_copy(&[1, 2], 4)),
                ],
                Held::default(),
            ),
            (
                "more token ids than its hashes' blocks (vLLM skipped null blocks): not trusted",
                vec![S(stored(&[1, 2], None, &t[..12], None))],
                Held::default(),
            ),
            (
                "an old vLLM's LoRA blocks (lora_id alone) are not the base model's",
                vec![S(BlockStored {
                    lora_id: Some(3),
                    ..stored(&[1, 2], None, &t[..8], None)
                })],
                Held::default(),
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
        assert_eq!(
            idx.names(),
            MIN_BLOCKS,
            "the replica's names go with their blocks"
        );
    }

    /// A chain named again under other hashes of the replica's (aliases), then forgotten
    /// past the bound: the names stay bounded, and a forgotten block's alias finds nothing.
    #[test]
    fn aliases_stay_bounded_and_never_name_another_block() {
        let idx = BlockIndex::new(0);
        let n = MIN_BLOCKS as u64;
        let tokens: Vec<u32> = (0..(n as u32) * 4).collect();
        let first: Vec<u64> = (1..=n).collect();
        let alias: Vec<u64> = (n + 1..=2 * n).collect();
        idx.stored(&stored(&first, None, &tokens, None));
        idx.stored(&stored(&alias, None, &tokens, None));
        assert_eq!(idx.size().0, MIN_BLOCKS);
        // New blocks push the old ones out; their names (both) go or lead nowhere.
        let other: Vec<u32> = tokens.iter().map(|t| t + 1).collect();
        let fresh: Vec<u64> = (2 * n + 1..=3 * n).collect();
        idx.stored(&stored(&fresh, None, &other, None));
        assert_eq!(idx.held(&PromptTokens::new(tokens.clone())).tokens(), 0);
        assert!(idx.names() <= 2 * MIN_BLOCKS, "{}", idx.names());
        assert_eq!(idx.removed(&removed(&[n + 1], None)).removed, 1);
        assert!(idx.held(&PromptTokens::new(other.clone())).tokens() > 0);
    }
}
