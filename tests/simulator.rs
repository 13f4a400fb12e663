//! The replica simulator on its own: the prefix cache, usage, and every fault mode.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn chat(sim: &Sim, body: &Value) -> reqwest::blocking::Response {
    http()
        .post(sim.url("/v1/chat/completions"))
        .json(body)
        .send()
        .expect("request")
}

#[test]
fn the_next_turn_finds_its_history_warm_and_usage_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let context = "x".repeat(40_000); // 10k tokens
    let t1: Value = chat(
        &sim,
        &chat_body(&[("system", &context), ("user", "a")], false, 8),
    )
    .json()
    .unwrap();
    assert_eq!(t1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt1 = t1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!((10_000..10_100).contains(&prompt1), "{prompt1}");
    let reply = t1["choices"][0]["message"]["content"].as_str().unwrap();
    let t2: Value = chat(
        &sim,
        &chat_body(
            &[
                ("system", &context),
                ("user", "a"),
                ("assistant", reply),
                ("user", "b"),
            ],
            false,
            8,
        ),
    )
    .json()
    .unwrap();
    let cached = t2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The whole first turn, reply included, is warm, up to the last partial block.
    assert!(
        cached >= prompt1,
        "cached {cached} < first prompt {prompt1}"
    );
    let stats = sim.stats();
    assert_eq!(stats["cached_tokens"].as_u64().unwrap(), cached);
    let metrics = http()
        .get(sim.url("/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(metrics.contains(&format!(
        "vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"sim-model\"}} {cached}"
    )));
}

#[test]
fn streams_end_with_usage_and_done() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let mut body = chat_body(&[("user", "hi")], true, 5);
    body["stream_options"] = json!({"include_usage": true});
    let (events, err) = sse_events(chat(&sim, &body));
    assert!(err.is_none());
    let datas: Vec<&str> = events.iter().map(|(_, d)| d.as_str()).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"));
    let usage: Value = serde_json::from_str(datas[datas.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["choices"], json!([]));
    let v: Value = http()
        .get(sim.url("/v1/models"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(v["data"][0]["id"], "sim-model");
}

#[test]
fn faults_refuse_hang_errors_and_slow_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let body = chat_body(&[("user", "q")], false, 1);

    sim.fault(json!({"fault": "error503", "count": 1}));
    assert_eq!(chat(&sim, &body).status(), 503);
    assert_eq!(chat(&sim, &body).status(), 200, "a counted fault runs out");
    sim.fault(json!({"fault": "error500"}));
    let r = chat(&sim, &body);
    assert_eq!(r.status(), 500);
    assert!(r.json::<Value>().unwrap()["error"]["message"].is_string());
    sim.fault(json!({"fault": "hang", "count": 1}));
    let quick = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let r = quick
        .post(sim.url("/v1/chat/completions"))
        .json(&body)
        .send();
    assert!(r.is_err_and(|e| e.is_timeout()));
    sim.fault(json!({"fault": "none"}));

    sim.fault(json!({"fault": "refuse", "seconds": 1.0}));
    assert!(wait_until(Duration::from_secs(3), || TcpStream::connect((
        "127.0.0.1",
        sim.port
    ))
    .is_err()));
    assert!(
        sim.wait_healthy(Duration::from_secs(5)),
        "accepting again after the pause"
    );

    // A slow start, as a restarting vLLM: refused, then /health failing, then healthy.
    sim.restart(&["--refuse-for", "0.6", "--unhealthy-for", "0.8"]);
    let started = Instant::now();
    assert!(TcpStream::connect(("127.0.0.1", sim.port)).is_err());
    assert!(wait_until(Duration::from_secs(5), || TcpStream::connect((
        "127.0.0.1",
        sim.port
    ))
    .is_ok()));
    let status = http().get(sim.url("/health")).send().unwrap().status();
    assert_eq!(status, 503, "listening but not ready yet");
    assert!(sim.wait_healthy(Duration::from_secs(5)));
    assert!(started.elapsed() >= Duration::from_millis(1000));
}

#[test]
fn the_harness_runs_the_binaries_cargo_built_for_these_tests() {
    if std::env::var_os("INFERLB_BIN_DIR").is_some() {
        return; // chosen explicitly
    }
    assert_eq!(
        inferlb_harness::bin_dir(),
        std::path::Path::new(INFERLB).parent().unwrap()
    );
}
