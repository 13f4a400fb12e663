//! The simulator's KV events are vLLM's: vLLM's router (`vllm-router --policy kv_aware`), a
//! client no one here wrote, subscribes to two sims' event sockets, learns from them that only
//! replica A holds a prefix (warmed on A directly, never through the router), and sends every
//! request with that prefix to A. Its own metrics show that it rendered each prompt and found
//! it in the index it built from the events, so the 8 out of 8 cannot come from luck.
//!
//! The router comes from `make peers` (`$INFERLB_PEERS_VENV`, default `target/venv-peers`).

mod peers;

use std::process::Command;
use std::time::Duration;

use inferlb_harness::{free_port, wait_until, Sim};
use peers::{client, n, peer_bin, start_router, stats, Logs};
use serde_json::{json, Value};

const N: u64 = 8;

fn chat(url: &str, messages: &[Value]) {
    let resp = client()
        .post(url)
        .json(&json!({"model": "sim-model", "messages": messages, "max_tokens": 4}))
        .send()
        .expect("an answer");
    let status = resp.status();
    assert_eq!(status, 200, "{}", resp.text().unwrap_or_default());
}

fn messages(prefix: &str, question: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": prefix}),
        json!({"role": "user", "content": question}),
    ]
}

/// The router colours its log fields even into a file.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut escape = false;
    for c in s.chars() {
        match (escape, c) {
            (false, '\x1b') => escape = true,
            (true, 'm') => escape = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// Live: the router is subscribed before A computes the prefix.
#[test]
fn vllm_router_routes_by_the_simulators_live_kv_events() {
    scene(false);
}

/// Replayed: A computes the prefix before the router starts; the router learns it only
/// through A's replay socket, which it asks once a later batch shows it the gap.
#[test]
fn vllm_router_routes_by_the_simulators_replayed_kv_events() {
    scene(true);
}

fn scene(warm_before_router: bool) {
    let logs = Logs::new();
    let router = peer_bin("INFERLB_PEERS_VENV", "venv-peers", "vllm-router");
    let endpoints: Vec<(String, String)> = (0..2)
        .map(|_| {
            (
                format!("tcp://127.0.0.1:{}", free_port()),
                format!("tcp://127.0.0.1:{}", free_port()),
            )
        })
        .collect();
    let sims: Vec<Sim> = ["a", "b"]
        .iter()
        .zip(&endpoints)
        .map(|(id, (ev, replay))| {
            let args = ["--speed", "10", "--block-tokens", "16"];
            let ev_args = ["--kv-events", ev, "--kv-events-replay", replay];
            Sim::start(logs.path(), id, &[&args[..], &ev_args[..]].concat())
        })
        .collect();
    let (a, b) = (&sims[0], &sims[1]);
    let (port, prom) = (free_port(), free_port());
    // The router logs to stdout, which the harness discards: a shell sends it to stderr, the
    // log file, where the test reads that the events arrived.
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exec \"$0\" \"$@\" 1>&2"]).arg(router);
    // B first, so that a tie (no knowledge of the prefix) would not favour A.
    cmd.args(["--worker-urls", &b.url(""), &a.url("")])
        .args(["--policy", "kv_aware", "--kv-event-model", "sim-model"])
        .args(["--kv-event-block-size", "16"]);
    for (sim, (ev, replay)) in sims.iter().zip(&endpoints) {
        cmd.args(["--kv-event-source", &format!("{}={ev}", sim.url(""))])
            .args([
                "--kv-event-replay-source",
                &format!("{}={replay}", sim.url("")),
            ]);
    }
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prometheus-host", "127.0.0.1"])
        .args(["--prometheus-port", &prom.to_string()])
        .args([
            "--worker-startup-timeout-secs",
            "30",
            "--log-level",
            "debug",
        ]);
    // A shared prefix of about 2,000 tokens, computed on A only.
    let prefix = "You are a careful assistant. ".repeat(280);
    let warm = || {
        chat(
            &a.url("/v1/chat/completions"),
            &messages(&prefix, "warm up"),
        );
        assert!(
            n(&stats(a), "kv_event_batches_sent") >= 1,
            "A published its blocks"
        );
    };
    if warm_before_router {
        warm();
    }
    let router = start_router(&logs, "vllm-router", cmd, port);
    let metrics = |name: &str| -> f64 {
        let text = client()
            .get(format!("http://127.0.0.1:{prom}/metrics"))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let log = || {
        strip_ansi(
            &std::fs::read_to_string(logs.path().join("vllm-router.log")).unwrap_or_default(),
        )
    };
    let a_url = a.url("");
    let a_url = a_url.trim_end_matches('/');
    // Its subscribers start with it; a PUB socket drops what it sends before one is there.
    let subscribed = wait_until(Duration::from_secs(20), || {
        log().matches("kv_index subscriber for ").count() >= 2
    });
    assert!(subscribed, "the router never subscribed");
    std::thread::sleep(Duration::from_millis(300));
    if warm_before_router {
        // Another prompt on A: its batch (seq 3) shows the router the gap it missed.
        chat(
            &a.url("/v1/chat/completions"),
            &messages("another system", "another question"),
        );
    } else {
        warm();
    }
    // Batch 1 holds the prompt's blocks (0 is the start's clear, 2 the reply's). When A was
    // warmed first, it comes from A's replay socket, asked once a later batch shows the gap.
    let how = if warm_before_router { "replay" } else { "" };
    let seen = format!("{how} sequence advanced source={a_url} rank=0 seq=1");
    let arrived = wait_until(Duration::from_secs(20), || log().contains(&seen));
    assert!(arrived, "the router never logged `{seen}`");
    let (a0, b0) = (n(&stats(a), "requests"), n(&stats(b), "requests"));
    let front = format!("http://127.0.0.1:{port}/v1/chat/completions");
    for i in 0..N {
        chat(&front, &messages(&prefix, &format!("question {i}")));
    }
    let (a1, b1) = (n(&stats(a), "requests"), n(&stats(b), "requests"));
    let hits = metrics("vllm_router_kv_placement_lookups_total{result=\"hit\"}");
    let rendered =
        metrics("vllm_router_kv_routing_inputs_total{transport=\"http\",result=\"render\"}");
    assert_eq!(
        (a1 - a0, b1 - b0),
        (N, 0),
        "all {N} to A (router hits {hits})"
    );
    // Not luck: the router rendered each prompt and found its prefix in the events' index.
    assert!(
        rendered >= N as f64,
        "the router rendered each prompt: {rendered}"
    );
    assert!(
        hits >= N as f64,
        "the router's index held the prefix each time: {hits}"
    );
    assert_eq!(n(&stats(a), "kv_event_batches_dropped"), 0);
    drop(router);
}
