//! Overload and fairness against real processes: a saturated fleet of simulated replicas with
//! a flooding key and an interactive one, a key over its tokens-per-minute budget, the queue's
//! bound under 5,000 waiting requests (and its memory), and bad confs refused at start.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

const ALICE: &str = "sk-alice-interactive";
const FLOOD: &str = "sk-flood-batch-job";
const METERED: &str = "sk-metered-tenant";
const OTHER: &str = "sk-someone-else";

/// A streamed chat of about `tokens` cold prompt tokens; (status, Retry-After, seconds to the
/// first streamed event). Panics when a stream that began does not end with `[DONE]`: streams
/// already running are never touched.
fn streamed(port: u16, key: &str, seed: &str, tokens: usize) -> (u16, Option<u64>, f64) {
    let body = chat_body(&[("user", &text_of(seed, tokens))], true, 4);
    let start = Instant::now();
    let r = http()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .expect("send");
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    if status != 200 {
        let text = r.text().unwrap_or_default();
        if key == ALICE {
            eprintln!("alice refused: {text}");
        }
        return (status, retry, start.elapsed().as_secs_f64());
    }
    let (events, _) = sse_events(r);
    assert_eq!(
        events.last().map(|(_, d)| d.as_str()),
        Some("[DONE]"),
        "a stream that began ends whole"
    );
    let first = events
        .first()
        .map_or(f64::NAN, |(at, _)| at.duration_since(start).as_secs_f64());
    (status, retry, first)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Alice's time to first token, `n` requests one after another.
fn alice_ttfts(port: u16, phase: &str, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let (status, _, ttft) = streamed(port, ALICE, &format!("alice {phase} {i}"), 6000);
            assert_eq!(status, 200, "alice is never refused");
            ttft
        })
        .collect()
}

#[test]
fn a_flooding_key_gets_429s_it_can_obey_while_the_other_keeps_its_time_to_first_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 10k prefill tokens a second: alice's 6000-token prompt takes 0.6 s cold.
    let flags = [
        "--prefill-tokens-per-s",
        "10000",
        "--decode-interval-ms",
        "5",
    ];
    let overload = "max_queued_prefill_tokens: 600\nqueue_length: 64\nqueue_timeout_seconds: 5\n\
        classes: [interactive, batch]\n\
        keys:\n  - {name: alice, key: sk-alice-interactive, class: interactive}\n  \
        - {name: flood, key: sk-flood-batch-job, class: batch, max_concurrent: 16}\n";
    let conf = LbConf {
        routing: Some("prefill_cost".into()),
        api_keys: vec![ALICE.into(), FLOOD.into()],
        overload: Some(overload.into()),
        ..test_conf()
    };
    let (_a, _b, lb) = cluster(dir.path(), &flags, conf);
    let port = lb.port;

    let unloaded = alice_ttfts(port, "unloaded", 7);

    // The flood: 24 clients of 300-token prompts, each obeying Retry-After.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, refused, obeyed_ok) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let flooders: Vec<_> = (0..24)
        .map(|t| {
            let (stop, ok, refused, obeyed_ok) =
                (stop.clone(), ok.clone(), refused.clone(), obeyed_ok.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut after_429 = false;
                let mut i = 0;
                // A client sent away with a Retry-After comes back once it has waited, even
                // after the flood stops: that return is what obeying it means.
                while (after_429 || !stop.load(Ordering::Relaxed)) && Instant::now() < deadline {
                    i += 1;
                    let (status, retry, _) = streamed(port, FLOOD, &format!("flood {t} {i}"), 300);
                    match status {
                        200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if after_429 {
                                obeyed_ok.fetch_add(1, Ordering::Relaxed);
                            }
                            after_429 = false;
                        }
                        429 => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            let retry = retry.expect("a 429 carries Retry-After");
                            assert!((1..=5).contains(&retry), "retry-after {retry}");
                            after_429 = true;
                            std::thread::sleep(Duration::from_secs(retry));
                        }
                        other => panic!("flood request answered {other}"),
                    }
                }
            })
        })
        .collect();
    // Saturated: requests wait in inferlb.
    assert!(
        wait_until(Duration::from_secs(10), || {
            lb.metric("inferlb_overload_saturated") == 1.0
        }),
        "the flood saturates the fleet"
    );
    let loaded = alice_ttfts(port, "loaded", 7);
    // Long enough for refused flooders to come back after their Retry-After.
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().expect("flooder");
    }

    let (u, l) = (median(unloaded.clone()), median(loaded.clone()));
    let ratio = l / u;
    let (ok, refused, obeyed_ok) = (
        ok.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        obeyed_ok.load(Ordering::Relaxed),
    );
    eprintln!(
        "alice TTFT median unloaded {u:.3} s, under the flood {l:.3} s: ratio {ratio:.2} \
         ({unloaded:.3?} / {loaded:.3?}); flood: {ok} answered, {refused} refused (429), \
         {obeyed_ok} answered right after obeying a Retry-After"
    );
    assert!(ratio <= 1.5, "alice's TTFT ratio {ratio:.2} > 1.5");
    assert!(refused > 0, "the flooding key got 429s");
    assert!(obeyed_ok > 0, "a 429 obeyed gets through");
    let refusals = lb.samples("inferlb_overload_rejected_total");
    assert!(
        refusals
            .iter()
            .filter(|(_, n)| *n > 0.0)
            .all(|(labels, _)| labels.contains("key=\"flood\"")),
        "only the flood key is refused: {refusals:?}"
    );
    let waits = lb.samples("inferlb_overload_queue_wait_seconds_count");
    assert!(
        waits
            .iter()
            .any(|(l, n)| l.contains("interactive") && *n > 0.0),
        "{waits:?}"
    );
}

