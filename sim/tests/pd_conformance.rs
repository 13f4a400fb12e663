//! The simulator speaks prefill/decode disaggregation as vLLM and SGLang do: the check is made
//! by clients no one here wrote, vLLM's router (`vllm-router --vllm-pd-disaggregation`) and
//! SGLang's gateway (`smg launch --pd-disaggregation`), in front of one producer sim and one
//! consumer sim. Each starts the real binaries on free loopback ports; every process is killed
//! on drop (a panic included) and the logs stay in a temp dir printed on failure.
//!
//! The routers come from `make peers`: `$INFERLB_PEERS_VENV` (default `target/venv-peers`) holds
//! `vllm-router`, `$INFERLB_SMG_VENV` (default `target/venv-smg`) holds `smg`.

mod peers;

use std::process::Command;
use std::time::Duration;

use inferlb_harness::{free_port, Sim};
use peers::{client, n, peer_bin, start_router, stats, Logs};
use serde_json::{json, Value};

/// A user message of about `tokens` tokens (4 bytes each in the simulator).
fn words(tag: &str, tokens: usize) -> String {
    let mut s = format!("{tag}: ");
    while s.len() < tokens * 4 {
        s.push_str("lorem ipsum dolor sit amet ");
    }
    s
}

/// One chat turn through the router: the reply text (checked to have `max_tokens` words).
fn chat(port: u16, messages: &[Value], stream: bool) -> String {
    let max_tokens = 8;
    let send = || {
        let resp = client()
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&json!({"model": "sim-model", "messages": messages, "max_tokens": max_tokens, "stream": stream}))
            .send()
            .expect("the router answers");
        (resp.status(), resp.text().expect("a body"))
    };
    // smg lists the model once its prefill worker is up, and may not have marked the decode
    // worker healthy yet: it then answers 503 before sending anything to either. Bounded.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (status, body) = loop {
        let (status, body) = send();
        let starting = status == 503 && body.contains("no_available_workers");
        if !starting || std::time::Instant::now() > deadline {
            break (status, body);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status, 200, "{body}");
    let text = if stream {
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).expect("a JSON event"))
            .inspect(|v| assert!(v.get("error").is_none(), "{v}"))
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect::<String>()
    } else {
        let v: Value = serde_json::from_str(&body).expect("JSON");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no content in {v}"))
            .to_owned()
    };
    assert_eq!(text.split_whitespace().count(), max_tokens, "{text:?}");
    text
}

/// Two turns of one conversation through a P/D router: the first (not streamed) pulls its
/// whole prompt, the second (streamed) only what the decode's own cache lacks.
fn two_turns(router_port: u16, prefill: &Sim, decode: &Sim) {
    let first = vec![json!({"role": "user", "content": words("turn one", 600)})];
    let reply = chat(router_port, &first, false);
    let (d1, p1) = (stats(decode), stats(prefill));
    assert_eq!(n(&d1, "handover_decode_requests"), 1, "{d1}");
    assert_eq!(n(&d1, "kv_pulls"), 1, "{d1}");
    assert_eq!(n(&d1, "kv_pull_failures"), 0, "{d1}");
    let t1 = n(&d1, "kv_tokens_transferred");
    assert!(t1 >= 600, "the whole prompt moved: {d1}");
    assert!(n(&p1, "handover_prefill_requests") >= 1, "{p1}");
    assert_eq!(
        n(&p1, "kv_leases_pulled"),
        1,
        "the decode took the lease: {p1}"
    );
    assert_eq!(n(&p1, "kv_leases_held"), 0, "{p1}");
    assert_eq!(n(&p1, "handover_fields_seen"), 0, "{p1}");

    let mut second = first.clone();
    second.push(json!({"role": "assistant", "content": reply}));
    second.push(json!({"role": "user", "content": words("turn two", 40)}));
    chat(router_port, &second, true);
    let d2 = stats(decode);
    assert_eq!(n(&d2, "kv_pulls"), 2, "{d2}");
    let t2 = n(&d2, "kv_tokens_transferred") - t1;
    assert!(
        t2 > 0 && t2 < t1 / 4,
        "the second turn pulls only its new part: {t2} after {t1}"
    );
    assert_eq!(n(&d2, "kv_pull_failures"), 0, "{d2}");
}

#[test]
fn vllm_router_runs_pd_against_the_simulator() {
    let logs = Logs::new();
    let router = peer_bin("INFERLB_PEERS_VENV", "venv-peers", "vllm-router");
    let prefill = Sim::start(
        logs.path(),
        "prefill",
        &["--kv-role", "producer", "--speed", "10"],
    );
    let decode = Sim::start(
        logs.path(),
        "decode",
        &["--kv-role", "consumer", "--speed", "10"],
    );
    let port = free_port();
    let mut cmd = Command::new(router);
    cmd.args([
        "--vllm-pd-disaggregation",
        "--prefill",
        &prefill.url(""),
        "none",
    ])
    .args(["--decode", &decode.url(""), "--kv-connector", "nixl"])
    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
    .args(["--prometheus-host", "127.0.0.1"])
    .args(["--prometheus-port", &free_port().to_string()])
    .args([
        "--worker-startup-timeout-secs",
        "30",
        "--log-level",
        "warning",
    ]);
    let _router = start_router(&logs, "vllm-router", cmd, port);
    two_turns(port, &prefill, &decode);
}

