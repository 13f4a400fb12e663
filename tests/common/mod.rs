//! Test harness: the real `inferlb` binary and real `inferlb-sim` replicas on free loopback
//! ports. Every process started here is killed when its handle drops; every wait is bounded.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_inferlb"))
        .parent()
        .expect("target dir")
        .to_path_buf()
}

pub fn sim_bin() -> PathBuf {
    let p = bin_dir().join("inferlb-sim");
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (`make test` does)",
        p.display()
    );
    p
}

/// Polls `f` every 20 ms until it is true or `limit` passes.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .expect("http client")
}

/// One simulated replica.
pub struct Sim {
    pub id: String,
    pub port: u16,
    pub args: Vec<String>,
    pub proc: Option<Proc>,
    dir: PathBuf,
}

impl Sim {
    pub fn start(dir: &std::path::Path, id: &str, extra: &[&str]) -> Sim {
        let mut s = Sim {
            id: id.to_string(),
            port: free_port(),
            args: extra.iter().map(|s| s.to_string()).collect(),
            proc: None,
            dir: dir.to_path_buf(),
        };
        s.restart(&[]);
        assert!(
            s.wait_healthy(Duration::from_secs(10)),
            "sim {id} did not come up"
        );
        s
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// (Re)starts the process on the same port; `more` adds flags (e.g. a slow start).
    pub fn restart(&mut self, more: &[&str]) {
        self.stop();
        let log = self.dir.join(format!("sim-{}.log", self.id));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("sim log");
        let child = Command::new(sim_bin())
            .args(["--listen", &self.addr(), "--id", &self.id])
            .args(&self.args)
            .args(more)
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("spawn inferlb-sim");
        self.proc = Some(Proc { child, log });
    }

    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    pub fn wait_healthy(&self, limit: Duration) -> bool {
        let c = http();
        wait_until(limit, || {
            c.get(self.url("/health"))
                .send()
                .is_ok_and(|r| r.status() == 200)
        })
    }

    pub fn stats(&self) -> serde_json::Value {
        http()
            .get(self.url("/sim/stats"))
            .send()
            .and_then(|r| r.json())
            .expect("sim stats")
    }

    pub fn fault(&self, body: serde_json::Value) {
        let r = http()
            .post(self.url("/sim/fault"))
            .json(&body)
            .send()
            .expect("sim fault");
        assert_eq!(r.status(), 200);
    }
}

/// The usual pair of replicas, gpu0 and gpu1.
pub fn two_sims(dir: &std::path::Path, extra: &[&str]) -> (Sim, Sim) {
    (
        Sim::start(dir, "gpu0", extra),
        Sim::start(dir, "gpu1", extra),
    )
}

/// gpu0 and gpu1 started with `flags`, and the balancer in front of them.
pub fn cluster(dir: &std::path::Path, flags: &[&str], options: LbOptions) -> (Sim, Sim, Lb) {
    let (a, b) = two_sims(dir, flags);
    let lb = Lb::start(dir, &[&a, &b], options);
    (a, b, lb)
}

/// The balancer, with its conf written into a temporary directory.
pub struct Lb {
    pub port: u16,
    pub admin_port: u16,
    pub proc: Proc,
    pub conf: PathBuf,
}

pub struct LbOptions<'a> {
    pub routing: &'a str,
    /// Extra lines for the `inferlb:` section, indented by two spaces.
    pub extra: &'a str,
    pub health_interval: f64,
}

impl Default for LbOptions<'_> {
    fn default() -> Self {
        LbOptions {
            routing: "adaptive",
            extra: "",
            health_interval: 1.0,
        }
    }
}

pub fn write_conf(
    dir: &std::path::Path,
    sims: &[&Sim],
    port: u16,
    admin: u16,
    o: &LbOptions,
) -> PathBuf {
    let replicas: String = sims
        .iter()
        .map(|s| format!("    - {{id: {}, address: \"{}\"}}\n", s.id, s.addr()))
        .collect();
    let text = format!(
        "threads: 2\npid_file: {dir}/inferlb.pid\nupgrade_sock: {dir}/upgrade.sock\n\
         grace_period_seconds: 5\ngraceful_shutdown_timeout_seconds: 2\nmax_retries: 4\n\
         inferlb:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin}\n  routing: {routing}\n\
         \x20 health: {{interval_seconds: {hi}, failures: 2, successes: 1, timeout_seconds: 0.5}}\n\
         \x20 replicas:\n{replicas}{extra}",
        dir = dir.display(),
        routing = o.routing,
        hi = o.health_interval,
        extra = o.extra,
    );
    let path = dir.join("inferlb.yaml");
    std::fs::write(&path, text).expect("write conf");
    path
}

impl Lb {
    pub fn start(dir: &std::path::Path, sims: &[&Sim], o: LbOptions) -> Lb {
        let (port, admin_port) = (free_port(), free_port());
        let conf = write_conf(dir, sims, port, admin_port, &o);
        let log = dir.join("inferlb.log");
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_inferlb"))
            .arg("-c")
            .arg(&conf)
            .env("RUST_LOG", "info")
            .env_remove("ROUTING")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("spawn inferlb");
        let lb = Lb {
            port,
            admin_port,
            proc: Proc { child, log },
            conf,
        };
        let up = wait_until(Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
                && TcpStream::connect(("127.0.0.1", admin_port)).is_ok()
        });
        assert!(up, "inferlb did not start:\n{}", lb.proc.log_text());
        lb
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn metrics(&self) -> String {
        http()
            .get(format!("http://127.0.0.1:{}/metrics", self.admin_port))
            .send()
            .and_then(|r| r.text())
            .expect("scrape")
    }

    /// The value of one sample, e.g. `inferlb_failovers_total{reason="connect_refused",replica="gpu0"}`.
    pub fn metric(&self, sample: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    pub fn admin(&self, method: &str, path: &str) -> serde_json::Value {
        let c = http();
        let url = format!("http://127.0.0.1:{}{}", self.admin_port, path);
        let req = if method == "POST" {
            c.post(url)
        } else {
            c.get(url)
        };
        req.send().and_then(|r| r.json()).expect("admin call")
    }

    pub fn replica_state(&self, id: &str) -> serde_json::Value {
        let all = self.admin("GET", "/admin/replicas");
        all["replicas"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["id"] == id).cloned())
            .expect("replica in admin state")
    }
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
