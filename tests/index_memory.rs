//! The prefix index's memory, measured with a counting allocator (this test binary's own, so
//! nothing else allocates meanwhile): bytes per indexed chunk, and per token of cache capacity.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use inferlb::fleet::index::{PrefixIndex, BYTES_PER_TOKEN};
use inferlb::protocol::api::prompt::{Link, CHUNK_BYTES};

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

#[test]
fn bytes_per_indexed_chunk_and_per_token_of_capacity() {
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
