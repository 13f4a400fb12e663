//! A throwaway `redis-server` on a loopback port: the store several inferlb instances share
//! their routing state through (Valkey speaks the same protocol).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{free_port, wait_until, Proc, Signal};

/// SIGTERM is redis-server's clean stop (nothing is saved: the server runs with `--save ""`).
const REDIS_STOP: Signal = Signal::SIGTERM;

/// A redis-server on a fixed loopback port, nothing written to disk. It can be killed (as a
/// crash: SIGKILL) and started again on the same port, empty.
pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    proc: Option<Proc>,
    secure: Option<RedisTls>,
}

/// TLS only (`--port 0`, `--tls-port`) and a password (`--requirepass`): the server's PEM
/// certificate and key, and the CA that issued it (also what `redis-cli` trusts).
#[derive(Debug, Clone)]
pub struct RedisTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_file: PathBuf,
    pub password: String,
}

impl Redis {
    /// The installed redis-server, if any (`make deps` installs it).
    pub fn find() -> Option<PathBuf> {
        ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    /// Starts one on a free port, its log in `<dir>/redis.log`, and waits (at most 10 s) until
    /// it answers PING; panics, with its log, if it does not or is not installed.
    pub fn start(dir: &Path) -> Redis {
        Redis::start_with(dir, None)
    }

    /// [`Redis::start`], with TLS only and a password (see [`RedisTls`]).
    pub fn start_tls(dir: &Path, tls: RedisTls) -> Redis {
        Redis::start_with(dir, Some(tls))
    }

    fn start_with(dir: &Path, secure: Option<RedisTls>) -> Redis {
        let mut r = Redis {
            port: free_port(),
            dir: dir.to_path_buf(),
            proc: None,
            secure,
        };
        r.restart();
        r
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://` with TLS (never with the password).
    pub fn url(&self) -> String {
        let scheme = if self.secure.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` run against it with `args` (TLS and password included): its stdout, or
    /// None when it could not run or failed. Inline arguments: no shell is involved.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(t) = &self.secure {
            cmd.arg("--tls").arg("--cacert").arg(&t.ca_file);
            // From the environment, not the command line (which other users can read).
            cmd.env("REDISCLI_AUTH", &t.password);
        }
        let out = cmd
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The lines of inferlb's conf (for [`crate::LbConf::extra`]) that make an instance named
    /// `instance` share its state through this server.
    pub fn cluster_conf(&self, instance: &str) -> String {
        format!(
            "  cluster: {{redis_url: \"{}\", instance_id: \"{instance}\"}}\n",
            self.url()
        )
    }

    /// (Re)starts the server on the same port, empty, and waits until it answers PING.
    pub fn restart(&mut self) {
        self.stop();
        let bin = Redis::find().expect("redis-server is not installed (`make deps` installs it)");
        let mut cmd = Command::new(bin);
        let port = self.port.to_string();
        match &self.secure {
            None => cmd.args(["--port", &port]),
            Some(t) => cmd
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port,
                    "--tls-auth-clients",
                    "no",
                ])
                .arg("--tls-cert-file")
                .arg(&t.cert_file)
                .arg("--tls-key-file")
                .arg(&t.key_file)
                .arg("--tls-ca-cert-file")
                .arg(&t.ca_file)
                .args(["--requirepass", &t.password]),
        };
        cmd.args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&self.dir);
        let log = self.dir.join("redis.log");
        let p = Proc::spawn("redis-server", cmd, Some(&log), REDIS_STOP)
            .unwrap_or_else(|e| panic!("spawn redis-server: {e}"));
        self.proc = Some(p);
        let up = wait_until(Duration::from_secs(10), || self.ping());
        assert!(
            up,
            "redis-server did not start on {}:\n{}",
            self.port,
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Stops it cleanly (SIGTERM); the port is kept for a restart.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop();
        }
    }

    /// Kills it as a crash would (SIGKILL), at once; the port is kept for a restart.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(Signal::SIGKILL);
            p.wait_exit(Duration::from_secs(5));
        }
    }

    pub fn is_running(&self) -> bool {
        self.proc.is_some()
    }

    /// Whether it answers `PING` with `+PONG` within a second.
    pub fn ping(&self) -> bool {
        if self.secure.is_some() {
            return self.cli(&["PING"]).is_some_and(|o| o.trim() == "PONG");
        }
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// Whether `key` exists (`EXISTS`, as an inline command: `key` has no spaces).
    pub fn exists(&self, key: &str) -> bool {
        if self.secure.is_some() {
            return self.cli(&["EXISTS", key]).is_some_and(|o| o.trim() == "1");
        }
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(format!("EXISTS {key}\r\n").as_bytes()).is_err() {
            return false;
        }
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).is_ok() && &buf == b":1\r\n"
    }
}
