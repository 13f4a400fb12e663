//! End to end: the real binary in front of real simulated replicas, on loopback.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn post(lb: &Lb, path: &str, body: &Value) -> reqwest::blocking::Response {
    http()
        .post(lb.url(path))
        .json(body)
        .send()
        .expect("request")
}

fn header(r: &reqwest::blocking::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

fn failover_lines(lb: &Lb) -> usize {
    lb.proc
        .log_text()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("failover: replica="))
        .count()
}

#[test]
fn the_seed_failover_scene_six_requests_six_200s_one_failover() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b) = two_sims(dir.path(), &["--speed", "20"]);
    // Health checks every 2 s: the data path, not the checker, must notice the dead card.
    let lb = Lb::start(
        dir.path(),
        &[&a, &b],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );
    let mut codes = vec![];
    for i in 0..6 {
        if i == 2 {
            a.stop(); // card gpu0 stopped mid-flight
        }
        let r = post(
            &lb,
            "/v1/chat/completions",
            &chat_body(&[("user", &format!("q{i}"))], false, 2),
        );
        codes.push(r.status().as_u16());
    }
    assert_eq!(codes, vec![200; 6]);
    assert_eq!(failover_lines(&lb), 1, "{}", lb.proc.log_text());
    assert_eq!(
        lb.metric(r#"inferlb_failovers_total{reason="connect_refused",replica="gpu0"}"#),
        1.0
    );
    assert_eq!(lb.replica_state("gpu0")["live"], false);
}

#[test]
fn a_1mb_body_fails_over_intact_with_content_length_and_expect_continue() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b, lb) = cluster(
        dir.path(),
        &["--speed", "50"],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );

    // Turn 1 pins the conversation; then its replica dies and turn 2 (1 MB) must move, whole.
    let context = "c".repeat(1_100_000);
    let turn1 = chat_body(&[("system", &context), ("user", "t1")], false, 2);
    let r = post(&lb, "/v1/chat/completions", &turn1);
    assert_eq!(r.status(), 200);
    let home = header(&r, "x-inferlb-replica");
    let (dead, alive) = if home == "gpu0" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    dead.stop();

    let turn2 = chat_body(
        &[
            ("system", &context),
            ("user", "t1"),
            ("assistant", "x"),
            ("user", "t2"),
        ],
        false,
        2,
    );
    let bytes = serde_json::to_vec(&turn2).unwrap();
    assert!(bytes.len() > 1_000_000);
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(bytes.clone())
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-inferlb-replica"), alive.id);
    assert_eq!(header(&r, "x-inferlb-route"), "repinned");
    assert_eq!(header(&r, "x-sim-body-bytes"), bytes.len().to_string());
    assert_eq!(
        header(&r, "x-sim-body-hash"),
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
    );
    assert_eq!(failover_lines(&lb), 1);

    // Expect: 100-continue: the balancer answers 100 itself and the replica never sees `expect`.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        bytes.len()
    );
    let mut s = std::net::TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    use std::io::{Read, Write};
    s.write_all(head.as_bytes()).unwrap();
    let mut first = [0u8; 25];
    s.read_exact(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first).starts_with("HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&first)
    );
    s.write_all(&bytes).unwrap();
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    assert!(rest.contains("200 OK"), "{rest}");
    assert!(
        rest.contains(&format!("x-sim-body-bytes: {}", bytes.len())),
        "{rest}"
    );
}

/// The replica saw exactly these body bytes (it reports their hash).
fn assert_body_arrived(resp: &str, body: &[u8]) {
    let hash = format!("x-sim-body-hash: {:016x}", xxhash_rust::xxh3::xxh3_64(body));
    assert!(resp.contains(&hash), "{resp}");
}

