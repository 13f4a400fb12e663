//! The replica simulator's engine queue, end to end on the binary: vLLM's
//! `cache_config_info`, the waiting and running gauges while prefills queue up, and how each
//! scheduler (`--scheduler fcfs|chunked|prefill-first`) lets a long cold prefill delay the
//! tokens of a stream already running. Timings are compared with each other (ratios between
//! gaps and the prefill's own duration), never with tight wall-clock bounds.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const RUNNING: &str = r#"vllm:num_requests_running{engine="0",model_name="sim-model"}"#;
const WAITING: &str = r#"vllm:num_requests_waiting{engine="0",model_name="sim-model"}"#;
const KV_USAGE: &str = r#"vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"}"#;

fn scrape(sim: &Sim) -> String {
    http()
        .get(sim.url("/metrics"))
        .send()
        .and_then(|r| r.text())
        .expect("scrape")
}

fn value(text: &str, sample: &str) -> f64 {
    sample_value(text, sample).unwrap_or_else(|| panic!("no sample {sample}:\n{text}"))
}

/// (running, waiting) as `/metrics` reports them.
fn gauges(sim: &Sim) -> (u64, u64) {
    let text = scrape(sim);
    (value(&text, RUNNING) as u64, value(&text, WAITING) as u64)
}

/// A prompt of exactly `tokens` tokens (4 bytes each), unlike any other `tag`'s.
fn prompt(tag: &str, tokens: usize) -> String {
    let mut p = format!("{tag}:");
    let fill = "abcdefghijklmnopqrstuvwxyz".repeat(tokens * 4 / 26 + 1);
    p.push_str(&fill[..tokens * 4 - p.len()]);
    p
}

/// A streamed `/v1/completions` on a connection of its own; a thread records when each token
/// arrives. Shutting the connection down is the client going away.
struct Stream {
    conn: TcpStream,
    tokens: Arc<Mutex<Vec<Instant>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Stream {
    fn start(sim: &Sim, prompt: &str, max_tokens: usize) -> Stream {
        let body = json!({
            "model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": true,
        })
        .to_string();
        let mut s = TcpStream::connect(("127.0.0.1", sim.port)).expect("connect");
        s.set_nodelay(true).ok();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            sim.addr(),
            body.len()
        );
        s.write_all(head.as_bytes()).expect("write head");
        s.write_all(body.as_bytes()).expect("write body");
        let conn = s.try_clone().expect("clone the connection");
        let tokens = Arc::new(Mutex::new(Vec::new()));
        let seen = tokens.clone();
        let reader = std::thread::spawn(move || {
            // Chunked transfer framing comes on lines of its own; the SSE lines come whole.
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { return };
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    return;
                }
                let v: Value = serde_json::from_str(data).expect("a JSON chunk");
                if v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                {
                    seen.lock().unwrap().push(Instant::now());
                }
            }
        });
        Stream {
            conn,
            tokens,
            reader: Some(reader),
        }
    }

    fn count(&self) -> usize {
        self.tokens.lock().unwrap().len()
    }

    fn times(&self) -> Vec<Instant> {
        self.tokens.lock().unwrap().clone()
    }

    fn first(&self) -> Option<Instant> {
        self.tokens.lock().unwrap().first().copied()
    }

    /// Waits (at most `limit`) until it has `n` tokens.
    fn wait_tokens(&self, n: usize, limit: Duration) -> bool {
        wait_until(limit, || self.count() >= n)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.conn.shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

#[test]
fn cache_config_info_is_vllms_and_the_scrape_passes_promtool() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--cache-tokens", "163840"]);
    let text = scrape(&sim);
    let info = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .unwrap_or_else(|| panic!("no cache_config_info:\n{text}"));
    assert!(info.ends_with("} 1"), "an info gauge is 1: {info}");
    assert!(text.contains("# TYPE vllm:cache_config_info gauge"));
    let labels: std::collections::HashMap<&str, &str> = info
        [info.find('{').unwrap() + 1..info.rfind('}').unwrap()]
        .split(',')
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k, v.trim_matches('"'))
        })
        .collect();
    let num = |k: &str| -> u64 { labels[k].parse().unwrap_or_else(|_| panic!("{k}: {info}")) };
    assert_eq!(labels["block_size"], "16");
    assert_eq!(num("num_gpu_blocks") * num("block_size"), 163_840);
    for k in [
        "cache_dtype",
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "num_gpu_blocks_override",
        "swap_space_bytes",
    ] {
        assert!(labels.contains_key(k), "{k} missing: {info}");
    }
    assert_eq!(labels["enable_prefix_caching"], "True");
    assert!(
        !labels.contains_key("model_name"),
        "vLLM's info has no model_name"
    );
    for sample in [RUNNING, WAITING, KV_USAGE] {
        assert_eq!(value(&text, sample), 0.0, "{sample}");
    }

    let Some(promtool) = ["/usr/bin/promtool", "promtool"].into_iter().find(|p| {
        std::process::Command::new(p)
            .arg("--version")
            .output()
            .is_ok()
    }) else {
        eprintln!("promtool is not installed: skipping its check");
        return;
    };
    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // vLLM's names have a colon, which promtool's lint (exit 3, lint problems only) frowns
    // upon; anything else, or a parse error (exit 1), fails.
    let other: Vec<&str> = report
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.ends_with("metric names should not contain ':'"))
        .collect();
    assert!(
        matches!(out.status.code(), Some(0) | Some(3)) && other.is_empty(),
        "promtool ({:?}): {report}",
        out.status.code()
    );
}

