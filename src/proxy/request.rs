//! The client's request head: its id, its key, its size, and what never goes to a replica.

use std::sync::atomic::{AtomicU64, Ordering};

use pingora_http::RequestHeader;
use subtle::ConstantTimeEq;

use super::answers::Refusal;
use crate::protocol::edge::PathRule;

/// HTTP/1.1 pipelining (RFC 9112 9.3.2): a next request the client sent before this one's
/// answer waits its turn on the connection instead of closing it, and a request waiting under
/// overload protection does not take it for its client leaving. Called before the body is
/// read: bytes past it are kept for the next request.
pub fn allow_pipelining(session: &mut pingora_proxy::Session) {
    use pingora_core::protocols::http::server::Session;
    if let Session::H1(h1) = session.as_downstream_mut() {
        h1.set_pipelining_enabled(true);
    }
}

/// The key of a stored response id in the balancer's `stored` table.
pub fn stored_key(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

/// Headers that describe one connection, not the request: never forwarded.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

pub fn strip_hop_by_hop(req: &mut RequestHeader) {
    let listed: Vec<String> = req
        .headers
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty() && n != "close" && n != "keep-alive")
        .collect();
    for name in listed.iter().map(String::as_str).chain(HOP_BY_HOP) {
        // Framing headers are Pingora's to manage.
        if name != "transfer-encoding" && name != "content-length" {
            req.remove_header(name);
        }
    }
}

/// The client's `x-request-id` when it is a sane token (kept as it came, no copy), else a
/// fresh one. Either is visible ASCII, so [`http::HeaderValue::to_str`] never fails on it.
pub fn request_id(given: Option<&http::HeaderValue>) -> http::HeaderValue {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let sane = |v: &&http::HeaderValue| {
        let v = v.as_bytes();
        !v.is_empty()
            && v.len() <= 128
            && v.iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(b))
    };
    if let Some(v) = given.filter(sane) {
        return v.clone();
    }
    // Unique across processes too (an upgrade runs two): pid, start time, counter.
    static PREFIX: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("{:x}{:05x}", t & 0xffff_ffff, std::process::id() & 0xfffff)
    });
    let fresh = format!("{}-{:x}", *PREFIX, NEXT.fetch_add(1, Ordering::Relaxed));
    http::HeaderValue::from_maybe_shared(bytes::Bytes::from(fresh))
        .expect("hex digits and a dash are a valid header value")
}

/// The session key of a request that carries the configured session header.
pub fn session_key(header: Option<&str>, req: &RequestHeader) -> Option<u64> {
    let value = req.headers.get(header?)?.as_bytes();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"inferlb-session\0");
    h.update(value);
    (!value.is_empty()).then(|| h.digest())
}

/// Bytes of the header block, roughly as sent.
pub fn header_bytes(req: &RequestHeader) -> usize {
    req.headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum()
}

/// Client keys guard every path but `public`, as `Authorization: Bearer` (OpenAI's SDKs) or
/// `x-api-key` (Anthropic's). `path` is the normalised one ([`normalised_target`]). Every key
/// is compared in constant time, so timing does not reveal how much of a key matched. `keys`
/// is a slice so that a reloaded list can be handed in as it is.
pub fn authorized(keys: &[String], public: &[PathRule], path: &str, req: &RequestHeader) -> bool {
    if keys.is_empty() || crate::protocol::edge::any(public, path) {
        return true;
    }
    let given = presented_key(&req.headers);
    keys.iter()
        .fold(subtle::Choice::from(0), |ok, key| {
            ok | key.as_bytes().ct_eq(given)
        })
        .into()
}

/// The client key a request presents (`Authorization: Bearer`, else `x-api-key`); empty
/// when none.
pub fn presented_key(headers: &http::HeaderMap) -> &[u8] {
    headers
        .get("authorization")
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()))
        .unwrap_or(b"")
}

/// Whether `path` (normalised) is ever forwarded: the defaults, or the conf's `forward_paths`.
pub fn forwarded(extra: &[PathRule], path: &str) -> bool {
    crate::protocol::edge::forwarded_by_default(path) || crate::protocol::edge::any(extra, path)
}

