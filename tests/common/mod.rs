//! Test helpers: the processes come from `inferlb-harness` (the real `inferlb` binary and real
//! `inferlb-sim` replicas on free loopback ports, each stopped when its handle drops, every wait
//! bounded); what is here speaks HTTP to them with reqwest.

// Each test file uses its own part of this module.
#![allow(dead_code, unused_imports)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

pub use inferlb_harness::{free_port, wait_until, Lb, LbConf, Proc, Replica, Signal, Sim};

/// The balancer binary cargo built for these tests.
pub const INFERLB: &str = env!("CARGO_BIN_EXE_inferlb");

/// The conf the tests start from: quick health checks and a short grace period.
pub fn test_conf() -> LbConf {
    LbConf {
        threads: Some(2),
        grace_period_seconds: Some(5),
        graceful_shutdown_timeout_seconds: Some(2),
        max_retries: Some(4),
        routing: Some("adaptive".into()),
        health_interval_seconds: Some(1.0),
        health_failures: Some(2),
        health_successes: Some(1),
        health_timeout_seconds: Some(0.5),
        ..LbConf::default()
    }
}

/// The usual pair of replicas, gpu0 and gpu1.
pub fn two_sims(dir: &std::path::Path, extra: &[&str]) -> (Sim, Sim) {
    let (a, b) = (
        Sim::spawn(dir, "gpu0", extra),
        Sim::spawn(dir, "gpu1", extra),
    );
    a.assert_healthy();
    b.assert_healthy();
    (a, b)
}

/// gpu0 and gpu1 started with `flags`, and the balancer in front of them.
pub fn cluster(dir: &std::path::Path, flags: &[&str], conf: LbConf) -> (Sim, Sim, Lb) {
    let (a, b) = two_sims(dir, flags);
    let lb = Lb::start(dir, &[&a, &b], conf);
    (a, b, lb)
}

pub fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .expect("http client")
}

/// A simulated replica's own endpoints.
pub trait SimApi {
    /// `/sim/stats`: requests, tokens, running and waiting.
    fn stats(&self) -> serde_json::Value;
    /// `/sim/fault`: makes the replica misbehave (`{"fault": "error503"}`, ...).
    fn fault(&self, body: serde_json::Value);
}

impl SimApi for Sim {
    fn stats(&self) -> serde_json::Value {
        http()
            .get(self.url("/sim/stats"))
            .send()
            .and_then(|r| r.json())
            .expect("sim stats")
    }

    fn fault(&self, body: serde_json::Value) {
        let r = http()
            .post(self.url("/sim/fault"))
            .json(&body)
            .send()
            .expect("sim fault");
        assert_eq!(r.status(), 200);
    }
}

/// The balancer's admin port: metrics and the admin endpoints.
pub trait LbApi {
    fn metrics(&self) -> String;
    /// The value of one sample, e.g.
    /// `inferlb_failovers_total{reason="connect_refused",replica="gpu0"}`; panics, showing the
    /// scrape, when the scrape has no such sample (a misspelt name or label must fail).
    fn metric(&self, sample: &str) -> f64;
    /// Every sample of the metric `name`: (labels as written, e.g. `{replica="gpu0"}`, value).
    /// Where a counter may legitimately have no sample yet (never incremented), check these
    /// instead of a single sample that could be misspelt.
    fn samples(&self, name: &str) -> Vec<(String, f64)>;
    fn admin(&self, method: &str, path: &str) -> serde_json::Value;
    /// One replica's entry in `/admin/replicas`.
    fn replica_state(&self, id: &str) -> serde_json::Value;
}

/// The value of `sample` in the exposition `text`, if it has that exact sample.
pub fn sample_value(text: &str, sample: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(sample)?;
        // The name and labels must end here: `_total` must not match `_total_sum`.
        rest.starts_with(' ').then(|| rest.trim().parse().ok())?
    })
}

/// Every sample of metric `name` in the exposition `text`.
pub fn samples_of(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = rest.rsplit_once(' ')?;
            if !(labels.is_empty() || labels.starts_with('{')) {
                return None;
            }
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

impl LbApi for Lb {
    fn metrics(&self) -> String {
        http()
            .get(self.admin_url("/metrics"))
            .send()
            .and_then(|r| r.text())
            .expect("scrape")
    }

    fn metric(&self, sample: &str) -> f64 {
        let text = self.metrics();
        sample_value(&text, sample)
            .unwrap_or_else(|| panic!("the scrape has no sample {sample}:\n{text}"))
    }

    fn samples(&self, name: &str) -> Vec<(String, f64)> {
        samples_of(&self.metrics(), name)
    }

    fn admin(&self, method: &str, path: &str) -> serde_json::Value {
        let c = http();
        let url = self.admin_url(path);
        let req = if method == "POST" {
            c.post(url)
        } else {
            c.get(url)
        };
        req.send().and_then(|r| r.json()).expect("admin call")
    }

    fn replica_state(&self, id: &str) -> serde_json::Value {
        let all = self.admin("GET", "/admin/replicas");
        all["replicas"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["id"] == id).cloned())
            .expect("replica in admin state")
    }
}

