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

use inferlb_harness::{free_port, Sim};
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

#[test]
fn vllm_router_routes_by_the_simulators_kv_events() {
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
    let mut cmd = Command::new(router);
    cmd.args(["--worker-urls", &a.url(""), &b.url("")])
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
    // The router subscribes as it starts; a PUB socket drops what it sends before that (the
    // replay socket would heal a gap, but only once a later batch shows one). Its log is no
    // use here (it writes to stdout, which the harness discards), so give it a moment.
    std::thread::sleep(Duration::from_secs(2));

    // A shared prefix of about 2,000 tokens, computed on A only.
    let prefix = "You are a careful assistant. ".repeat(280);
    chat(
        &a.url("/v1/chat/completions"),
        &messages(&prefix, "warm up"),
    );
    assert!(
        n(&stats(a), "kv_event_batches_sent") >= 1,
        "A published its blocks"
    );
    std::thread::sleep(Duration::from_millis(500));
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
