//! Operations under continuous load: binary upgrade, SIGTERM, drain, rolling replica deploys.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// What a load run saw.
#[derive(Default, Debug)]
struct Tally {
    sent: AtomicU64,
    failed: AtomicU64,
    streams_done: AtomicU64,
    failures: Mutex<Vec<String>>,
}

/// Continuous load against `port`: non-streamed requests and long streams, mixed, until
/// `stop` is set (and at most 60 s).
fn load(
    port: u16,
    workers: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<JoinHandle<()>> {
    (0..workers)
        .map(|w| {
            let (stop, tally) = (stop.clone(), tally.clone());
            std::thread::spawn(move || {
                let client = http();
                let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
                let started = Instant::now();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
                    let stream = w % 2 == 0;
                    // Streams of 40 tokens at 50 ms: 2 s each, so many are in flight at any moment.
                    let body = chat_body(
                        &[("user", &format!("w{w} r{i}"))],
                        stream,
                        if stream { 40 } else { 4 },
                    );
                    tally.sent.fetch_add(1, Ordering::Relaxed);
                    let outcome = match client.post(&url).json(&body).send() {
                        Err(e) => Err(format!("send: {e}")),
                        Ok(r) if r.status() != 200 => Err(format!("status {}", r.status())),
                        Ok(r) if stream => {
                            let (events, err) = sse_events(r);
                            match (events.last().map(|e| e.1.as_str()), err) {
                                (Some("[DONE]"), None) => {
                                    tally.streams_done.fetch_add(1, Ordering::Relaxed);
                                    Ok(())
                                }
                                (last, err) => Err(format!("stream ended with {last:?}, {err:?}")),
                            }
                        }
                        Ok(r) => r.bytes().map(|_| ()).map_err(|e| format!("body: {e}")),
                    };
                    if let Err(e) = outcome {
                        tally.failed.fetch_add(1, Ordering::Relaxed);
                        tally.failures.lock().unwrap().push(e);
                    }
                    i += 1;
                }
            })
        })
        .collect()
}

fn slow_sims(dir: &std::path::Path) -> (Sim, Sim) {
    let extra = ["--decode-interval-ms", "50", "--speed", "1"];
    (
        Sim::start(dir, "gpu0", &extra),
        Sim::start(dir, "gpu1", &extra),
    )
}

