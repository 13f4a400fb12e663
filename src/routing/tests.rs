//! Table and property tests of the policies, replayed on a stand-in for the balancer's state.

use super::*;
use crate::api::{classify as classify_in, Family};

fn classify(body: &[u8]) -> crate::api::RequestInfo {
    classify_in(Family::Chat, body)
}
use proptest::prelude::*;
use std::collections::HashMap;

/// A test stand-in for the balancer's state: replicas, in-flight counts, the served table.
struct Bench {
    policy: Policy,
    ids: Vec<String>,
    down: Vec<String>,
    in_flight: HashMap<String, usize>,
    served: HashMap<u64, String>,
    tick: u64,
    /// The session key the next requests carry.
    session: Option<u64>,
}

impl Bench {
    fn new(mode: Mode, ids: &[&str]) -> Self {
        Bench {
            policy: Policy {
                mode,
                spill_margin: None,
            },
            ids: ids.iter().map(|s| s.to_string()).collect(),
            down: vec![],
            in_flight: HashMap::new(),
            served: HashMap::new(),
            tick: 0,
            session: None,
        }
    }

    /// Decides, then does what the caller does: count in flight, record what was served.
    fn route(&mut self, body: &[u8]) -> Option<(String, Route)> {
        let info = classify(body);
        let candidates: Vec<Candidate<&str>> = self
            .ids
            .iter()
            .map(|id| Candidate {
                handle: id.as_str(),
                id,
                available: !self.down.contains(id),
                reachable: !self.down.contains(id),
                in_flight: *self.in_flight.get(id).unwrap_or(&0),
                cached_tokens: 0,
                queued_tokens: 0,
                running: 0,
            })
            .collect();
        let served = &self.served;
        let d = self.policy.decide(
            &info.shape,
            self.session,
            &candidates,
            |h| served.get(&h).map(|s| s.as_str()),
            self.tick,
        )?;
        let (replica, route) = (d.replica.to_string(), d.route);
        self.tick += 1;
        *self.in_flight.entry(replica.clone()).or_default() += 1;
        for k in info.shape.served_key().into_iter().chain(self.session) {
            self.served.insert(k, replica.clone());
        }
        Some((replica, route))
    }

    fn finish_all(&mut self) {
        self.in_flight.clear();
    }
}

fn chat(turns: &[&str]) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "S".repeat(4000)})];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": t}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
        .expect("test fixture")
}

#[test]
fn a_same_prefix_burst_of_16_splits_8_8() {
    for mode in [Mode::Adaptive, Mode::RoundRobin] {
        let mut b = Bench::new(mode, &["gpu0", "gpu1"]);
        let mut count: HashMap<String, usize> = HashMap::new();
        for i in 0..16 {
            let (r, _) = b
                .route(&chat(&[&format!("task {i}")]))
                .expect("test fixture");
            *count.entry(r).or_default() += 1;
        }
        assert_eq!(count["gpu0"], 8, "{mode:?}");
        assert_eq!(count["gpu1"], 8, "{mode:?}");
    }
}

#[test]
fn affinity_piles_a_same_prefix_burst_onto_one_card() {
    // The seed's measured failure, kept so it can be re-measured.
    let mut b = Bench::new(Mode::Affinity, &["gpu0", "gpu1"]);
    let picks: Vec<String> = (0..16)
        .map(|i| {
            b.route(&chat(&[&format!("task {i}")]))
                .expect("test fixture")
                .0
        })
        .collect();
    assert!(picks.iter().all(|p| p == &picks[0]));
}

#[test]
fn an_agent_loop_stays_on_the_replica_that_served_its_first_turn() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0", "gpu1"]);
    let mut history = vec!["turn 0".to_string()];
    let (first, route) = b.route(&chat(&["turn 0"])).expect("test fixture");
    assert_eq!(route, Route::Spread);
    for turn in 1..5 {
        history.push(format!("answer {turn}"));
        history.push(format!("turn {turn}"));
        // Unrelated fresh traffic in between must not move the loop.
        b.route(&chat(&[&format!("noise {turn}")]))
            .expect("test fixture");
        let refs: Vec<&str> = history.iter().map(|s| s.as_str()).collect();
        let (r, route) = b.route(&chat(&refs)).expect("test fixture");
        assert_eq!(
            (r.as_str(), route),
            (first.as_str(), Route::Pinned),
            "turn {turn}"
        );
    }
}

#[test]
fn an_exact_repeat_and_a_single_message_spread() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0", "gpu1"]);
    let body = chat(&["q"]);
    let (a, _) = b.route(&body).expect("test fixture");
    let (again, route) = b.route(&body).expect("test fixture");
    assert_eq!(route, Route::Spread);
    assert_ne!(a, again, "a repeat is fresh work, so it spreads");
    let (_, route) = b
        .route(br#"{"prompt":"a completion"}"#)
        .expect("test fixture");
    assert_eq!(route, Route::Spread);
    let (_, route) = b.route(b"\x00 not json").expect("test fixture");
    assert_eq!(route, Route::Spread);
}

