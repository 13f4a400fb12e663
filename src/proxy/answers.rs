//! The answers inferlb writes itself, in OpenAI's shapes: errors, `/v1/models`, and the error
//! event that ends a stream a replica cut.

use bytes::Bytes;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use crate::metrics::METRICS;

/// A request answered before any replica saw it.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    /// The `reason` label of `inferlb_rejected_total`.
    pub reason: &'static str,
    pub message: String,
    /// Close the connection after answering (unread request bytes may be on the wire).
    pub close: bool,
}

/// An error body in OpenAI's JSON shape.
pub fn openai_error(status: u16, message: &str) -> Bytes {
    let kind = match status {
        400..=499 => "invalid_request_error",
        503 => "service_unavailable",
        _ => "server_error",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    });
    Bytes::from(body.to_string())
}

/// The SSE event that ends a stream its replica cut, so the client sees an error, never a
/// silent truncation that looks like success.
pub fn stream_error_event(message: &str) -> Bytes {
    let mut event = b"data: ".to_vec();
    event.extend_from_slice(&openai_error(502, message));
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

/// `GET /v1/models`: the union of what the replicas serve.
pub fn models_list(models: &[String]) -> Bytes {
    let data: Vec<serde_json::Value> = models
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "inferlb"}))
        .collect();
    Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string())
}

pub async fn respond_json(session: &mut Session, status: u16, body: Bytes) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(3))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

pub async fn respond_error(session: &mut Session, status: u16, message: &str) -> Result<()> {
    respond_json(session, status, openai_error(status, message)).await
}

/// Answers a refused request and counts it.
pub async fn refuse(session: &mut Session, r: &Refusal) -> Result<()> {
    METRICS.rejected.with_label_values(&[r.reason]).inc();
    if r.close {
        session.set_keepalive(None);
    }
    respond_error(session, r.status, &r.message).await?;
    // Read and drop what the client is still sending, for a moment, before closing: closing on
    // unread data resets the connection, and a client still uploading would see the reset
    // instead of this answer (a lingering close, as nginx does). Not when it waits for
    // `100 Continue`: it sends nothing.
    let waits_for_continue = session.req_header().headers.contains_key("expect");
    if r.status == 413 && !waits_for_continue {
        let downstream = session.as_downstream_mut();
        downstream.set_total_drain_timeout(Some(std::time::Duration::from_secs(2)));
        let _ = downstream.drain_request_body().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_openai_shape_and_type_by_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (404, "invalid_request_error"),
            (502, "server_error"),
            (503, "service_unavailable"),
        ] {
            let v: serde_json::Value =
                serde_json::from_slice(&openai_error(status, "why")).expect("json");
            assert_eq!(v["error"]["type"], kind);
            assert_eq!(v["error"]["code"], status);
            assert_eq!(v["error"]["message"], "why");
        }
    }

    #[test]
    fn a_stream_error_is_one_sse_data_event() {
        let e = stream_error_event("cut");
        let text = std::str::from_utf8(&e).expect("utf-8");
        assert!(
            text.starts_with("data: {") && text.ends_with("}\n\n"),
            "{text}"
        );
    }

    #[test]
    fn models_are_listed_as_openai_does() {
        let v: serde_json::Value =
            serde_json::from_slice(&models_list(&["a".into(), "b".into()])).expect("json");
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][1]["id"], "b");
    }
}
