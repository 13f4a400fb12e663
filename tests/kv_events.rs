//! The replicas' own KV events read by inferlb: a simulator publishing vLLM's events (ZMQ,
//! msgpack, with a replay socket), its stream seen live, and a cache reset it announces
//! emptying inferlb's estimate for it at once, so the next turn is not predicted warm.

mod common;

use std::time::Duration;

use common::*;
use inferlb_harness::{free_port, Replica};

/// gpu0 publishing its KV events (and their replay, with `replay`) on free ports, with `more`
/// flags, and inferlb reading them.
fn publishing(dir: &std::path::Path, replay: bool, more: &[&str]) -> (Sim, Lb) {
    let ev = format!("tcp://127.0.0.1:{}", free_port());
    let rp = format!("tcp://127.0.0.1:{}", free_port());
    let mut args = vec!["--kv-events", &ev];
    let mut extra = format!("kv_events: \"{ev}\"");
    if replay {
        args.extend(["--kv-events-replay", &rp]);
        extra.push_str(&format!(", kv_events_replay: \"{rp}\""));
    }
    args.extend(more);
    let sim = Sim::spawn(dir, "gpu0", &args);
    sim.assert_healthy();
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas: vec![Replica {
            extra,
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

/// A simulator `id` with `tk`'s tokenizer and `ranks` engines, publishing its KV events and
/// their replay on free ports (rank k on each plus k), with `more` flags: it and the two
/// endpoints (rank 0's).
fn with_events(
    dir: &std::path::Path,
    id: &str,
    tk: &str,
    ranks: u16,
    more: &[&str],
) -> (Sim, String, String) {
    let ev = format!("tcp://127.0.0.1:{}", inferlb_harness::free_ports(ranks));
    let rp = format!("tcp://127.0.0.1:{}", inferlb_harness::free_ports(ranks));
    let n = ranks.to_string();
    let mut args = vec![
        "--tokenizer",
        tk,
        "--kv-events",
        &ev,
        "--kv-events-replay",
        &rp,
    ];
    if ranks > 1 {
        args.extend(["--data-parallel-size", n.as_str()]);
    }
    args.extend(more);
    let sim = Sim::spawn(dir, id, &args);
    sim.assert_healthy();
    (sim, ev, rp)
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
    let (sim, lb) = publishing(dir.path(), true, &[]);
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
/// its publisher, asked once the stream is silent, no longer has the last batch applied (its
/// sequence began again from 0): the estimate is cleared within seconds. Its `/metrics` tells
/// neither its process's start nor its prompt tokens counter here, either of which would tell
/// the restart first (the next test).
#[test]
fn a_publisher_that_restarted_clears_the_estimate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = ["--no-start-time", "--no-prompt-counter"];
    let (mut sim, lb) = publishing(dir.path(), true, &flags);
    let said = "replica gpu0: its KV event publisher restarted; its estimate is cleared";
    restarted_and_predicted_cold(&mut sim, &lb, said, 2.0);
}

/// With no replay socket to ask, a restart is read from the replica's `/metrics` (a later
/// `process_start_time_seconds`): the estimate is emptied and the stream subscribed anew
/// within seconds, not after ten silent ones. (Without a replay, the stream is partial: the
/// publisher's first batches went out before inferlb subscribed.)
#[test]
fn a_restart_read_from_metrics_clears_the_estimate_and_resubscribes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut sim, lb) = publishing(dir.path(), false, &[]);
    let said = "replica gpu0: restarted (its /metrics); its KV event stream begins anew";
    restarted_and_predicted_cold(&mut sim, &lb, said, 1.0);
}

/// gpu0's stream read (in `state`: 2 live, 1 partial), three turns of one history sent, then gpu0 restarted: inferlb says
/// `said` within 8 s, the stream is read again, the next turn is predicted cold, as it is (no
/// misprediction), and what a new prompt stores comes in on the new stream.
fn restarted_and_predicted_cold(sim: &mut Sim, lb: &Lb, said: &str, state: f64) {
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    let live = || sample("inferlb_kv_events_state{replica=\"gpu0\"}") == state;
    assert!(
        wait_until(Duration::from_secs(10), live),
        "{}",
        lb.metrics()
    );
    let history = text_of("restart history", 6000);
    let messages = [("user", history.as_str())];
    for _ in 0..3 {
        routed_chat(lb, &messages);
    }
    sim.restart(&[]);
    sim.assert_healthy();
    // Not by the resubscription after ten silent seconds.
    let cleared = wait_until(Duration::from_secs(8), || lb.proc.log_text().contains(said));
    assert!(cleared, "{}", lb.proc.log_text());
    // Live again from the new publisher's replay (partial throughout without one: what the
    // batches below show instead).
    assert!(wait_until(Duration::from_secs(5), live), "{}", lb.metrics());
    let (_, _, resp) = routed_chat(lb, &messages);
    assert_eq!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "{resp}"
    );
    let wrong = "inferlb_cache_mispredictions_total{cause=\"absent\",replica=\"gpu0\"}";
    assert_eq!(sample(wrong), 0.0, "{}", lb.metrics());
    // The new stream is read: the blocks a new prompt stores come in, on it or (if they were
    // published before the subscription) through the replay at its connect. Without a replay,
    // what was published before the subscription is lost: a new prompt a second until then.
    let read = || {
        ["batches", "replayed"]
            .iter()
            .map(|k| {
                sample(&format!(
                    "inferlb_kv_events_total{{kind=\"{k}\",replica=\"gpu0\"}}"
                ))
            })
            .sum::<f64>()
    };
    let before = read();
    let read = (0..10).any(|i| {
        let new = text_of(&format!("a new prompt after the restart {i}"), 2000);
        routed_chat(lb, &[("user", new.as_str())]);
        wait_until(Duration::from_secs(1), || read() > before)
    });
    assert!(read, "{}", lb.metrics());
}

