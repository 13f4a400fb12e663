//! The indexes' memory, measured with a counting allocator (this test binary's own; the tests
//! take turns, so nothing else allocates meanwhile): the prefix index's bytes per indexed chunk
//! and per token of cache capacity, and the KV-events index's bytes per block.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use inferlb::fleet::blocks::BlockIndex;
use inferlb::fleet::index::{PrefixIndex, BYTES_PER_TOKEN};
use inferlb::protocol::api::prompt::{Link, CHUNK_BYTES};
use inferlb_kvevents::{BlockHash, BlockStored, Medium};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time: the count is the whole binary's.
static TURN: Mutex<()> = Mutex::new(());

#[test]
fn bytes_per_indexed_chunk_and_per_token_of_capacity() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let chunks = 1_000_000u64;
    let tokens_per_chunk = CHUNK_BYTES as u64 / BYTES_PER_TOKEN;
    // One replica holding a million chunks: 256M tokens of cache, far above any card's.
    // Prompts of 400 chunks (about 100k tokens) each, all different.
    let links: Vec<Link> = (0..chunks)
        .map(|i| Link {
            hash: (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            part_end: false,
            bytes: (i % 400 + 1) * CHUNK_BYTES as u64,
        })
        .collect();
    let before = LIVE.load(Ordering::Relaxed);
    let index = PrefixIndex::new(chunks * tokens_per_chunk);
    for prompt in links.chunks(400) {
        index.record(prompt);
    }
    let used = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let (held, _) = index.size();
    assert_eq!(held as u64, chunks);
    let per_chunk = used / chunks as f64;
    let per_token = per_chunk / tokens_per_chunk as f64;
    println!(
        "prefix index: {per_chunk:.1} bytes per indexed chunk ({CHUNK_BYTES} bytes, \
         {tokens_per_chunk} tokens), {per_token:.3} bytes per token of cache capacity"
    );
    // A bound that catches a change of data structure, not noise: the count is exact.
    assert!(per_chunk < 96.0, "{per_chunk} bytes per chunk");
}

/// The KV-events index (`fleet::blocks`): a million 16-token blocks stored as vLLM announces
/// them (chains of 400 blocks, a prompt of 6,400 tokens each, int hashes, on the GPU), with the
/// replica's hash kept beside each block so that removals find it.
#[test]
fn bytes_per_block_of_the_events_index() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    const BLOCKS: u64 = 1_000_000;
    const CHAIN: u64 = 400;
    const SIZE: u32 = 16;
    let before = LIVE.load(Ordering::Relaxed);
    let index = BlockIndex::new(BLOCKS as usize);
    let mut token_ids = Vec::with_capacity((CHAIN * SIZE as u64) as usize);
    for prompt in 0..BLOCKS / CHAIN {
        token_ids.clear();
        token_ids.extend((0..CHAIN * SIZE as u64).map(|t| (prompt * 7919 + t) as u32));
        let e = BlockStored {
            block_hashes: (0..CHAIN)
                .map(|b| {
                    BlockHash::Int((prompt * CHAIN + b + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                })
                .collect(),
            parent_block_hash: None,
            token_ids: token_ids.clone(),
            block_size: SIZE,
            medium: Some(Medium::Gpu),
            ..BlockStored::default()
        };
        let applied = index.stored(&e);
        assert_eq!(applied.stored, CHAIN, "prompt {prompt}");
    }
    let (held, _) = index.size();
    assert_eq!(held as u64, BLOCKS);
    // The token buffer is the test's, not the index's (each event was dropped in its turn).
    drop(token_ids);
    let used = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let per_block = used / BLOCKS as f64;
    println!(
        "KV-events index: {per_block:.1} bytes per block ({SIZE} tokens): {:.1} MB for a \
         500k-token cache's {} blocks",
        per_block * 500_000.0 / SIZE as f64 / 1e6,
        500_000 / SIZE
    );
    // A bound that catches a change of data structure, not noise: the count is exact.
    assert!(per_block < 160.0, "{per_block} bytes per block");
}
