//! The replicas' own KV events read by inferlb: a simulator publishing vLLM's events (ZMQ,
//! msgpack, with a replay socket), its stream seen live, and a cache reset it announces
//! emptying inferlb's estimate for it at once, so the next turn is not predicted warm.

mod common;

use std::time::Duration;

use common::*;
use inferlb_harness::{free_port, Replica};

/// gpu0 publishing its KV events (and their replay) on free ports, and inferlb reading them.
fn publishing(dir: &std::path::Path) -> (Sim, Lb) {
    let (events, replay) = (free_port(), free_port());
    let ev = format!("tcp://127.0.0.1:{events}");
    let rp = format!("tcp://127.0.0.1:{replay}");
    let sim = Sim::spawn(
        dir,
        "gpu0",
        &["--kv-events", &ev, "--kv-events-replay", &rp],
    );
    sim.assert_healthy();
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas: vec![Replica {
            extra: format!("kv_events: \"{ev}\", kv_events_replay: \"{rp}\""),
            ..Replica::of(&sim)
        }],
        ..test_conf()
    };
    let lb = Lb::start(dir, &[], conf);
    (sim, lb)
}

/// A chat tokenizer written under `dir`: its directory, for `--tokenizer` and `tokenizers:`.
fn a_tokenizer(dir: &std::path::Path) -> String {
    let tokenizer = dir.join("tokenizer");
    std::fs::create_dir(&tokenizer).expect("mkdir");
    inferlb_tokens::fixture::write_dir(&tokenizer, inferlb_tokens::fixture::CHATML_TOOLS)
        .expect("a tokenizer");
    tokenizer.to_string_lossy().to_string()
}

/// Waits until inferlb reads every one of `ids`' event streams whole.
fn all_live(lb: &Lb, ids: &[&str]) {
    let state = |id: &str| {
        let series = format!("inferlb_kv_events_state{{replica=\"{id}\"}}");
        sample_value(&lb.metrics(), &series)
    };
    let live = wait_until(Duration::from_secs(10), || {
        ids.iter().all(|id| state(id) == Some(2.0))
    });
    assert!(live, "{}\n{}", lb.metrics(), lb.proc.log_text());
}

#[test]
fn a_reset_the_replica_announces_empties_its_estimate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (sim, lb) = publishing(dir.path());
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    // Seen whole: the startup clear came through the replay socket.
    let live = wait_until(Duration::from_secs(10), || {
        sample("inferlb_kv_events_state{replica=\"gpu0\"}") == 2.0
    });
    assert!(live, "{}\n{}", lb.metrics(), lb.proc.log_text());
    let history = text_of("kv events history", 6000);
    let messages = [("user", history.as_str())];
    routed_chat(&lb, &messages);
    let stored = wait_until(Duration::from_secs(10), || {
        sample("inferlb_kv_events_total{kind=\"stored\",replica=\"gpu0\"}") > 0.0
    });
    assert!(stored, "{}", lb.metrics());
    let mispredicted = "inferlb_cache_mispredictions_total{cause=\"absent\",replica=\"gpu0\"}";
    // The replica's cache is reset behind inferlb's back; it says so on its stream.
    let cleared = sample("inferlb_kv_events_total{kind=\"cleared\",replica=\"gpu0\"}");
    let r = http()
        .post(format!("http://{}/reset_prefix_cache", sim.addr()))
        .send()
        .expect("reset");
    assert!(r.status().is_success());
    let heard = wait_until(Duration::from_secs(10), || {
        sample("inferlb_kv_events_total{kind=\"cleared\",replica=\"gpu0\"}") > cleared
    });
    assert!(heard, "{}", lb.metrics());
    assert!(lb
        .proc
        .log_text()
        .contains("replica gpu0: its cache was cleared (KV events)"));
    // The next turn: predicted cold, as it is; no misprediction to find.
    let (_, _, resp) = routed_chat(&lb, &messages);
    assert_eq!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "{resp}"
    );
    assert_eq!(sample(mispredicted), 0.0, "{}", lb.metrics());
    assert_eq!(
        sample("inferlb_cache_predicted_tokens_total{replica=\"gpu0\"}"),
        0.0
    );
}

