//! Hostile and broken input, access control, header hygiene and cancellation, against the
//! running binary.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use common::*;
use serde_json::Value;

fn status_and_body(resp: &str) -> (u16, String) {
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

fn post_raw(port: u16, path: &str, extra_headers: &str, body: &[u8]) -> (u16, String) {
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n{extra_headers}connection: close\r\n\r\n",
        body.len()
    );
    status_and_body(&raw_exchange(port, &head, body, Duration::from_secs(15)))
}

fn is_openai_error(body: &str) -> bool {
    serde_json::from_str::<Value>(body).is_ok_and(|v| v["error"]["message"].is_string())
}

#[test]
fn bad_input_gets_clear_answers_and_the_balancer_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            max_body_bytes: Some(100_000),
            body_read_timeout_seconds: Some(1.0),
            max_header_bytes: Some(16384),
            ..test_conf()
        },
    );
    let chat = "/v1/chat/completions";
    // What the balancer cannot classify is routed as fresh; the replica's own answer comes back.
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("body that is not JSON", b"hello".to_vec(), 400),
        ("JSON that is not an object", b"[1, 2, 3]".to_vec(), 400),
        (
            "messages not a list",
            br#"{"messages": "hi"}"#.to_vec(),
            400,
        ),
        (
            "messages holding non-objects",
            br#"{"messages": [1, "two"]}"#.to_vec(),
            400,
        ),
        (
            "invalid UTF-8",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
        ),
        ("a 0-byte body", vec![], 400),
        ("a body over the limit", vec![b'x'; 200_000], 413),
    ];
    let mut seen = vec![];
    for (what, body, want) in cases {
        let (status, text) = post_raw(lb.port, chat, "", &body);
        seen.push(format!("{what}: {status}"));
        assert_eq!(status, want, "{what}: {text}");
        assert!(is_openai_error(&text), "{what}: {text}");
    }
    // A client that uploads all of a large body before it reads the answer still gets the 413
    // (inferlb reads and drops the rest instead of resetting the connection under it).
    let r = http()
        .post(lb.url("/v1/completions"))
        .body(vec![b'z'; 16_000_000])
        .send()
        .expect("the 413 arrives, not a reset");
    assert_eq!(r.status(), 413);
    seen.push("a 16 MB body over the limit, sent whole: 413".into());
    // A chunked body over the limit.
    let mut chunked = Vec::new();
    for _ in 0..30 {
        chunked.extend_from_slice(b"1388\r\n");
        chunked.extend_from_slice(&[b'y'; 5000]);
        chunked.extend_from_slice(b"\r\n");
    }
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let (status, text) = status_and_body(&raw_exchange(
        lb.port,
        head,
        &chunked,
        Duration::from_secs(10),
    ));
    seen.push(format!("a chunked body over the limit: {status}"));
    assert_eq!(status, 413, "{text}");
    // A Content-Length larger than what is sent, then the client closes its side: 400.
    let mut s = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{\"prompt\": \"x",
    )
    .unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let (status, text) = status_and_body(&out);
    seen.push(format!(
        "a Content-Length larger than what is sent: {status}"
    ));
    assert_eq!(status, 400, "{out}");
    assert!(is_openai_error(&text));
    // ... and one that stalls: cut off by the total deadline.
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n";
    let (status, text) = status_and_body(&raw_exchange(
        lb.port,
        head,
        b"{\"prompt\"",
        Duration::from_secs(10),
    ));
    seen.push(format!("a client that stalls mid-body: {status}"));
    assert_eq!(status, 408, "{text}");
    // Oversized headers.
    let big = format!("x-junk: {}\r\n", "j".repeat(20_000));
    let (status, text) = post_raw(lb.port, chat, &big, br#"{"messages": []}"#);
    seen.push(format!("oversized headers: {status}"));
    assert_eq!(status, 431, "{text}");
    assert!(is_openai_error(&text));
    // Expect: 100-continue with a body that will be refused: 413 at once, no 100, no body read.
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000000\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n";
    let resp = raw_exchange(lb.port, head, b"", Duration::from_secs(10));
    seen.push(format!(
        "Expect: 100-continue with a rejected body: {}",
        status_and_body(&resp).0
    ));
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(!resp.contains("100 Continue"));
    eprintln!("bad input: {seen:#?}");

    // Still serving, and never panicked.
    let r = http()
        .post(lb.url(chat))
        .json(&chat_body(&[("user", "fine")], false, 1))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!lb.proc.log_text().contains("panicked"));
}