fn chunked(data: &[u8], piece: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in data.chunks(piece) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

const CHUNKED_HEAD: &str =
    "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";

#[test]
fn chunked_bodies_of_1mb_fail_over_intact() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, _b, lb) = cluster(
        dir.path(),
        &["--speed", "50"],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );
    let small = serde_json::to_vec(&chat_body(&[("user", &"s".repeat(50_000))], false, 1)).unwrap();
    let resp = raw_exchange(
        lb.port,
        CHUNKED_HEAD,
        &chunked(&small, 7000),
        Duration::from_secs(20),
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_body_arrived(&resp, &small);

    // gpu0 dies; requests alternate, so within two of them one is refused and fails over.
    a.stop();
    for i in 0..2 {
        let big = serde_json::to_vec(&chat_body(
            &[("user", &format!("{i}{}", "b".repeat(1_000_000)))],
            false,
            1,
        ))
        .unwrap();
        let resp = raw_exchange(
            lb.port,
            CHUNKED_HEAD,
            &chunked(&big, 16_000),
            Duration::from_secs(20),
        );
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("x-inferlb-replica: gpu1"), "{resp}");
        assert_body_arrived(&resp, &big);
    }
    assert_eq!(failover_lines(&lb), 1, "{}", lb.proc.log_text());

    // A chunked body over 64 KiB that is not JSON cannot be replayed: a clear 411.
    let resp = raw_exchange(
        lb.port,
        CHUNKED_HEAD,
        &chunked(&vec![b'z'; 200_000], 9000),
        Duration::from_secs(20),
    );
    assert!(resp.starts_with("HTTP/1.1 411"), "{resp}");
    assert!(
        resp.contains("\"error\"") && resp.contains("Content-Length"),
        "{resp}"
    );
}

#[test]
fn body_limits_and_stalls_get_openai_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            max_body_bytes: Some(100_000),
            body_read_timeout_seconds: Some(1.0),
            ..test_conf()
        },
    );
    let r = http()
        .post(lb.url("/v1/completions"))
        .body(vec![b'x'; 200_000])
        .send()
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], 413);
    assert!(v["error"]["message"].as_str().unwrap().contains("100000"));

    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let mut body = Vec::new();
    for _ in 0..30 {
        body.extend_from_slice(format!("{:x}\r\n", 5000).as_bytes());
        body.extend_from_slice(&[b'y'; 5000]);
        body.extend_from_slice(b"\r\n");
    }
    let resp = raw_exchange(lb.port, head, &body, Duration::from_secs(10));
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");

    // A client that stalls mid-body is cut off by the total deadline, not held forever.
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n";
    let started = Instant::now();
    let resp = raw_exchange(
        lb.port,
        head,
        b"{\"prompt\": \"only part",
        Duration::from_secs(15),
    );
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(started.elapsed() < Duration::from_secs(14));
    // And the balancer still serves the next request.
    let r = post(
        &lb,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(r.status(), 200);
}

