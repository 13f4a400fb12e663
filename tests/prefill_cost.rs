//! `prefill_cost` routing against real simulated replicas: a same-prefix burst still splits,
//! an agent loop stays on its warm replica, a fork of a long history goes home while home is
//! idle, a follower rides on the prefill of the prefix it shares, and each replica's cache
//! size is learnt from its `/metrics`, as is a restart between two health checks.

mod common;

use std::collections::HashMap;

use common::*;

fn conf() -> LbConf {
    LbConf {
        routing: Some("prefill_cost".into()),
        ..test_conf()
    }
}
#[test]
fn a_same_prefix_burst_splits_and_an_agent_loop_stays_home() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Slow enough that the burst's prefills overlap.
    let (_a, _b, lb) = cluster(dir.path(), &["--speed", "2"], conf());
    let system = text_of("shared system prompt", 4000);
    let port = lb.port;
    let burst: Vec<_> = (0..16)
        .map(|i| {
            let system = system.clone();
            std::thread::spawn(move || {
                let body = chat_body(
                    &[("system", &system), ("user", &format!("task {i}"))],
                    false,
                    2,
                );
                let r = http()
                    .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .expect("send");
                r.headers()["x-inferlb-replica"]
                    .to_str()
                    .expect("header")
                    .to_string()
            })
        })
        .collect();
    let mut count: HashMap<String, usize> = HashMap::new();
    for t in burst {
        *count.entry(t.join().expect("thread")).or_default() += 1;
    }
    let most = count.values().copied().max().unwrap_or(0);
    assert!(
        most <= 10,
        "a same-prefix burst must not pile onto one card: {count:?}"
    );

    // An agent loop: every turn after the first on the first turn's replica.
    let context = text_of("agent context", 6000);
    let mut history = vec![
        ("system".to_string(), context),
        ("user".to_string(), "go".to_string()),
    ];
    let mut home = String::new();
    for turn in 0..5 {
        let refs: Vec<(&str, &str)> = history
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let (replica, route, resp) = routed_chat(&lb, &refs);
        if turn == 0 {
            home = replica;
        } else {
            assert_eq!(
                (replica.as_str(), route.as_str()),
                (home.as_str(), "pinned"),
                "turn {turn}"
            );
            let cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
            assert!(cached.unwrap_or(0) >= 5000, "turn {turn} warm: {resp}");
        }
        let reply = resp["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        history.push(("assistant".into(), reply));
        history.push(("user".into(), format!("turn {turn}")));
    }
}

/// A request sharing the prefix of one still prefilling waits for it there and finds the
/// prefix cached, rather than prefilling it again on a replica whose queue is shorter. Here
/// one replica prefills 20k tokens of another prompt, the other the 40k-token leader: the
/// follower's queue cost is lower on the first, but waiting for the leader then prefilling
/// its own few tokens ends sooner (and puts no second copy of the prefix in a cache).
#[test]
fn a_follower_rides_on_the_prefill_of_the_prefix_it_shares() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), &["--prefill-tokens-per-s", "20000"], conf());
    let port = lb.port;
    let send = |messages: Vec<(String, String)>| {
        std::thread::spawn(move || {
            let refs: Vec<(&str, &str)> = messages
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            routed_chat_on(port, &refs).0
        })
    };
    let other = send(vec![("user".into(), text_of("another prompt", 20_000))]);
    std::thread::sleep(std::time::Duration::from_millis(150));
    let doc = text_of("a shared document", 40_000);
    let leader = send(vec![
        ("system".into(), doc.clone()),
        ("user".into(), "first question".into()),
    ]);
    std::thread::sleep(std::time::Duration::from_millis(150));
    let (replica, route, resp) = routed_chat(&lb, &[("system", &doc), ("user", "second question")]);
    let (other, leader) = (other.join().expect("other"), leader.join().expect("leader"));
    assert_ne!(other, leader, "the leader went to the idle replica");
    assert_eq!(
        (replica.as_str(), route.as_str()),
        (leader.as_str(), "prefix"),
        "the follower waits for the leader's prefill"
    );
    let cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 39_000, "it found the leader's prefix: {resp}");
}

#[test]
fn a_fork_of_a_long_history_goes_to_the_replica_that_holds_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), &[], conf());
    let long = text_of("long history", 15_000);
    let (home, _, _) = routed_chat(
        &lb,
        &[("user", &long), ("assistant", "ok"), ("user", "first")],
    );
    for s in 0..6 {
        // Siblings: the same history, another last question; sent one after another (idle home).
        let q = format!("sibling {s}");
        let (replica, route, resp) =
            routed_chat(&lb, &[("user", &long), ("assistant", "ok"), ("user", &q)]);
        assert_eq!(replica, home, "sibling {s} ({route})");
        assert!(route == "pinned" || route == "prefix", "{route}");
        let cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert!(cached.unwrap_or(0) >= 14_000, "sibling {s}: {resp}");
    }
    // Fresh work shares nothing with it: it spreads.
    let (_, route, _) = routed_chat(&lb, &[("user", "something unrelated")]);
    assert_eq!(route, "spread");
}

