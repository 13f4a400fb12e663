//! The front door against an attacker, on the running binary: smuggling and desync on a raw
//! socket, the path a replica receives against the path inferlb checked, the client's keys and
//! steering fields kept from replicas, hostile request ids and session headers.
//!
//! The replica here is a recorder: a raw TCP listener that keeps every request head and body
//! exactly as it arrived and answers a fixed JSON 200, so the tests see what reached it, byte
//! for byte (the simulator would parse and normalise).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::Value;

/// One request as the recorder received it.
#[derive(Debug, Clone)]
struct Seen {
    /// The request line, e.g. `POST /v1/chat/completions HTTP/1.1`.
    line: String,
    /// Header names (lower case) and values, in order, as sent.
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Seen {
    fn target(&self) -> &str {
        self.line.split(' ').nth(1).unwrap_or("")
    }

    fn header(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    fn id(&self) -> String {
        self.header("x-request-id")
            .first()
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    }
}

/// A replica that records what arrives and answers every request with one JSON 200 (a models
/// list and an empty chat answer at once).
struct Recorder {
    addr: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
}

const ANSWER: &str =
    r#"{"object":"list","data":[{"id":"sim-model","object":"model"}],"id":"r","choices":[]}"#;

impl Recorder {
    fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        Recorder { addr, seen, stop }
    }

    /// What arrived with this request id (health checks have none).
    fn with_id(&self, id: &str) -> Vec<Seen> {
        let seen = self.seen.lock().expect("lock");
        seen.iter().filter(|s| s.id() == id).cloned().collect()
    }

    /// Every request a client caused (health checks left out).
    fn client_requests(&self) -> Vec<Seen> {
        let seen = self.seen.lock().expect("lock");
        seen.iter()
            .filter(|s| s.target() != "/health")
            .cloned()
            .collect()
    }

    fn replica(&self, id: &str) -> Replica {
        Replica {
            models: vec!["sim-model".into()],
            ..Replica::new(id, &self.addr)
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(&self.addr);
    }
}

/// Serves one connection: each request recorded, answered, until the peer closes or idles.
fn serve(mut conn: TcpStream, seen: &Mutex<Vec<Seen>>) {
    conn.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    // Bounded: a connection carries at most this many requests here.
    for _ in 0..1000 {
        let end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let head = buf[..end - 4].to_vec();
        let mut lines = head
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let line = String::from_utf8_lossy(lines.next().unwrap_or(b"")).into_owned();
        let headers: Vec<(String, Vec<u8>)> = lines
            .filter_map(|l| {
                let colon = l.iter().position(|&b| b == b':')?;
                let name = String::from_utf8_lossy(&l[..colon]).to_ascii_lowercase();
                Some((name, l[colon + 1..].trim_ascii().to_vec()))
            })
            .collect();
        buf.drain(..end);
        let header = |n: &str| {
            headers
                .iter()
                .find(|(h, _)| h == n)
                .map(|(_, v)| String::from_utf8_lossy(v).to_string())
        };
        let body = if header("transfer-encoding").is_some() {
            match read_chunked(&mut conn, &mut buf) {
                Some(b) => b,
                None => return,
            }
        } else {
            let len: usize = header("content-length")
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            while buf.len() < len {
                match conn.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                }
            }
            buf.drain(..len).collect()
        };
        seen.lock().expect("lock").push(Seen {
            line,
            headers,
            body,
        });
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
            ANSWER.len()
        );
        if conn.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// A chunked body off `conn` (after what `buf` holds), decoded; `None` if it breaks off.
fn read_chunked(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut more = |buf: &mut Vec<u8>| match conn.read(&mut chunk) {
        Ok(0) | Err(_) => false,
        Ok(k) => {
            buf.extend_from_slice(&chunk[..k]);
            true
        }
    };
    for _ in 0..100_000 {
        let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
            if !more(buf) {
                return None;
            }
            continue;
        };
        let size_text = String::from_utf8_lossy(&buf[..eol]).to_string();
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        while buf.len() < eol + 2 + size + 2 {
            if !more(buf) {
                return None;
            }
        }
        body.extend_from_slice(&buf[eol + 2..eol + 2 + size]);
        buf.drain(..eol + 2 + size + 2);
        if size == 0 {
            return Some(body);
        }
    }
    None
}

/// Writes `bytes` on a fresh connection and reads responses until the server closes or
/// `limit` passes; returns them (status, body) and whether the server closed.
fn exchange(port: u16, bytes: &[u8], want: usize, limit: Duration) -> (Vec<(u16, String)>, bool) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(bytes).expect("write");
    let got = read_responses(&mut s, want, limit);
    // Closed: the next read ends at once, with nothing or a reset.
    s.set_read_timeout(Some(Duration::from_millis(500))).ok();
    let mut rest = [0u8; 64];
    let closed = match s.read(&mut rest) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    (got, closed)
}

