//! Any bytes: classifying never panics, and the JSON-end scanner agrees whatever the split.
#![no_main]

use inferlb::body::JsonEnd;
use inferlb::shape::{classify, Shape};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let info = classify(data);
    let _ = info.shape.affinity_key();
    if let Shape::Chat { prefixes } = &info.shape {
        assert!(!prefixes.is_empty());
        assert_eq!(info.shape.strict_prefixes().count(), prefixes.len() - 1);
    }
    let mut whole = JsonEnd::default();
    whole.feed(data);
    let split = data.first().map_or(0, |b| *b as usize) % (data.len() + 1);
    let mut parts = JsonEnd::default();
    parts.feed(&data[..split]);
    parts.feed(&data[split..]);
    assert_eq!(whole.complete(), parts.complete());
});