#[test]
fn each_replicas_cache_size_and_load_are_read_from_its_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = Sim::spawn(dir.path(), "gpu0", &["--cache-tokens", "300000"]);
    let b = Sim::spawn(dir.path(), "gpu1", &["--cache-tokens", "500000"]);
    a.assert_healthy();
    b.assert_healthy();
    let lb = Lb::start(dir.path(), &[&a, &b], conf());
    let learnt = wait_until(std::time::Duration::from_secs(10), || {
        let log = lb.proc.log_text();
        log.contains("replica gpu0 caches 300000 tokens")
            && log.contains("replica gpu1 caches 500000 tokens")
    });
    assert!(learnt, "{}", lb.proc.log_text());
    assert!(
        !lb.proc.log_text().contains("/metrics missing"),
        "the simulator's /metrics is vLLM's"
    );
}

/// The replicas' own word corrects the estimate. A stream that does not ask for its usage is
/// sent asking, and its client gets no usage event; each answer's cached count is set beside
/// the prediction in the metrics; and a replica that restarted between two health checks
/// (its cache lost), on a server whose `/metrics` tells neither its process's start nor its
/// prompt tokens counter, is found wrong once, then right again.
#[test]
fn the_replicas_usage_checks_and_corrects_the_estimate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = ["--no-start-time", "--no-prompt-counter"];
    let (mut a, mut b, lb) = cluster(dir.path(), &flags, conf());
    let history = text_of("usage history", 8000);
    let messages = [("user", history.as_str())];
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .json(&chat_body(&messages, true, 4))
        .send()
        .expect("send");
    assert_eq!(r.status(), 200);
    let home = r.headers()["x-inferlb-replica"]
        .to_str()
        .expect("header")
        .to_string();
    let (events, err) = sse_events(r);
    assert_eq!(err, None);
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"));
    assert!(events.len() > 2, "{events:?}");
    assert!(
        events.iter().all(|(_, e)| !e.contains("\"usage\":{")),
        "the client did not ask for usage: {events:?}"
    );
    let metrics = || lb.metrics();
    let sample = |name: &str, labels: &str| {
        sample_value(&metrics(), &format!("{name}{{{labels}}}")).unwrap_or(0.0)
    };
    let replica = format!("replica=\"{home}\"");
    // The usage the stream was asked for reached the check: a cold prompt, predicted 0.
    let reported = sample("inferlb_cache_reported_tokens_total", &replica);
    let predicted = format!("inferlb_cache_predicted_tokens_total{{{replica}}}");
    assert_eq!(
        sample_value(&metrics(), &predicted),
        Some(0.0),
        "{}",
        metrics()
    );
    // Warm: predicted and reported agree within a block.
    let (again, _, _) = routed_chat(&lb, &messages);
    assert_eq!(again, home);
    let predicted = sample("inferlb_cache_predicted_tokens_total", &replica);
    let reported = sample("inferlb_cache_reported_tokens_total", &replica) - reported;
    assert!(predicted >= 7000.0, "{predicted}");
    assert!(
        (predicted - reported).abs() <= 17.0,
        "{predicted} {reported}"
    );
    let wrong = |cause: &str| {
        sample(
            "inferlb_cache_mispredictions_total",
            &format!("cause=\"{cause}\",{replica}"),
        )
    };
    assert_eq!(wrong("absent"), 0.0);
    // The home restarts at once, with an empty cache; its health never flips.
    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let (third, _, resp) = routed_chat(&lb, &messages);
    assert_eq!(third, home);
    assert_eq!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "{resp}"
    );
    assert_eq!(wrong("absent"), 1.0, "{}", metrics());
    // It holds the prompt again, and the index knows it: no second misprediction.
    routed_chat(&lb, &messages);
    assert_eq!(wrong("absent"), 1.0);
    assert_eq!(wrong("evicted"), 0.0);
}

