//! Arbitrary request bodies against arbitrary replica sets that change between requests:
//! routing always names an available replica, or says none is live.
#![no_main]

use std::collections::HashMap;

use std::sync::Arc;

use inferlb::conf::Mode;
use inferlb::routing::{Candidate, Router};
use inferlb::protocol::api::{classify, Family};
use libfuzzer_sys::fuzz_target;

const IDS: [&str; 5] = ["a", "b", "c", "d", "e"];

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else { return };
    let mode = [Mode::Adaptive, Mode::Affinity, Mode::RoundRobin, Mode::PrefillCost][head as usize % 4];
    let policy = Router::new(mode, (head & 8 != 0).then_some(1 + (head as usize >> 4)));
    let mut served: HashMap<u64, &str> = HashMap::new();
    let mut in_flight = [0usize; 5];
    // Each request: one byte of replica-set state, one of length, then the body.
    let mut input = rest;
    let mut tick = 0u64;
    while input.len() >= 2 {
        let (state, len) = (input[0], input[1] as usize);
        let body = &input[2..(2 + len).min(input.len())];
        input = &input[(2 + len).min(input.len())..];
        let count = 1 + (state as usize % 5);
        let candidates: Vec<Candidate> = IDS[..count]
            .iter()
            .enumerate()
            .map(|(i, id)| { let available = state & (1 << (i + 3)) != 0 || i == 4; Candidate { id, available, reachable: available, in_flight: in_flight[i], cached_tokens: (state as u64) << i, queued_tokens: in_flight[i] as u64 * 1000, running: in_flight[i], kv_tokens: 0, } })
            .collect();
        let info = classify(Family::Chat, body);
        let decision = policy.decide(&info.shape, None, &candidates, &|h| served.get(&h).map(|s| Arc::from(*s)), tick);
        tick += 1;
        match decision {
            Some(d) => {
                let i = IDS.iter().position(|id| *id == d.replica).expect("one of ours");
                assert!(candidates[i].available, "routed to an unavailable replica");
                in_flight[i] = (in_flight[i] + 1) % 7;
                if let Some(k) = info.shape.served_key() {
                    served.insert(k, IDS[i]);
                }
            }
            None => assert!(candidates.iter().all(|c| !c.available)),
        }
    }
});
