//! Every body arrives whole, told by a client that is not ours: curl's HTTP/2 uploads with no
//! length (h2c with prior knowledge, and h2 over TLS by ALPN) of 1 KB, 50 KB and 300 KB (past
//! Pingora's 64 KiB retry buffer), on a first attempt and on a retry after the first replica
//! refused the connection; and a raw chunked upload with bytes after its JSON document.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA and a certificate for `localhost` signed by it: (CA file, certificate, key).
fn certificate(dir: &Path) -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "inferlb bodies test CA");
    let ca = params.self_signed(&ca_key).expect("CA");
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["localhost".into()])
        .expect("params")
        .signed_by(&key, &ca, &ca_key)
        .expect("sign");
    let file = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write pem");
        p.display().to_string()
    };
    (
        file("ca.pem", ca.pem()),
        file("server.crt", leaf.pem()),
        file("server.key", key.serialize_pem()),
    )
}

/// What one curl upload came back with.
#[derive(Debug)]
struct Answer {
    /// `http_version http_code`, e.g. `2 200`.
    version_status: String,
    /// Response headers, names lowercased.
    headers: Vec<(String, String)>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The replica that answered saw exactly `body`.
    fn assert_whole(&self, body: &[u8], what: &str) {
        assert_eq!(self.version_status, "2 200", "{what}: {self:?}");
        assert_eq!(
            self.header("x-sim-body-bytes"),
            Some(body.len().to_string().as_str()),
            "{what}: {self:?}"
        );
        let hash = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(body));
        assert_eq!(
            self.header("x-sim-body-hash"),
            Some(hash.as_str()),
            "{what}"
        );
    }
}

/// Uploads `body` from curl's standard input (`-T -`: HTTP/2 without a content-length) to
/// the balancer at `base` with `args` (the protocol, and TLS trust), in session `session`.
fn curl_upload(base: &str, args: &[&str], session: &str, body: &[u8]) -> Answer {
    let mut child = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "15",
            "-X",
            "POST",
            "-T",
            "-",
            "-o",
            "/dev/null",
        ])
        .args(["-D", "-", "-w", "%{http_version} %{http_code}"])
        .args(["-H", "content-type: application/json"])
        .args(["-H", &format!("x-session-id: {session}")])
        .args(args)
        .arg(format!("{base}/v1/chat/completions"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("curl");
    let mut stdin = child.stdin.take().expect("stdin");
    let data = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&data);
    });
    let out = child.wait_with_output().expect("curl output");
    writer.join().expect("writer");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, last) = text.rsplit_once("\r\n\r\n").unwrap_or(("", &text));
    let headers = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Answer {
        version_status: last.trim().to_string(),
        headers,
    }
}

#[test]
fn http2_uploads_without_a_length_arrive_whole_over_h2c_and_tls_and_on_a_retry() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificate(dir.path());
    let (mut a, b) = two_sims(dir.path(), &["--speed", "50"]);
    let plain = free_port();
    let conf = LbConf {
        session_header: Some("x-session-id".into()),
        extra: format!(
            "  h2c: true\n  plain_listen: 127.0.0.1:{plain}\n  \
             tls: {{cert_file: '{cert}', key_file: '{key}'}}\n"
        ),
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&a, &b], conf);
    let h2c = (
        format!("http://127.0.0.1:{plain}"),
        vec!["--http2-prior-knowledge"],
    );
    let resolve = format!("localhost:{}:127.0.0.1", lb.port);
    let tls = (
        format!("https://localhost:{}", lb.port),
        vec!["--http2", "--cacert", &ca, "--resolve", &resolve],
    );
    for (name, (base, args)) in [("h2c", &h2c), ("tls", &tls)] {
        for kb in [1, 50, 300] {
            let what = format!("{name} {kb} KB");
            let body_of = |i: usize| {
                let text = text_of(&format!("{what} {i}"), kb * 1000 / 4);
                serde_json::to_vec(&chat_body(&[("user", &text)], false, 1)).unwrap()
            };
            assert!(
                wait_until(Duration::from_secs(10), || lb.replica_state("gpu0")["live"]
                    == true),
                "gpu0 back"
            );
            // A conversation that lands on gpu0 while it is up: the whole body, first attempt.
            let mut on_gpu0 = None;
            for i in 0..12 {
                let (session, body) = (format!("{what} {i}"), body_of(i));
                let answer = curl_upload(base, args, &session, &body);
                answer.assert_whole(&body, &what);
                if answer.header("x-inferlb-replica") == Some("gpu0") {
                    on_gpu0 = Some((session, body));
                    break;
                }
            }
            let (session, body) =
                on_gpu0.unwrap_or_else(|| panic!("{what}: no conversation went to gpu0"));
            // gpu0 goes away: the session's next request is refused there and retried on gpu1.
            a.stop();
            let answer = curl_upload(base, args, &session, &body);
            answer.assert_whole(&body, &format!("{what}, retried"));
            assert_eq!(answer.header("x-inferlb-replica"), Some("gpu1"), "{what}");
            assert_eq!(answer.header("x-inferlb-route"), Some("repinned"), "{what}");
            a.restart(&[]);
            assert!(a.wait_healthy(Duration::from_secs(10)));
        }
    }
    let refused = r#"inferlb_failovers_total{reason="connect_refused",replica="gpu0"}"#;
    assert_eq!(
        lb.metric(refused),
        6.0,
        "each retry was a refused connection"
    );
}

fn chunked(pieces: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in pieces {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[test]
fn bytes_after_a_chunked_json_document_reach_the_replica_as_sent() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(dir.path(), &["--speed", "50"], test_conf());
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    // Under and over the 64 KiB retry buffer; what follows the document comes in chunks of
    // its own, as a streaming encoder writes a final newline.
    for kb in [10, 200] {
        let text = text_of(&format!("trailing {kb}"), kb * 1000 / 4);
        let json = serde_json::to_vec(&chat_body(&[("user", &text)], false, 1)).unwrap();
        let tail: &[&[u8]] = &[b"\n", b"  \r\n\t"];
        let mut sent = json.clone();
        for t in tail {
            sent.extend_from_slice(t);
        }
        let mut pieces: Vec<&[u8]> = json.chunks(7000).collect();
        pieces.extend_from_slice(tail);
        let resp = raw_exchange(lb.port, head, &chunked(&pieces), Duration::from_secs(20));
        assert!(resp.starts_with("HTTP/1.1 200"), "{kb} KB: {resp}");
        let lower = resp.to_ascii_lowercase();
        assert!(
            lower.contains(&format!("x-sim-body-bytes: {}\r\n", sent.len())),
            "{kb} KB: the replica got {} bytes of the {} sent\n{resp}",
            lower
                .split("x-sim-body-bytes: ")
                .nth(1)
                .and_then(|r| r.split("\r\n").next())
                .unwrap_or("?"),
            sent.len()
        );
        let hash = format!(
            "x-sim-body-hash: {:016x}",
            xxhash_rust::xxh3::xxh3_64(&sent)
        );
        assert!(lower.contains(&hash), "{kb} KB: {resp}");
    }
}
