//! TLS and HTTP/2 against real processes, with certificates made here at test time: the
//! listener (h2 and http/1.1 by ALPN, a plain second listener, a certificate reloaded from its
//! changed files), replicas behind TLS (verified, a wrong or expired certificate demoted like a
//! refused connection, a client certificate for a mesh), and bad input at the TLS layer.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use serde_json::json;

/// A test certificate authority; what it issues is written as PEM files into its folder.
struct Pki {
    dir: PathBuf,
    name: String,
    ca: Certificate,
    key: KeyPair,
}

impl Pki {
    fn new(dir: &Path, name: &str) -> Pki {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("inferlb test CA {name}"));
        let ca = params.self_signed(&key).expect("self-signed CA");
        std::fs::write(dir.join(format!("{name}-ca.pem")), ca.pem()).expect("write CA");
        Pki {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            ca,
            key,
        }
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    fn ca_pem(&self) -> Vec<u8> {
        self.ca.pem().into_bytes()
    }

    /// A certificate for `names` (host names or IP addresses), valid now unless `expired`:
    /// (certificate file, key file).
    fn issue(&self, file: &str, names: &[&str], expired: bool) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{file} ({})", self.name));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.ca, &self.key).expect("sign");
        let (c, k) = (
            self.dir.join(format!("{file}.crt")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write cert");
        std::fs::write(&k, key.serialize_pem()).expect("write key");
        (c, k)
    }
}

/// Replaces a file's content the way an operator's tooling does: written beside, renamed over.
fn replace_file(path: &Path, from: &Path) {
    let tmp = path.with_extension("new");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, path).expect("rename");
}

fn https_client(ca_pem: &[u8]) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem).expect("CA pem"))
        .timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .expect("https client")
}

/// `inferlb.tls` (and a plain second listener when `plain` is set) as conf lines.
fn tls_section(cert: &Path, key: &Path, plain: Option<u16>) -> String {
    let mut s = format!(
        "  tls: {{cert_file: '{}', key_file: '{}', reload_interval_seconds: 0.2}}\n",
        cert.display(),
        key.display()
    );
    if let Some(p) = plain {
        s.push_str(&format!("  plain_listen: 127.0.0.1:{p}\n"));
    }
    s
}

/// curl over HTTPS to the balancer, trusting `ca`: (exit code, `http_version http_code`).
fn curl_https(port: u16, ca: &Path, version_flag: &str) -> (i32, String) {
    let body = chat_body(&[("user", "hello over tls")], false, 4).to_string();
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(ca)
        .args([
            version_flag,
            "--resolve",
            &format!("localhost:{port}:127.0.0.1"),
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
            "-H",
            "content-type: application/json",
            "-d",
            &body,
            &format!("https://localhost:{port}/v1/chat/completions"),
        ])
        .output()
        .expect("curl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn the_listener_speaks_h2_and_http1_over_tls_and_reloads_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let first = Pki::new(dir.path(), "first");
    let (cert, key) = first.issue("server", &["localhost", "127.0.0.1"], false);
    let (a, b) = two_sims(dir.path(), &["--decode-interval-ms", "20"]);
    let plain = free_port();
    let conf = LbConf {
        extra: tls_section(&cert, &key, Some(plain)),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&a, &b], conf);

    assert_eq!(
        curl_https(lb.port, &first.ca_file(), "--http2"),
        (0, "2 200".into())
    );
    assert_eq!(
        curl_https(lb.port, &first.ca_file(), "--http1.1"),
        (0, "1.1 200".into())
    );
    let r = http()
        .post(format!("http://127.0.0.1:{plain}/v1/chat/completions"))
        .json(&chat_body(&[("user", "plain listener")], false, 4))
        .send()
        .expect("plain listener");
    assert_eq!(r.status(), 200, "the plain listener serves too");

    // A stream that runs across the reload, on a connection made with the old certificate.
    let client = https_client(&first.ca_pem());
    let url = format!("https://127.0.0.1:{}/v1/chat/completions", lb.port);
    let long = client
        .post(&url)
        .json(&chat_body(
            &[("user", "a long answer across a reload")],
            true,
            60,
        ))
        .send()
        .expect("stream before the reload");
    assert_eq!(long.version(), reqwest::Version::HTTP_2);
    let stream = std::thread::spawn(move || sse_events(long));

    // The operator's tooling swaps both files for a certificate from another CA.
    let second = Pki::new(dir.path(), "second");
    let (cert2, key2) = second.issue("server2", &["localhost", "127.0.0.1"], false);
    assert_ne!(
        curl_https(lb.port, &second.ca_file(), "--http2").0,
        0,
        "not yet trusted"
    );
    // A half-written pair is refused and the old certificate stays.
    std::fs::write(dir.path().join("garbage.pem"), "not a certificate").unwrap();
    replace_file(&cert, &dir.path().join("garbage.pem"));
    let refused = wait_until(Duration::from_secs(10), || {
        lb.proc.log_text().contains("not reloaded")
    });
    assert!(
        refused,
        "the reloader read the bad pair:\n{}",
        lb.proc.log_text()
    );
    assert_eq!(
        curl_https(lb.port, &first.ca_file(), "--http1.1"),
        (0, "1.1 200".into())
    );
    replace_file(&key, &key2);
    replace_file(&cert, &cert2);
    let reloaded = wait_until(Duration::from_secs(10), || {
        curl_https(lb.port, &second.ca_file(), "--http2") == (0, "2 200".into())
    });
    assert!(
        reloaded,
        "the new certificate is served:\n{}",
        lb.proc.log_text()
    );
    assert_ne!(
        curl_https(lb.port, &first.ca_file(), "--http2").0,
        0,
        "the old one is gone"
    );
    assert_eq!(lb.metric("inferlb_tls_certificate_reloads_total"), 1.0);

    let (events, err) = stream.join().unwrap();
    assert!(
        err.is_none(),
        "the stream across the reload was cut: {err:?}"
    );
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"));
}