/// A chat request sent through the balancer, answered 200: which replica, why, and the body.
pub fn routed_chat(lb: &Lb, messages: &[(&str, &str)]) -> (String, String, serde_json::Value) {
    routed_chat_on(lb.port, messages)
}

/// [`routed_chat`] through the balancer on `port` (from a thread that does not hold the `Lb`).
pub fn routed_chat_on(port: u16, messages: &[(&str, &str)]) -> (String, String, serde_json::Value) {
    let r = http()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .json(&chat_body(messages, false, 2))
        .send()
        .expect("send");
    assert_eq!(r.status(), 200);
    let h = |n: &str| r.headers()[n].to_str().expect("header").to_string();
    let (replica, route) = (h("x-inferlb-replica"), h("x-inferlb-route"));
    (replica, route, r.json().expect("json"))
}

/// About `tokens` simulator tokens (4 bytes each) of text, distinct per `seed`.
pub fn text_of(seed: &str, tokens: usize) -> String {
    let mut t = String::with_capacity(tokens * 4 + 16);
    let mut i = 0;
    while t.len() < tokens * 4 {
        t.push_str(&format!("{seed}-{i} "));
        i += 1;
    }
    t.truncate(tokens * 4);
    t
}

pub fn chat_body(messages: &[(&str, &str)], stream: bool, max_tokens: u32) -> serde_json::Value {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "sim-model", "messages": msgs, "stream": stream, "max_tokens": max_tokens})
}

/// A raw HTTP/1.1 exchange: writes `head` (and `body` if any), returns the whole response
/// text read until the server closes or `limit` passes.
pub fn raw_exchange(port: u16, head: &str, body: &[u8], limit: Duration) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(limit)).ok();
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).ok();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A POST of `body` (JSON) to `path` as raw HTTP/1.1, kept alive: what a pipelining client writes.
pub fn raw_post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads `n` HTTP/1.1 responses off `s` in order (bodies by `content-length` or chunked), each
/// as (status, body); fewer when the server closes or nothing arrives for `limit`.
pub fn read_responses(s: &mut TcpStream, n: usize, limit: Duration) -> Vec<(u16, String)> {
    s.set_read_timeout(Some(limit)).ok();
    let (mut buf, mut out) = (Vec::<u8>::new(), vec![]);
    let mut chunk = [0u8; 16 * 1024];
    while out.len() < n {
        if let Some((status, body, used)) = one_response(&buf) {
            out.push((status, body));
            buf.drain(..used);
            continue;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    out
}

/// The first whole response in `buf`: status, body and the bytes it took.
fn one_response(buf: &[u8]) -> Option<(u16, String, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
    };
    if let Some(len) = header("content-length:") {
        let len: usize = len.parse().ok()?;
        let body = buf.get(end..end + len)?;
        return Some((
            status,
            String::from_utf8_lossy(body).into_owned(),
            end + len,
        ));
    }
    if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
        let (mut at, mut body) = (end, Vec::new());
        loop {
            let line_end = at + buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
            let size = std::str::from_utf8(&buf[at..line_end]).ok()?;
            let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
            let data = line_end + 2;
            if size == 0 {
                let done = data + buf.get(data..)?.windows(2).position(|w| w == b"\r\n")? + 2;
                return Some((status, String::from_utf8_lossy(&body).into_owned(), done));
            }
            body.extend_from_slice(buf.get(data..data + size)?);
            at = data + size + 2;
        }
    }
    Some((status, String::new(), end))
}

/// Reads an SSE response line by line, with the instant each `data:` line arrived.
pub fn sse_events(resp: reqwest::blocking::Response) -> (Vec<(Instant, String)>, Option<String>) {
    let mut events = vec![];
    let mut reader = BufReader::new(resp);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => return (events, None),
            Ok(_) => {
                if let Some(d) = line.trim_end().strip_prefix("data: ") {
                    events.push((Instant::now(), d.to_string()));
                }
            }
            Err(e) => return (events, Some(e.to_string())),
        }
    }
}

/// The names of the metrics starting with `prefix` that the shipped Grafana dashboard queries,
/// each as often as a query names it.
pub fn dashboard_metrics(prefix: &str) -> Vec<String> {
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/conf/grafana/inferlb-dashboard.json"
    ))
    .expect("dashboard");
    dashboard
        .match_indices(prefix)
        .map(|(at, _)| {
            dashboard[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}