#[test]
fn a_publisher_that_is_not_there_is_gone_and_routing_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = Sim::spawn(dir.path(), "gpu0", &[]);
    sim.assert_healthy();
    let nowhere = format!("tcp://127.0.0.1:{}", free_port());
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas: vec![Replica {
            extra: format!("kv_events: \"{nowhere}\""),
            ..Replica::of(&sim)
        }],
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let (replica, _, _) = routed_chat(&lb, &[("user", "hello")]);
    assert_eq!(replica, "gpu0");
    let gone = wait_until(Duration::from_secs(10), || {
        sample_value(&lb.metrics(), "inferlb_kv_events_state{replica=\"gpu0\"}") == Some(0.0)
    });
    assert!(gone, "{}\n{}", lb.metrics(), lb.proc.log_text());
    assert!(lb.proc.log_text().contains("KV event stream gone"));
}

/// A replica restarted between two health checks says nothing on a stream that died with it;
/// its publisher's sequence starting again from 0 tells: the estimate is cleared.
#[test]
fn a_publisher_that_restarted_clears_the_estimate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut sim, lb) = publishing(dir.path());
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    let live = || sample("inferlb_kv_events_state{replica=\"gpu0\"}") == 2.0;
    assert!(
        wait_until(Duration::from_secs(10), live),
        "{}",
        lb.metrics()
    );
    let history = text_of("restart history", 6000);
    let messages = [("user", history.as_str())];
    for _ in 0..3 {
        routed_chat(&lb, &messages);
    }
    sim.restart(&[]);
    sim.assert_healthy();
    let said = "replica gpu0: its KV event publisher restarted; its estimate is cleared";
    let cleared = wait_until(Duration::from_secs(20), || {
        lb.proc.log_text().contains(said)
    });
    assert!(cleared, "{}", lb.proc.log_text());
    assert!(wait_until(Duration::from_secs(5), live), "{}", lb.metrics());
    // Predicted cold, as it is: no misprediction.
    let (_, _, resp) = routed_chat(&lb, &messages);
    assert_eq!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "{resp}"
    );
    let wrong = "inferlb_cache_mispredictions_total{cause=\"absent\",replica=\"gpu0\"}";
    assert_eq!(sample(wrong), 0.0, "{}", lb.metrics());
}

/// Prompts that reached the replicas some other way (sent to them straight, not through
/// inferlb): the estimate knows nothing of them, but with the model's tokenizer the replicas'
/// events say which holds each, and each goes there, warm.
#[test]
fn a_prompt_goes_where_the_replicas_events_say_it_is_held() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let mut sims = Vec::new();
    let mut replicas = Vec::new();
    for id in ["gpu0", "gpu1"] {
        let ev = format!("tcp://127.0.0.1:{}", free_port());
        let rp = format!("tcp://127.0.0.1:{}", free_port());
        let sim = Sim::spawn(
            dir.path(),
            id,
            &[
                "--tokenizer",
                &tk,
                "--kv-events",
                &ev,
                "--kv-events-replay",
                &rp,
            ],
        );
        sim.assert_healthy();
        replicas.push(Replica {
            extra: format!("kv_events: \"{ev}\", kv_events_replay: \"{rp}\""),
            ..Replica::of(&sim)
        });
        sims.push(sim);
    }
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas,
        extra: format!("  tokenizers: {{sim-model: \"{tk}\"}}\n"),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    all_live(&lb, &["gpu0", "gpu1"]);
    // Three prompts held by gpu0, then three by gpu1: no alternation a spread could match.
    for (i, home) in [0usize, 0, 0, 1, 1, 1].into_iter().enumerate() {
        let history = text_of(&format!("held elsewhere {i}"), 3000);
        let messages = [("user", history.as_str())];
        let id = ["gpu0", "gpu1"][home];
        let blocks = format!("inferlb_kv_blocks{{replica=\"{id}\"}}");
        let before = sample(&blocks);
        let r = http()
            .post(sims[home].url("/v1/chat/completions"))
            .json(&chat_body(&messages, false, 2))
            .send()
            .expect("straight to the replica");
        assert_eq!(r.status(), 200);
        let heard = wait_until(Duration::from_secs(10), || sample(&blocks) > before);
        assert!(heard, "{}", lb.metrics());
        let (replica, route, resp) = routed_chat(&lb, &messages);
        assert_eq!(
            (replica.as_str(), route.as_str()),
            (id, "prefix"),
            "prompt {i}"
        );
        let prompt = resp["usage"]["prompt_tokens"].as_u64().expect("usage");
        let cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached tokens");
        assert!(cached * 10 >= prompt * 9, "{cached} of {prompt}: {resp}");
    }
    assert!(
        sample("inferlb_cache_lookups_total{source=\"events\"}") >= 6.0,
        "{}",
        lb.metrics()
    );
}

