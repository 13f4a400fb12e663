//! nginx as a plain reverse proxy: the bench's comparison target for the proxy's own overhead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{free_port, http_status, wait_until, Proc, Signal};

/// SIGTERM to the master is nginx's fast shutdown (what `nginx -s stop` sends): the master
/// stops its workers, waits for them, removes its pid file and exits. Killing the master instead
/// would leave the workers running, orphaned.
const NGINX_STOP: Signal = Signal::SIGTERM;

/// An nginx master process (in the foreground, `daemon off`) and its two workers, proxying to
/// upstream ports on loopback with keep-alive and without buffering.
pub struct Nginx {
    pub port: u16,
    proc: Proc,
    pid_file: PathBuf,
}

impl Nginx {
    /// The installed nginx binary, if any.
    pub fn find() -> Option<PathBuf> {
        ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    /// Writes `<dir>/nginx.conf` (everything nginx writes goes in `dir` too), starts `bin` on a
    /// free port in front of `upstreams` and waits (at most 10 s) until `/health` answers 200
    /// through it.
    pub fn start(bin: &Path, dir: &Path, upstreams: &[u16]) -> Result<Nginx, String> {
        let port = free_port();
        let conf = write_conf(dir, port, upstreams).map_err(|e| format!("nginx conf: {e}"))?;
        let mut cmd = Command::new(bin);
        cmd.args(["-e", "stderr", "-p"])
            .arg(dir)
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off;"]);
        let log = dir.join("nginx-stderr.log");
        let proc = Proc::spawn("nginx", cmd, Some(&log), NGINX_STOP)
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let mut nginx = Nginx {
            port,
            proc,
            pid_file: dir.join("nginx.pid"),
        };
        let up = wait_until(Duration::from_secs(10), || {
            http_status(port, "/health", Duration::from_secs(1)) == Some(200)
                || nginx.proc.has_exited()
        });
        if !up || nginx.proc.has_exited() {
            return Err(format!(
                "nginx did not start: {}",
                nginx.proc.log_text().trim()
            ));
        }
        Ok(nginx)
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Stops the master and, through it, the workers; returns once its pid file is gone (or
    /// 2 s after the master exited).
    pub fn stop(&mut self) {
        self.proc.stop();
        wait_until(Duration::from_secs(2), || !self.pid_file.exists());
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
    }
}

fn write_conf(dir: &Path, port: u16, upstreams: &[u16]) -> std::io::Result<PathBuf> {
    let servers: String = upstreams
        .iter()
        .map(|p| format!("    server 127.0.0.1:{p};\n"))
        .collect();
    let d = dir.display();
    let text = format!(
        "worker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d};\n  proxy_temp_path {d};\n  fastcgi_temp_path {d};\n  uwsgi_temp_path {d};\n  scgi_temp_path {d};\n\
         \x20 upstream replicas {{\n{servers}    keepalive 64;\n  }}\n\
         \x20 server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://replicas;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, text)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// The workers of an nginx master, from /proc.
    fn workers_of(master: u32) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .ok()
                    .and_then(|s| {
                        let rest = &s[s.rfind(')')? + 1..];
                        rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                    })
                    == Some(master)
            })
            .collect()
    }

    #[test]
    fn nginx_proxies_and_leaves_no_worker_behind() {
        let Some(bin) = Nginx::find() else {
            eprintln!("nginx is not installed: skipped (`make deps` installs it)");
            return;
        };
        // An upstream answering 200 to every request.
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        let up_port = upstream.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for c in upstream.incoming() {
                let Ok(mut c) = c else { break };
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf);
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                );
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let mut nginx = Nginx::start(&bin, dir.path(), &[up_port]).expect("nginx starts");
        let master = nginx.pid();
        let workers = workers_of(master);
        assert_eq!(workers.len(), 2, "{workers:?}");
        assert!(dir.path().join("nginx.pid").exists());
        nginx.stop();
        assert!(!dir.path().join("nginx.pid").exists());
        for w in workers.iter().chain([&master]) {
            assert!(
                !Path::new(&format!("/proc/{w}")).exists()
                    || std::fs::read_to_string(format!("/proc/{w}/stat"))
                        .is_ok_and(|s| s[s.rfind(')').unwrap() + 1..]
                            .trim_start()
                            .starts_with('Z')),
                "nginx process {w} outlived the stop"
            );
        }
    }
}