fn chat(port: u16, key: &str, seed: &str, tokens: usize) -> reqwest::blocking::Response {
    http()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat_body(&[("user", &text_of(seed, tokens))], false, 4))
        .send()
        .expect("send")
}

#[test]
fn a_key_over_its_tokens_per_minute_is_refused_and_recovers_after_the_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 60k tokens a minute over a 2 s window: 2000 tokens a window.
    let overload = "window_seconds: 2\n\
        keys:\n  - {name: metered, key: sk-metered-tenant, tokens_per_minute: 60000}\n";
    let conf = LbConf {
        api_keys: vec![METERED.into(), OTHER.into()],
        overload: Some(overload.into()),
        ..test_conf()
    };
    let (_a, _b, lb) = cluster(dir.path(), &["--speed", "10"], conf);
    let port = lb.port;
    assert_eq!(chat(port, METERED, "m1", 800).status(), 200);
    assert_eq!(chat(port, METERED, "m2", 800).status(), 200);
    let r = chat(port, METERED, "m3", 800);
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    assert!((1..=2).contains(&retry), "retry-after {retry}");
    let v: serde_json::Value = r.json().expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["code"], 429);
    // Anthropic's shape on /v1/messages.
    let m = http()
        .post(lb.url("/v1/messages"))
        .header("x-api-key", METERED)
        .json(&serde_json::json!({"model": "sim-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": text_of("m4", 800)}]}))
        .send()
        .expect("send");
    assert_eq!(m.status(), 429);
    assert!(m.headers().contains_key("retry-after"));
    let v: serde_json::Value = m.json().expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    // Another key is unaffected.
    assert_eq!(chat(port, OTHER, "o1", 800).status(), 200);
    std::thread::sleep(Duration::from_secs(retry));
    assert_eq!(
        chat(port, METERED, "m5", 800).status(),
        200,
        "recovered after Retry-After"
    );
    assert_eq!(
        lb.metric("inferlb_overload_rejected_total{key=\"metered\",reason=\"tokens_per_minute\"}"),
        2.0
    );
    let completion =
        lb.metric("inferlb_overload_tokens_total{key=\"metered\",kind=\"completion\"}");
    assert_eq!(completion, 12.0, "4 tokens from each of 3 answers' usage");
    let log = lb.proc.log_text();
    assert!(
        log.contains("overload=tokens_per_minute"),
        "the access log says why:\n{log}"
    );
    // Every overload series the Grafana dashboard queries is in the scrape.
    let scrape = lb.metrics();
    let queried = dashboard_metrics("inferlb_overload_");
    for name in &queried {
        assert!(
            scrape.lines().any(|l| l.starts_with(name.as_str())),
            "{name} not in the scrape"
        );
    }
    assert!(queried.len() >= 6, "the dashboard has the overload panels");
}

