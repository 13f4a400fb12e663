//! One simulated replica (`inferlb-sim`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{bin, free_port, http_status, wait_until, Proc, Signal};

/// inferlb-sim installs no signal handler: SIGTERM's default action ends it at once, which is
/// also how a replica dies under a balancer in the tests ("card stopped").
const SIM_STOP: Signal = Signal::SIGTERM;

/// A simulated replica on a fixed loopback port. It can be stopped and started again on the
/// same port; its stderr goes to `<dir>/sim-<id>.log` (appended across restarts).
pub struct Sim {
    pub id: String,
    pub port: u16,
    /// Flags given on every start (`--speed 20`, ...).
    pub args: Vec<String>,
    log: PathBuf,
    proc: Option<Proc>,
}

impl Sim {
    /// Starts a replica on a free port with `extra` flags and waits (at most 10 s) until its
    /// `/health` answers 200; panics, with its log, if it does not.
    pub fn start(dir: &Path, id: &str, extra: &[&str]) -> Sim {
        let s = Sim::spawn(dir, id, extra);
        s.assert_healthy();
        s
    }

    /// Like [`Sim::start`] without waiting for it to be healthy.
    pub fn spawn(dir: &Path, id: &str, extra: &[&str]) -> Sim {
        let mut s = Sim {
            id: id.to_string(),
            port: free_port(),
            args: extra.iter().map(|s| s.to_string()).collect(),
            log: dir.join(format!("sim-{id}.log")),
            proc: None,
        };
        s.restart(&[]);
        s
    }

    /// Panics, with the log, unless `/health` answers 200 within 10 s.
    pub fn assert_healthy(&self) {
        assert!(
            self.wait_healthy(Duration::from_secs(10)),
            "sim {} did not come up on {}:\n{}",
            self.id,
            self.addr(),
            self.log_text()
        );
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// (Re)starts the process on the same port, without waiting for it to be ready; `more`
    /// adds flags for this start only (e.g. a slow start: `--refuse-for 1`).
    pub fn restart(&mut self, more: &[&str]) {
        self.stop();
        let mut cmd = Command::new(bin("inferlb-sim"));
        cmd.args(["--listen", &self.addr(), "--id", &self.id])
            .args(&self.args)
            .args(more);
        let name = format!("inferlb-sim {}", self.id);
        let p = Proc::spawn(&name, cmd, Some(&self.log), SIM_STOP)
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        self.proc = Some(p);
    }

    /// Stops the process (the replica goes away); the port is kept for a restart.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop();
        }
    }

    /// Whether it was started and not stopped since.
    pub fn is_running(&self) -> bool {
        self.proc.is_some()
    }

    pub fn proc(&self) -> Option<&Proc> {
        self.proc.as_ref()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `/health` until it answers 200 or `limit` passes; a replica serving TLS
    /// (`--tls-cert`) is ready when it accepts connections.
    pub fn wait_healthy(&self, limit: Duration) -> bool {
        if self.serves_tls() {
            return wait_until(limit, || {
                std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            });
        }
        wait_until(limit, || {
            http_status(self.port, "/health", Duration::from_secs(1)) == Some(200)
        })
    }

    /// Started with `--tls-cert`: it speaks HTTPS only.
    pub fn serves_tls(&self) -> bool {
        self.args
            .iter()
            .any(|a| a == "--tls-cert" || a.starts_with("--tls-cert="))
    }
}