/// The request target in the form the replica routes on ([`crate::protocol::edge::normalise`]), read
/// from the bytes as they came (not the URI's rendering of them): an origin-form target, or
/// the path and query of an absolute-form one.
pub fn normalised_target(req: &RequestHeader) -> Result<String, crate::protocol::edge::Refused> {
    let raw = req.raw_path();
    if !req.raw_path_is_utf8() {
        return Err("the request target has a non-ASCII byte");
    }
    if raw.first() == Some(&b'/') {
        return crate::protocol::edge::normalise(raw);
    }
    let absolute = [&b"http://"[..], b"https://"]
        .iter()
        .any(|s| raw.len() > s.len() && raw[..s.len()].eq_ignore_ascii_case(s));
    if !absolute {
        return Err("the request target must be a path (origin-form) or an http(s) URL");
    }
    let path = req.uri.path_and_query().map_or("/", |p| p.as_str());
    crate::protocol::edge::normalise(path.as_bytes())
}

/// At the edge, before anything else reads the request: its framing checked (equal
/// `Content-Length` values made one header) and its target normalised in place, so the key
/// check, routing and the head forwarded all see that one form.
pub fn settle_edge(session: &mut pingora_proxy::Session) -> Option<Refusal> {
    use pingora_core::protocols::http::server::Session as Downstream;
    let bad = |why: &str| {
        Some(Refusal {
            status: 400,
            reason: "bad_request",
            message: format!("bad request: {why}"),
            close: true,
        })
    };
    let raw_head = match session.as_downstream() {
        Downstream::H1(h1) => Some(h1.get_headers_raw_bytes()),
        _ => None,
    };
    match framing(session.req_header(), raw_head.as_deref()) {
        Err(why) => return bad(why),
        Ok(Some(n)) => {
            if session
                .req_header_mut()
                .insert_header("content-length", n.to_string())
                .is_err()
            {
                return bad("Content-Length");
            }
        }
        Ok(None) => {}
    }
    let target = match normalised_target(session.req_header()) {
        Ok(t) => t,
        Err(why) => return bad(why),
    };
    if target.as_bytes() != session.req_header().raw_path() {
        match target.parse::<http::Uri>() {
            Ok(uri) => session.req_header_mut().set_uri(uri),
            Err(_) => return bad("the request target"),
        }
    }
    None
}

/// The body's framing, from its head: `Ok(Some(n))` when several equal `Content-Length`
/// values must become one header, or why it is refused: both `Content-Length` and
/// `Transfer-Encoding` (Pingora drops the first and goes on; `raw_head` is the head as it
/// came, where it still shows), a `Transfer-Encoding` other than exactly `chunked`, or
/// `Content-Length` values that are not one number. A proxy and a replica that frame a body
/// differently would read its tail as a next request.
pub fn framing(req: &RequestHeader, raw_head: Option<&[u8]>) -> Result<Option<u64>, &'static str> {
    let te: Vec<&[u8]> = req
        .headers
        .get_all("transfer-encoding")
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    let cl = req.headers.get_all("content-length");
    if !te.is_empty() {
        let raw_cl = raw_head.is_some_and(|h| {
            h.split(|&b| b == b'\n')
                .skip(1)
                .any(|l| l.len() > 15 && l[..15].eq_ignore_ascii_case(b"content-length:"))
        });
        if cl.iter().next().is_some() || raw_cl {
            return Err("a request may not have both Content-Length and Transfer-Encoding");
        }
        if te.len() > 1 || !te[0].trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Err("the only Transfer-Encoding accepted is `chunked`");
        }
        return Ok(None);
    }
    let mut values = 0;
    let mut length = None;
    for v in cl.iter() {
        for n in v.as_bytes().split(|&b| b == b',') {
            let n = n.trim_ascii();
            let ok = !n.is_empty() && n.len() <= 18 && n.iter().all(u8::is_ascii_digit);
            let n: u64 = std::str::from_utf8(n)
                .ok()
                .filter(|_| ok)
                .and_then(|n| n.parse().ok())
                .ok_or("Content-Length is not a number")?;
            if length.is_some_and(|l| l != n) {
                return Err("Content-Length has several different values");
            }
            length = Some(n);
            values += 1;
        }
    }
    Ok(length.filter(|_| values > 1))
}