#[test]
fn a_stream_cut_after_its_first_bytes_is_not_retried_and_ends_for_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, lb) = cluster(dir.path(), &[], test_conf());
    for s in [&a, &b] {
        s.fault(json!({"fault": "cut_stream"}));
    }
    let r = post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "cut me")], true, 50),
    );
    assert_eq!(r.status(), 200);
    let (events, err) = sse_events(r);
    let datas: Vec<&str> = events.iter().map(|(_, d)| d.as_str()).collect();
    assert!(datas.len() >= 2, "the first bytes arrived: {datas:?}");
    assert!(
        err.is_some(),
        "the connection ends without a clean end of body, so it is not reused"
    );
    assert!(
        !datas.contains(&"[DONE]"),
        "a cut stream must not look complete: {datas:?}"
    );
    let last: Value = serde_json::from_str(datas.last().unwrap()).unwrap();
    assert!(
        last["error"]["message"].is_string(),
        "ends with an error event: {datas:?}"
    );
    let served: u64 = [&a, &b]
        .iter()
        .map(|s| s.stats()["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(served, 1, "never retried once streaming began");
    assert_eq!(lb.metric("inferlb_stream_errors_total"), 1.0);
    assert_eq!(failover_lines(&lb), 0);
}

/// The data events of a stream, and whether it ended cleanly with `[DONE]` and no error event.
fn stream_whole(r: reqwest::blocking::Response) -> (Vec<String>, bool) {
    let (events, err) = sse_events(r);
    let datas: Vec<String> = events.into_iter().map(|(_, d)| d).collect();
    let whole = err.is_none()
        && datas.last().map(String::as_str) == Some("[DONE]")
        && !datas.iter().any(|d| d.contains("\"error\""));
    (datas, whole)
}

/// A replica lost during a prefill has sent its stream's header and nothing else: the client
/// holds a 200 and no byte of the answer, so the stream goes on, whole, from the other
/// replica. When that one breaks the same way, the stream ends with an error event, never
/// hangs and never looks complete. (Completions: the simulator's `cut_before_token` sends a
/// chat stream's role chunk before it cuts, which vLLM sends only with the first token.)
#[test]
fn a_stream_cut_before_its_first_token_goes_on_from_another_replica() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, lb) = cluster(dir.path(), &[], test_conf());
    a.fault(json!({"fault": "cut_before_token", "count": 1}));
    // Whichever replica the routing picks first, the faulted one is picked within a few.
    let mut resumed = None;
    for i in 0..4 {
        let r = post(
            &lb,
            "/v1/completions",
            &json!({"prompt": format!("resume me {i}"), "max_tokens": 8, "stream": true}),
        );
        assert_eq!(r.status(), 200, "request {i}");
        let first = header(&r, "x-inferlb-replica");
        let (datas, whole) = stream_whole(r);
        assert!(whole, "request {i} (header from {first}): {datas:?}");
        // Exactly one answer: its 8 tokens once, one end.
        let tokens = datas
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter(|v| {
                v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
            .count();
        assert_eq!(tokens, 8, "request {i}: {datas:?}");
        assert_eq!(datas.iter().filter(|d| *d == "[DONE]").count(), 1);
        if first == "gpu0" {
            resumed = Some(i);
            break;
        }
    }
    assert!(resumed.is_some(), "gpu0 was never chosen");
    assert_eq!(a.stats()["requests"].as_u64(), Some(1), "gpu0 took it once");
    assert_eq!(
        lb.metric(r#"inferlb_failovers_total{reason="connection_closed",replica="gpu0"}"#),
        1.0,
        "{}",
        lb.metrics()
    );
    assert_eq!(lb.metric("inferlb_stream_errors_total"), 0.0);
    // Served: no replica's failure ended it.
    let final_errors = lb.samples("inferlb_upstream_errors_total");
    assert!(final_errors.is_empty(), "{final_errors:?}");
    assert_eq!(failover_lines(&lb), 1);
    let log = lb.proc.log_text();
    assert!(!log.contains("Fail to proxy"), "{log}");
    // Its access line names the replica that served it, after one failover, as a 200.
    let served = log
        .lines()
        .any(|l| l.contains("replica=gpu1 attempts=2 failovers=1 status=200"));
    assert!(served, "{log}");

    // Both break before their first token: no replica is left, the stream ends in an error.
    for s in [&a, &b] {
        s.fault(json!({"fault": "cut_before_token", "count": 1}));
    }
    // gpu0 was demoted by the cut: wait for its health check to readmit it.
    let readmitted = wait_until(Duration::from_secs(30), || {
        lb.metric(r#"inferlb_replica_up{replica="gpu0"}"#) == 1.0
    });
    assert!(readmitted, "{}", lb.metrics());
    let served = |s: &Sim| s.stats()["requests"].as_u64().unwrap_or(0);
    let before = served(&a) + served(&b);
    let r = post(
        &lb,
        "/v1/completions",
        &json!({"prompt": "cut twice", "max_tokens": 8, "stream": true}),
    );
    assert_eq!(r.status(), 200);
    let (datas, whole) = stream_whole(r);
    assert!(!whole, "{datas:?}");
    let last: Value = serde_json::from_str(datas.last().expect("an event")).expect("json");
    assert!(last["error"]["message"].is_string(), "{datas:?}");
    assert_eq!(
        served(&a) + served(&b),
        before + 2,
        "each replica tried once"
    );
    assert_eq!(lb.metric("inferlb_stream_errors_total"), 1.0);
    // The last replica tried ended it: one final error, for it alone.
    let final_errors = lb.samples("inferlb_upstream_errors_total");
    let total: f64 = final_errors.iter().map(|(_, v)| v).sum();
    assert_eq!(total, 1.0, "{final_errors:?}");
}

#[test]
fn sse_is_relayed_event_by_event() {
    let dir = tempfile::tempdir().unwrap();
    // 100 ms between tokens: a buffering proxy would deliver all 12 events at once.
    let (_a, _b, lb) = cluster(dir.path(), &["--decode-interval-ms", "100"], test_conf());
    let r = post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "stream")], true, 12),
    );
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    let (events, err) = sse_events(r);
    assert!(err.is_none());
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let first = events[1].0; // the first token
    let last = events.last().unwrap().0;
    assert!(
        last.duration_since(first) >= Duration::from_millis(500),
        "events arrived together"
    );
}