#[test]
fn continuations_follow_their_replica_out_and_back_in() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0", "gpu1", "gpu2"]);
    let mut history = vec!["t0".to_string()];
    let (home, _) = b.route(&chat(&["t0"])).expect("test fixture");
    for turn in 1..12 {
        // Every third turn the current home leaves; two turns later it comes back.
        if turn % 3 == 0 {
            b.down = vec![home.clone()];
        }
        if turn % 3 == 2 {
            b.down.clear();
        }
        history.push(format!("a{turn}"));
        history.push(format!("t{turn}"));
        let refs: Vec<&str> = history.iter().map(|s| s.as_str()).collect();
        let before = b.served.clone();
        let (r, route) = b.route(&chat(&refs)).expect("test fixture");
        assert!(
            !b.down.contains(&r),
            "turn {turn}: routed to a down replica"
        );
        let expected_home = chat_home(&before, &refs);
        if b.down.contains(&expected_home) {
            assert_eq!(route, Route::Repinned, "turn {turn}");
        } else {
            assert_eq!(
                (r.clone(), route),
                (expected_home, Route::Pinned),
                "turn {turn}"
            );
        }
        b.finish_all();
    }
}

/// The replica that served the previous turn of this conversation.
fn chat_home(served: &HashMap<u64, String>, refs: &[&str]) -> String {
    let info = classify(&chat(refs));
    let home = info
        .shape
        .strict_prefixes()
        .find_map(|h| served.get(&h).cloned());
    home.expect("a continuation has a served prefix")
}

#[test]
fn ids_not_positions_name_replicas() {
    // The seed's stale-index bug: a replica list that changes order must not move a pin.
    let mut b = Bench::new(Mode::Adaptive, &["a", "b", "c"]);
    let (home, _) = b.route(&chat(&["t0"])).expect("test fixture");
    b.ids.reverse();
    b.ids.retain(|id| id != "x");
    let (r, route) = b.route(&chat(&["t0", "a1", "t1"])).expect("test fixture");
    assert_eq!((r, route), (home, Route::Pinned));
}

#[test]
fn a_hot_replica_spills_a_continuation_when_far_busier() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0", "gpu1"]);
    b.policy.spill_margin = Some(3);
    let (home, _) = b.route(&chat(&["t0"])).expect("test fixture");
    b.finish_all();
    b.in_flight.insert(home.clone(), 2);
    let (r, route) = b.route(&chat(&["t0", "a", "t1"])).expect("test fixture");
    assert_eq!((r.as_str(), route), (home.as_str(), Route::Pinned));
    b.in_flight.insert(home.clone(), 3);
    let (r, route) = b
        .route(&chat(&["t0", "a", "t1", "b", "t2"]))
        .expect("test fixture");
    assert_eq!(route, Route::Spilled);
    assert_ne!(r, home);
    // The table followed: the next turn is pinned to the new home.
    b.finish_all();
    let (r2, route) = b
        .route(&chat(&["t0", "a", "t1", "b", "t2", "c", "t3"]))
        .expect("test fixture");
    assert_eq!((r2, route), (r, Route::Pinned));
}

#[test]
fn none_live_is_none() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0"]);
    b.down = vec!["gpu0".into()];
    assert_eq!(b.route(&chat(&["x"])), None);
    let mut b = Bench::new(Mode::Adaptive, &[]);
    assert_eq!(b.route(&chat(&["x"])), None);
}

#[test]
fn affinity_keeps_keys_in_place_when_another_replica_leaves() {
    let mut b = Bench::new(Mode::Affinity, &["a", "b", "c"]);
    let bodies: Vec<Vec<u8>> = (0..30)
        .map(|i| br#"{"prompt":"P"#.iter().chain(i.to_string().as_bytes()).copied().chain(*br#""}"#).collect())
        .collect();
    let before: Vec<String> = bodies
        .iter()
        .map(|x| b.route(x).expect("test fixture").0)
        .collect();
    b.down = vec!["c".into()];
    for (x, was) in bodies.iter().zip(&before) {
        let now = b.route(x).expect("test fixture").0;
        if was != "c" {
            assert_eq!(&now, was);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// Arbitrary bodies and arbitrary replica-set changes: never a panic, always a live
    /// replica or a clear "none live".
    #[test]
    fn routing_returns_a_live_replica_or_none(
        ops in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..64), 0u8..8), 1..60),
        mode in prop_oneof![Just(Mode::Adaptive), Just(Mode::Affinity), Just(Mode::RoundRobin)],
    ) {
        let mut b = Bench::new(mode, &["r0", "r1", "r2", "r3"]);
        b.policy.spill_margin = Some(2);
        let mut history: Vec<String> = vec![];
        for (flags, bytes, kind) in ops {
            b.down = b.ids.iter().enumerate().filter(|(i, _)| flags & (1 << i) != 0).map(|(_, id)| id.clone()).collect();
            let body = match kind {
                0..=3 => { history.push(String::from_utf8_lossy(&bytes).into_owned()); let r: Vec<&str> = history.iter().map(|s| s.as_str()).collect(); chat(&r) }
                4 => { history.clear(); chat(&["fresh"]) }
                _ => bytes,
            };
            match b.route(&body) {
                Some((r, _)) => prop_assert!(!b.down.contains(&r) && b.ids.contains(&r)),
                None => prop_assert_eq!(b.down.len(), b.ids.len()),
            }
            if flags & 0x80 != 0 { b.finish_all(); }
        }
    }

}