/// gpu0 (with `more0` flags) and gpu1 with `tk`'s tokenizer, publishing their events, and
/// inferlb routing by prefill cost with the same tokenizer, both streams live.
fn two_publishing(dir: &std::path::Path, tk: &str, more0: &[&str]) -> (Vec<Sim>, Lb) {
    let mut sims = Vec::new();
    let mut replicas = Vec::new();
    for (id, more) in [("gpu0", more0), ("gpu1", &[][..])] {
        let (sim, ev, rp) = with_events(dir, id, tk, 1, more);
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
    let lb = Lb::start(dir, &[], conf);
    all_live(&lb, &["gpu0", "gpu1"]);
    (sims, lb)
}

/// Prompts that reached the replicas some other way (sent to them straight, not through
/// inferlb): the estimate knows nothing of them, but with the model's tokenizer the replicas'
/// events say which holds each, and each goes there, warm.
#[test]
fn a_prompt_goes_where_the_replicas_events_say_it_is_held() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let (sims, lb) = two_publishing(dir.path(), &tk, &[]);
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
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

/// Anthropic Messages and Responses prompts are tokenized as the chat bodies vLLM makes of
/// them (the simulator makes the same), so the replicas' events find them too: each prompt,
/// sent straight to one replica first, then goes there through inferlb, its route `prefix`
/// and most of it read from the cache.
#[test]
fn messages_and_responses_prompts_go_where_the_events_say_they_are_held() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let (sims, lb) = two_publishing(dir.path(), &tk, &[]);
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    let lookups = "inferlb_cache_lookups_total{source=\"events\"}";
    let first_lookups = sample(lookups);
    let homes = [0usize, 0, 1, 1];
    for (i, home) in homes.into_iter().enumerate() {
        let history = text_of(&format!("agent turn {i}"), 3000);
        let (path, body) = match i % 2 {
            0 => (
                "/v1/messages",
                serde_json::json!({"model": "sim-model", "max_tokens": 2, "system": "Be brief.",
                    "messages": [{"role": "user", "content": [{"type": "text", "text": history}]}]}),
            ),
            _ => (
                "/v1/responses",
                serde_json::json!({"model": "sim-model", "max_output_tokens": 2, "store": false,
                    "instructions": "Be brief.",
                    "input": [{"role": "user", "content": [{"type": "input_text", "text": history}]}]}),
            ),
        };
        let id = ["gpu0", "gpu1"][home];
        let blocks = format!("inferlb_kv_blocks{{replica=\"{id}\"}}");
        let before = sample(&blocks);
        let r = http()
            .post(sims[home].url(path))
            .json(&body)
            .send()
            .expect("straight to the replica");
        assert_eq!(r.status(), 200, "{path}");
        let heard = wait_until(Duration::from_secs(10), || sample(&blocks) > before);
        assert!(heard, "{}", lb.metrics());
        let r = http().post(lb.url(path)).json(&body).send().expect("send");
        assert_eq!(r.status(), 200, "{path}");
        let h = |n: &str| r.headers()[n].to_str().expect("header").to_string();
        let (replica, route) = (h("x-inferlb-replica"), h("x-inferlb-route"));
        assert_eq!(
            (replica.as_str(), route.as_str()),
            (id, "prefix"),
            "{path} {i}"
        );
        let resp: serde_json::Value = r.json().expect("json");
        let u = &resp["usage"];
        let (uncached, cached) = match i % 2 {
            0 => (
                u["input_tokens"].as_u64(),
                u["cache_read_input_tokens"].as_u64(),
            ),
            _ => {
                let all = u["input_tokens"].as_u64().expect("input tokens");
                let cached = u["input_tokens_details"]["cached_tokens"].as_u64();
                (cached.map(|c| all - c), cached)
            }
        };
        let (uncached, cached) = (uncached.expect("usage"), cached.expect("cached"));
        assert!(
            cached >= uncached * 9,
            "{cached} cached, {uncached} not: {resp}"
        );
    }
    assert!(
        sample(lookups) - first_lookups >= homes.len() as f64,
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
    let (sim, ev, rp) = with_events(dir.path(), "dp", &tk, 2, &[]);
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

/// `kv_events: server_info`: the replica names its event sockets in its own
/// `GET /server_info`, in vLLM's form (a data-parallel server: each rank on the ports plus its
/// rank) and in SGLang's, and inferlb reads each stream from there: every one live, and a
/// prompt held by one engine routed to it on the events' word.
#[test]
fn a_replica_that_names_its_event_sockets_over_http_is_read_from_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let (dp, ev, _) = with_events(dir.path(), "dp", &tk, 2, &["--server-info", "vllm"]);
    let (sg, ev1, _) = with_events(dir.path(), "sg", &tk, 1, &["--server-info", "sglang"]);
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        replicas: vec![
            Replica {
                extra: "data_parallel_size: 2, kv_events: server_info".into(),
                ..Replica::of(&dp)
            },
            Replica {
                extra: "kv_events: server_info".into(),
                ..Replica::of(&sg)
            },
        ],
        extra: format!("  tokenizers: {{sim-model: \"{tk}\"}}\n"),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let sample = |s: &str| sample_value(&lb.metrics(), s).unwrap_or(0.0);
    all_live(&lb, &["dp-dp0", "dp-dp1", "sg"]);
    let log = lb.proc.log_text();
    for (id, publisher) in [
        ("dp-dp0", ev.clone()),
        (
            "dp-dp1",
            inferlb_kvevents::endpoint_for_rank(&ev, 1).expect("rank 1"),
        ),
        ("sg", ev1.clone()),
    ] {
        let said = format!("replica {id}: KV events on {publisher} ");
        assert!(log.contains(&said), "{said} not in\n{log}");
    }
    for (i, (sim, rank, id)) in [
        (&dp, Some(1), "dp-dp1"),
        (&sg, None, "sg"),
        (&dp, Some(0), "dp-dp0"),
    ]
    .into_iter()
    .enumerate()
    {
        let history = text_of(&format!("named over http {i}"), 3000);
        let messages = [("user", history.as_str())];
        let blocks = format!("inferlb_kv_blocks{{replica=\"{id}\"}}");
        let before = sample(&blocks);
        let mut straight = http()
            .post(sim.url("/v1/chat/completions"))
            .json(&chat_body(&messages, false, 2));
        if let Some(k) = rank {
            straight = straight.header("X-data-parallel-rank", k.to_string());
        }
        assert_eq!(straight.send().expect("straight").status(), 200);
        let heard = wait_until(Duration::from_secs(10), || sample(&blocks) > before);
        assert!(heard, "{}", lb.metrics());
        let (replica, route, _) = routed_chat(&lb, &messages);
        assert_eq!(
            (replica.as_str(), route.as_str()),
            (id, "prefix"),
            "prompt {i}"
        );
    }
}

/// Sends `text` as one user message straight to `sim`.
fn straight(sim: &Sim, text: &str) {
    let r = http()
        .post(sim.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", text)], false, 2))
        .send()
        .expect("straight to the replica");
    assert_eq!(r.status(), 200);
}

/// The value of one of inferlb's samples, 0 when absent.
fn sample_of(lb: &Lb, series: &str) -> f64 {
    sample_value(&lb.metrics(), series).unwrap_or(0.0)
}

/// A batch the subscriber missed (never published; the replay socket has it) is a gap, healed
/// through the replay socket: the stream stays live, and the prompt stored in that batch goes
/// home warm.
#[test]
fn a_missed_batch_is_replayed_and_the_stream_stays_live() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    // Batch 0 is the startup reset; batch 1, the first prompt's blocks, is withheld.
    let (sims, lb) = two_publishing(dir.path(), &tk, &["--kv-events-withhold", "1"]);
    let batches = |kind: &str| {
        sample_of(
            &lb,
            &format!("inferlb_kv_events_total{{kind=\"{kind}\",replica=\"gpu0\"}}"),
        )
    };
    let replayed = batches("replayed");
    let (a, b) = (text_of("missed a", 3000), text_of("missed b", 3000));
    straight(&sims[0], &a);
    // The first prompt's batch never comes; the next one shows the gap.
    straight(&sims[0], &b);
    let sent = sims[0].stats()["kv_event_batches_sent"]
        .as_f64()
        .expect("batches sent");
    let all_applied = wait_until(Duration::from_secs(10), || {
        batches("batches") + batches("replayed") >= sent
    });
    assert!(
        all_applied,
        "{sent} sent\n{}\n{}",
        lb.metrics(),
        lb.proc.log_text()
    );
    assert!(batches("replayed") > replayed, "{}", lb.metrics());
    assert_eq!(
        sample_of(&lb, "inferlb_kv_events_state{replica=\"gpu0\"}"),
        2.0,
        "{}",
        lb.proc.log_text()
    );
    for text in [&a, &b] {
        let (replica, route, resp) = routed_chat(&lb, &[("user", text.as_str())]);
        assert_eq!(
            (replica.as_str(), route.as_str()),
            ("gpu0", "prefix"),
            "{resp}"
        );
    }
    assert!(
        !lb.proc.log_text().contains("stream partial"),
        "{}",
        lb.proc.log_text()
    );
}

/// A gap the replay cannot heal (its buffer no longer has the batch): the stream is `partial`,
/// the block index is emptied and keeps only what is stored after, the missed prompt is not
/// predicted held, and the replica's next cache reset makes the stream whole again.
#[test]
fn a_gap_the_replay_cannot_heal_is_partial_until_the_next_reset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = a_tokenizer(dir.path());
    let flags = ["--kv-events-withhold", "1", "--kv-events-buffer", "1"];
    let (sims, lb) = two_publishing(dir.path(), &tk, &flags);
    let state = "inferlb_kv_events_state{replica=\"gpu0\"}";
    let (a, b) = (text_of("lost a", 3000), text_of("lost b", 3000));
    straight(&sims[0], &a);
    straight(&sims[0], &b);
    let partial = wait_until(Duration::from_secs(10), || sample_of(&lb, state) == 1.0);
    assert!(partial, "{}\n{}", lb.metrics(), lb.proc.log_text());
    assert!(lb
        .proc
        .log_text()
        .contains("replica gpu0: KV event stream partial (was live)"));
    // Stored after the gap, on a chain the index saw begin: trusted, and found.
    let (replica, route, resp) = routed_chat(&lb, &[("user", b.as_str())]);
    assert_eq!(
        (replica.as_str(), route.as_str()),
        ("gpu0", "prefix"),
        "{resp}"
    );
    // Stored in the batch missed: neither the index nor the estimate knows it.
    let (_, route, resp) = routed_chat(&lb, &[("user", a.as_str())]);
    assert_ne!(route, "prefix", "{resp}");
    // A reset starts the replica clean: the stream is whole again.
    let r = http()
        .post(format!("http://{}/reset_prefix_cache", sims[0].addr()))
        .send()
        .expect("reset");
    assert!(r.status().is_success());
    let live = wait_until(Duration::from_secs(10), || sample_of(&lb, state) == 2.0);
    assert!(live, "{}\n{}", lb.metrics(), lb.proc.log_text());
}