#[test]
fn a_burst_spreads_8_8_and_an_agent_loop_stays_pinned() {
    let dir = tempfile::tempdir().unwrap();
    // Slow enough that the 16 requests all arrive before the first prefill is over, even on
    // a loaded machine (at speed 20 a run in six split 9/7 under load: a late request found
    // the prefix already cached).
    let (_a, _b, lb) = cluster(dir.path(), &["--speed", "5"], test_conf());
    let prefix = "shared context ".repeat(2000);
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let url = lb.url("/v1/chat/completions");
            let body = chat_body(
                &[("system", &prefix), ("user", &format!("task {i}"))],
                false,
                8,
            );
            std::thread::spawn(move || {
                let r = http().post(url).json(&body).send().unwrap();
                assert_eq!(r.status(), 200);
                (
                    header(&r, "x-inferlb-replica"),
                    header(&r, "x-inferlb-route"),
                )
            })
        })
        .collect();
    let mut split: HashMap<String, usize> = HashMap::new();
    for h in handles {
        let (replica, route) = h.join().unwrap();
        assert_eq!(route, "spread");
        *split.entry(replica).or_default() += 1;
    }
    assert_eq!(split.get("gpu0"), Some(&8), "{split:?}");
    assert_eq!(split.get("gpu1"), Some(&8), "{split:?}");

    let mut history: Vec<(String, String)> = vec![("system".into(), prefix.clone())];
    let mut seen = vec![];
    for turn in 0..5 {
        history.push(("user".into(), format!("turn {turn}")));
        let refs: Vec<(&str, &str)> = history
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let r = post(&lb, "/v1/chat/completions", &chat_body(&refs, false, 4));
        let (replica, route) = (
            header(&r, "x-inferlb-replica"),
            header(&r, "x-inferlb-route"),
        );
        let v: Value = r.json().unwrap();
        history.push((
            "assistant".into(),
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        ));
        seen.push((
            replica,
            route,
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        ));
    }
    eprintln!("agent loop: {seen:?}");
    assert_eq!(seen[0].1, "spread");
    for (replica, route, cached) in &seen[1..] {
        assert_eq!((replica, route.as_str()), (&seen[0].0, "pinned"));
        assert!(*cached > 7000, "the history was warm: {cached}");
    }
}

