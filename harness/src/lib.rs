//! The processes the tests and the bench run: simulated replicas ([`Sim`]), the balancer
//! ([`Lb`], with its conf written by [`LbConf`]), nginx ([`Nginx`]) and the peer routers
//! ([`Peer`]: SGLang's and vLLM's) and Redis ([`Redis`], the store inferlb instances share
//! state through), each on free loopback ports.
//!
//! Every process is held by a [`Proc`], which stops it the way that program stops cleanly when
//! the handle drops (and kills it only if it does not exit in time), so nothing a test or a
//! bench run starts outlives it. Every wait is bounded.
//!
//! The API is synchronous (std::process, std::net): readiness checks are raw HTTP/1.1 over a
//! `TcpStream`.

mod lb;
mod nginx;
mod peer;
mod ports;
mod proc;
mod redis;
mod sim;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use lb::{Lb, LbConf, Replica};
pub use nginx::{Nginx, NginxTls};
pub use nix::sys::signal::Signal;
pub use peer::{Peer, PeerConf, PeerKind};
pub use ports::{free_port, free_ports};
pub use proc::Proc;
pub use redis::{Redis, RedisTls};
pub use sim::Sim;

/// Resident memory of process `pid` (`VmRSS` of /proc/<pid>/status), in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())?;
    Some(kb * 1024)
}

/// Polls `f` every 20 ms until it is true (returns true) or `limit` passes (returns false).
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The directory holding the workspace's binaries (`inferlb`, `inferlb-sim`): `$INFERLB_BIN_DIR`
/// when set, else the running executable's own directory (the bench, in `target/release`), else
/// its parent (cargo puts test binaries in `target/<profile>/deps`).
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("INFERLB_BIN_DIR") {
            return PathBuf::from(d);
        }
        let exe = std::env::current_exe().expect("the running executable's path");
        let here = exe
            .parent()
            .expect("the executable's directory")
            .to_path_buf();
        match here.parent() {
            Some(up) if !here.join("inferlb-sim").exists() && up.join("inferlb-sim").exists() => {
                up.to_path_buf()
            }
            _ => here,
        }
    })
}

/// The path of one of the workspace's binaries; panics, saying what to do, when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (`cargo build --release --workspace --bins`; `make test` does)",
        p.display()
    );
    p
}

/// `GET path` on `127.0.0.1:port` over a fresh connection: the response's status code, or None
/// when nothing answers within `timeout`.
pub fn http_status(port: u16, path: &str, timeout: Duration) -> Option<u16> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    let head =
        format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).ok()?;
    // "HTTP/1.1 200 ..." : the status line is all that is needed.
    let mut buf = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    std::str::from_utf8(&buf[..n])
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Quotes `s` as a YAML double-quoted scalar.
fn yaml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn wait_until_is_bounded_and_returns_early() {
        let started = Instant::now();
        assert!(!wait_until(Duration::from_millis(100), || false));
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(started.elapsed() < Duration::from_secs(2));
        let mut n = 0;
        assert!(wait_until(Duration::from_secs(5), || {
            n += 1;
            n == 3
        }));
    }

    #[test]
    fn http_status_reads_the_status_line_and_gives_up_on_silence() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut req = [0u8; 256];
            let _ = c.read(&mut req);
            c.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            // A second connection that never answers.
            let (_silent, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        assert_eq!(
            http_status(port, "/health", Duration::from_secs(2)),
            Some(503)
        );
        assert_eq!(
            http_status(port, "/health", Duration::from_millis(200)),
            None
        );
        server.join().unwrap();
        assert_eq!(
            http_status(free_port(), "/", Duration::from_millis(200)),
            None
        );
    }

    #[test]
    fn yaml_strings_are_quoted() {
        assert_eq!(yaml_str(r#"a"b\c"#), r#""a\"b\\c""#);
    }
}
