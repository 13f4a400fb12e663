//! The affinity table's memory at a million conversations, as the proxy holds it (mimalloc,
//! replica ids shared): the process's resident set before and after, from /proc/self/status.
//! Ignored by default (it fills a million entries); run it with
//! `cargo test --release --test affinity_memory -- --ignored --nocapture`.

use std::sync::Arc;

use inferlb::fleet::affinity::AffinityTable;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn rss_bytes() -> u64 {
    inferlb_harness::rss_bytes(std::process::id()).expect("VmRSS of this process")
}

#[test]
#[ignore = "fills a million entries: run with --ignored --release"]
fn a_million_conversations_in_bounded_memory() {
    let n = 1_000_000u64;
    let replicas: Vec<Arc<str>> = (0..16).map(|i| Arc::from(format!("gpu{i}"))).collect();
    let before = rss_bytes();
    let table = AffinityTable::new(n as usize, None);
    let empty = rss_bytes();
    for i in 0..n {
        let h = xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        table.record(h, &replicas[(i % 16) as usize]);
    }
    let full = rss_bytes();
    // Another million pushes the first out: the table stays bounded.
    for i in n..2 * n {
        let h = xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        table.record(h, &replicas[(i % 16) as usize]);
    }
    let churned = rss_bytes();
    let per_entry = (full - before) as f64 / table.len() as f64;
    println!(
        "affinity table: {} entries; RSS {:.1} MB before, {:.1} MB empty, {:.1} MB full, \
         {:.1} MB after another million; {per_entry:.1} bytes per entry",
        table.len(),
        before as f64 / 1e6,
        empty as f64 / 1e6,
        full as f64 / 1e6,
        churned as f64 / 1e6,
    );
    // Capacity is split evenly over the shards, so "a million" is rounded up a little.
    assert!(
        table.len() as u64 <= n + n / 1000,
        "bounded: {}",
        table.len()
    );
    assert!(full <= 150_000_000, "RSS {full} bytes at a million entries");
    assert!(
        churned <= full + full / 10,
        "RSS grew to {churned} under churn"
    );
}