/// One agent turn: (replica, route, (cached, prompt) tokens, reply).
fn turn(port: u16, history: &[(String, String)]) -> (String, String, (u64, u64), String) {
    let refs: Vec<(&str, &str)> = history
        .iter()
        .map(|(r, c)| (r.as_str(), c.as_str()))
        .collect();
    let r = http()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .json(&chat_body(&refs, false, 2))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let h = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (replica, route) = (h("x-inferlb-replica"), h("x-inferlb-route"));
    let v: Value = r.json().unwrap();
    (
        replica,
        route,
        (
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
        ),
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

/// Runs `n` conversations for `turns` turns, calling `between` after turn `at`; returns the
/// warm-hit rate of turns after `at` and their (replica, route) per conversation.
fn agent_loops(
    port: &dyn Fn() -> u16,
    n: usize,
    turns: usize,
    at: usize,
    between: &mut dyn FnMut(),
) -> (f64, Vec<Vec<(String, String)>>) {
    let context = "ctx ".repeat(5_000);
    let mut histories: Vec<Vec<(String, String)>> = (0..n)
        .map(|c| vec![("system".to_string(), format!("conversation {c} {context}"))])
        .collect();
    let (mut cached, mut prompt) = (0u64, 0u64);
    let mut routes = vec![vec![]; n];
    for t in 0..turns {
        if t == at {
            between();
        }
        for (c, h) in histories.iter_mut().enumerate() {
            h.push(("user".into(), format!("turn {t}")));
            let (replica, route, hit, reply) = turn(port(), h);
            h.push(("assistant".into(), reply));
            if t >= at {
                cached += hit.0;
                prompt += hit.1;
                routes[c].push((replica, route));
            }
        }
    }
    (cached as f64 / prompt.max(1) as f64, routes)
}

#[test]
fn a_binary_upgrade_drops_nothing_and_keeps_conversations_warm() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = slow_sims(dir.path());
    let old = Lb::start(dir.path(), &[&a, &b], test_conf());
    let port = old.port;

    // Without an upgrade: the reference warm-hit rate of agent loops.
    let (reference, _) = agent_loops(&|| port, 4, 4, 2, &mut || {});

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let workers = load(port, 6, stop.clone(), tally.clone());
    std::thread::sleep(Duration::from_millis(1500));

    let mut new: Option<Proc> = None;
    let upgrade_at = Instant::now();
    let (across, routes) = agent_loops(&|| port, 4, 4, 2, &mut || {
        // The new process waits for the listening sockets; SIGQUIT makes the old one hand them over.
        let mut cmd = old.command();
        cmd.arg("-u").env("RUST_LOG", "info");
        let log = dir.path().join("inferlb-new.log");
        new = Some(Lb::spawn("inferlb (upgraded)", cmd, Some(&log)).unwrap());
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            old.proc.signal(Signal::SIGQUIT),
            "SIGQUIT to the old process"
        );
        // Let the old process stop accepting, so the turns below are served by the new one.
        std::thread::sleep(Duration::from_secs(7));
    });
    let mut old = old;
    let exited = old.proc.wait_exit(Duration::from_secs(30)).is_some();
    let old_lifetime = upgrade_at.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let new = new.expect("the new process ran");
    let sent = tally.sent.load(Ordering::Relaxed);
    let failed = tally.failed.load(Ordering::Relaxed);
    eprintln!(
        "upgrade: sent {sent}, failed {failed}, streams completed {}, old process exited after {old_lifetime:?}; warm-hit rate {across:.3} across vs {reference:.3} without",
        tally.streams_done.load(Ordering::Relaxed)
    );
    assert!(exited, "the old process exits within its grace period");
    assert_eq!(failed, 0, "{:?}", tally.failures.lock().unwrap());
    assert!(tally.streams_done.load(Ordering::Relaxed) > 10);
    assert!(
        new.log_text().contains("affinity pins"),
        "the new process learnt the pins: {}",
        new.log_text()
    );
    for r in &routes {
        assert!(
            r.iter()
                .all(|(replica, route)| route == "pinned" && replica == &r[0].0),
            "{routes:?}"
        );
    }
    assert!(
        across >= reference,
        "warm-hit rate across an upgrade {across} < {reference}"
    );
}

