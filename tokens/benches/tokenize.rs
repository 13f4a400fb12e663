//! Chat bodies of 4 KB, 400 KB and 4 MB (an agent conversation of ~2 KB turns, ChatML with
//! tools) tokenized cold (a full render and tokenize) and warm (the conversation's previous
//! request is in the message cache, and the body adds one new turn). The tokenizer is a
//! byte-level BPE trained in setup (`fixture`). The allocator is the proxy's (mimalloc).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use inferlb_tokens::{fixture, ModelTokens};
use serde_json::{json, Value};
use std::cell::Cell;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORDS: &[&str] = &[
    "the",
    "replica",
    "cache",
    "prefix",
    "weather",
    "Paris",
    "request",
    "balancer",
    "token",
    "function",
    "returns",
    "{\"city\":",
    "\"unit\"}",
    "42",
    "because",
    "and",
    "of",
    "a",
    "\n",
];

fn prose(seed: usize, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut x = seed as u64 * 6364136223846793005 + 1442695040888963407;
    while s.len() < bytes {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(WORDS[(x >> 33) as usize % WORDS.len()]);
        s.push(' ');
    }
    s
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

/// The history (system, then user/assistant pairs) to about `bytes`, ending with a user turn.
fn history(bytes: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut size = 0;
    let mut i = 0;
    while size < bytes {
        let u = prose(i, 600);
        let a = prose(i + 1_000_000, 1_400);
        size += u.len() + a.len();
        m.push(json!({"role": "user", "content": u}));
        m.push(json!({"role": "assistant", "content": a}));
        i += 1;
    }
    m.pop();
    m
}

fn body(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"messages": messages, "tools": tools(), "add_generation_prompt": true}),
    )
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_dir(dir.path(), fixture::CHATML_TOOLS).unwrap();
    for (label, bytes) in [("4KB", 4_000), ("400KB", 400_000), ("4MB", 4_000_000)] {
        let model = ModelTokens::from_dir(dir.path()).unwrap();
        let prev = history(bytes);
        let prev_body = body(&prev);
        let mut g = c.benchmark_group(format!("chat_{label}"));
        if bytes >= 400_000 {
            g.sample_size(10);
        }
        let ids = model.chat_ids_uncached(&prev_body).unwrap().len();
        eprintln!("{label}: body {} bytes, {ids} ids", prev_body.len());
        g.bench_function("cold", |b| {
            b.iter(|| model.chat_ids_uncached(&prev_body).unwrap())
        });
        // The previous request seen once; each iteration then sends the answer and a new user
        // turn (new each time, so that it is never itself in the cache).
        model.chat_ids(&prev_body).unwrap();
        let answer = json!({"role": "assistant", "content": prose(7, 1_400)});
        let n = Cell::new(0usize);
        g.bench_function("warm_one_new_turn", |b| {
            b.iter_batched(
                || {
                    n.set(n.get() + 1);
                    let mut m = prev.clone();
                    m.push(answer.clone());
                    m.push(json!({"role": "user", "content": prose(n.get() + 5_000_000, 600)}));
                    body(&m)
                },
                |body| {
                    let resumed = model.resumed_bodies();
                    let t = model.chat_ids(&body).unwrap();
                    assert!(t.reused > 0);
                    // The history is not read again (a body this small may be).
                    assert!(bytes < 100_000 || model.resumed_bodies() > resumed);
                    t
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
