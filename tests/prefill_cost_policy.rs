//! The `prefill_cost` policy replayed against real prefix indexes (the fleet's cache model,
//! a layer above routing, hence here and not beside the policy): bursts, agent loops, forks.
use std::collections::HashMap;

use std::sync::Arc;

use inferlb::conf::Mode;
use inferlb::fleet::replica::Pending;
use inferlb::protocol::api::{classify as classify_in, Family, RequestInfo};
use inferlb::routing::{Candidate, Route, Router};

/// A stand-in for the balancer under `prefill_cost`: each replica's prefix index and queued
/// prefill, updated as the balancer does after each decision.
struct CostBench {
    policy: Router,
    ids: Vec<String>,
    index: Vec<inferlb::fleet::index::PrefixIndex>,
    queued: Vec<u64>,
    running: Vec<usize>,
    served: HashMap<u64, String>,
    /// Prompts sent whose prefill is not over: recorded in the index at `drain`.
    prefilling: Vec<(usize, Vec<inferlb::protocol::api::prompt::Link>)>,
    /// The same prompts as each replica's pending list.
    pending: Vec<Pending>,
    tick: u64,
}

impl CostBench {
    fn new(n: usize) -> CostBench {
        CostBench {
            policy: Router::new(Mode::PrefillCost, None),
            ids: (0..n).map(|i| format!("gpu{i}")).collect(),
            index: (0..n)
                .map(|_| inferlb::fleet::index::PrefixIndex::new(2_000_000))
                .collect(),
            queued: vec![0; n],
            running: vec![0; n],
            served: HashMap::new(),
            prefilling: vec![],
            pending: (0..n).map(|_| Pending::default()).collect(),
            tick: 0,
        }
    }

    /// Routes a request that stays queued (no first byte yet); returns (replica, route).
    fn route(&mut self, body: &[u8]) -> (usize, Route) {
        let info = classify(body);
        let links = info.shape.links();
        let candidates: Vec<Candidate> = self
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| Candidate {
                id,
                available: true,
                reachable: true,
                in_flight: self.running[i],
                cached_tokens: self.index[i].cached_tokens(links),
                cached_exact: false,
                pending_tokens: self.pending[i].shared_tokens(links),
                queued_tokens: self.queued[i],
                running: 0,
                kv_tokens: 0,
            })
            .collect();
        let served = &self.served;
        let d = self
            .policy
            .decide(
                &info.shape,
                None,
                &candidates,
                &|h| served.get(&h).map(|s| Arc::from(s.as_str())),
                self.tick,
            )
            .expect("a replica");
        self.tick += 1;
        let i = self
            .ids
            .iter()
            .position(|id| id == d.replica)
            .expect("known");
        // Queued as a cold prefill, riding or not, as the balancer does.
        self.queued[i] += info.shape.prompt_tokens() - candidates[i].cached_tokens;
        self.pending[i].add(links);
        self.running[i] += 1;
        self.prefilling.push((i, links.to_vec()));
        if let Some(k) = info.shape.served_key() {
            self.served.insert(k, self.ids[i].clone());
        }
        (i, d.route)
    }

    /// Every request's prefill is done: each replica now holds what it was sent.
    fn drain(&mut self) {
        for (i, links) in self.prefilling.drain(..) {
            self.index[i].record(&links);
        }
        self.queued.iter_mut().for_each(|q| *q = 0);
        self.pending
            .iter_mut()
            .for_each(|p| *p = Pending::default());
        self.running.iter_mut().for_each(|r| *r = 0);
    }
}

/// About `tokens` tokens (4 bytes each) of text distinct per `seed`.
fn history(tokens: usize, seed: &str) -> String {
    let mut text = String::with_capacity(tokens * 4 + 16);
    let mut i = 0;
    while text.len() < tokens * 4 {
        text.push_str(&format!("{seed}{i} "));
        i += 1;
    }
    text.truncate(tokens * 4);
    text
}

#[test]
fn prefill_cost_splits_a_same_prefix_burst_evenly() {
    let mut b = CostBench::new(2);
    let mut count = [0; 2];
    for i in 0..16 {
        count[b.route(&chat(&[&format!("task {i}")])).0] += 1;
    }
    assert_eq!(count, [8, 8]);
}

#[test]
fn a_burst_sharing_a_long_prefix_spreads_while_the_first_prefill_runs() {
    // Sixteen sub-agents sharing a 90k-token prompt, all sent before any prefill is over:
    // no replica holds the prefix yet, so none is cheaper for it.
    let mut b = CostBench::new(2);
    let prefix = history(90_000, "shared");
    let mut count = [0; 2];
    for i in 0..16 {
        count[b.route(&chat(&[&prefix, &format!("subtask {i}")])).0] += 1;
    }
    assert_eq!(count, [8, 8]);
    // Once it is over, both hold it, and the next one goes to either, warm.
    b.drain();
    let (_, route) = b.route(&chat(&[&prefix, "subtask 16"]));
    assert_eq!(route, Route::Prefix);
}

#[test]
fn prefill_cost_keeps_an_agent_loop_home_while_home_is_not_much_busier() {
    let mut b = CostBench::new(2);
    let big = history(20_000, "ctx");
    let mut turns = vec![big.clone()];
    let (home, route) = b.route(&chat(&[&big]));
    assert_eq!(route, Route::Spread);
    b.drain();
    for t in 1..5 {
        turns.push(format!("answer {t}"));
        turns.push(format!("turn {t}"));
        let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
        // Home has some work queued, far less than re-reading 20k tokens elsewhere.
        b.queued[home] = 5_000;
        let (r, route) = b.route(&chat(&refs));
        assert_eq!((r, route), (home, Route::Pinned), "turn {t}");
        b.drain();
    }
    // Home is now buried under more queued prefill than a cold start elsewhere is worth.
    turns.push("answer x".into());
    turns.push("turn x".into());
    let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
    b.queued[home] = 100_000;
    let (r, route) = b.route(&chat(&refs));
    assert_eq!((r == home, route), (false, Route::Spilled));
}

#[test]
fn prefill_cost_sends_a_fork_home_when_idle_and_spreads_it_when_home_is_busy() {
    for (home_queue, expect_home) in [(0u64, 8usize), (400_000, 0)] {
        let mut b = CostBench::new(4);
        let long = history(60_000, "hist");
        let (home, _) = b.route(&chat(&[&long, "a0", "q0"]));
        b.drain();
        b.queued[home] = home_queue;
        let mut at_home = 0;
        for s in 0..8 {
            // Siblings: the same history, a different last question.
            let (r, route) = b.route(&chat(&[&long, "a0", &format!("sibling {s}")]));
            if r == home {
                at_home += 1;
                assert_ne!(route, Route::Spread);
            }
        }
        assert_eq!(at_home, expect_home, "home queue {home_queue}");
    }
}

fn classify(body: &[u8]) -> RequestInfo {
    classify_in(Family::Chat, body)
}

/// A chat body: a 4,000-byte system prompt, then `turns` alternating user and assistant.
fn chat(turns: &[&str]) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "S".repeat(4000)})];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": t}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
        .expect("test fixture")
}