#[test]
fn a_session_key_pins_unrelated_prompts_to_its_first_replica() {
    let mut b = Bench::new(Mode::Adaptive, &["gpu0", "gpu1", "gpu2"]);
    b.session = Some(42);
    let (home, route) = b.route(&chat(&["first"])).expect("routed");
    assert_eq!(route, Route::Spread);
    for i in 0..5 {
        // Fresh prompts that share nothing: the session alone names the home.
        let (r, route) = b.route(&chat(&[&format!("other {i}")])).expect("routed");
        assert_eq!(
            (r.as_str(), route),
            (home.as_str(), Route::Pinned),
            "request {i}"
        );
    }
    // Its home goes down: it moves, and the pin follows.
    b.down = vec![home.clone()];
    let (moved, route) = b.route(&chat(&["again"])).expect("routed");
    assert_eq!(route, Route::Repinned);
    b.down.clear();
    let (r, route) = b.route(&chat(&["and again"])).expect("routed");
    assert_eq!((r, route), (moved, Route::Pinned));
    // Without the key, content decides again.
    b.session = None;
    assert_eq!(b.route(&chat(&["new"])).expect("routed").1, Route::Spread);
}

#[test]
fn a_stored_response_goes_to_its_owner_drained_or_not_and_nowhere_else() {
    let c = |id: &'static str, available: bool, reachable: bool| Candidate {
        handle: id,
        id,
        available,
        reachable,
        in_flight: 0,
        cached_tokens: 0,
        queued_tokens: 0,
        running: 0,
    };
    let fleet = [
        c("a", true, true),
        c("b", false, true),
        c("c", false, false),
    ];
    assert_eq!(
        stored("a", &fleet).map(|d| (d.replica, d.route)),
        Some(("a", Route::Stored))
    );
    assert_eq!(
        stored("b", &fleet).map(|d| d.replica),
        Some("b"),
        "a drained owner still serves it"
    );
    assert_eq!(
        stored("c", &fleet),
        None,
        "down or already tried: no other replica has it"
    );
    assert_eq!(stored("z", &fleet), None);
}

/// A stand-in for the balancer under `prefill_cost`: each replica's prefix index and queued
/// prefill, updated as the balancer does after each decision.
struct CostBench {
    policy: Policy,
    ids: Vec<String>,
    index: Vec<crate::index::PrefixIndex>,
    queued: Vec<u64>,
    running: Vec<usize>,
    served: HashMap<u64, String>,
    tick: u64,
}

impl CostBench {
    fn new(n: usize) -> CostBench {
        CostBench {
            policy: Policy {
                mode: Mode::PrefillCost,
                spill_margin: None,
            },
            ids: (0..n).map(|i| format!("gpu{i}")).collect(),
            index: (0..n)
                .map(|_| crate::index::PrefixIndex::new(2_000_000))
                .collect(),
            queued: vec![0; n],
            running: vec![0; n],
            served: HashMap::new(),
            tick: 0,
        }
    }

    /// Routes a request that stays queued (no first byte yet); returns (replica, route).
    fn route(&mut self, body: &[u8]) -> (usize, Route) {
        let info = classify(body);
        let links = info.shape.links();
        let candidates: Vec<Candidate<usize>> = self
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| Candidate {
                handle: i,
                id,
                available: true,
                reachable: true,
                in_flight: self.running[i],
                cached_tokens: self.index[i].cached_tokens(links),
                queued_tokens: self.queued[i],
                running: 0,
            })
            .collect();
        let served = &self.served;
        let d = self
            .policy
            .decide(
                &info.shape,
                None,
                &candidates,
                |h| served.get(&h).cloned(),
                self.tick,
            )
            .expect("a replica");
        self.tick += 1;
        let i = d.replica;
        self.queued[i] += info.shape.prompt_tokens() - candidates[i].cached_tokens;
        self.running[i] += 1;
        self.index[i].record(links);
        if let Some(k) = info.shape.served_key() {
            self.served.insert(k, self.ids[i].clone());
        }
        (i, d.route)
    }

    /// Every request's prefill is done.
    fn drain(&mut self) {
        self.queued.iter_mut().for_each(|q| *q = 0);
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
    // Home is now buried under more queued prefill than a cold start elsewhere costs.
    turns.push("answer x".into());
    turns.push("turn x".into());
    let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
    b.queued[home] = 60_000;
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