/// A replica restarted between two health checks tells it in its `/metrics` (a later
/// `process_start_time_seconds`): inferlb empties its estimate and drops its pins before the
/// next turn, which then spreads, predicted cold, as it is (no misprediction), and counts the
/// restart.
#[test]
fn a_restart_between_health_checks_is_read_from_the_replicas_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut a, mut b, lb) = cluster(dir.path(), &[], conf());
    let history = text_of("restarted history", 8000);
    let messages = [("user", history.as_str())];
    let (home, _, _) = routed_chat(&lb, &messages);
    let (again, _, resp) = routed_chat(&lb, &messages);
    assert_eq!(again, home);
    let cached =
        |resp: &serde_json::Value| resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached(&resp) > Some(7000), "{resp}");
    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let said = format!("replica {home}: restarted (its /metrics gives a later process start)");
    let found = wait_until(std::time::Duration::from_secs(5), || {
        lb.proc.log_text().contains(&said)
    });
    assert!(found, "{}", lb.proc.log_text());
    // The conversation's next turn: no replica holds its history now, and its pin to the
    // replica that served it went with the cache, so it spreads rather than go back pinned.
    let next = [
        ("user", history.as_str()),
        ("assistant", "an answer"),
        ("user", "and then?"),
    ];
    let (_, route, resp) = routed_chat(&lb, &next);
    assert_eq!(route, "spread");
    assert_eq!(cached(&resp), Some(0), "{resp}");
    let metrics = lb.metrics();
    let sample = |series: &str| sample_value(&metrics, series).unwrap_or(0.0);
    for cause in ["absent", "evicted"] {
        let wrong =
            format!("inferlb_cache_mispredictions_total{{cause=\"{cause}\",replica=\"{home}\"}}");
        assert_eq!(sample(&wrong), 0.0, "{metrics}");
    }
    let restarts = |id: &str| {
        sample(&format!(
            "inferlb_replica_restarts_total{{replica=\"{id}\"}}"
        ))
    };
    let other = if a.id == home { &b.id } else { &a.id };
    assert_eq!((restarts(&home), restarts(other)), (1.0, 0.0), "{metrics}");
}

/// A conversation of a 2k-token first turn through `lb`, and its second turn, pinned to the
/// replica that served the first: (that replica, the first turn).
fn pinned_history(lb: &Lb, seed: &str) -> (String, String) {
    let history = text_of(seed, 2000);
    let (home, _, _) = routed_chat(lb, &[("user", history.as_str())]);
    let (replica, route, _) = routed_chat(lb, &next_turn(&history));
    assert_eq!((replica, route.as_str()), (home.clone(), "pinned"));
    (home, history)
}

/// The turn after `history`'s answer.
fn next_turn(history: &str) -> [(&str, &str); 3] {
    [
        ("user", history),
        ("assistant", "an answer"),
        ("user", "and then?"),
    ]
}

/// inferlb stopped, a replica restarted meanwhile, inferlb started again on the state file it
/// left: the file says at which process start of each replica its pins were made, so the first
/// read of the new start is a restart, and the conversation's next turn spreads rather than go
/// back pinned to a cold replica.
#[test]
fn a_replica_restarted_while_inferlb_was_stopped_loses_the_pins_it_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut a, mut b, mut lb) = cluster(dir.path(), &[], conf());
    let (home, history) = pinned_history(&lb, "left history");
    // Saved every 2 s once the pins changed (a quick stop saves nothing more): the pin, and
    // the start its replica's /metrics gave.
    let path = dir.path().join("inferlb-affinity.json");
    let saved = wait_until(std::time::Duration::from_secs(10), || {
        let file = std::fs::read_to_string(&path).unwrap_or_default();
        let state: serde_json::Value = serde_json::from_str(&file).unwrap_or_default();
        let starts = state["starts"].as_array().cloned().unwrap_or_default();
        let pins = state["entries"].as_array().map_or(0, Vec::len);
        pins > 0
            && starts
                .iter()
                .any(|s| s[0] == home.as_str() && s[1].as_u64() > Some(0))
    });
    assert!(
        saved,
        "{}",
        std::fs::read_to_string(&path).unwrap_or_default()
    );
    lb.proc.stop();

    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let lb = Lb::start(dir.path(), &[&a, &b], conf());
    assert!(
        lb.proc.log_text().contains("pins loaded from"),
        "{}",
        lb.proc.log_text()
    );
    let said = format!("replica {home}: restarted (its /metrics gives a later process start)");
    let found = wait_until(std::time::Duration::from_secs(5), || {
        lb.proc.log_text().contains(&said)
    });
    assert!(found, "{}", lb.proc.log_text());
    assert_eq!(routed_chat(&lb, &next_turn(&history)).1, "spread");
}

/// A server that gives no process start (llama.cpp, SGLang, vLLM with several API servers):
/// its restart is read from its prompt tokens counter going back, with the same effect: the
/// estimate empties, the pins go, and the conversation's next turn spreads.
#[test]
fn a_restart_of_a_server_without_a_start_is_read_from_its_counter() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut a, mut b, lb) = cluster(dir.path(), &["--no-start-time"], conf());
    let (home, history) = pinned_history(&lb, "counted history");
    // Its counter is read past zero before the restart.
    std::thread::sleep(std::time::Duration::from_millis(600));
    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let said = format!("replica {home}: restarted (its /metrics counts fewer prompt tokens)");
    let found = wait_until(std::time::Duration::from_secs(5), || {
        lb.proc.log_text().contains(&said)
    });
    assert!(found, "{}", lb.proc.log_text());
    assert_eq!(routed_chat(&lb, &next_turn(&history)).1, "spread");
}
