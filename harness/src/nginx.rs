//! nginx as a plain reverse proxy, optionally terminating TLS too: the bench's comparison target
//! for the proxy's own overhead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{free_port, http_status, wait_until, Proc, Signal};

/// SIGTERM to the master is nginx's fast shutdown (what `nginx -s stop` sends): the master
/// stops its workers, waits for them, removes its pid file and exits. Killing the master instead
/// would leave the workers running, orphaned.
const NGINX_STOP: Signal = Signal::SIGTERM;

/// `keepalive_requests` of every server: nginx's default closes a client's connection after
/// 1,000 requests, which would put reconnections (and TLS handshakes) into a steady-state
/// measurement; inferlb keeps a connection as long as the client does.
pub const KEEPALIVE_REQUESTS: u64 = 1_000_000;

/// TLS on a second `server` of the same nginx ([`Nginx::start_tls`]): the same `location`,
/// behind `listen ... ssl`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NginxTls {
    /// PEM, the server's certificate first (a chain allowed): `ssl_certificate`.
    pub cert_file: PathBuf,
    /// PEM: `ssl_certificate_key`.
    pub key_file: PathBuf,
    /// `ssl_protocols` (e.g. `"TLSv1.3"`); None: nginx's default.
    pub protocols: Option<String>,
    /// TLS 1.3 cipher suites, OpenSSL's `Ciphersuites` through `ssl_conf_command` (e.g.
    /// `"TLS_AES_128_GCM_SHA256"`); None: OpenSSL's default.
    pub ciphersuites: Option<String>,
    /// `ssl_ecdh_curve` (e.g. `"X25519"`); None: nginx's default.
    pub curves: Option<String>,
}