#[test]
fn no_live_replica_is_an_immediate_503_in_openai_format() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b, lb) = cluster(dir.path(), &[], test_conf());
    a.stop();
    b.stop();
    for _ in 0..3 {
        let started = Instant::now();
        let r = post(
            &lb,
            "/v1/chat/completions",
            &chat_body(&[("user", "x")], false, 1),
        );
        assert_eq!(r.status(), 503);
        let v: Value = r.json().unwrap();
        assert_eq!(v["error"]["code"], 503);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn health_checks_log_each_transition_once_and_readmit_a_demoted_replica() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, _b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            health_interval_seconds: Some(0.3),
            ..test_conf()
        },
    );
    a.stop();
    assert!(wait_until(Duration::from_secs(10), || lb
        .proc
        .log_text()
        .contains("replica gpu0 (")
        && lb.proc.log_text().contains("is down")));
    std::thread::sleep(Duration::from_secs(1)); // more failed checks: still one line
    a.restart(&[]);
    assert!(wait_until(Duration::from_secs(10), || lb
        .replica_state("gpu0")["live"]
        == true));
    std::thread::sleep(Duration::from_secs(1));
    let log = lb.proc.log_text();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("replica gpu0") && l.contains("is down"))
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("replica gpu0") && l.contains("is up"))
            .count(),
        1,
        "{log}"
    );
    // Back in rotation: fresh requests reach it again.
    let replicas: Vec<String> = (0..4)
        .map(|i| {
            header(
                &post(
                    &lb,
                    "/v1/completions",
                    &json!({"prompt": format!("p{i}"), "max_tokens": 1}),
                ),
                "x-inferlb-replica",
            )
        })
        .collect();
    assert!(replicas.contains(&"gpu0".to_string()), "{replicas:?}");
    assert_eq!(lb.metric(r#"inferlb_replica_up{replica="gpu0"}"#), 1.0);
}

#[test]
fn the_api_is_proxied_models_and_other_paths_included() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(dir.path(), &["--speed", "20"], test_conf());
    let v: Value = http()
        .get(lb.url("/v1/models"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(v["data"][0]["id"], "sim-model");
    let r = post(
        &lb,
        "/v1/completions",
        &json!({"model": "sim-model", "prompt": "once upon", "max_tokens": 3}),
    );
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let r = post(
        &lb,
        "/v1/completions",
        &json!({"prompt": "s", "max_tokens": 3, "stream": true}),
    );
    let (events, _) = sse_events(r);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    // Any other path is not the inference API: it never reaches a replica.
    let r = http().get(lb.url("/metrics")).send().unwrap();
    assert_eq!(r.status(), 404);
    assert!(!r.text().unwrap().contains("vllm:num_requests_running"));
    // A body that is not JSON is routed as fresh; the replica's 400 comes back.
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .body("not json")
        .send()
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-inferlb-route"), "spread");
}

#[test]
fn a_scrape_passes_promtool() {
    let dir = tempfile::tempdir().unwrap();
    // Slow health checks: the stopped replica below is found by a request, which fails over.
    let (mut a, _b, lb) = cluster(
        dir.path(),
        &["--speed", "20"],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );
    post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "x")], false, 1),
    );
    // A failover, so that the failover counter has a sample (a counter vector has none, not
    // even its HELP line, until one is counted).
    a.stop();
    for i in 0..4 {
        let r = post(
            &lb,
            "/v1/chat/completions",
            &chat_body(&[("user", &format!("f{i}"))], false, 1),
        );
        assert_eq!(r.status(), 200);
    }
    let text = lb.metrics();
    for name in [
        "inferlb_requests_total",
        "inferlb_failovers_total",
        "inferlb_replica_up",
        "inferlb_replica_in_flight",
        "inferlb_affinity_entries",
        "inferlb_time_to_first_byte_seconds_bucket",
    ] {
        assert!(
            !samples_of(&text, name).is_empty(),
            "{name} has no sample:\n{text}"
        );
    }
    assert_eq!(
        sample_value(
            &text,
            r#"inferlb_failovers_total{reason="connect_refused",replica="gpu0"}"#
        ),
        Some(1.0),
        "{text}"
    );
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed by `make deps`");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_conf_is_refused_with_the_key_named_and_dash_t_checks_it() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_inferlb");
    let good =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/inferlb.yaml")).unwrap();
    let ok = std::process::Command::new(bin)
        .args([
            "-t",
            "-c",
            concat!(env!("CARGO_MANIFEST_DIR"), "/conf/inferlb.yaml"),
        ])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    for (bad, key) in [
        (
            good.replace("  routing: prefill_cost", "  routing: fastest"),
            "fastest",
        ),
        (
            good.replace("  affinity_capacity:", "  affinity_capacty:"),
            "affinity_capacty",
        ),
        (good.replace("max_retries:", "max_retry:"), "max_retry"),
    ] {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, bad).unwrap();
        for flags in [&["-t", "-c"][..], &["-c"][..]] {
            let out = std::process::Command::new(bin)
                .args(flags)
                .arg(&path)
                .output()
                .unwrap();
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(key), "{key} not named in: {err}");
        }
    }
    let out = std::process::Command::new(bin)
        .args([
            "-t",
            "-c",
            concat!(env!("CARGO_MANIFEST_DIR"), "/conf/inferlb.yaml"),
        ])
        .env("ROUTING", "random")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ROUTING"));
}

#[test]
fn a_replica_that_resets_after_reading_the_request_fails_over() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _b, lb) = cluster(
        dir.path(),
        &["--speed", "50"],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );
    // Warm the upstream pool so later attempts reuse pooled connections too.
    for i in 0..4 {
        let r = post(
            &lb,
            "/v1/completions",
            &json!({"prompt": format!("warm {i}"), "max_tokens": 1}),
        );
        assert_eq!(r.status(), 200);
    }
    a.fault(json!({"fault": "reset"}));
    for i in 0..6 {
        let r = post(
            &lb,
            "/v1/chat/completions",
            &chat_body(&[("user", &format!("r{i}"))], i % 2 == 0, 2),
        );
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(header(&r, "x-inferlb-replica"), "gpu1");
        let _ = r.bytes();
    }
    assert!(
        lb.metric(r#"inferlb_failovers_total{reason="connection_closed",replica="gpu0"}"#) >= 1.0,
        "{}",
        lb.metrics()
    );
    assert!(
        !lb.proc.log_text().contains("panicked"),
        "{}",
        lb.proc.log_text()
    );
}

