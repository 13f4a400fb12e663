//! Any bytes: classifying never panics, and the JSON-end scanner agrees whatever the split.
#![no_main]

use inferlb::protocol::body::JsonEnd;
use inferlb::protocol::api::{classify, Family};
use inferlb::protocol::api::shape::Shape;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let family = [Family::Chat, Family::Completions, Family::Responses, Family::Messages]
        [data.first().map_or(0, |b| *b as usize) % 4];
    let info = classify(family, data);
    let _ = info.shape.affinity_key();
    if let Shape::Prompt { links } = &info.shape {
        assert!(links.last().is_some_and(|l| l.part_end));
        let parts = info.shape.part_ends().count();
        assert_eq!(info.shape.strict_prefixes().count(), parts - 1);
    }
    let mut whole = JsonEnd::default();
    whole.feed(data);
    let split = data.first().map_or(0, |b| *b as usize) % (data.len() + 1);
    let mut parts = JsonEnd::default();
    parts.feed(&data[..split]);
    parts.feed(&data[split..]);
    assert_eq!(whole.complete(), parts.complete());
});
