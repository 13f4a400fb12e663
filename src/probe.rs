//! The few requests inferlb itself sends to replicas, off the data path: `GET /v1/models`
//! (what a replica serves) and `GET /v1/responses/{id}` (which replica stores a response).
//! Plain HTTP/1.0 over a fresh connection, bounded in time and size.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::replica::Replica;

/// `GET path` on `r`: the status and body, or None when it does not answer in time.
pub(crate) async fn get(r: &Replica, path: &str, timeout: Duration) -> Option<(u16, Vec<u8>)> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(r.socket).await.ok()?;
        let auth = r
            .api_key
            .as_ref()
            .map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
        let req = format!("GET {path} HTTP/1.0\r\nhost: {}\r\n{auth}\r\n", r.address);
        s.write_all(req.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.take(1 << 20).read_to_end(&mut out).await.ok()?;
        Some(out)
    };
    let out = tokio::time::timeout(timeout, exchange).await.ok()??;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let status = std::str::from_utf8(out.get(9..12)?).ok()?.parse().ok()?;
    Some((status, out[split + 4..].to_vec()))
}

/// The ids in a replica's `/v1/models`, or None when it does not answer sensibly.
pub async fn models(r: &Replica, timeout: Duration) -> Option<Vec<String>> {
    let (status, body) = get(r, "/v1/models", timeout).await?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    let ids: Vec<String> = v["data"]
        .as_array()?
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    (!ids.is_empty()).then_some(ids)
}

/// Whether `id` can go into a path as it is (ids are tokens like `resp_1a2b`).
fn path_safe(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 256
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Asks every replica in `among` at once whether it stores response `id`; the first that
/// answers 200 within `timeout`, or None.
pub async fn stored_response(
    among: &[Arc<Replica>],
    id: &str,
    timeout: Duration,
) -> Option<Arc<Replica>> {
    if !path_safe(id) {
        return None;
    }
    let path = format!("/v1/responses/{id}");
    let mut asks: FuturesUnordered<_> = among
        .iter()
        .map(|r| {
            let path = &path;
            async move { (r, get(r, path, timeout).await) }
        })
        .collect();
    while let Some((r, answer)) = asks.next().await {
        if matches!(answer, Some((200, _))) {
            return Some(r.clone());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_token_ids_go_into_a_path() {
        assert!(path_safe("resp_0a1b-2.c"));
        for bad in ["", "a/b", "a?b", "a b", "../x", "%2e"] {
            assert!(!path_safe(bad), "{bad:?}");
        }
    }
}
