//! The client's request head: its id, its key, its size, and what never goes to a replica.

use std::sync::atomic::{AtomicU64, Ordering};

use pingora_http::RequestHeader;
use subtle::ConstantTimeEq;

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

/// Client keys guard the API (`/v1/...`), as vLLM's `--api-key` does: `Authorization: Bearer`
/// as OpenAI's SDKs send it, or `x-api-key` as Anthropic's do. Every key is compared in
/// constant time, so timing does not reveal how much of a key matched.
pub fn authorized(keys: &[String], req: &RequestHeader) -> bool {
    if keys.is_empty() || !req.uri.path().starts_with("/v1") {
        return true;
    }
    let given = req
        .headers
        .get("authorization")
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .or_else(|| req.headers.get("x-api-key").map(|v| v.as_bytes()))
        .unwrap_or(b"");
    keys.iter()
        .fold(subtle::Choice::from(0), |ok, key| {
            ok | key.as_bytes().ct_eq(given)
        })
        .into()
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
    fn keys_guard_only_the_api() {
        let keys = vec!["sk-secret-1".to_string()];
        assert!(authorized(&[], &req("/v1/chat/completions", &[])));
        assert!(!authorized(&keys, &req("/v1/chat/completions", &[])));
        let ok = req(
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-secret-1")],
        );
        assert!(authorized(&keys, &ok));
        let wrong = req("/v1/models", &[("authorization", "Bearer sk-secret-2")]);
        assert!(!authorized(&keys, &wrong));
        assert!(authorized(&keys, &req("/health", &[])));
        let anthropic = req("/v1/messages", &[("x-api-key", "sk-secret-1")]);
        assert!(authorized(&keys, &anthropic));
        assert!(!authorized(
            &keys,
            &req("/v1/messages", &[("x-api-key", "sk-secret")])
        ));
    }
}
