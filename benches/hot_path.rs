//! Micro-benchmarks of the request path's own work (`cargo bench --bench hot_path`): reading a
//! body into its prompt chain, for every API family and three sizes, and one routing decision
//! over 2, 16 and 128 replicas with a large prefix index.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use inferlb::api::{classify, Family};
use inferlb::index::PrefixIndex;
use inferlb::routing::{Candidate, Mode, Policy};
use serde_json::{json, Value};

/// Text of about `bytes` bytes in `n` pieces, with a few escapes as real prompts have.
fn pieces(bytes: usize, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let mut t = format!("piece {i}: \"quoted\"\n");
            while t.len() < bytes / n {
                t.push_str("the quick brown fox jumps over the lazy dog 0123456789 ");
            }
            t
        })
        .collect()
}

fn body(family: Family, bytes: usize) -> Vec<u8> {
    let n = (bytes / 2000).clamp(2, 400);
    let texts = pieces(bytes, n);
    let role = |i: usize| {
        if i.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        }
    };
    let v: Value = match family {
        Family::Chat => json!({"model": "m", "stream": true, "messages": texts.iter().enumerate()
            .map(|(i, t)| json!({"role": role(i), "content": t})).collect::<Vec<_>>()}),
        Family::Responses => json!({"model": "m", "instructions": "be brief", "input": texts.iter()
            .enumerate().map(|(i, t)| json!({"type": "message", "role": role(i),
                "content": [{"type": "input_text", "text": t}]})).collect::<Vec<_>>()}),
        Family::Messages => json!({"model": "m", "max_tokens": 10, "system": "be brief",
            "messages": texts.iter().enumerate().map(|(i, t)| json!({"role": role(i),
                "content": [{"type": "text", "text": t}]})).collect::<Vec<_>>()}),
        Family::Completions => json!({"model": "m", "prompt": texts.concat()}),
    };
    serde_json::to_vec(&v).expect("json")
}

fn classification(c: &mut Criterion) {
    let mut g = c.benchmark_group("classify");
    for family in [
        Family::Chat,
        Family::Responses,
        Family::Messages,
        Family::Completions,
    ] {
        for size in [4_000, 400_000, 4_000_000] {
            let b = body(family, size);
            g.throughput(Throughput::Bytes(b.len() as u64));
            let id = BenchmarkId::new(format!("{family:?}"), format!("{}KB", size / 1000));
            g.bench_with_input(id, &b, |bench, b| {
                bench.iter(|| classify(family, black_box(b)))
            });
        }
    }
    g.finish();
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    // A 100k-token agent prompt.
    let prompt = body(Family::Chat, 400_000);
    let info = classify(Family::Chat, &prompt);
    let links = info.shape.links().to_vec();
    for replicas in [2usize, 16, 128] {
        // 1M indexed chunks over the fleet, this prompt held by one replica.
        let per = 1_000_000 / replicas;
        let ids: Vec<String> = (0..replicas).map(|i| format!("gpu{i}")).collect();
        let index: Vec<PrefixIndex> = (0..replicas)
            .map(|r| {
                let idx = PrefixIndex::new(u64::MAX / 2);
                let filler: Vec<inferlb::api::prompt::Link> = (0..per as u64)
                    .map(|i| inferlb::api::prompt::Link {
                        hash: ((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ r as u64,
                        part_end: false,
                        bytes: (i % 400 + 1) * 1024,
                    })
                    .collect();
                filler.chunks(400).for_each(|p| idx.record(p));
                idx
            })
            .collect();
        index[replicas / 2].record(&links);
        for (mode, name) in [
            (Mode::PrefillCost, "prefill_cost"),
            (Mode::Adaptive, "adaptive"),
        ] {
            let policy = Policy {
                mode,
                spill_margin: Some(4),
            };
            g.bench_function(BenchmarkId::new(name, replicas), |bench| {
                bench.iter(|| {
                    let candidates: Vec<Candidate<usize>> = ids
                        .iter()
                        .enumerate()
                        .map(|(i, id)| Candidate {
                            handle: i,
                            id,
                            available: true,
                            reachable: true,
                            in_flight: i % 3,
                            cached_tokens: if mode == Mode::PrefillCost {
                                index[i].cached_tokens(&links)
                            } else {
                                0
                            },
                            queued_tokens: (i as u64 % 5) * 1000,
                            running: i % 4,
                        })
                        .collect();
                    policy.decide(&info.shape, None, &candidates, |_| None::<&str>, 7)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, classification, decision);
criterion_main!(benches);
