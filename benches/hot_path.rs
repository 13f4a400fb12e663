//! Micro-benchmarks of the request path's own work (`cargo bench --bench hot_path`): reading a
//! body into its prompt chain, for every API family and three sizes; classify plus tokenize of
//! a chat body, cold and as a conversation's next turn (the tokenizer's message cache warm);
//! and one routing decision over 2, 16 and 128 replicas with a prefix index of 1M chunks and
//! four prompts pending on each, with its p50/p99 printed.

use std::cell::OnceCell;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use inferlb::conf::Mode;
use inferlb::fleet::index::PrefixIndex;
use inferlb::fleet::replica::Pending;
use inferlb::protocol::api::prompt::Link;
use inferlb::protocol::api::{classify, Family};
use inferlb::protocol::tokens::Tokenizers;
use inferlb::routing::{Candidate, Router};
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

/// This thread's CPU time so far (`/proc/thread-self/schedstat`), in ns: on a shared machine
/// the wall time of a call also counts the time other processes held the core. The kernel
/// brings it up to date at each tick, so it is read over rounds of about 100 ms.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Prints the CPU time per call of `f`, the median of 9 rounds of about 100 ms each.
fn cpu_per_call<T>(name: &str, mut f: impl FnMut() -> T) {
    let t = Instant::now();
    black_box(f());
    let calls = (100_000_000 / t.elapsed().as_nanos().max(1)).clamp(1, 1_000_000) as u64;
    let mut rounds: Vec<u64> = (0..9)
        .map(|_| {
            let start = cpu_ns();
            for _ in 0..calls {
                black_box(f());
            }
            (cpu_ns() - start) / calls
        })
        .collect();
    rounds.sort_unstable();
    println!(
        "{name}: {:.1} us CPU per call (median of 9 rounds of {calls})",
        rounds[4] as f64 / 1000.0
    );
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
            let mut measured = false;
            g.bench_with_input(id, &b, |bench, b| {
                if !std::mem::replace(&mut measured, true) {
                    cpu_per_call(&format!("classify/{family:?}/{}KB", size / 1000), || {
                        classify(family, black_box(b))
                    });
                }
                bench.iter(|| classify(family, black_box(b)))
            });
        }
    }
    g.finish();
}

