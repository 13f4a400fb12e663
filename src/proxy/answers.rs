//! The answers inferlb writes itself, in the caller's API's shapes (OpenAI's, or Anthropic's
//! on `/v1/messages`): errors, `/v1/models`, and the error event that ends a stream a replica
//! cut.

use bytes::Bytes;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use crate::protocol::api::Family;
use crate::telemetry::metrics::METRICS;

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
        429 => "rate_limit_exceeded",
        400..=499 => "invalid_request_error",
        503 => "service_unavailable",
        _ => "server_error",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    });
    Bytes::from(body.to_string())
}

/// An error body in Anthropic's JSON shape, its type named as Anthropic names them.
pub fn anthropic_error(status: u16, message: &str) -> Bytes {
    let kind = match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    let body = serde_json::json!({"type": "error", "error": {"type": kind, "message": message}});
    Bytes::from(body.to_string())
}

/// An error body in the shape of `family`'s API.
pub fn error_body(family: Family, status: u16, message: &str) -> Bytes {
    if family.is_anthropic() {
        anthropic_error(status, message)
    } else {
        openai_error(status, message)
    }
}

/// The SSE event that ends a stream its replica cut, in the stream's own API's shape, so the
/// client sees an error, never a silent truncation that looks like success.
pub fn stream_error_event(family: Family, message: &str) -> Bytes {
    let event = match family {
        Family::Chat | Family::Completions => {
            format!(
                "data: {}\n\n",
                String::from_utf8_lossy(&openai_error(502, message))
            )
        }
        Family::Messages => format!(
            "event: error\ndata: {}\n\n",
            String::from_utf8_lossy(&anthropic_error(502, message))
        ),
        Family::Responses => {
            let body = serde_json::json!({
                "type": "error", "code": "server_error", "message": message, "param": null
            });
            format!("event: error\ndata: {body}\n\n")
        }
    };
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

/// An answer with no replica behind it; it carries the request's id like every other.
pub async fn respond_json(
    session: &mut Session,
    request_id: &str,
    status: u16,
    body: Bytes,
) -> Result<()> {
    respond_json_with(session, request_id, status, body, None).await
}

/// A 429 of overload protection, with `Retry-After`; counted like every refusal.
pub async fn too_many(
    session: &mut Session,
    request_id: &str,
    family: Family,
    t: &crate::overload::TooMany,
) -> Result<()> {
    METRICS.rejected.with_label_values(&[t.reason]).inc();
    let body = error_body(family, 429, &t.message);
    let retry_after = t.retry_after.to_string();
    respond_json_with(
        session,
        request_id,
        429,
        body,
        Some(("retry-after", retry_after)),
    )
    .await
}

async fn respond_json_with(
    session: &mut Session,
    request_id: &str,
    status: u16,
    body: Bytes,
    extra: Option<(&'static str, String)>,
) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(5))?;
    if let Some((name, value)) = extra {
        resp.insert_header(name, value)?;
    }
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    resp.insert_header("x-request-id", request_id)?;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

pub async fn respond_error(
    session: &mut Session,
    request_id: &str,
    family: Family,
    status: u16,
    message: &str,
) -> Result<()> {
    let body = error_body(family, status, message);
    respond_json(session, request_id, status, body).await
}

/// Answers a refused request and counts it.
pub async fn refuse(
    session: &mut Session,
    request_id: &str,
    family: Family,
    r: &Refusal,
) -> Result<()> {
    METRICS.rejected.with_label_values(&[r.reason]).inc();
    if r.close {
        session.set_keepalive(None);
    }
    respond_error(session, request_id, family, r.status, &r.message).await?;
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
            (429, "rate_limit_exceeded"),
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
    fn anthropic_errors_have_anthropic_shape() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (502, "api_error"),
            (503, "overloaded_error"),
        ] {
            let v: serde_json::Value =
                serde_json::from_slice(&error_body(Family::Messages, status, "why")).expect("json");
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], kind, "{status}");
            assert_eq!(v["error"]["message"], "why");
        }
        let v: serde_json::Value =
            serde_json::from_slice(&error_body(Family::Responses, 503, "x")).expect("json");
        assert_eq!(v["error"]["type"], "service_unavailable");
    }

    #[test]
    fn a_stream_error_is_one_sse_event_in_each_apis_shape() {
        for (family, head, kind) in [
            (Family::Chat, "data: ", None),
            (Family::Completions, "data: ", None),
            (Family::Messages, "event: error\ndata: ", Some("error")),
            (Family::Responses, "event: error\ndata: ", Some("error")),
        ] {
            let e = stream_error_event(family, "cut");
            let text = std::str::from_utf8(&e).expect("utf-8");
            let data = text.strip_prefix(head).expect(head);
            let data = data.strip_suffix("\n\n").expect("one event");
            let v: serde_json::Value = serde_json::from_str(data).expect("json");
            assert_eq!(v["type"].as_str(), kind, "{family:?}");
            assert!(data.contains("cut"));
        }
    }

    #[test]
    fn models_are_listed_as_openai_does() {
        let v: serde_json::Value =
            serde_json::from_slice(&models_list(&["a".into(), "b".into()])).expect("json");
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][1]["id"], "b");
    }
}
