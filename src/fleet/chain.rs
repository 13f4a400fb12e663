//! A prompt's token ids and the chain hashes of its blocks: block `i` hashes its `block_size`
//! tokens with block `i - 1`'s hash, so a replica's held blocks of a prompt are a leading run,
//! and a request's token ids give the same names its KV events gave ([`super::blocks`]).

use std::sync::Mutex;

use inferlb_tokens::TokenIds;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The chain's seed before a prompt's first block.
pub(super) const ROOT: u64 = 0x6b76_5f63_6861_696e;

/// A prompt's token ids, with its chain hashes per block size computed once for every replica
/// that is asked about it. The ids may be a leading part of the prompt's ([`Self::partial`]):
/// enough when no replica holds all of that part.
#[derive(Debug)]
pub struct PromptTokens {
    /// In the tokenizer's segments (shared with its message cache), not copied.
    ids: TokenIds,
    /// The whole prompt's tokens: `ids.len()`, or more for a leading part.
    total: usize,
    chains: Mutex<Vec<(u32, std::sync::Arc<Vec<u64>>)>>,
}

impl PromptTokens {
    pub fn new(ids: impl Into<TokenIds>) -> PromptTokens {
        PromptTokens::partial(ids, 0)
    }

    /// The first ids of a prompt of `total` tokens.
    pub fn partial(ids: impl Into<TokenIds>, total: usize) -> PromptTokens {
        let ids = ids.into();
        PromptTokens {
            total: total.max(ids.len()),
            ids,
            chains: Mutex::new(Vec::new()),
        }
    }

    /// The whole prompt's tokens (estimated from the part known, for a leading part).
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The ids known are all the prompt's.
    pub fn is_whole(&self) -> bool {
        self.ids.len() >= self.total
    }

    /// Tokens of the known ids a replica of `block_size` could hold at most: their whole
    /// blocks before the prompt's last token.
    pub fn coverable(&self, block_size: u32) -> u64 {
        let size = u64::from(block_size.max(1));
        let usable = match self.is_whole() {
            true => self.ids.len().saturating_sub(1),
            false => self.ids.len(),
        };
        usable as u64 / size * size
    }

    /// The chain hashes of the blocks a replica of `block_size` could have cached for this
    /// prompt: the whole blocks before its last token (vLLM always computes the last one).
    pub(super) fn chain(&self, block_size: u32) -> std::sync::Arc<Vec<u64>> {
        let mut memo = self.chains.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, c)) = memo.iter().find(|(b, _)| *b == block_size) {
            return c.clone();
        }
        let usable = self.coverable(1) as usize;
        let chain = std::sync::Arc::new(chain_hashes(ROOT, &self.ids, usable, block_size));
        memo.push((block_size, chain.clone()));
        chain
    }
}

/// The chain hashes of the whole blocks of `block_size` among the first `usable` of `ids`,
/// from `parent`, read segment by segment (a block across two segments is put together).
fn chain_hashes(parent: u64, ids: &TokenIds, usable: usize, block_size: u32) -> Vec<u64> {
    let size = block_size.max(1) as usize;
    let mut prev = parent;
    let mut buf = Vec::with_capacity(size * 4);
    let mut carry: Vec<u32> = Vec::with_capacity(size);
    let mut out = Vec::with_capacity(usable / size);
    let mut left = usable;
    for segment in ids.segments() {
        let mut s = &segment[..segment.len().min(left)];
        left -= s.len();
        if !carry.is_empty() {
            let take = (size - carry.len()).min(s.len());
            carry.extend_from_slice(&s[..take]);
            s = &s[take..];
            if carry.len() == size {
                prev = block_hash(&mut buf, prev, &carry, 0);
                out.push(prev);
                carry.clear();
            }
        }
        let mut blocks = s.chunks_exact(size);
        for block in &mut blocks {
            prev = block_hash(&mut buf, prev, block, 0);
            out.push(prev);
        }
        carry.extend_from_slice(blocks.remainder());
        if left == 0 {
            break;
        }
    }
    out
}

/// One block's chain hash: its tokens, its parent's hash, and what else the replica's hash
/// covers (`extra`, 0 for none: multimodal inputs, a cache salt). `buf` is scratch space.
pub(super) fn block_hash(buf: &mut Vec<u8>, parent: u64, tokens: &[u32], extra: u64) -> u64 {
    buf.clear();
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, parent ^ extra.rotate_left(17))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt's chain is the same however its ids are segmented.
    #[test]
    fn the_chain_is_the_same_over_any_segments() {
        let flat: Vec<u32> = (0..103).collect();
        let whole = chain_hashes(ROOT, &TokenIds::from(flat.clone()), 100, 16);
        assert_eq!(whole.len(), 6);
        for cuts in [
            vec![1],
            vec![15, 16, 17],
            vec![7, 30, 31, 32, 99],
            vec![0, 0, 50],
        ] {
            let mut segments = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([flat.len()]) {
                segments.push(std::sync::Arc::from(&flat[at..c]));
                at = c;
            }
            let ids = TokenIds::from_segments(segments);
            assert_eq!(chain_hashes(ROOT, &ids, 100, 16), whole);
            assert_eq!(chain_hashes(ROOT, &ids, 103, 4).len(), 25);
        }
    }
}