#[test]
fn replica_503s_fail_over_500s_pass_through_and_a_hang_is_a_504() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, lb) = cluster(
        dir.path(),
        &["--speed", "50"],
        LbConf {
            health_interval_seconds: Some(2.0),
            upstream_read_timeout_seconds: Some(1.0),
            ..test_conf()
        },
    );
    // A starting or overloaded vLLM says 503: the request produced nothing, another replica serves it.
    a.fault(json!({"fault": "error503"}));
    for i in 0..4 {
        let r = post(
            &lb,
            "/v1/chat/completions",
            &chat_body(&[("user", &format!("x{i}"))], false, 1),
        );
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-inferlb-replica"), "gpu1");
    }
    assert!(lb.metric(r#"inferlb_failovers_total{reason="http_503",replica="gpu0"}"#) >= 1.0);
    // Both 503: the client gets a 503 in OpenAI's format, saying a replica answered it (not
    // that none was live: both are, once gpu0's passing check re-admits it).
    b.fault(json!({"fault": "error503"}));
    let both_live = || {
        wait_until(Duration::from_secs(10), || {
            ["gpu0", "gpu1"]
                .iter()
                .all(|id| lb.replica_state(id)["live"] == true)
        })
    };
    assert!(both_live(), "{}", lb.admin("GET", "/admin/replicas"));
    let r = post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "both")], false, 1),
    );
    assert_eq!(r.status(), 503);
    let message = r.json::<Value>().unwrap()["error"]["message"].clone();
    assert!(
        message.as_str().is_some_and(|m| m.contains("answered 503")),
        "{message}"
    );
    // A 500 is the replica's answer about this request: it goes back as it is.
    a.fault(json!({"fault": "error500"}));
    b.fault(json!({"fault": "error500"}));
    assert!(both_live(), "{}", lb.admin("GET", "/admin/replicas"));
    let r = post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "e")], false, 1),
    );
    assert_eq!(r.status(), 500);
    assert!(!header(&r, "x-inferlb-replica").is_empty());
    // A replica that never answers: 504 after the read timeout, and no retry (it is still working).
    a.fault(json!({"fault": "hang"}));
    b.fault(json!({"fault": "hang"}));
    let before = failover_lines(&lb);
    let r = post(
        &lb,
        "/v1/chat/completions",
        &chat_body(&[("user", "h")], false, 1),
    );
    assert_eq!(r.status(), 504);
    assert_eq!(r.json::<Value>().unwrap()["error"]["code"], 504);
    assert_eq!(failover_lines(&lb), before);
}

#[test]
fn metric_lookups_find_exact_samples_and_nothing_else() {
    let scrape = "# HELP inferlb_failovers_total Attempts that failed.\n\
                  # TYPE inferlb_failovers_total counter\n\
                  inferlb_failovers_total{reason=\"connect_refused\",replica=\"gpu0\"} 2\n\
                  inferlb_stream_errors_total 1\n\
                  inferlb_time_to_first_byte_seconds_sum{route=\"spread\"} 0.5\n";
    let refused = r#"inferlb_failovers_total{reason="connect_refused",replica="gpu0"}"#;
    assert_eq!(sample_value(scrape, refused), Some(2.0));
    assert_eq!(
        sample_value(scrape, "inferlb_stream_errors_total"),
        Some(1.0)
    );
    // A wrong label, a label set cut short, a name that is only a prefix: no sample, so
    // `Lb::metric` fails the test instead of reading 0.
    for wrong in [
        r#"inferlb_failovers_total{reason="http_503",replica="gpu0"}"#,
        r#"inferlb_failovers_total{reason="connect_refused""#,
        "inferlb_stream_errors",
        "inferlb_time_to_first_byte_seconds",
    ] {
        assert_eq!(sample_value(scrape, wrong), None, "{wrong}");
    }
    assert_eq!(
        samples_of(scrape, "inferlb_failovers_total"),
        vec![(
            r#"{reason="connect_refused",replica="gpu0"}"#.to_string(),
            2.0
        )]
    );
    assert!(samples_of(scrape, "inferlb_time_to_first_byte_seconds").is_empty());
}