/// A data-parallel server: one address, two engines, each with its own cache and publishing
/// on the configured ports plus its rank (as vLLM's `--data-parallel-size` does). inferlb has
/// a replica per rank, each subscribed to its own engine's stream; a prompt one engine holds
/// goes to that engine, named in `X-data-parallel-rank`, whatever rank the client asked for.
#[test]
fn each_rank_of_a_data_parallel_server_is_a_replica_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let ev = format!("tcp://127.0.0.1:{}", inferlb_harness::free_ports(2));
    let rp = format!("tcp://127.0.0.1:{}", inferlb_harness::free_ports(2));
    let sim = Sim::spawn(
        dir.path(),
        "dp",
        &[
            "--tokenizer",
            &tk,
            "--data-parallel-size",
            "2",
            "--kv-events",
            &ev,
            "--kv-events-replay",
            &rp,
        ],
    );
    sim.assert_healthy();
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas: vec![Replica {
            extra: format!(
                "data_parallel_size: 2, kv_events: \"{ev}\", kv_events_replay: \"{rp}\""
            ),
            ..Replica::of(&sim)
        }],
        extra: format!("  tokenizers: {{sim-model: \"{tk}\"}}\n"),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    all_live(&lb, &["dp-dp0", "dp-dp1"]);
    for (i, home) in [0usize, 0, 1, 1, 0, 1].into_iter().enumerate() {
        let history = text_of(&format!("held by one engine {i}"), 3000);
        let messages = [("user", history.as_str())];
        let id = format!("dp-dp{home}");
        let blocks = format!("inferlb_kv_blocks{{replica=\"{id}\"}}");
        let before = sample(&blocks);
        let r = http()
            .post(sim.url("/v1/chat/completions"))
            .header("X-data-parallel-rank", home.to_string())
            .json(&chat_body(&messages, false, 2))
            .send()
            .expect("straight to one engine");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-sim-dp-rank"], home.to_string().as_str());
        let heard = wait_until(Duration::from_secs(10), || sample(&blocks) > before);
        assert!(heard, "{}", lb.metrics());
        // The client names the other engine: the routing's choice stands.
        let r = http()
            .post(lb.url("/v1/chat/completions"))
            .header("x-data-parallel-rank", (1 - home).to_string())
            .json(&chat_body(&messages, false, 2))
            .send()
            .expect("through inferlb");
        assert_eq!(r.status(), 200);
        let h = |n: &str| r.headers()[n].to_str().expect("header").to_string();
        assert_eq!(
            (
                h("x-inferlb-replica"),
                h("x-inferlb-route"),
                h("x-sim-dp-rank")
            ),
            (id.clone(), "prefix".to_string(), home.to_string()),
            "prompt {i}"
        );
        let resp: serde_json::Value = r.json().expect("json");
        let prompt = resp["usage"]["prompt_tokens"].as_u64().expect("usage");
        let cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached tokens");
        assert!(cached * 10 >= prompt * 9, "{cached} of {prompt}: {resp}");
    }
    // Each engine's requests were its own: three straight and three through inferlb.
    for k in 0..2 {
        let stats: serde_json::Value = http()
            .get(sim.url("/sim/stats"))
            .header("X-data-parallel-rank", k.to_string())
            .send()
            .expect("stats")
            .json()
            .expect("json");
        assert_eq!(
            (stats["dp_rank"].as_u64(), stats["requests"].as_u64()),
            (Some(k), Some(6))
        );
    }
}
