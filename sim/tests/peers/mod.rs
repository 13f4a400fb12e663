//! What the peer conformance tests share: their logs, the peer routers' binaries, and the
//! sims' stats.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use inferlb_harness::{bin_dir, wait_until, Proc, Signal, Sim};
use serde_json::Value;

/// The temp dir of one test's logs: removed on success, kept and printed on failure.
pub struct Logs {
    dir: Option<tempfile::TempDir>,
}

impl Logs {
    pub fn new() -> Logs {
        Logs {
            dir: Some(tempfile::tempdir().expect("temp dir")),
        }
    }
    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("temp dir").path()
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Some(d) = self.dir.take() {
            let path = d.keep();
            eprintln!("logs kept in {}", path.display());
            for e in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                let tail: String = text
                    .lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                eprintln!("--- {} (last 40 lines)\n{tail}", e.path().display());
            }
        }
    }
}

pub fn workspace_target() -> PathBuf {
    let dir = bin_dir();
    dir.parent().unwrap_or(dir).to_path_buf()
}

/// A peer router's executable, or a failure that says how to install it.
pub fn peer_bin(env: &str, default_venv: &str, name: &str) -> PathBuf {
    let venv = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_target().join(default_venv));
    let p = venv.join("bin").join(name);
    assert!(
        p.exists(),
        "{} is missing: run `make peers` (it installs the peer routers into target/venv-peers \
         and target/venv-smg; or set ${env})",
        p.display()
    );
    p
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .expect("HTTP client")
}

pub fn stats(sim: &Sim) -> Value {
    client()
        .get(sim.url("/sim/stats"))
        .send()
        .and_then(|r| r.json())
        .expect("/sim/stats")
}

pub fn n(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// Starts a router and waits (at most 60 s) until its `/v1/models` lists the sims' model.
pub fn start_router(logs: &Logs, name: &str, cmd: Command, port: u16) -> Proc {
    let log = logs.path().join(format!("{name}.log"));
    let mut p = Proc::spawn(name, cmd, Some(&log), Signal::SIGTERM).expect("router starts");
    let url = format!("http://127.0.0.1:{port}/v1/models");
    let c = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .no_proxy()
        .build()
        .expect("HTTP client");
    let ready = wait_until(Duration::from_secs(60), || {
        !p.has_exited()
            && c.get(&url)
                .send()
                .ok()
                .filter(|r| r.status() == 200)
                .and_then(|r| r.text().ok())
                .is_some_and(|t| t.contains("sim-model"))
    });
    assert!(ready, "{name} did not become ready on port {port}");
    p
}
