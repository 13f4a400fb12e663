//! Table and property tests of the policies, replayed on a stand-in for the balancer's state.

use super::*;
use crate::protocol::api::{classify as classify_in, Family};

pub(super) fn classify(body: &[u8]) -> crate::protocol::api::RequestInfo {
    classify_in(Family::Chat, body)
}
use proptest::prelude::*;
use std::collections::HashMap;

/// A test stand-in for the balancer's state: replicas, in-flight counts, the served table.
struct Bench {
    mode: Mode,
    spill_margin: Option<usize>,
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
            mode,
            spill_margin: None,
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
        let candidates: Vec<Candidate> = self
            .ids
            .iter()
            .map(|id| Candidate {
                id,
                available: !self.down.contains(id),
                reachable: !self.down.contains(id),
                in_flight: *self.in_flight.get(id).unwrap_or(&0),
                cached_tokens: 0,
                cached_exact: false,
                pending_tokens: 0,
                queued_tokens: 0,
                running: 0,
                kv_tokens: 0,
            })
            .collect();
        let served = &self.served;
        let served_by = |h| served.get(&h).map(|s| Arc::from(s.as_str()));
        let d = Router::new(self.mode, self.spill_margin).decide(
            &info.shape,
            self.session,
            &candidates,
            &served_by,
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

pub(super) fn chat(turns: &[&str]) -> Vec<u8> {
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
    b.spill_margin = Some(3);
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
        b.spill_margin = Some(2);
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
        id,
        available,
        reachable,
        in_flight: 0,
        cached_tokens: 0,
        cached_exact: false,
        pending_tokens: 0,
        queued_tokens: 0,
        running: 0,
        kv_tokens: 0,
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