#[test]
fn api_keys_guard_the_api_and_upstream_keys_replace_the_clients() {
    let dir = tempfile::tempdir().unwrap();
    let a = Sim::start(dir.path(), "gpu0", &[]);
    let lb = Lb::start(
        dir.path(),
        &[&a],
        LbConf {
            api_keys: vec!["client-key-1234".into(), "other-key-5678".into()],
            // `/health` is neither forwarded nor open unless the conf says so.
            extra: "  forward_paths: [/health]\n  public_paths: [/health]\n".into(),
            ..test_conf()
        },
    );
    let c = http();
    for auth in [
        None,
        Some("Bearer wrong-key-0000"),
        Some("client-key-1234"),
        Some("Bearer client-key-12345"),
    ] {
        let mut req =
            c.post(lb.url("/v1/chat/completions"))
                .json(&chat_body(&[("user", "x")], false, 1));
        if let Some(h) = auth {
            req = req.header("authorization", h);
        }
        let r = req.send().unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("API key"));
    }
    for key in ["client-key-1234", "other-key-5678"] {
        let r = c
            .post(lb.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&chat_body(&[("user", "x")], false, 1))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // A path the conf makes public is open; every other path needs the key, and a path not
    // forwarded is refused even with it.
    assert_eq!(c.get(lb.url("/health")).send().unwrap().status(), 200);
    assert_eq!(c.post(lb.url("/invocations")).send().unwrap().status(), 401);
    assert_eq!(c.get(lb.url("/v1/models")).send().unwrap().status(), 401);
    let keyed = c
        .post(lb.url("/invocations"))
        .bearer_auth("client-key-1234");
    assert_eq!(keyed.send().unwrap().status(), 404);
    // Keys never reach the logs.
    let log = lb.proc.log_text();
    assert!(
        !log.contains("client-key-1234") && !log.contains("wrong-key"),
        "{log}"
    );
}

#[test]
fn upstream_keys_hop_by_hop_headers_and_absolute_uris() {
    let dir = tempfile::tempdir().unwrap();
    let a = Sim::start(dir.path(), "gpu0", &[]);
    // Nothing but the replica and its key: inferlb's own defaults for everything else.
    let lb = Lb::start(
        dir.path(),
        &[],
        LbConf {
            replicas: vec![Replica {
                api_key: Some("replica-secret".into()),
                ..Replica::of(&a)
            }],
            extra: "  forward_paths: [/sim/echo]\n".into(),
            ..LbConf::default()
        },
    );
    let port = lb.port;
    // An absolute URI naming another host, hop-by-hop headers, and the client's own key.
    let head = "GET http://evil.example:9/sim/echo?q=1 HTTP/1.1\r\nhost: evil.example:9\r\n\
                authorization: Bearer client-secret\r\nconnection: close, x-private\r\nx-private: 1\r\n\
                keep-alive: timeout=5\r\nproxy-authorization: Basic abc\r\nte: trailers\r\nupgrade: h2c\r\nx-kept: yes\r\n\r\n";
    let (status, body) = status_and_body(&raw_exchange(port, head, b"", Duration::from_secs(10)));
    assert_eq!(status, 200, "{body}");
    let echo: Value = serde_json::from_str(body.trim()).unwrap_or_else(|_| {
        // A chunked body: take the JSON between the chunk framing.
        serde_json::from_str(body.lines().find(|l| l.starts_with('{')).unwrap()).unwrap()
    });
    let h = &echo["headers"];
    assert_eq!(echo["uri"], "/sim/echo?q=1", "origin-form only: {echo}");
    assert_eq!(h["host"], a.addr(), "the replica's own address: {echo}");
    assert_eq!(h["authorization"], "Bearer replica-secret");
    for gone in [
        "x-private",
        "keep-alive",
        "proxy-authorization",
        "te",
        "upgrade",
    ] {
        assert!(h.get(gone).is_none(), "{gone} was forwarded: {echo}");
    }
    assert_eq!(h["x-kept"], "yes");
}