#[test]
fn the_queue_holds_its_bound_under_5000_waiting_requests_and_leaving_clients_are_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    // One token a second: the first request holds the replica for the whole test.
    let sim = Sim::start(dir.path(), "gpu0", &["--prefill-tokens-per-s", "1"]);
    let conf = LbConf {
        threads: Some(2),
        overload: Some(
            "max_queued_prefill_tokens: 1\nqueue_length: 4000\nqueue_timeout_seconds: 120\n".into(),
        ),
        access_log: Some("off".into()),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&sim], conf);
    let port = lb.port;
    let body = chat_body(&[("user", "hi")], false, 1).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    // One request of 400 tokens takes the replica for minutes; then the others queue.
    let long = chat_body(&[("user", &text_of("long", 400))], false, 1).to_string();
    let mut first = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let long_head = head.replace(
        &format!("length: {}", body.len()),
        &format!("length: {}", long.len()),
    );
    first
        .write_all(format!("{long_head}{long}").as_bytes())
        .expect("write");
    assert!(wait_until(Duration::from_secs(5), || {
        lb.metric("inferlb_replica_in_flight{replica=\"gpu0\"}") == 1.0
    }));
    let before = inferlb_harness::rss_bytes(lb.proc.pid()).expect("inferlb VmRSS");
    let mut clients = Vec::with_capacity(5000);
    for _ in 0..5000 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.write_all(format!("{head}{body}").as_bytes())
            .expect("write");
        clients.push(s);
    }
    let queue = "inferlb_overload_queue_length{class=\"default\"}";
    assert!(
        wait_until(Duration::from_secs(30), || lb.metric(queue) == 4000.0),
        "the queue fills to its bound: {}",
        lb.metric(queue)
    );
    let refused = "inferlb_overload_rejected_total{key=\"anonymous\",reason=\"queue_full\"}";
    assert!(wait_until(Duration::from_secs(10), || lb.metric(refused) == 1000.0));
    let at_bound = inferlb_harness::rss_bytes(lb.proc.pid()).expect("inferlb VmRSS");
    // The refused ones have their 429 with Retry-After; the queued ones nothing yet. The
    // counter moves before the last answers are written, so read each socket's head as it
    // arrives, in passes bounded in time, until a thousand are whole.
    let mut heads = vec![Vec::new(); clients.len()];
    for s in &clients {
        s.set_nonblocking(true).expect("nonblocking");
    }
    let whole = |h: &Vec<u8>| h.windows(4).any(|w| w == b"\r\n\r\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for (s, head) in clients.iter_mut().zip(&mut heads) {
            let mut buf = [0u8; 4096];
            if let Ok(n) = s.read(&mut buf) {
                head.extend_from_slice(&buf[..n]);
            }
        }
        if heads.iter().filter(|h| whole(h)).count() >= 1000 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (mut answered, mut with_retry) = (0, 0);
    for head in heads.iter().filter(|h| !h.is_empty()) {
        let text = String::from_utf8_lossy(head);
        answered += 1;
        assert!(text.starts_with("HTTP/1.1 429"), "{text}");
        with_retry += usize::from(text.to_ascii_lowercase().contains("retry-after:"));
    }
    assert_eq!((answered, with_retry), (1000, 1000));
    assert_eq!(lb.metric(queue), 4000.0, "still at the bound");
    // What a waiting request costs the process: mostly Pingora's own per-request buffers (a
    // 64 KiB body read buffer among them); the queue's own share is about 200 bytes of it (see
    // the unit test `queue::tests::five_thousand_entries_take_about_a_megabyte`).
    let per_request = at_bound.saturating_sub(before) as f64 / 4000.0;
    eprintln!(
        "4000 queued (1000 refused): inferlb RSS {:.1} MB -> {:.1} MB, {per_request:.0} bytes per \
         waiting request (connection, Pingora session, queue entry)",
        before as f64 / 1e6,
        at_bound as f64 / 1e6
    );
    assert!(
        per_request < 256.0 * 1024.0,
        "{per_request} bytes a request"
    );

    // Every waiting client hangs up: each leaves the queue at once, and is counted.
    let hung_up = Instant::now();
    drop(clients);
    assert!(
        wait_until(Duration::from_secs(10), || lb.metric(queue) == 0.0),
        "queue after hang-ups: {}",
        lb.metric(queue)
    );
    eprintln!(
        "4000 hang-ups left the queue in {:.2} s",
        hung_up.elapsed().as_secs_f64()
    );
    assert_eq!(
        lb.metric("inferlb_overload_abandoned_total{class=\"default\"}"),
        4000.0
    );
    drop(first);
}