#[test]
fn sigterm_lets_streams_in_flight_finish() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = slow_sims(dir.path());
    let mut lb = Lb::start(dir.path(), &[&a, &b], test_conf());
    let url = lb.url("/v1/chat/completions");
    let stream = std::thread::spawn(move || {
        let r = http()
            .post(url)
            .json(&chat_body(&[("user", "long")], true, 40))
            .send()
            .unwrap();
        sse_events(r)
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(lb.proc.signal(Signal::SIGTERM));
    let (events, err) = stream.join().unwrap();
    assert!(err.is_none());
    assert_eq!(events.last().unwrap().1, "[DONE]", "the stream finished");
    assert!(lb.proc.wait_exit(Duration::from_secs(15)).is_some());
}

#[test]
fn drain_takes_a_replica_out_and_undrain_puts_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = slow_sims(dir.path());
    let lb = Lb::start(dir.path(), &[&a, &b], test_conf());
    // A conversation homed on gpu0, and a stream in flight on gpu0.
    let mut history = vec![("system".to_string(), "ctx ".repeat(2000))];
    let mut home = String::new();
    for i in 0..4 {
        history.truncate(1);
        history.push(("user".into(), format!("hello {i}")));
        let (replica, _, _, reply) = turn(lb.port, &history);
        history.push(("assistant".into(), reply));
        if replica == "gpu0" {
            home = replica;
            break;
        }
    }
    assert_eq!(home, "gpu0");
    let url = lb.url("/v1/chat/completions");
    let in_flight = std::thread::spawn(move || {
        // Least busy first: with both idle, two streams take one replica each.
        let c = http();
        let s1 = c
            .post(&url)
            .json(&chat_body(&[("user", "s1")], true, 30))
            .send()
            .unwrap();
        let s2 = c
            .post(&url)
            .json(&chat_body(&[("user", "s2")], true, 30))
            .send()
            .unwrap();
        [s1, s2].map(|r| {
            let replica = r.headers()["x-inferlb-replica"]
                .to_str()
                .unwrap()
                .to_string();
            (replica, sse_events(r))
        })
    });
    std::thread::sleep(Duration::from_millis(300));
    let state = lb.admin("POST", "/admin/replicas/gpu0/drain");
    assert!(state["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["id"] == "gpu0" && r["draining"] == true));
    assert_eq!(
        lb.metric(r#"inferlb_replica_draining{replica="gpu0"}"#),
        1.0
    );
    for i in 0..4 {
        let r = http()
            .post(lb.url("/v1/completions"))
            .json(&json!({"prompt": format!("p{i}"), "max_tokens": 1}))
            .send()
            .unwrap();
        assert_eq!(r.headers()["x-inferlb-replica"], "gpu1");
    }
    history.push(("user".into(), "next".into()));
    let (replica, route, _, _) = turn(lb.port, &history);
    assert_eq!(
        (replica.as_str(), route.as_str()),
        ("gpu1", "repinned"),
        "the conversation moved"
    );
    for (replica, (events, err)) in in_flight.join().unwrap() {
        assert!(err.is_none(), "{replica}");
        assert_eq!(
            events.last().unwrap().1,
            "[DONE]",
            "in-flight requests on {replica} finished"
        );
    }
    assert!(wait_until(Duration::from_secs(5), || lb
        .replica_state("gpu0")["in_flight"]
        == 0));
    lb.admin("POST", "/admin/replicas/gpu0/undrain");
    assert_eq!(
        lb.metric(r#"inferlb_replica_draining{replica="gpu0"}"#),
        0.0
    );
    // Back only after a passing health check.
    assert_eq!(lb.replica_state("gpu0")["live"], false);
    assert!(wait_until(Duration::from_secs(5), || lb
        .replica_state("gpu0")["live"]
        == true));
    let replicas: Vec<String> = (0..4)
        .map(|i| {
            let r = http()
                .post(lb.url("/v1/completions"))
                .json(&json!({"prompt": format!("q{i}"), "max_tokens": 1}))
                .send()
                .unwrap();
            r.headers()["x-inferlb-replica"]
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(replicas.contains(&"gpu0".to_string()), "{replicas:?}");
    let missing = lb.admin("POST", "/admin/replicas/nope/drain");
    assert!(missing["error"].is_string());
}

#[test]
fn a_rolling_deploy_under_load_is_invisible_to_clients() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b) = slow_sims(dir.path());
    let lb = Lb::start(
        dir.path(),
        &[&a, &b],
        LbConf {
            health_interval_seconds: Some(0.3),
            ..test_conf()
        },
    );
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let workers = load(lb.port, 6, stop.clone(), tally.clone());
    std::thread::sleep(Duration::from_secs(1));
    for sim in [&mut a, &mut b] {
        let id = sim.id.clone();
        // The documented procedure: drain, let in-flight requests finish, restart, undrain.
        lb.admin("POST", &format!("/admin/replicas/{id}/drain"));
        assert!(wait_until(Duration::from_secs(10), || lb
            .replica_state(&id)["in_flight"]
            == 0));
        sim.stop();
        std::thread::sleep(Duration::from_millis(500));
        // vLLM's slow start: refused connections, then /health failing, then healthy.
        sim.restart(&["--refuse-for", "1", "--unhealthy-for", "1"]);
        // Undrained at once: health checks alone must keep it out until it is ready.
        lb.admin("POST", &format!("/admin/replicas/{id}/undrain"));
        assert!(wait_until(Duration::from_secs(15), || lb
            .replica_state(&id)["live"]
            == true));
        std::thread::sleep(Duration::from_millis(800));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let (sent, failed) = (
        tally.sent.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
    );
    let failovers = lb.samples("inferlb_failovers_total");
    let total: f64 = failovers.iter().map(|(_, v)| v).sum();
    eprintln!(
        "rolling deploy: sent {sent}, failed {failed}, streams completed {}, failovers {total} {failovers:?}",
        tally.streams_done.load(Ordering::Relaxed)
    );
    assert_eq!(failed, 0, "{:?}", tally.failures.lock().unwrap());
    // No request reached a replica that was still starting (it would have answered 503). The
    // counter has no sample until it counts one; the label's spelling is checked where one is
    // counted (balancer.rs, replica_503s_fail_over...).
    let refused_503: Vec<_> = failovers
        .iter()
        .filter(|(labels, _)| labels.contains(r#"reason="http_503""#))
        .collect();
    assert!(refused_503.is_empty(), "{refused_503:?}");
    // Both replicas serve again.
    assert!(
        a.stats()["requests"].as_u64().unwrap() > 0 && b.stats()["requests"].as_u64().unwrap() > 0
    );
}