#[test]
fn replicas_behind_tls_are_verified_and_a_bad_certificate_fails_over() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "mesh");
    let sim_tls = |id: &str, names: &[&str], expired: bool| {
        let (c, k) = pki.issue(id, names, expired);
        let (c, k) = (c.display().to_string(), k.display().to_string());
        let s = Sim::spawn(dir.path(), id, &["--tls-cert", &c, "--tls-key", &k]);
        s.assert_healthy();
        s
    };
    let good = sim_tls("good", &["localhost"], false);
    let wrong = sim_tls("wronghost", &["wrong.example"], false);
    let expired = sim_tls("expired", &["localhost"], true);
    let replicas = [&good, &wrong, &expired]
        .iter()
        .map(|s| Replica::new(&s.id, &format!("https://localhost:{}", s.port)))
        .collect();
    let conf = LbConf {
        // Slow checks: the data path meets the bad certificates first.
        health_interval_seconds: Some(2.0),
        replicas,
        extra: format!("  upstream: {{ca_file: '{}'}}\n", pki.ca_file().display()),
        routing: Some("roundrobin".into()),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[], conf);
    let c = http();
    for i in 0..12 {
        let r = c
            .post(lb.url("/v1/chat/completions"))
            .json(&chat_body(&[("user", &format!("verified {i}"))], false, 4))
            .send()
            .expect("request");
        assert_eq!(r.status(), 200, "request {i}: {:?}", r.text());
        assert_eq!(r.headers()["x-inferlb-replica"], "good");
    }
    for bad in ["wronghost", "expired"] {
        let failed = lb
            .samples("inferlb_failovers_total")
            .iter()
            .any(|(labels, v)| {
                labels.contains(&format!("replica=\"{bad}\""))
                    && labels.contains("tls_handshake")
                    && *v >= 1.0
            });
        assert!(
            failed,
            "{bad}: a TLS failure, failed over:\n{}",
            lb.metrics()
        );
        assert_eq!(
            lb.metric(&format!("inferlb_replica_up{{replica=\"{bad}\"}}")),
            0.0
        );
    }
    let log = lb.proc.log_text();
    assert!(
        log.contains("certificate not valid for name") && log.contains("certificate expired"),
        "each verification failure is logged with its reason:\n{log}"
    );
    assert_eq!(lb.metric("inferlb_replica_up{replica=\"good\"}"), 1.0);
}