fn chat(text: &str) -> String {
    chat_body(&[("user", text)], false, 2).to_string()
}

/// A well-formed request that follows an attack on the same connection.
fn second(id: &str) -> String {
    let body = chat("second");
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: {id}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn lb_with(dir: &std::path::Path, replicas: Vec<Replica>, conf: LbConf) -> Lb {
    Lb::start(dir, &[], LbConf { replicas, ..conf })
}

fn still_serves(lb: &Lb) {
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .bearer_auth("client-key-1234")
        .header("content-type", "application/json")
        .body(chat("after"))
        .send()
        .expect("send");
    assert_eq!(r.status(), 200, "the balancer stopped serving");
}

/// Every request the replica got is well framed: one framing header, one value, the body it
/// names.
fn assert_well_framed(seen: &[Seen]) {
    for s in seen {
        let cl = s.header("content-length");
        let te = s.header("transfer-encoding");
        assert!(cl.len() + te.len() <= 1, "framing headers: {s:?}");
        if let Some(cl) = cl.first() {
            let n: usize = std::str::from_utf8(cl).unwrap().parse().expect("a number");
            assert_eq!(n, s.body.len(), "{s:?}");
        }
        if let Some(te) = te.first() {
            assert_eq!(*te, b"chunked", "{s:?}");
        }
    }
}

#[test]
fn smuggling_and_desync_attempts_end_in_a_4xx_a_close_or_the_same_request() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start();
    let lb = lb_with(
        dir.path(),
        vec![rec.replica("r")],
        LbConf {
            api_keys: vec!["client-key-1234".into()],
            ..test_conf()
        },
    );
    let body = chat("first");
    let n = body.len();
    let auth = "authorization: Bearer client-key-1234\r\n";
    let post = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n";
    // (name, bytes before the second request, whether the first is a well-formed request
    // Pingora may rewrite and forward: then both are answered 200).
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", n);
    let cases: Vec<(&str, String, bool)> = vec![
        (
            "CL and TE",
            format!("{post}{auth}x-request-id: cl-te\r\ncontent-length: {}\r\ntransfer-encoding: chunked\r\n\r\n{chunked}", chunked.len()),
            false,
        ),
        (
            "TE and CL, CL short",
            format!("{post}{auth}x-request-id: te-cl\r\ntransfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n{chunked}"),
            false,
        ),
        (
            "TE with obs-fold",
            format!("{post}{auth}x-request-id: fold\r\ntransfer-encoding:\r\n chunked\r\ncontent-length: {n}\r\n\r\n{body}"),
            false,
        ),
        (
            "TE: chunked, identity",
            format!("{post}{auth}x-request-id: te-id\r\ntransfer-encoding: chunked, identity\r\n\r\n{chunked}"),
            false,
        ),
        (
            "TE: gzip, chunked",
            format!("{post}{auth}x-request-id: te-gz\r\ntransfer-encoding: gzip, chunked\r\n\r\n{chunked}"),
            false,
        ),
        (
            "two TE headers",
            format!("{post}{auth}x-request-id: te-2\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n{chunked}"),
            false,
        ),
        (
            "differing CL",
            format!("{post}{auth}x-request-id: cl-diff\r\ncontent-length: {n}\r\ncontent-length: 5\r\n\r\n{body}"),
            false,
        ),
        (
            "differing CL in one header",
            format!("{post}{auth}x-request-id: cl-diff1\r\ncontent-length: 5, {n}\r\n\r\n{body}"),
            false,
        ),
        (
            "CL not a number",
            format!("{post}{auth}x-request-id: cl-nan\r\ncontent-length: +{n}\r\n\r\n{body}"),
            false,
        ),
        (
            "invalid chunk size",
            format!("{post}{auth}x-request-id: chunk-zz\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n"),
            false,
        ),
        (
            "negative chunk size",
            format!("{post}{auth}x-request-id: chunk-neg\r\ntransfer-encoding: chunked\r\n\r\n-{:x}\r\n{body}\r\n0\r\n\r\n", n),
            false,
        ),
        (
            "chunk size overflowing",
            format!("{post}{auth}x-request-id: chunk-big\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffff1\r\n{body}\r\n0\r\n\r\n"),
            false,
        ),
        (
            "equal CL twice",
            format!("{post}{auth}x-request-id: cl-same\r\ncontent-length: {n}\r\ncontent-length: {n}\r\n\r\n{body}"),
            true,
        ),
        (
            "equal CL in one header",
            format!("{post}{auth}x-request-id: cl-same1\r\ncontent-length: {n}, {n}\r\n\r\n{body}"),
            true,
        ),
        (
            "bare LF line ends",
            format!("POST /v1/chat/completions HTTP/1.1\nhost: x\n{}x-request-id: bare-lf\ncontent-length: {n}\n\n{body}", auth.replace("\r\n", "\n")),
            true,
        ),
    ];
    for (name, attack, well_formed) in &cases {
        let first_id = attack
            .split("x-request-id: ")
            .nth(1)
            .and_then(|r| r.split(['\r', '\n']).next())
            .unwrap()
            .to_string();
        let second_id = format!("{first_id}-second");
        let mut bytes = attack.clone().into_bytes();
        bytes.extend_from_slice(
            second(&second_id)
                .replace("host: x\r\n", &format!("host: x\r\n{auth}"))
                .as_bytes(),
        );
        let (got, closed) = exchange(lb.port, &bytes, 2, Duration::from_secs(3));
        let statuses: Vec<u16> = got.iter().map(|r| r.0).collect();
        if *well_formed {
            assert_eq!(statuses, [200, 200], "{name}: {got:?}");
            let first = rec.with_id(&first_id);
            assert_eq!(first.len(), 1, "{name}: {first:?}");
            assert_eq!(first[0].body, body.as_bytes(), "{name}");
            assert_eq!(
                first[0].header("content-length"),
                [n.to_string().as_bytes()],
                "{name}"
            );
            assert_eq!(rec.with_id(&second_id).len(), 1, "{name}");
        } else {
            assert!(
                closed && (got.is_empty() || got.len() == 1 && (400..500).contains(&got[0].0)),
                "{name}: a 4xx then a close, or a close: {got:?} (closed: {closed})"
            );
            assert!(rec.with_id(&first_id).is_empty(), "{name}: forwarded");
            assert!(
                rec.with_id(&second_id).is_empty(),
                "{name}: the tail was read as a request"
            );
        }
    }
    let all = rec.client_requests();
    assert_well_framed(&all);
    for s in &all {
        assert_eq!(s.target(), "/v1/chat/completions", "{s:?}");
    }
    still_serves(&lb);
}