/// Four 30k-token cold prompts at 20k tokens/s (1.5 s of prefill each) arrive together: the
/// first prefills (running) while three queue (waiting); once its first token is out it is
/// decoding, the second prefills: 2 running, 2 waiting. Clients going away leave the gauges.
fn queue_gauges(scheduler: &str) {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(
        dir.path(),
        scheduler,
        &["--scheduler", scheduler, "--prefill-tokens-per-s", "20000"],
    );
    let streams: Vec<Stream> = (0..4)
        .map(|i| Stream::start(&sim, &prompt(&format!("{scheduler}{i}"), 30_000), 1000))
        .collect();
    // All four in the engine, and the scheduler's step since (a request arrives waiting and
    // is scheduled at the next step, as in vLLM: (0, 4) is a moment's state).
    let mut seen = (0, 0);
    assert!(
        wait_until(Duration::from_secs(5), || {
            seen = gauges(&sim);
            seen.0 + seen.1 == 4 && seen.0 > 0
        }),
        "four requests in the engine: {seen:?}"
    );
    assert!(
        streams.iter().all(|s| s.count() == 0),
        "no first token yet: read too late"
    );
    assert_eq!(seen, (1, 3), "{scheduler}: one prefilling, three queued");
    let stats = sim.stats();
    assert_eq!(
        (stats["running"].as_u64(), stats["waiting"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(stats["decoding"], 0);
    let backlog = stats["prefill_backlog_tokens"].as_u64().unwrap();
    assert!(
        (90_000..=120_000).contains(&backlog),
        "{scheduler}: three prompts and part of one left: {backlog}"
    );

    assert!(
        wait_until(Duration::from_secs(10), || streams
            .iter()
            .any(|s| s.count() > 0)),
        "a first token"
    );
    let first = streams.iter().filter_map(Stream::first).min().unwrap();
    let now = gauges(&sim);
    assert!(
        first.elapsed() < Duration::from_millis(1200),
        "read too late to judge"
    );
    assert_eq!(
        now,
        (2, 2),
        "{scheduler}: one decoding, one prefilling, two queued"
    );
    assert_eq!(sim.stats()["decoding"], 1);
    assert!(value(&scrape(&sim), KV_USAGE) > 0.0);

    drop(streams);
    let mut left = (0, 0);
    assert!(
        wait_until(Duration::from_secs(10), || {
            left = gauges(&sim);
            left == (0, 0)
        }),
        "{scheduler}: clients gone, requests gone: {left:?}"
    );
    assert_eq!(value(&scrape(&sim), KV_USAGE), 0.0);
}

#[test]
fn fcfs_counts_queued_prefills_as_waiting() {
    queue_gauges("fcfs");
}

#[test]
fn chunked_counts_unscheduled_prefills_as_waiting() {
    queue_gauges("chunked");
}

/// What a stream decoding at 10 ms a token (20 ms at --speed 2) sees while a 60k-token cold
/// prompt (1 s of prefill at 30k tokens/s and --speed 2) is submitted beside it: its median
/// gap before, its longest gap while the long prompt waits for its first token, how many
/// tokens it got meanwhile, and the long prompt's time to first token.
struct Beside {
    median_before: Duration,
    max_during: Duration,
    during: usize,
    ttft: Duration,
}

fn beside_a_long_prefill(scheduler: &str) -> Beside {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(
        dir.path(),
        scheduler,
        &["--scheduler", scheduler, "--speed", "2"],
    );
    let running = Stream::start(&sim, &prompt("short", 100), 2000);
    assert!(running.wait_tokens(20, Duration::from_secs(10)));
    let submitted = Instant::now();
    let long = Stream::start(&sim, &prompt("long", 60_000), 2);
    assert!(long.wait_tokens(1, Duration::from_secs(20)), "{scheduler}");
    let first = long.first().unwrap();
    // A few more tokens, so the gap that ends the prefill is seen.
    let have = running.count();
    assert!(running.wait_tokens(have + 3, Duration::from_secs(10)));
    let times = running.times();
    drop((running, long));

    let mut before: Vec<Duration> = times
        .windows(2)
        .filter(|w| w[1] <= submitted)
        .map(|w| w[1] - w[0])
        .collect();
    before.sort();
    let during: Vec<Duration> = times
        .windows(2)
        .filter(|w| w[1] > submitted && w[0] < first)
        .map(|w| w[1] - w[0])
        .collect();
    let b = Beside {
        median_before: before[before.len() / 2],
        max_during: during.iter().copied().max().unwrap(),
        during: times
            .iter()
            .filter(|t| **t > submitted && **t < first)
            .count(),
        ttft: first - submitted,
    };
    eprintln!(
        "{scheduler}: median gap before {:?}, longest during {:?} ({} tokens), long TTFT {:?}",
        b.median_before, b.max_during, b.during, b.ttft
    );
    b
}

#[test]
fn a_long_prefill_stalls_running_streams_only_without_chunking() {
    let stalled = beside_a_long_prefill("prefill-first");
    let chunked = beside_a_long_prefill("chunked");
    let fcfs = beside_a_long_prefill("fcfs");

    // prefill-first (vLLM without chunked prefill): the stream stops for the whole prefill.
    assert!(
        stalled.max_during * 10 >= stalled.ttft * 7,
        "prefill-first: the gap is about the prefill: {:?} vs {:?}",
        stalled.max_during,
        stalled.ttft
    );
    assert!(stalled.max_during >= stalled.median_before * 10);

    // chunked: the prefill is cut into 8192-token steps (~0.14 s each here), and the stream
    // gets a token every step, however long the prompt takes.
    assert!(
        chunked.max_during * 3 <= chunked.ttft,
        "chunked: the gap stays a step, far below the prefill: {:?} vs {:?}",
        chunked.max_during,
        chunked.ttft
    );
    assert!(
        chunked.during >= 4,
        "chunked: tokens flow during the prefill: {}",
        chunked.during
    );
    assert!(
        chunked.max_during * 3 <= stalled.max_during,
        "chunked {:?} vs prefill-first {:?}",
        chunked.max_during,
        stalled.max_during
    );
    // ... and the steps are longer than a decode step alone: chunking is not free.
    assert!(chunked.max_during >= chunked.median_before * 3);

    // fcfs: decoding costs the prefill resource nothing, so the stream keeps its own pace.
    assert!(
        fcfs.max_during * 4 <= fcfs.ttft,
        "fcfs: {:?} vs {:?}",
        fcfs.max_during,
        fcfs.ttft
    );
    assert!(fcfs.during >= 20, "fcfs: {}", fcfs.during);
}