#[test]
fn a_replica_that_asks_for_a_client_certificate_gets_one() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "mesh");
    let (c, k) = pki.issue("mesh-replica", &["localhost"], false);
    let ca = pki.ca_file().display().to_string();
    let (c, k) = (c.display().to_string(), k.display().to_string());
    let mesh = Sim::spawn(
        dir.path(),
        "mesh",
        &["--tls-cert", &c, "--tls-key", &k, "--tls-client-ca", &ca],
    );
    mesh.assert_healthy();
    let (client_cert, client_key) = pki.issue("inferlb-client", &["inferlb.test"], false);
    let replica = || {
        vec![Replica::new(
            "mesh",
            &format!("https://localhost:{}", mesh.port),
        )]
    };

    let with_cert = LbConf {
        replicas: replica(),
        extra: format!(
            "  upstream: {{ca_file: '{ca}', client_cert_file: '{}', client_key_file: '{}'}}\n",
            client_cert.display(),
            client_key.display()
        ),
        ..test_conf()
    };
    let a_dir = dir.path().join("a");
    std::fs::create_dir_all(&a_dir).unwrap();
    let lb = Lb::start(&a_dir, &[], with_cert);
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", "through the mesh")], false, 4))
        .send()
        .expect("request");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-inferlb-replica"], "mesh");
    // Health checks and /metrics reads go over the same TLS: the replica stays up.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(lb.metric("inferlb_replica_up{replica=\"mesh\"}"), 1.0);

    let without = LbConf {
        replicas: replica(),
        extra: format!("  upstream: {{ca_file: '{ca}'}}\n"),
        ..test_conf()
    };
    let b_dir = dir.path().join("b");
    std::fs::create_dir_all(&b_dir).unwrap();
    let lb2 = Lb::start(&b_dir, &[], without);
    let r = http()
        .post(lb2.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", "no client certificate")], false, 4))
        .send()
        .expect("request");
    // Refused at the handshake, it is demoted, and there is no other replica.
    assert_eq!(r.status(), 503, "refused by the mesh: {:?}", r.text());
    let down = wait_until(Duration::from_secs(5), || {
        lb2.metric("inferlb_replica_up{replica=\"mesh\"}") == 0.0
    });
    assert!(down, "a replica that refuses the handshake is down");
}

#[test]
fn thirty_two_h2_streams_on_one_connection_fail_over_and_cut_as_on_http1() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "edge");
    let (cert, key) = pki.issue("server", &["127.0.0.1"], false);
    let (a, b) = two_sims(dir.path(), &["--decode-interval-ms", "10"]);
    let conf = LbConf {
        extra: tls_section(&cert, &key, None),
        routing: Some("roundrobin".into()),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&a, &b], conf);
    let client = https_client(&pki.ca_pem());
    let url = format!("https://127.0.0.1:{}/v1/chat/completions", lb.port);
    // One connection first, so that every stream after it is multiplexed on it.
    let warm = client
        .post(&url)
        .json(&chat_body(&[("user", "warm")], false, 2))
        .send()
        .expect("warm");
    assert_eq!(warm.version(), reqwest::Version::HTTP_2);

    // gpu0 resets the next 8 requests before a byte: those fail over to gpu1.
    a.fault(json!({"fault": "reset", "count": 8}));
    let streams: Vec<_> = (0..32)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            std::thread::spawn(move || {
                let body = chat_body(&[("user", &format!("stream {i}"))], true, 20);
                let r = client.post(&url).json(&body).send().expect("stream");
                let (status, version) = (r.status().as_u16(), r.version());
                let (events, err) = sse_events(r);
                (status, version, events, err)
            })
        })
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (status, version, events, err) = s.join().unwrap();
        assert_eq!(status, 200, "stream {i}");
        assert_eq!(version, reqwest::Version::HTTP_2, "stream {i}");
        assert!(err.is_none(), "stream {i} was cut: {err:?}");
        assert_eq!(
            events.last().map(|e| e.1.as_str()),
            Some("[DONE]"),
            "stream {i}"
        );
    }
    let failovers: f64 = lb
        .samples("inferlb_failovers_total")
        .iter()
        .filter(|(l, _)| l.contains("replica=\"gpu0\""))
        .map(|(_, v)| v)
        .sum();
    assert!(
        failovers >= 1.0,
        "some of the 32 failed over:\n{}",
        lb.metrics()
    );

    // A stream cut mid-answer: the SSE error event, then a reset stream, never a clean end.
    a.fault(json!({"fault": "cut_stream", "count": 1}));
    b.fault(json!({"fault": "cut_stream", "count": 1}));
    let r = client
        .post(&url)
        .json(&chat_body(&[("user", "cut me")], true, 50))
        .send()
        .expect("stream to cut");
    assert_eq!(r.status(), 200);
    let (events, err) = sse_events(r);
    assert!(
        err.is_some(),
        "the cut stream must not end cleanly: {events:?}"
    );
    let last = events.last().map(|e| e.1.clone()).unwrap_or_default();
    assert!(
        last.contains("\"error\""),
        "the last event is the error event: {last}"
    );
}