#[test]
fn the_path_a_replica_receives_is_the_path_inferlb_checked() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start();
    let lb = lb_with(
        dir.path(),
        vec![rec.replica("r")],
        LbConf {
            api_keys: vec!["client-key-1234".into()],
            extra: "  forward_paths: [/tokenize]\n  public_paths: [/tokenize]\n".into(),
            ..test_conf()
        },
    );
    let targets: &[&[u8]] = &[
        b"/v1/chat/completions",
        b"/%761/chat/completions",
        b"/%76%31/%63hat/completions",
        b"/v1//chat/completions",
        b"//v1/chat//completions",
        b"/v1/./chat/completions",
        b"/v1/x/../chat/completions",
        b"/v1/x/%2e%2e/chat/completions",
        b"/%2e%2e/v1/chat/completions",
        b"/../v1/chat/completions",
        b"/v1/chat/completions?x=%2F&y=..",
        b"/v1/chat/completions#frag",
        b"http://evil.example:9/v1/chat/completions",
        b"/v1/chat%2Fcompletions",
        b"/v1/chat%2fcompletions",
        b"/v1/chat/completions%00",
        b"/v1/chat/completions%2F",
        b"/v1/chat/completions%",
        b"/v1/%2525chat",
        b"/v1\\chat\\completions",
        b"/v1/chat/completions\\",
        b"/v1/chat/completions/",
        b"/v1/chat/completions;x",
        b"/v1/chat/completions/..",
        b"/v1/caf\xc3\xa9",
        b"/v1/chat/completions\xff",
        b"/v1/chat/completions?q=\xc3\xa9",
        b"/invocations",
        b"/%69nvocations",
        b"/pooling",
        b"/score",
        b"/generate",
        b"/flush_cache",
        b"/health",
        b"/tokenize",
        b"/%74okenize",
        b"/v1/../tokenize",
        b"/tokenize/../v1/chat/completions",
        b"*",
    ];
    let body = chat("path");
    let mut forwarded = 0;
    for (i, target) in targets.iter().enumerate() {
        let label = String::from_utf8_lossy(target).into_owned();
        // What the edge makes of it: no fragment (never sent on), no scheme and host.
        let path = target.split(|&b| b == b'#').next().unwrap_or(b"");
        let path = path
            .strip_prefix(&b"http://evil.example:9"[..])
            .unwrap_or(path);
        let expected = inferlb::protocol::edge::normalise(path).ok();
        for keyed in [true, false] {
            let id = format!("p{i}-{keyed}");
            let mut bytes = b"POST ".to_vec();
            bytes.extend_from_slice(target);
            bytes.extend_from_slice(b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n");
            if keyed {
                bytes.extend_from_slice(b"authorization: Bearer client-key-1234\r\n");
            }
            bytes.extend_from_slice(
                format!(
                    "x-request-id: {id}\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            let (got, _) = exchange(lb.port, &bytes, 1, Duration::from_secs(3));
            let status = got.first().map_or(0, |r| r.0);
            let seen = rec.with_id(&id);
            if !(200..300).contains(&status) {
                assert!((400..500).contains(&status), "{label}: {got:?}");
                assert!(
                    seen.is_empty(),
                    "{label} (key: {keyed}): got {status} but forwarded: {seen:?}"
                );
                continue;
            }
            // Forwarded: the replica got exactly the normal form, once, which the key check
            // and the allow-list read too.
            assert_eq!(seen.len(), 1, "{label}: {seen:?}");
            let want = expected
                .as_deref()
                .unwrap_or_else(|| panic!("{label}: forwarded but not normal"));
            assert_eq!(seen[0].target(), want, "{label}");
            let path = want.split('?').next().unwrap();
            assert!(
                ["/v1/chat/completions", "/tokenize"].contains(&path),
                "{label}: {path} forwarded"
            );
            assert!(
                keyed || path == "/tokenize",
                "{label}: forwarded without a key"
            );
            forwarded += 1;
        }
    }
    // The corpus holds both kinds.
    assert!(forwarded >= 15, "{forwarded}");
    // Routing reads the normal form too: `/v1//messages` is Anthropic's API, errors included.
    let r = http()
        .post(lb.url("/v1//messages"))
        .header("x-api-key", "client-key-1234")
        .header("content-type", "application/json")
        .body(r#"{"model":"nope","max_tokens":1,"messages":[{"role":"user","content":"x"}]}"#)
        .send()
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().unwrap();
    assert_eq!(v["type"], "error", "{v}");
    still_serves(&lb);
}

#[test]
fn client_keys_never_reach_a_replica_and_steering_fields_are_stripped() {
    let dir = tempfile::tempdir().unwrap();
    let (keyed, bare) = (Recorder::start(), Recorder::start());
    let lb_keyed = lb_with(
        dir.path(),
        vec![Replica {
            api_key: Some("replica-secret".into()),
            ..keyed.replica("k")
        }],
        LbConf {
            api_keys: vec!["client-key-1234".into()],
            ..test_conf()
        },
    );
    let dir2 = tempfile::tempdir().unwrap();
    let lb_bare = lb_with(dir2.path(), vec![bare.replica("b")], test_conf());
    let steering = r#"{"model":"sim-model","messages":[{"role":"user","content":"kv_transfer_params"}],"kv_transfer_params":{"remote_host":"10.0.0.9","remote_port":1},"bootstrap_host":"10.0.0.9","bootstrap_port":8998,"bootstrap_room":1,"kv\u005ftransfer_params":{"do_remote_prefill":true},"stream":false}"#;
    for (lb, rec, key) in [
        (&lb_keyed, &keyed, Some("replica-secret")),
        (&lb_bare, &bare, None),
    ] {
        for (i, chunked) in [false, true].into_iter().enumerate() {
            let id = format!("steer-{i}");
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-request-id: {id}\r\n\
                 authorization: Bearer client-key-1234\r\nx-api-key: client-key-1234\r\n"
            );
            let bytes = if chunked {
                let (a, b) = steering.split_at(40);
                format!("{head}transfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len())
            } else {
                format!("{head}content-length: {}\r\n\r\n{steering}", steering.len())
            };
            let (got, _) = exchange(lb.port, bytes.as_bytes(), 1, Duration::from_secs(3));
            assert_eq!(got.first().map(|r| r.0), Some(200), "{got:?}");
            let seen = rec.with_id(&id);
            assert_eq!(seen.len(), 1, "{seen:?}");
            let s = &seen[0];
            assert!(s.header("x-api-key").is_empty(), "{s:?}");
            let auth: Vec<String> = s
                .header("authorization")
                .iter()
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect();
            let want: Vec<String> = key.iter().map(|k| format!("Bearer {k}")).collect();
            assert_eq!(auth, want, "{s:?}");
            let v: Value = serde_json::from_slice(&s.body).expect("JSON");
            let mut fields: Vec<&String> = v.as_object().unwrap().keys().collect();
            fields.sort();
            assert_eq!(fields, ["messages", "model", "stream"], "{v}");
            assert_eq!(v["messages"][0]["content"], "kv_transfer_params");
            assert_well_framed(&seen);
        }
        // Python's json reads `NaN`; this checker does not, and it may hide a steering field.
        let id = "steer-nan";
        let nan = r#"{"model":"sim-model","messages":[],"temperature":NaN,"bootstrap_host":"h"}"#;
        let bytes = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-request-id: {id}\r\n\
             authorization: Bearer client-key-1234\r\ncontent-length: {}\r\n\r\n{nan}",
            nan.len()
        );
        let (got, _) = exchange(lb.port, bytes.as_bytes(), 1, Duration::from_secs(3));
        assert_eq!(got.first().map(|r| r.0), Some(400), "{got:?}");
        assert!(got[0].1.contains("bootstrap_host"), "{got:?}");
        assert!(rec.with_id(id).is_empty());
    }
}

#[test]
fn hostile_request_ids_and_session_headers_are_refused_or_made_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start();
    let lb = lb_with(
        dir.path(),
        vec![rec.replica("r")],
        LbConf {
            api_keys: vec!["client-key-1234".into()],
            session_header: Some("x-session-id".into()),
            ..test_conf()
        },
    );
    let body = chat("ids");
    let cases: &[&[u8]] = &[
        b"x-request-id: abc\rdef\r\n",
        b"x-request-id: abc\r\n def\r\n",
        b"x-request-id: abc\r\n\tx-injected: 1\r\n",
        b"x-request-id: caf\xc3\xa9\r\n",
        b"x-request-id: a b<script>\r\n",
        b"x-request-id: \xff\xfe\r\n",
        b"x-request-id: a\x00b\r\n",
        b"x-request-id: a\x7fb\r\n",
        b"x-session-id: abc\rdef\r\n",
        b"x-session-id: abc\r\n def\r\n",
        b"x-session-id: s\xc3\xa9ssion\r\n",
        b"x-session-id: \xff\xfe\r\n",
        b"x-session-id: a\x00b\r\n",
    ];
    let before = rec.client_requests().len();
    let mut answered = 0;
    for (i, header) in cases.iter().enumerate() {
        let label = String::from_utf8_lossy(header).into_owned();
        let mut bytes =
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".to_vec();
        bytes.extend_from_slice(b"authorization: Bearer client-key-1234\r\n");
        bytes.extend_from_slice(format!("x-case: {i}\r\n").as_bytes());
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(format!("content-length: {}\r\n\r\n{body}", body.len()).as_bytes());
        let mut s = TcpStream::connect(("127.0.0.1", lb.port)).unwrap();
        s.write_all(&bytes).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).ok();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let text = String::from_utf8_lossy(&raw);
        let status: u16 = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        assert!(
            status == 200 || (400..500).contains(&status),
            "{label}: {text}"
        );
        let head_end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(raw.len());
        let head = &raw[..head_end];
        // The answer's head is plain ASCII lines, whatever the request held.
        assert!(
            head.iter()
                .all(|&b| b == b'\r' || b == b'\n' || (b' '..0x7f).contains(&b)),
            "{label}: {text}"
        );
        let lines = head.split(|&b| b == b'\n').count();
        assert!(
            !text.to_ascii_lowercase().contains("x-injected"),
            "{label}: {text}"
        );
        if status != 200 {
            continue;
        }
        answered += 1;
        let id = text
            .lines()
            .find_map(|l| l.strip_prefix("x-request-id: "))
            .unwrap_or_else(|| panic!("{label}: no id in {text} ({lines} lines)"))
            .trim()
            .to_string();
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)),
            "{label}: {id}"
        );
        // The replica got the same sane id, and nothing the client did not send.
        let seen = rec.with_id(&id);
        assert_eq!(seen.len(), 1, "{label}: {id}");
        assert!(seen[0].header("x-injected").is_empty());
    }
    assert!(
        answered >= 4,
        "some cases are well-formed requests: {answered}"
    );
    assert_eq!(rec.client_requests().len() - before, answered);
    still_serves(&lb);
}