#[test]
fn a_waiting_request_whose_client_pipelines_the_next_one_keeps_its_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 200 tokens a second: a 400-token prompt holds the replica for about 2 s.
    let sim = Sim::start(dir.path(), "gpu0", &["--prefill-tokens-per-s", "200"]);
    let conf = LbConf {
        overload: Some(
            "max_queued_prefill_tokens: 1\nqueue_length: 100\nqueue_timeout_seconds: 60\n".into(),
        ),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&sim], conf);
    let post = |text: &str| {
        raw_post(
            "/v1/chat/completions",
            &chat_body(&[("user", text)], false, 1).to_string(),
        )
    };
    let mut first = TcpStream::connect(("127.0.0.1", lb.port)).expect("connect");
    first
        .write_all(post(&text_of("long", 400)).as_bytes())
        .expect("write");
    assert!(wait_until(Duration::from_secs(5), || {
        lb.metric("inferlb_replica_in_flight{replica=\"gpu0\"}") == 1.0
    }));
    // The second client's request waits; then it sends its next request on the same
    // connection before the first is answered.
    let mut second = TcpStream::connect(("127.0.0.1", lb.port)).expect("connect");
    second.write_all(post("one").as_bytes()).expect("write");
    let queue = "inferlb_overload_queue_length{class=\"default\"}";
    assert!(wait_until(Duration::from_secs(5), || lb.metric(queue) == 1.0));
    second.write_all(post("two").as_bytes()).expect("write");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        lb.metric(queue),
        1.0,
        "still waiting, not taken for a hang-up"
    );
    let answers = read_responses(&mut second, 2, Duration::from_secs(20));
    let statuses: Vec<u16> = answers.iter().map(|(status, _)| *status).collect();
    assert_eq!(statuses, [200, 200], "{answers:?}");
    assert_eq!(
        lb.metric("inferlb_overload_abandoned_total{class=\"default\"}"),
        0.0
    );
    assert_eq!(
        read_responses(&mut first, 1, Duration::from_secs(10)).len(),
        1
    );
}

#[test]
fn a_queued_chunked_upload_whose_terminator_comes_late_is_served_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 20k tokens a second: the first request's 40k-token prompt holds the replica about 2 s.
    let sim = Sim::start(dir.path(), "gpu0", &["--prefill-tokens-per-s", "20000"]);
    let conf = LbConf {
        overload: Some(
            "max_queued_prefill_tokens: 1\nqueue_length: 100\nqueue_timeout_seconds: 60\n".into(),
        ),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&sim], conf);
    let mut first = TcpStream::connect(("127.0.0.1", lb.port)).expect("connect");
    let long = chat_body(&[("user", &text_of("long", 40_000))], false, 1).to_string();
    first
        .write_all(raw_post("/v1/chat/completions", &long).as_bytes())
        .expect("write");
    assert!(wait_until(Duration::from_secs(5), || {
        lb.metric("inferlb_replica_in_flight{replica=\"gpu0\"}") == 1.0
    }));
    // Past the 64 KiB retry buffer, its JSON is read whole and it queues while its chunked
    // terminator is still on the way.
    let json = chat_body(&[("user", &text_of("late end", 25_000))], false, 1).to_string();
    let mut body = Vec::new();
    for c in json.as_bytes().chunks(8000) {
        body.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        body.extend_from_slice(c);
        body.extend_from_slice(b"\r\n");
    }
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let mut second = TcpStream::connect(("127.0.0.1", lb.port)).expect("connect");
    second.write_all(head.as_bytes()).expect("write head");
    second.write_all(&body).expect("write body");
    let queue = "inferlb_overload_queue_length{class=\"default\"}";
    assert!(wait_until(Duration::from_secs(5), || lb.metric(queue) == 1.0));
    std::thread::sleep(Duration::from_millis(200));
    second.write_all(b"0\r\n\r\n").expect("write terminator");
    second
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut resp = Vec::new();
    let _ = second.read_to_end(&mut resp);
    let resp = String::from_utf8_lossy(&resp).to_ascii_lowercase();
    assert!(resp.starts_with("http/1.1 200"), "{resp}");
    assert!(
        resp.contains(&format!("x-sim-body-bytes: {}\r\n", json.len())),
        "{resp}"
    );
    let hash = xxhash_rust::xxh3::xxh3_64(json.as_bytes());
    assert!(
        resp.contains(&format!("x-sim-body-hash: {hash:016x}")),
        "{resp}"
    );
    assert_eq!(
        lb.metric("inferlb_overload_abandoned_total{class=\"default\"}"),
        0.0
    );
    assert_eq!(
        read_responses(&mut first, 1, Duration::from_secs(10)).len(),
        1
    );
}

#[test]
fn bad_overload_limits_are_refused_at_start_with_the_key_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (section, key) in [
        ("queue_length: 0", "inferlb.overload.queue_length"),
        ("max_running: -3", "inferlb.overload.max_running"),
        (
            "max_queued_prefill_tokens: 1000000000000",
            "inferlb.overload.max_queued_prefill_tokens",
        ),
        (
            "budget: {tokens_per_minute: 0}",
            "inferlb.overload.budget.tokens_per_minute",
        ),
        ("queue_lenght: 10", "queue_lenght"),
    ] {
        let conf = LbConf {
            listen_port: free_port(),
            admin_port: free_port(),
            overload: Some(section.into()),
            replicas: vec![Replica::new("gpu0", "127.0.0.1:9")],
            ..test_conf()
        };
        let path = dir.path().join("bad.yaml");
        conf.write(&path).expect("write conf");
        let out = std::process::Command::new(INFERLB)
            .args(["-t", "-c"])
            .arg(&path)
            .output()
            .expect("run inferlb -t");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{section} accepted");
        assert!(stderr.contains(key), "{key} not named: {stderr}");
    }
}