/// Reads what the server sends until it closes (or `limit`): (bytes, closed in time).
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let start = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        s.set_read_timeout(Some(Duration::from_millis(500))).ok();
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

#[test]
fn bad_input_at_the_tls_layer_is_closed_and_the_listener_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "edge");
    let (cert, key) = pki.issue("server", &["localhost", "127.0.0.1"], false);
    let (a, b) = two_sims(dir.path(), &[]);
    let conf = LbConf {
        extra: tls_section(&cert, &key, None),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&a, &b], conf);
    let serving = || curl_https(lb.port, &pki.ca_file(), "--http2") == (0, "2 200".into());

    // A handshake that starts and never finishes: five bytes of a record header.
    let mut stalled = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();

    // Plain HTTP to the TLS port: no HTTP answer, a closed connection.
    let mut s = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(5));
    assert!(closed, "plain HTTP on the TLS port is closed");
    assert!(!String::from_utf8_lossy(&got).contains("200 OK"));
    assert!(serving());

    // Garbage.
    let mut s = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let _ = s.write_all(&noise);
    assert!(
        read_until_closed(&mut s, Duration::from_secs(5)).1,
        "garbage is closed"
    );
    assert!(serving());

    // A protocol version it does not speak (TLS 1.1; rustls does 1.2 and 1.3).
    let old = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "5",
            "-k",
            "--tlsv1.1",
            "--tls-max",
            "1.1",
        ])
        .arg(format!("https://127.0.0.1:{}/v1/models", lb.port))
        .output()
        .expect("curl");
    assert_ne!(old.status.code(), Some(0), "TLS 1.1 is refused");
    assert!(serving());

    // The stalled handshake is bounded (Pingora's handshake timeout, 60 s) and never held
    // up anything else meanwhile.
    let started = Instant::now();
    let (_, closed) = read_until_closed(&mut stalled, Duration::from_secs(75));
    assert!(closed, "a handshake that never finishes is closed");
    eprintln!(
        "stalled handshake closed after {:?} more",
        started.elapsed()
    );
    assert!(serving());
}

#[test]
fn tls_conf_mistakes_are_refused_with_the_key_named() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "conf");
    let (cert, key) = pki.issue("server", &["localhost"], false);
    let (_, other_key) = pki.issue("other", &["localhost"], false);
    let missing = dir.path().join("missing.pem");
    let check = |extra: String, replica: &str| {
        let conf = LbConf {
            listen_port: free_port(),
            admin_port: free_port(),
            replicas: vec![Replica::new("gpu0", replica)],
            extra,
            ..test_conf()
        };
        let path = dir.path().join("check.yaml");
        conf.write(&path).unwrap();
        let out = Command::new(INFERLB)
            .arg("-t")
            .arg("-c")
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let ok = "127.0.0.1:9";
    for (extra, replica, named) in [
        (tls_section(&missing, &key, None), ok, "inferlb.tls"),
        (tls_section(&cert, &other_key, None), ok, "inferlb.tls"),
        (
            format!("  plain_listen: 127.0.0.1:{}\n", free_port()),
            ok,
            "inferlb.plain_listen",
        ),
        (
            format!("  upstream: {{ca_file: '{}'}}\n", missing.display()),
            ok,
            "inferlb.upstream.ca_file",
        ),
        (
            format!("  upstream: {{client_cert_file: '{}'}}\n", cert.display()),
            ok,
            "inferlb.upstream.client_cert_file",
        ),
        (
            String::new(),
            "ftp://127.0.0.1:9",
            "inferlb.replicas[0].address",
        ),
    ] {
        let (code, err) = check(extra.clone(), replica);
        assert_eq!(code, Some(2), "refused: {extra} {replica}\n{err}");
        assert!(err.contains(named), "names {named}: {err}");
    }
    let (code, err) = check(tls_section(&cert, &key, None), "https://localhost:9");
    assert_eq!(code, Some(0), "a valid TLS conf passes: {err}");
}

