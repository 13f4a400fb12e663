//! Any `/metrics` page a replica could serve: reading it never panics, its counts stay in
//! bounds, and the load and cost computed from them never overflow (the fuzz profile builds
//! with overflow checks on).
#![no_main]

use std::sync::LazyLock;

use inferlb::fleet::poll::{parse, MAX_CACHE_TOKENS, MAX_REQUESTS};
use inferlb::fleet::registry::Registry;
use inferlb::routing::{cost::cost, Candidate};
use libfuzzer_sys::fuzz_target;

static FLEET: LazyLock<Registry> = LazyLock::new(|| {
    let conf = inferlb::conf::parse(
        "inferlb:\n  replicas:\n    - {id: a, address: \"127.0.0.1:1\"}\n",
        None,
    )
    .expect("conf");
    Registry::new(&conf.inferlb.replicas, &conf.inferlb.upstream)
});

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes: a request's uncached tokens; the rest: the page.
    let (head, page) = data.split_at(data.len().min(8));
    let mut n = [0u8; 8];
    n[..head.len()].copy_from_slice(head);
    let uncached = u64::from_le_bytes(n);
    let Some(r) = parse(&String::from_utf8_lossy(page)) else {
        return;
    };
    assert!(r.waiting <= MAX_REQUESTS && r.running <= MAX_REQUESTS, "{r:?}");
    assert!(r.cache_tokens.is_none_or(|t| t <= MAX_CACHE_TOKENS), "{r:?}");
    let fleet = FLEET.all();
    let replica = &fleet[0];
    replica.set_reported_load(Some((r.waiting, r.running)));
    let queued = replica.queue_prefill(uncached);
    let candidate = Candidate {
        handle: (),
        id: "a",
        available: true,
        reachable: true,
        in_flight: replica.in_flight_everywhere(),
        cached_tokens: 0,
        queued_tokens: replica.queued_tokens(),
        running: replica.running(),
        kv_tokens: 0,
    };
    let _ = cost(&candidate, uncached, uncached / 2);
    drop(queued);
});