#[test]
fn two_instances_share_a_keys_budget_through_redis_and_count_alone_when_it_is_gone() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut redis = inferlb_harness::Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &["--speed", "10"]);
    // 60k tokens a minute over a 4 s window: 4000 tokens a window, whichever instance.
    let overload = "window_seconds: 4\n\
        keys:\n  - {name: metered, key: sk-metered-tenant, tokens_per_minute: 60000}\n";
    let start = |name: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        let conf = LbConf {
            api_keys: vec![METERED.into()],
            overload: Some(overload.into()),
            extra: redis.cluster_conf(name),
            ..test_conf()
        };
        Lb::start(&dir, &[&a, &b], conf)
    };
    let (one, two) = (start("one"), start("two"));
    let shared = "inferlb_overload_shared";
    // Sharing starts with an instance's first request.
    assert_eq!(chat(one.port, METERED, "s1", 1500).status(), 200);
    assert_eq!(chat(two.port, METERED, "s2", 100).status(), 200);
    assert!(wait_until(Duration::from_secs(5), || {
        one.metric(shared) == 1.0 && two.metric(shared) == 1.0
    }));
    assert_eq!(chat(one.port, METERED, "s3", 1500).status(), 200);
    // Instance two learns what one used (about 3100 of 4000) within a few exchanges.
    std::thread::sleep(Duration::from_millis(800));
    let r = chat(two.port, METERED, "s4", 1500);
    assert_eq!(r.status(), 429, "two counts what one used");
    assert!(r.headers().contains_key("retry-after"));

    // Redis gone: requests never wait on it; each instance counts only its own use again.
    redis.kill();
    assert!(wait_until(Duration::from_secs(5), || two.metric(shared) == 0.0));
    let started = Instant::now();
    assert_eq!(
        chat(two.port, METERED, "s5", 1500).status(),
        200,
        "two alone has used about 100 tokens"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "not blocked on Redis"
    );
    assert!(
        two.proc
            .log_text()
            .contains("counting this instance's use only"),
        "the outage is logged"
    );
}

#[test]
fn a_saturated_models_queue_does_not_hold_back_another_models_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    // gpu0 serves model a at one token a second: its first request holds it for minutes.
    let slow = Sim::start(
        dir.path(),
        "gpu0",
        &["--model", "model-a", "--prefill-tokens-per-s", "1"],
    );
    let fast = Sim::start(dir.path(), "gpu1", &["--model", "model-b"]);
    let conf = LbConf {
        overload: Some("max_queued_prefill_tokens: 1\nqueue_timeout_seconds: 60\n".into()),
        replicas: vec![
            Replica {
                models: vec!["model-a".into()],
                ..Replica::of(&slow)
            },
            Replica {
                models: vec!["model-b".into()],
                ..Replica::of(&fast)
            },
        ],
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let send = |model: &str, text: &str| {
        let body = serde_json::json!({"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": text}]})
        .to_string();
        let mut s = TcpStream::connect(("127.0.0.1", lb.port)).expect("connect");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(format!("{head}{body}").as_bytes())
            .expect("write");
        s
    };
    let _holding = send("model-a", &text_of("long", 400));
    assert!(wait_until(Duration::from_secs(5), || {
        lb.metric("inferlb_replica_in_flight{replica=\"gpu0\"}") == 1.0
    }));
    let _waiting = [send("model-a", "one"), send("model-a", "two")];
    let queue = "inferlb_overload_queue_length{class=\"default\"}";
    assert!(wait_until(Duration::from_secs(5), || lb.metric(queue) == 2.0));
    // Model b's replica has room: its requests go at once, past model a's queue.
    for i in 0..3 {
        let started = Instant::now();
        let r = http()
            .post(lb.url("/v1/chat/completions"))
            .json(&serde_json::json!({"model": "model-b", "max_tokens": 1,
                "messages": [{"role": "user", "content": format!("b {i}")}]}))
            .send()
            .expect("send");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-inferlb-replica"], "gpu1");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(lb.metric(queue), 2.0, "model a's requests still wait");
}