#[test]
fn disconnected_clients_cancel_their_upstream_requests_and_nothing_leaks() {
    let dir = tempfile::tempdir().unwrap();
    // Slow prefill (a long prompt takes ~2 s) and slow decode: plenty of time to hang up.
    let extra = [
        "--prefill-tokens-per-s",
        "2000",
        "--decode-interval-ms",
        "100",
    ];
    let (a, b, lb) = cluster(dir.path(), &extra, test_conf());
    let mut threads = vec![];
    for i in 0..24 {
        let url = lb.url("/v1/chat/completions");
        threads.push(std::thread::spawn(move || {
            let waiting = i % 2 == 0;
            // Half hang up while the replica is still in prefill, half once the stream flows.
            let prompt = if waiting {
                "p ".repeat(2_000)
            } else {
                format!("short {i}")
            };
            let client = reqwest::blocking::Client::builder()
                .timeout(Duration::from_millis(if waiting { 300 } else { 3000 }))
                .build()
                .unwrap();
            let sent = client
                .post(url)
                .json(&chat_body(&[("user", &prompt)], true, 200))
                .send();
            // The answer's status, then the first event (or the client's timeout), then hang up.
            let status = sent.map(|mut r| {
                let mut buf = [0u8; 256];
                let _ = r.read(&mut buf);
                r.status().as_u16()
            });
            (waiting, status.map_err(|e| e.to_string()))
        }));
    }
    for t in threads {
        let (waiting, read) = t.join().unwrap();
        // The streaming half was answered; the other half may hang up before its headers.
        if !waiting {
            assert_eq!(read, Ok(200));
        }
    }
    // Every request reached a replica, so the quiet below is the cancellations' doing.
    let reached = wait_until(Duration::from_secs(10), || {
        [&a, &b]
            .iter()
            .map(|s| s.stats()["requests"].as_u64().unwrap_or(0))
            .sum::<u64>()
            == 24
    });
    assert!(reached, "{} {}", a.stats(), b.stats());
    let quiet = wait_until(Duration::from_secs(10), || {
        [&a, &b]
            .iter()
            .all(|s| s.stats()["running"] == 0 && s.stats()["waiting"] == 0)
    });
    assert!(
        quiet,
        "replicas still generating: {} {}",
        a.stats(),
        b.stats()
    );
    assert!(wait_until(Duration::from_secs(5), || {
        lb.metric(r#"inferlb_replica_in_flight{replica="gpu0"}"#) == 0.0
            && lb.metric(r#"inferlb_replica_in_flight{replica="gpu1"}"#) == 0.0
    }));
    let generated: u64 = [&a, &b]
        .iter()
        .map(|s| s.stats()["generation_tokens"].as_u64().unwrap())
        .sum();
    assert!(
        (12..24 * 40).contains(&generated),
        "generation began and stopped early: {generated} tokens"
    );
}

#[test]
fn pipelined_requests_are_answered_in_order_on_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(dir.path(), &[], test_conf());
    let chat = |text: &str| {
        raw_post(
            "/v1/chat/completions",
            &chat_body(&[("user", text)], false, 2).to_string(),
        )
    };
    // Four requests in one write: a chat, one the replica refuses, one the balancer answers
    // itself, another chat.
    let mut s = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    let all = format!(
        "{}{}GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n{}",
        chat("first"),
        raw_post("/v1/chat/completions", "hello"),
        chat("fourth")
    );
    s.write_all(all.as_bytes()).unwrap();
    let got = read_responses(&mut s, 4, Duration::from_secs(10));
    let statuses: Vec<u16> = got.iter().map(|(status, _)| *status).collect();
    assert_eq!(statuses, [200, 400, 200, 200], "{got:?}");
    assert!(got[0].1.contains("chat.completion"), "{}", got[0].1);
    assert!(got[2].1.contains("sim-model"), "{}", got[2].1);
    assert!(got[3].1.contains("chat.completion"), "{}", got[3].1);
    // The connection stays open for more, sent one at a time.
    s.write_all(chat("fifth").as_bytes()).unwrap();
    let more = read_responses(&mut s, 1, Duration::from_secs(10));
    assert_eq!(more.first().map(|r| r.0), Some(200), "{more:?}");
}

/// A listener address inferlb cannot bind stops it at start with the key and the reason; it
/// does not run on without that listener (Pingora alone gives up on the one listener and
/// leaves the process serving without it).
#[test]
fn an_address_that_cannot_be_bound_stops_inferlb_at_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("inferlb.yaml");
    let d = dir.path().display();
    // 192.0.2.1 (TEST-NET-1) is no address of this host: binding it fails at once.
    std::fs::write(
        &conf,
        format!(
            "pid_file: {d}/lb.pid\nupgrade_sock: {d}/lb.sock\ninferlb:\n  listen: 127.0.0.1:{}\n  \
             admin_listen: 192.0.2.1:{}\n  admin: {{token_env: INFERLB_TEST_ADMIN_TOKEN}}\n  \
             replicas:\n    - {{id: a, address: \"127.0.0.1:{}\"}}\n",
            free_port(),
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    let log = dir.path().join("inferlb.log");
    let mut cmd = std::process::Command::new(inferlb_harness::bin("inferlb"));
    // A non-loopback admin listener needs a token (issue 21) before it gets to the bind.
    cmd.arg("-c")
        .arg(&conf)
        .env("INFERLB_TEST_ADMIN_TOKEN", "a-token-for-this-test-only");
    let mut p = Proc::spawn("inferlb", cmd, Some(&log), Signal::SIGINT).unwrap();
    let status = p.wait_exit(Duration::from_secs(10));
    let text = p.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{text}");
    assert!(
        text.contains("inferlb.admin_listen: cannot listen on 192.0.2.1:"),
        "{text}"
    );
}

/// An address still in use at start (an old process still stopping) is waited for.
#[test]
fn an_address_still_in_use_at_start_is_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = two_sims(dir.path(), &[]);
    let admin_port = free_port();
    let held = std::net::TcpListener::bind(("127.0.0.1", admin_port)).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        drop(held);
    });
    let lb = Lb::start(
        dir.path(),
        &[&a, &b],
        LbConf {
            admin_port,
            ..test_conf()
        },
    );
    release.join().unwrap();
    // inferlb waited itself (Pingora alone would retry too, then run on without the listener).
    let log = lb.proc.log_text();
    assert!(
        log.contains(&format!(
            "inferlb.admin_listen 127.0.0.1:{admin_port} is in use: waiting"
        )),
        "{log}"
    );
    assert!(lb.metrics().contains("inferlb_"));
    let (replica, _, _) = routed_chat(&lb, &[("user", "after the wait")]);
    assert!(["gpu0", "gpu1"].contains(&replica.as_str()), "{replica}");
}