/// The body without the members a client may not send ([`crate::protocol::api::strip::STEERING`]):
/// `None` when it has none; a 400 when it may and cannot be read.
pub fn without_steering(body: &[u8]) -> Result<Option<bytes::Bytes>, Refusal> {
    use crate::protocol::api::strip::{strip_members, Stripped, STEERING};
    match strip_members(body, &STEERING) {
        Stripped::Unchanged => Ok(None),
        Stripped::Body(b) => Ok(Some(b.into())),
        Stripped::Unreadable => Err(Refusal {
            status: 400,
            reason: "bad_body",
            message: format!(
                "the request body is not JSON inferlb can read, and it may hold a field only \
                 inferlb sets ({}): send plain UTF-8 JSON",
                STEERING.join(", ")
            ),
            close: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &str, headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", path.as_bytes(), None).expect("head");
        for (n, v) in headers {
            r.append_header(n.to_string(), *v).expect("header");
        }
        r
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut r = req(
            "/v1/x",
            &[
                ("connection", "keep-alive, x-secret"),
                ("x-secret", "1"),
                ("upgrade", "h2c"),
                ("te", "trailers"),
                ("x-kept", "1"),
                ("content-length", "3"),
            ],
        );
        strip_hop_by_hop(&mut r);
        for gone in ["connection", "x-secret", "upgrade", "te"] {
            assert!(!r.headers.contains_key(gone), "{gone}");
        }
        assert!(r.headers.contains_key("x-kept") && r.headers.contains_key("content-length"));
    }

    #[test]
    fn a_sane_request_id_is_kept_and_others_replaced() {
        let v = http::HeaderValue::from_static("abc-123_x.y:z");
        assert_eq!(request_id(Some(&v)), "abc-123_x.y:z");
        let bad = http::HeaderValue::from_static("has space");
        let fresh = request_id(Some(&bad));
        assert_ne!(fresh, "has space");
        assert!(fresh.to_str().is_ok_and(|f| f.contains('-')), "{fresh:?}");
        assert_ne!(request_id(None), request_id(None), "fresh ids differ");
    }

    #[test]
    fn a_session_key_comes_from_the_configured_header_only() {
        let r = req("/v1/x", &[("x-session-id", "abc")]);
        assert!(session_key(Some("x-session-id"), &r).is_some());
        assert_eq!(session_key(None, &r), None);
        assert_eq!(session_key(Some("x-other"), &r), None);
        let other = req("/v1/x", &[("x-session-id", "abd")]);
        assert_ne!(
            session_key(Some("x-session-id"), &r),
            session_key(Some("x-session-id"), &other)
        );
        assert_eq!(
            session_key(Some("x-session-id"), &req("/", &[("x-session-id", "")])),
            None
        );
    }

    #[test]
    fn keys_guard_every_path_but_the_public_ones() {
        let keys = vec!["sk-secret-1".to_string()];
        let chat = "/v1/chat/completions";
        let authorized = |keys: &[String], public: &[PathRule], r: &RequestHeader| {
            let path = normalised_target(r).expect("normal");
            authorized(keys, public, &path, r)
        };
        assert!(authorized(&[], &[], &req(chat, &[])));
        assert!(!authorized(&keys, &[], &req(chat, &[])));
        let ok = req(chat, &[("authorization", "Bearer sk-secret-1")]);
        assert!(authorized(&keys, &[], &ok));
        let wrong = req("/v1/models", &[("authorization", "Bearer sk-secret-2")]);
        assert!(!authorized(&keys, &[], &wrong));
        // Every path, not only `/v1/...`: vLLM serves chat at `/invocations`, and uvicorn
        // reads `/%761/...` as `/v1/...`.
        for path in [
            "/health",
            "/invocations",
            "/%761/chat/completions",
            "/v1/models",
        ] {
            assert!(!authorized(&keys, &[], &req(path, &[])), "{path}");
        }
        let public = [PathRule::parse("/health").expect("rule")];
        assert!(authorized(&keys, &public, &req("/health", &[])));
        assert!(authorized(&keys, &public, &req("//health", &[])));
        assert!(!authorized(&keys, &public, &req("/v1/models", &[])));
        let anthropic = req("/v1/messages", &[("x-api-key", "sk-secret-1")]);
        assert!(authorized(&keys, &[], &anthropic));
        assert!(!authorized(
            &keys,
            &[],
            &req("/v1/messages", &[("x-api-key", "sk-secret")])
        ));
    }

    #[test]
    fn only_listed_paths_are_forwarded() {
        let extra = [PathRule::parse("/tokenize").expect("rule")];
        assert!(forwarded(&[], "/v1/chat/completions"));
        assert!(!forwarded(&[], "/tokenize") && forwarded(&extra, "/tokenize"));
        assert!(!forwarded(&extra, "/invocations"));
    }

    #[test]
    fn targets_are_read_from_their_bytes_and_absolute_forms_lose_their_host() {
        let cases: &[(&[u8], Result<&str, ()>)] = &[
            (b"/%761/chat/completions", Ok("/v1/chat/completions")),
            (b"http://evil.example:9/sim/echo?q=1", Ok("/sim/echo?q=1")),
            (b"HTTPS://h/v1//models", Ok("/v1/models")),
            (b"http://h", Ok("/")),
            (b"/v1/caf\xc3\xa9", Err(())),
            (b"/v1/\xff", Err(())),
            (b"*", Err(())),
            (b"ftp://h/v1/models", Err(())),
            (b"host:443", Err(())),
        ];
        for (target, want) in cases {
            let r = RequestHeader::build("GET", target, None).expect("head");
            let got = normalised_target(&r);
            let label = String::from_utf8_lossy(target);
            assert_eq!(got.as_deref().map_err(|_| ()), *want, "{label}");
        }
    }

    #[test]
    fn framing_refuses_what_two_parsers_could_read_two_ways() {
        let head = |h: &[(&str, &str)]| req("/v1/completions", h);
        let raw_cl: &[u8] = b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n";
        let raw_bare: &[u8] = b"POST / HTTP/1.1\ncontent-length:5\n\n";
        let raw_none: &[u8] = b"POST / HTTP/1.1\r\nx-content-length: 5\r\n\r\n";
        let te = [("transfer-encoding", "chunked")];
        assert_eq!(framing(&head(&te), Some(raw_none)), Ok(None));
        assert_eq!(
            framing(&head(&[("transfer-encoding", " Chunked ")]), None),
            Ok(None)
        );
        assert!(
            framing(&head(&te), Some(raw_cl)).is_err(),
            "CL removed by Pingora"
        );
        assert!(framing(&head(&te), Some(raw_bare)).is_err());
        assert!(framing(
            &head(&[("transfer-encoding", "chunked"), ("content-length", "5")]),
            None
        )
        .is_err());
        for bad in [
            "chunked, identity",
            "gzip, chunked",
            "identity",
            "chunked, chunked",
            "",
        ] {
            assert!(
                framing(&head(&[("transfer-encoding", bad)]), None).is_err(),
                "{bad}"
            );
        }
        let two_te = head(&[
            ("transfer-encoding", "chunked"),
            ("transfer-encoding", "chunked"),
        ]);
        assert!(framing(&two_te, None).is_err());
        assert_eq!(framing(&head(&[("content-length", "100")]), None), Ok(None));
        assert_eq!(
            framing(&head(&[("content-length", "100, 100")]), None),
            Ok(Some(100))
        );
        let twice = head(&[("content-length", "7"), ("content-length", "7")]);
        assert_eq!(framing(&twice, None), Ok(Some(7)));
        for bad in [
            "100, 101",
            "+5",
            "-1",
            "0x10",
            "",
            "5,",
            "1 0",
            "99999999999999999999",
        ] {
            assert!(
                framing(&head(&[("content-length", bad)]), None).is_err(),
                "{bad:?}"
            );
        }
        let differ = head(&[("content-length", "7"), ("content-length", "8")]);
        assert!(framing(&differ, None).is_err());
        assert_eq!(framing(&head(&[]), None), Ok(None));
    }

    #[test]
    fn steering_members_are_stripped_or_the_body_refused() {
        let got = without_steering(br#"{"model":"m","kv_transfer_params":{}}"#).expect("read");
        assert_eq!(got.as_deref(), Some(&br#"{"model":"m"}"#[..]));
        assert_eq!(without_steering(br#"{"model":"m"}"#).expect("read"), None);
        let r = without_steering(br#"{"bootstrap_host":NaN}"#).expect_err("refused");
        assert_eq!(r.status, 400);
    }
}