#[test]
fn smg_runs_pd_against_the_simulator() {
    let logs = Logs::new();
    let smg = peer_bin("INFERLB_SMG_VENV", "venv-smg", "smg");
    let bootstrap = free_port().to_string();
    let prefill = Sim::start(
        logs.path(),
        "prefill",
        &[
            "--kv-role",
            "producer",
            "--pd-protocol",
            "sglang",
            "--bootstrap-port",
            &bootstrap,
            "--speed",
            "10",
        ],
    );
    let decode = Sim::start(
        logs.path(),
        "decode",
        &[
            "--kv-role",
            "consumer",
            "--pd-protocol",
            "sglang",
            "--speed",
            "10",
        ],
    );
    let port = free_port();
    let mut cmd = Command::new(smg);
    cmd.args([
        "launch",
        "--pd-disaggregation",
        "--prefill",
        &prefill.url(""),
        &bootstrap,
    ])
    .args(["--decode", &decode.url("")])
    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
    .args(["--prometheus-host", "127.0.0.1"])
    .args(["--prometheus-port", &free_port().to_string()])
    .args(["--worker-startup-timeout-secs", "30", "--log-level", "warn"]);
    let _router = start_router(&logs, "smg", cmd, port);
    two_turns(port, &prefill, &decode);
}

/// Failed handovers, sent straight to the sims: vLLM's error shapes, SGLang's bounded wait, and
/// a replica without a connector ignoring (and counting) the fields.
#[test]
fn failed_handovers_fail_as_vllm_does_and_a_plain_replica_ignores_the_fields() {
    let logs = Logs::new();
    let decode = Sim::start(logs.path(), "decode", &["--kv-role", "consumer"]);
    let gone = free_port();
    let ktp = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "nobody", "remote_request_id": "r-unknown", "remote_block_ids": [[0, 1]],
        "remote_host": "127.0.0.1", "remote_port": gone, "remote_num_tokens": 40, "tp_size": 1});
    let body = |stream: bool| {
        json!({"model": "sim-model", "messages": [{"role": "user", "content": words("x", 40)}],
            "max_tokens": 4, "stream": stream, "kv_transfer_params": ktp})
    };
    let c = client();
    let url = decode.url("/v1/chat/completions");
    let r = c.post(&url).json(&body(false)).send().expect("an answer");
    assert_eq!(r.status(), 500);
    let v: Value = r.json().expect("JSON");
    assert_eq!(
        v,
        json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}})
    );
    let r = c.post(&url).json(&body(true)).send().expect("an answer");
    assert_eq!(r.status(), 200);
    let text = r.text().expect("a body");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 3, "{text}");
    let role: Value = serde_json::from_str(events[0]).expect("JSON");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{text}");
    let err: Value = serde_json::from_str(events[1]).expect("JSON");
    assert_eq!(err["error"]["code"], 500, "{text}");
    assert_eq!(events[2], "[DONE]");
    let s = stats(&decode);
    assert_eq!(n(&s, "kv_pull_failures"), 2, "{s}");
    assert_eq!(n(&s, "generation_tokens"), 0, "{s}");

    // SGLang: a room that never becomes ready fails once the (short) lease passes.
    let bootstrap = free_port();
    let prefill = Sim::start(
        logs.path(),
        "sg-prefill",
        &[
            "--kv-role",
            "producer",
            "--pd-protocol",
            "sglang",
            "--bootstrap-port",
            &bootstrap.to_string(),
            "--kv-lease-seconds",
            "0.5",
        ],
    );
    let sg_decode = Sim::start(
        logs.path(),
        "sg-decode",
        &[
            "--kv-role",
            "consumer",
            "--pd-protocol",
            "sglang",
            "--kv-lease-seconds",
            "0.5",
        ],
    );
    let r = c
        .post(sg_decode.url("/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": words("y", 40), "max_tokens": 4,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 12345u64}))
        .send()
        .expect("an answer");
    assert_eq!(r.status(), 500);
    assert_eq!(n(&stats(&sg_decode), "kv_pull_failures"), 1);
    assert_eq!(n(&stats(&prefill), "kv_leases_granted"), 0);

    // No connector: the fields are ignored (the request is served whole) and counted.
    let plain = Sim::start(logs.path(), "plain", &[]);
    let r = c
        .post(plain.url("/v1/chat/completions"))
        .json(&body(false))
        .send()
        .expect("an answer");
    assert_eq!(r.status(), 200);
    let s = stats(&plain);
    assert_eq!(n(&s, "handover_fields_seen"), 1, "{s}");
    assert_eq!(n(&s, "kv_pulls") + n(&s, "kv_pull_failures"), 0, "{s}");
}