/// Classify plus tokenize a chat body with a model's tokenizer (`inferlb_tokens`' trained
/// fixture, a ChatML template with tools), as admission does for KV-event routing: cold (a
/// conversation never seen), and warm (its previous request seen; each body adds the answer
/// and a new user turn).
fn classify_and_tokenize(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("dir");
    inferlb_tokens::fixture::write_dir(dir.path(), inferlb_tokens::fixture::CHATML_TOOLS)
        .expect("fixture");
    let dirs = std::collections::BTreeMap::from([("m".to_string(), dir.path().to_path_buf())]);
    let path = "/v1/chat/completions";
    let mut g = c.benchmark_group("classify_tokenize");
    for size in [4_000, 400_000, 4_000_000] {
        let label = format!("{}KB", size / 1000);
        if size >= 400_000 {
            g.sample_size(10);
        }
        let prev: Value = serde_json::from_slice(&body(Family::Chat, size)).expect("json");
        let prev_body = serde_json::to_vec(&prev).expect("json");
        let both = |t: &Tokenizers, b: &[u8]| {
            let info = classify(Family::Chat, black_box(b));
            let ids = t.ids(Family::Chat, path, "m", b, usize::MAX).expect("ids");
            (info, ids)
        };
        g.bench_function(BenchmarkId::new("cold", &label), |bench| {
            bench.iter_batched(
                || Tokenizers::load(&dirs).expect("load"),
                |t| both(&t, &prev_body),
                BatchSize::PerIteration,
            )
        });
        let t = Tokenizers::load(&dirs).expect("load");
        both(&t, &prev_body);
        let mut n = 0usize;
        g.bench_function(BenchmarkId::new("warm_one_new_turn", &label), |bench| {
            bench.iter_batched(
                || {
                    n += 1;
                    let mut next = prev.clone();
                    let messages = next["messages"].as_array_mut().expect("messages");
                    messages.push(json!({"role": "assistant", "content": pieces(1_400, 1)[0]}));
                    messages.push(json!({"role": "user", "content": format!("turn {n}: {}", pieces(600, 1)[0])}));
                    serde_json::to_vec(&next).expect("json")
                },
                |b| both(&t, &b),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

/// Per replica, 1M indexed chunks over the fleet, and `links` held by the middle replica; and
/// per replica four prompts pending, one of them sharing the first half of `links`.
fn fleet(replicas: usize, links: &[Link]) -> (Vec<PrefixIndex>, Vec<Pending>) {
    let per = 1_000_000 / replicas;
    let index: Vec<PrefixIndex> = (0..replicas)
        .map(|r| {
            let idx = PrefixIndex::new(u64::MAX / 2);
            let filler: Vec<Link> = (0..per as u64)
                .map(|i| Link {
                    hash: ((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ r as u64,
                    part_end: false,
                    bytes: (i % 400 + 1) * 1024,
                })
                .collect();
            for p in filler.chunks(400) {
                idx.record(p);
            }
            idx
        })
        .collect();
    index[replicas / 2].record(links);
    let pending = (0..replicas)
        .map(|r| {
            let p = Pending::default();
            p.add(&links[..links.len() / 2]);
            for k in 0..3u64 {
                let other: Vec<Link> = links
                    .iter()
                    .map(|l| Link {
                        hash: l.hash ^ (r as u64 * 4 + k + 1),
                        ..*l
                    })
                    .collect();
                p.add(&other);
            }
            p
        })
        .collect();
    (index, pending)
}

/// One routing decision, timed call by call (criterion's mean comes from the same calls), so
/// the tail is seen too: p50, p99 and the worst are printed after each case.
fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    // A 100k-token agent prompt.
    let prompt = body(Family::Chat, 400_000);
    let info = classify(Family::Chat, &prompt);
    let links = info.shape.links().to_vec();
    for replicas in [2usize, 16, 128] {
        // Built only when a case of this size runs (criterion filters by name).
        let index = OnceCell::new();
        let ids: Vec<String> = (0..replicas).map(|i| format!("gpu{i}")).collect();
        for (mode, name) in [
            (Mode::PrefillCost, "prefill_cost"),
            (Mode::Adaptive, "adaptive"),
        ] {
            let policy = Router::new(mode, Some(4));
            let mut each: Vec<Duration> = Vec::new();
            g.bench_function(BenchmarkId::new(name, replicas), |bench| {
                let (index, pending) = index.get_or_init(|| fleet(replicas, &links));
                let decide = || {
                    let candidates: Vec<Candidate> = ids
                        .iter()
                        .enumerate()
                        .map(|(i, id)| Candidate {
                            id,
                            available: true,
                            reachable: true,
                            in_flight: i % 3,
                            cached_tokens: if mode == Mode::PrefillCost {
                                index[i].cached_tokens(&links)
                            } else {
                                0
                            },
                            cached_exact: false,
                            pending_tokens: if mode == Mode::PrefillCost {
                                pending[i].shared_tokens(&links)
                            } else {
                                0
                            },
                            queued_tokens: (i as u64 % 5) * 1000,
                            running: i % 4,
                            kv_tokens: 0,
                        })
                        .collect();
                    policy
                        .decide(&info.shape, None, &candidates, &|_| None, 7)
                        .map(|d| d.route)
                };
                bench.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        black_box(decide());
                        let d = t.elapsed();
                        total += d;
                        each.push(d);
                    }
                    total
                })
            });
            if !each.is_empty() {
                each.sort_unstable();
                let at = |q: f64| each[((each.len() - 1) as f64 * q) as usize];
                println!(
                    "decide/{name}/{replicas}: p50 {:?} p99 {:?} max {:?} ({} calls, 1M chunks indexed)",
                    at(0.5),
                    at(0.99),
                    each[each.len() - 1],
                    each.len()
                );
            }
        }
    }
    g.finish();
}

criterion_group!(benches, classification, classify_and_tokenize, decision);
criterion_main!(benches);