#[test]
fn a_graceful_upgrade_serves_the_new_certificate_and_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = Pki::new(dir.path(), "first");
    let second = Pki::new(dir.path(), "second");
    let (cert, key) = first.issue("server", &["127.0.0.1"], false);
    let (a, b) = two_sims(dir.path(), &["--decode-interval-ms", "5"]);
    let mut section = tls_section(&cert, &key, None);
    // No reload by polling here: only the upgrade may bring the new certificate.
    section = section.replace(
        "reload_interval_seconds: 0.2",
        "reload_interval_seconds: 3600",
    );
    let conf = LbConf {
        extra: section,
        ..test_conf()
    };
    let old = Lb::start(dir.path(), &[&a, &b], conf);
    let port = old.port;

    // Clients that trust both CAs keep sending over kept-alive HTTPS connections throughout.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ca1, ca2) = (first.ca_pem(), second.ca_pem());
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let stop = stop.clone();
            let client = reqwest::blocking::Client::builder()
                .use_rustls_tls()
                .tls_built_in_root_certs(false)
                .add_root_certificate(reqwest::Certificate::from_pem(&ca1).unwrap())
                .add_root_certificate(reqwest::Certificate::from_pem(&ca2).unwrap())
                .timeout(Duration::from_secs(30))
                .no_proxy()
                .build()
                .unwrap();
            std::thread::spawn(move || {
                let url = format!("https://127.0.0.1:{port}/v1/chat/completions");
                let (mut sent, mut failed) = (0u32, vec![]);
                let deadline = Instant::now() + Duration::from_secs(40);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline
                {
                    let body = chat_body(&[("user", &format!("worker {w} turn {sent}"))], true, 8);
                    sent += 1;
                    match client.post(&url).json(&body).send() {
                        Ok(r) if r.status() == 200 => {
                            let (events, err) = sse_events(r);
                            if err.is_some()
                                || events.last().map(|e| e.1.as_str()) != Some("[DONE]")
                            {
                                failed.push(format!("cut: {err:?}"));
                            }
                        }
                        Ok(r) => failed.push(format!("status {}", r.status())),
                        Err(e) => failed.push(format!("{e}")),
                    }
                }
                (sent, failed)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));

    let (cert2, key2) = second.issue("server2", &["127.0.0.1"], false);
    replace_file(&key, &key2);
    replace_file(&cert, &cert2);
    let mut cmd = old.command();
    cmd.arg("-u").env("RUST_LOG", "info");
    let new = Lb::spawn("inferlb (upgraded)", cmd, Some(&dir.path().join("new.log"))).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        old.proc.signal(Signal::SIGQUIT),
        "SIGQUIT to the old process"
    );
    let served = wait_until(Duration::from_secs(15), || {
        curl_https_ip(port, &second.ca_file()) == (0, "2 200".into())
    });
    assert!(
        served,
        "the new process serves the new certificate:\n{}",
        new.log_text()
    );
    let mut old = old;
    assert!(
        old.proc.wait_exit(Duration::from_secs(20)).is_some(),
        "the old process exits"
    );
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut sent, mut failed) = (0, vec![]);
    for w in workers {
        let (s, f) = w.join().unwrap();
        sent += s;
        failed.extend(f);
    }
    eprintln!(
        "HTTPS across an upgrade: sent {sent}, failed {}",
        failed.len()
    );
    assert!(sent > 20, "load ran: {sent}");
    assert!(failed.is_empty(), "{failed:?}");
}

/// curl to `https://127.0.0.1:port` trusting `ca`: (exit code, `http_version http_code`).
fn curl_https_ip(port: u16, ca: &Path) -> (i32, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", "--http2", "--cacert"])
        .arg(ca)
        .args(["-o", "/dev/null", "-w", "%{http_version} %{http_code}"])
        .arg(format!("https://127.0.0.1:{port}/v1/models"))
        .output()
        .expect("curl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn h2c_with_prior_knowledge_on_the_plain_listener_when_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = two_sims(dir.path(), &[]);
    let conf = LbConf {
        extra: "  h2c: true\n".into(),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&a, &b], conf);
    let body = chat_body(&[("user", "h2c")], true, 4).to_string();
    for (flag, version) in [("--http2-prior-knowledge", "2"), ("--http1.1", "1.1")] {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "10",
                flag,
                "-H",
                "content-type: application/json",
            ])
            .args(["-d", &body, "-w", "\n%{http_version} %{http_code}"])
            .arg(lb.url("/v1/chat/completions"))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.ends_with(&format!("{version} 200")), "{flag}: {text}");
        assert!(text.contains("data: [DONE]"), "{flag}: {text}");
    }
}