/// An nginx master process (in the foreground, `daemon off`) and its two workers, proxying to
/// upstream ports on loopback with keep-alive and without buffering.
pub struct Nginx {
    /// The plain HTTP server.
    pub port: u16,
    /// The TLS server, when started with [`Nginx::start_tls`].
    pub tls_port: Option<u16>,
    /// Its access log (nginx's default `combined` format), when started with one
    /// ([`Nginx::start_logged`]); otherwise `access_log off`.
    pub access_log: Option<PathBuf>,
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
        Nginx::start_with(bin, dir, upstreams, None, false)
    }

    /// [`Nginx::start`], writing an access log to `<dir>/access.log` when `access_log` is set.
    pub fn start_logged(
        bin: &Path,
        dir: &Path,
        upstreams: &[u16],
        access_log: bool,
    ) -> Result<Nginx, String> {
        Nginx::start_with(bin, dir, upstreams, None, access_log)
    }

    /// [`Nginx::start`], with a second server on another free port terminating TLS as `tls`
    /// says, in front of the same upstreams. Also waits until that port answers: nginx answers
    /// a plain HTTP request on a TLS port with 400, which it does only once the server is up
    /// with its certificate loaded.
    pub fn start_tls(
        bin: &Path,
        dir: &Path,
        upstreams: &[u16],
        tls: &NginxTls,
    ) -> Result<Nginx, String> {
        Nginx::start_with(bin, dir, upstreams, Some(tls), false)
    }

    fn start_with(
        bin: &Path,
        dir: &Path,
        upstreams: &[u16],
        tls: Option<&NginxTls>,
        access_log: bool,
    ) -> Result<Nginx, String> {
        let port = free_port();
        let tls = tls.map(|t| (free_port(), t));
        let conf = dir.join("nginx.conf");
        let access_log = access_log.then(|| dir.join("access.log"));
        let text = render_conf(dir, port, upstreams, tls, access_log.as_deref());
        std::fs::write(&conf, text).map_err(|e| format!("nginx conf: {e}"))?;
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
            tls_port: tls.map(|(p, _)| p),
            access_log,
            proc,
            pid_file: dir.join("nginx.pid"),
        };
        let up = wait_until(Duration::from_secs(10), || {
            let serving = http_status(port, "/health", Duration::from_secs(1)) == Some(200)
                && nginx
                    .tls_port
                    .is_none_or(|p| http_status(p, "/health", Duration::from_secs(1)) == Some(400));
            serving || nginx.proc.has_exited()
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

    /// `https://<host>:<tls port>` (`host` as the certificate names it), when it serves TLS.
    pub fn tls_url(&self, host: &str) -> Option<String> {
        self.tls_port.map(|p| format!("https://{host}:{p}"))
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

/// nginx.conf's text: a plain server on `port` and, with `tls`, a TLS server on its port, both
/// with the same `location`; an access log to `access_log`, or none.
fn render_conf(
    dir: &Path,
    port: u16,
    upstreams: &[u16],
    tls: Option<(u16, &NginxTls)>,
    access_log: Option<&Path>,
) -> String {
    let servers: String = upstreams
        .iter()
        .map(|p| format!("    server 127.0.0.1:{p};\n"))
        .collect();
    let d = dir.display();
    let access_log = access_log.map_or("off".to_string(), |p| p.display().to_string());
    let location = "    location / {\n      proxy_pass http://replicas;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }\n";
    let mut text = format!(
        "worker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 4096; }}\n\
         http {{\n  access_log {access_log};\n  keepalive_requests {KEEPALIVE_REQUESTS};\n  client_body_temp_path {d};\n  proxy_temp_path {d};\n  fastcgi_temp_path {d};\n  uwsgi_temp_path {d};\n  scgi_temp_path {d};\n\
         \x20 upstream replicas {{\n{servers}    keepalive 64;\n  }}\n\
         \x20 server {{\n    listen 127.0.0.1:{port};\n{location}  }}\n"
    );
    if let Some((tls_port, t)) = tls {
        text.push_str(&format!(
            "  server {{\n    listen 127.0.0.1:{tls_port} ssl;\n    ssl_certificate {};\n    ssl_certificate_key {};\n",
            t.cert_file.display(),
            t.key_file.display()
        ));
        if let Some(p) = &t.protocols {
            text.push_str(&format!("    ssl_protocols {p};\n"));
        }
        if let Some(c) = &t.ciphersuites {
            text.push_str(&format!("    ssl_conf_command Ciphersuites {c};\n"));
        }
        if let Some(c) = &t.curves {
            text.push_str(&format!("    ssl_ecdh_curve {c};\n"));
        }
        text.push_str(&format!("{location}  }}\n"));
    }
    text.push_str("}\n");
    text
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
    fn the_tls_server_has_the_plain_servers_location_behind_listen_ssl() {
        let tls = NginxTls {
            cert_file: "/d/server.crt".into(),
            key_file: "/d/server.key".into(),
            protocols: Some("TLSv1.3".into()),
            ciphersuites: Some("TLS_AES_128_GCM_SHA256".into()),
            curves: Some("X25519".into()),
        };
        let plain = render_conf(Path::new("/d"), 7, &[9], None, None);
        let both = render_conf(Path::new("/d"), 7, &[9], Some((8, &tls)), None);
        assert!(!plain.contains("ssl"), "{plain}");
        assert!(plain.contains("  keepalive_requests 1000000;\n"), "{plain}");
        assert!(plain.contains("  access_log off;\n"), "{plain}");
        let logged = render_conf(Path::new("/d"), 7, &[9], None, Some(Path::new("/d/a.log")));
        assert!(logged.contains("  access_log /d/a.log;\n"), "{logged}");
        assert_eq!(plain.matches("server {").count(), 1);
        assert_eq!(both.matches("server {").count(), 2);
        let tls_server = &both[both.find("listen 127.0.0.1:8 ssl;").expect("listen ssl")..];
        for line in [
            "ssl_certificate /d/server.crt;",
            "ssl_certificate_key /d/server.key;",
            "ssl_protocols TLSv1.3;",
            "ssl_conf_command Ciphersuites TLS_AES_128_GCM_SHA256;",
            "ssl_ecdh_curve X25519;",
            "proxy_pass http://replicas;",
        ] {
            assert!(tls_server.contains(line), "{line} missing:\n{both}");
        }
        // Without the TLS server, the text is the plain one.
        assert!(both.starts_with(plain.trim_end_matches("}\n")));
    }

    /// An upstream answering 200 to every request, on a loopback port.
    fn ok_upstream() -> u16 {
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
        up_port
    }

    #[test]
    fn nginx_serves_tls_beside_plain_http() {
        let Some(bin) = Nginx::find() else {
            eprintln!("nginx is not installed: skipped (`make deps` installs it)");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        // A self-signed certificate from the openssl CLI (the harness has no TLS library).
        let made = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj"])
            .args(["/CN=localhost", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output();
        if !made.is_ok_and(|o| o.status.success()) {
            eprintln!("the openssl CLI could not make a certificate: skipped");
            return;
        }
        let tls = NginxTls {
            cert_file: cert,
            key_file: key,
            protocols: Some("TLSv1.3".into()),
            ciphersuites: Some("TLS_AES_128_GCM_SHA256".into()),
            curves: Some("X25519".into()),
        };
        let mut nginx =
            Nginx::start_tls(&bin, dir.path(), &[ok_upstream()], &tls).expect("nginx starts");
        let tls_port = nginx.tls_port.expect("a TLS port");
        assert_ne!(tls_port, nginx.port);
        assert_eq!(
            nginx.tls_url("localhost"),
            Some(format!("https://localhost:{tls_port}"))
        );
        assert_eq!(
            http_status(nginx.port, "/x", Duration::from_secs(2)),
            Some(200)
        );
        // Plain HTTP on the TLS port: nginx's 400, so TLS is what that port speaks.
        assert_eq!(
            http_status(tls_port, "/x", Duration::from_secs(2)),
            Some(400)
        );
        nginx.stop();
        assert!(!dir.path().join("nginx.pid").exists());
    }

    #[test]
    fn a_tls_server_whose_certificate_is_missing_is_an_error() {
        let Some(bin) = Nginx::find() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let tls = NginxTls {
            cert_file: dir.path().join("absent.crt"),
            key_file: dir.path().join("absent.key"),
            ..NginxTls::default()
        };
        let err = Nginx::start_tls(&bin, dir.path(), &[ok_upstream()], &tls)
            .err()
            .expect("no certificate, no nginx");
        assert!(err.contains("absent.crt"), "{err}");
    }

    #[test]
    fn nginx_proxies_and_leaves_no_worker_behind() {
        let Some(bin) = Nginx::find() else {
            eprintln!("nginx is not installed: skipped (`make deps` installs it)");
            return;
        };
        let up_port = ok_upstream();
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
