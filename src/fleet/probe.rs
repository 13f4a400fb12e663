//! The few requests inferlb itself sends to replicas, off the data path: `GET /v1/models`
//! (what a replica serves), `GET /metrics` (its load) and `GET /v1/responses/{id}` (which
//! replica stores a response). Sent over Pingora's connector to the replica's own peer, so TLS,
//! SNI, the trusted roots and a client certificate are exactly the data path's; bounded in time
//! and size.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use pingora_core::connectors::http::Connector;
use pingora_http::RequestHeader;

use crate::fleet::replica::Replica;

/// The largest answer read from a replica.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// One connector (and connection pool) for every probe.
static CONNECTOR: LazyLock<Connector> = LazyLock::new(|| Connector::new(None));

/// Builds the connector now (it reads the system's trusted roots), so that the first probes
/// after start are not the ones to wait for it.
pub fn init() {
    LazyLock::force(&CONNECTOR);
}

/// `GET path` on `r`: the status and body, or None when it does not answer in time.
pub(crate) async fn get(r: &Replica, path: &str, timeout: Duration) -> Option<(u16, Vec<u8>)> {
    tokio::time::timeout(timeout, exchange(r, path))
        .await
        .ok()?
}

async fn exchange(r: &Replica, path: &str) -> Option<(u16, Vec<u8>)> {
    let mut req = RequestHeader::build("GET", path.as_bytes(), None).ok()?;
    req.insert_header("host", &r.endpoint.host).ok()?;
    if let Some(k) = &r.endpoint.api_key {
        req.insert_header("authorization", format!("Bearer {}", k.current()))
            .ok()?;
    }
    let (mut session, _reused) = CONNECTOR.get_http_session(&r.endpoint.peer).await.ok()?;
    session.write_request_header(Box::new(req)).await.ok()?;
    session.finish_request_body().await.ok()?;
    session.read_response_header().await.ok()?;
    let status = session.response_header()?.status.as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = session.read_response_body().await.ok()? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    if session.response_done() {
        CONNECTOR
            .release_http_session(
                session,
                &r.endpoint.peer,
                r.endpoint.peer.options.idle_timeout,
            )
            .await;
    }
    Some((status, body))
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

/// Asks every replica in `among` whose models are still unknown (neither configured nor
/// learnt yet: right after start or after it was added) for its `/v1/models` at once, and
/// records what each says. Bounded by `timeout`; a replica that does not answer stays unknown.
pub async fn learn_models(among: &[Arc<Replica>], timeout: Duration) {
    let mut asks: FuturesUnordered<_> = among
        .iter()
        .filter(|r| !r.models_configured && r.models().is_empty())
        .map(|r| async move { (r, models(r, timeout).await) })
        .collect();
    while let Some((r, answer)) = asks.next().await {
        if let Some(ids) = answer {
            r.set_models(ids);
        }
    }
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
