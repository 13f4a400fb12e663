//! Peer routers the bench measures inferlb against: SGLang's router and vLLM's router, both
//! installed from PyPI into a virtual environment (`make peers`, under `target/venv-peers`).
//!
//! Both rename their process once running (`sglang::router`, `vllm::router`), so they are only
//! ever known by the pid their [`Proc`] holds; each gets its own Prometheus port (vLLM's router
//! panics when that port is taken).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{bin_dir, free_port, http_status, wait_until, Proc, Signal};

/// Both routers shut down gracefully on SIGTERM (and are killed if they do not within the stop
/// limit).
const PEER_STOP: Signal = Signal::SIGTERM;

/// Which router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    /// PyPI `sglang-router`, started as `python -m sglang_router.launch_router`.
    Sglang,
    /// PyPI `vllm-router`, started as its `vllm-router` script.
    Vllm,
}

impl PeerKind {
    /// The short name the bench uses for it (`sglang`, `vllm`).
    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Sglang => "sglang",
            PeerKind::Vllm => "vllm",
        }
    }

    /// The kind named `name` (`sglang`, `vllm`).
    pub fn parse(name: &str) -> Option<PeerKind> {
        match name {
            "sglang" => Some(PeerKind::Sglang),
            "vllm" => Some(PeerKind::Vllm),
            _ => None,
        }
    }

    /// The executable in `venv` that starts it.
    fn program(self, venv: &Path) -> PathBuf {
        match self {
            PeerKind::Sglang => venv.join("bin").join("python"),
            PeerKind::Vllm => venv.join("bin").join("vllm-router"),
        }
    }

    /// Whether `venv` holds this router (its launcher, and for SGLang its Python package).
    pub fn installed_in(self, venv: &Path) -> bool {
        match self {
            PeerKind::Sglang => {
                self.program(venv).exists() && venv.join("bin").join("sglang-router").exists()
            }
            PeerKind::Vllm => self.program(venv).exists(),
        }
    }
}

/// How to start a peer router.
#[derive(Debug, Clone)]
pub struct PeerConf {
    /// `--policy` (e.g. `cache_aware`).
    pub policy: String,
    /// Further flags, after the ones [`Peer::start`] always gives.
    pub extra: Vec<String>,
    /// How long to wait for it to serve `GET /v1/models`.
    pub ready_within: Duration,
}

impl Default for PeerConf {
    fn default() -> PeerConf {
        PeerConf {
            policy: "cache_aware".into(),
            extra: vec![],
            ready_within: Duration::from_secs(30),
        }
    }
}

/// A running peer router.
pub struct Peer {
    pub kind: PeerKind,
    pub port: u16,
    pub prometheus_port: u16,
    pub proc: Proc,
}

impl Peer {
    /// Where `make peers` installs the routers: `target/venv-peers`, beside the release
    /// directory holding the workspace's binaries; `$INFERLB_PEERS_VENV` when set.
    pub fn default_venv() -> PathBuf {
        if let Some(v) = std::env::var_os("INFERLB_PEERS_VENV") {
            return PathBuf::from(v);
        }
        let dir = bin_dir();
        dir.parent().unwrap_or(dir).join("venv-peers")
    }

    /// Starts router `kind` from `venv` on a free port in front of `workers` (base URLs such as
    /// `http://127.0.0.1:8001`), its stderr and stdout in `log` (discarded when None), and waits
    /// until `GET /v1/models` answers 200 through it. An error says why it did not start (not
    /// installed, exited, or not ready in time); nothing is left running then.
    pub fn start(
        kind: PeerKind,
        venv: &Path,
        workers: &[String],
        conf: &PeerConf,
        log: Option<&Path>,
    ) -> Result<Peer, String> {
        if !kind.installed_in(venv) {
            return Err(format!(
                "{} router not installed in {} (`make peers` installs it)",
                kind.name(),
                venv.display()
            ));
        }
        let port = free_port();
        let prometheus_port = free_port();
        let mut cmd = Command::new(kind.program(venv));
        if kind == PeerKind::Sglang {
            cmd.args(["-m", "sglang_router.launch_router"]);
        }
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--worker-urls")
            .args(workers)
            .args(["--policy", &conf.policy])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &prometheus_port.to_string()])
            .args([
                "--log-level",
                match kind {
                    PeerKind::Sglang => "warn",
                    PeerKind::Vllm => "warning",
                },
            ])
            .args(&conf.extra)
            // Python's own output unbuffered, so a failure to start is in the log at once.
            .env("PYTHONUNBUFFERED", "1");
        if let Some(log) = log {
            std::fs::write(log, "").map_err(|e| format!("{}: {e}", log.display()))?;
        }
        let proc = Proc::spawn(kind.name(), cmd, log, PEER_STOP)
            .map_err(|e| format!("spawn the {} router: {e}", kind.name()))?;
        let mut peer = Peer {
            kind,
            port,
            prometheus_port,
            proc,
        };
        let up = wait_until(conf.ready_within, || {
            peer.is_ready() || peer.proc.has_exited()
        });
        if !up || peer.proc.has_exited() {
            let exit = peer.proc.try_exited();
            peer.proc.stop();
            let log = peer.proc.log_text();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(format!(
                "the {} router did not start (exit: {exit:?}): {}",
                kind.name(),
                tail.join(" | ")
            ));
        }
        Ok(peer)
    }

    /// It serves `GET /v1/models` (the readiness check both routers answer once their workers
    /// are registered).
    pub fn is_ready(&self) -> bool {
        http_status(self.port, "/v1/models", Duration::from_secs(1)) == Some(200)
    }

    /// A URL on its port.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// Stops it (SIGTERM, then SIGKILL for it and its children if it does not exit in time).
    pub fn stop(&mut self) {
        self.proc.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_have_names_and_a_missing_venv_is_an_error_not_a_process() {
        for k in [PeerKind::Sglang, PeerKind::Vllm] {
            assert_eq!(PeerKind::parse(k.name()), Some(k));
        }
        assert_eq!(PeerKind::parse("nginx"), None);
        let dir = tempfile::tempdir().unwrap();
        let err = Peer::start(
            PeerKind::Vllm,
            dir.path(),
            &["http://127.0.0.1:1".into()],
            &PeerConf::default(),
            None,
        )
        .err()
        .expect("no router in an empty directory");
        assert!(err.contains("not installed"), "{err}");
    }
}
