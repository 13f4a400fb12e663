//! Reading a request body whole and sending it again on every attempt.
//!
//! Pingora forwards a body it has already read only from its retry buffer, which holds at most
//! 64 KiB (`BODY_BUF_LIMIT` in pingora-core) and is dropped whole past that, while an agent's
//! prompt is often several hundred KB. So:
//! - with `Content-Length`, buffering is switched on only when at most 64 KiB remain: the
//!   buffer then holds just the tail, is never truncated, and its presence makes Pingora call
//!   `request_body_filter`, where [`BodyReplay::substitute`] puts the whole body in its place;
//! - with chunked encoding, reading stops as soon as the JSON value is complete ([`JsonEnd`]),
//!   leaving the chunked terminator on the wire: Pingora reads it and calls
//!   `request_body_filter`, where the whole body is sent.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora_proxy::Session;

use super::JsonEnd;

/// Pingora replays at most this much of a request body from its retry buffer.
const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// The whole body must arrive within this.
    pub read_timeout: Duration,
}

/// Why a body was refused before any replica saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    TooLarge {
        limit: usize,
    },
    Timeout(Duration),
    Read(String),
    /// A chunked body over 64 KiB that is not JSON: its end cannot be seen early.
    ChunkedTooLarge,
}

impl BodyError {
    pub fn status(&self) -> u16 {
        match self {
            BodyError::TooLarge { .. } => 413,
            BodyError::Timeout(_) => 408,
            BodyError::Read(_) => 400,
            BodyError::ChunkedTooLarge => 411,
        }
    }

    /// The `reason` label of `inferlb_rejected_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            BodyError::TooLarge { .. } => "too_large",
            BodyError::Timeout(_) => "timeout",
            BodyError::Read(_) => "bad_body",
            BodyError::ChunkedTooLarge => "chunked_too_large",
        }
    }

    pub fn message(&self) -> String {
        match self {
            BodyError::TooLarge { limit } => {
                format!("the request body is larger than the limit of {limit} bytes")
            }
            BodyError::Timeout(t) => format!("the request body did not arrive within {t:?}"),
            BodyError::Read(e) => format!("reading the request body: {e}"),
            BodyError::ChunkedTooLarge => format!(
                "chunked request bodies over {RETRY_BUFFER_LIMIT} bytes must be JSON: send Content-Length"
            ),
        }
    }
}

/// One request's body and how much of it each attempt was given.
#[derive(Debug, Default)]
pub struct BodyReplay {
    body: Bytes,
    /// A chunked body was read up to its JSON end; Pingora reads the terminator.
    chunked_tail_pending: bool,
    /// The attempt whose body was already handed to Pingora.
    sent_for: u32,
}

fn header<'s>(session: &'s Session, name: &str) -> Option<&'s str> {
    session.req_header().headers.get(name)?.to_str().ok()
}

impl BodyReplay {
    /// Reads the whole body, bounded in size and total time. Answers `Expect: 100-continue`
    /// itself (the replica must not see it: the client waits for inferlb's answer).
    pub async fn read(session: &mut Session, limits: BodyLimits) -> Result<BodyReplay, BodyError> {
        let length = header(session, "content-length").and_then(|v| v.trim().parse::<usize>().ok());
        let chunked = header(session, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let expects_continue =
            header(session, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        let limit = limits.max_bytes;
        if length.is_some_and(|n| n > limit) {
            return Err(BodyError::TooLarge { limit });
        }
        if expects_continue {
            session.req_header_mut().remove_header("expect");
            session
                .write_continue_response()
                .await
                .map_err(|e| BodyError::Read(e.to_string()))?;
        }
        let mut replay = BodyReplay::default();
        if session.is_body_empty() {
            return Ok(replay);
        }
        let deadline = tokio::time::Instant::now() + limits.read_timeout;
        // Most bodies come in one chunk: it is kept as it came, copied only when a second one
        // follows.
        let mut first: Option<Bytes> = None;
        let mut body = BytesMut::new();
        let mut json_end = JsonEnd::default();
        if chunked {
            // Covers chunked bodies up to 64 KiB on every retry; larger ones are replayed by
            // leaving their terminator to Pingora.
            session.enable_retry_buffering();
        }
        loop {
            if chunked && json_end.complete() {
                replay.chunked_tail_pending = true;
                break;
            }
            let read = first.as_ref().map_or(body.len(), Bytes::len);
            if length.is_some_and(|n| n.saturating_sub(read) <= RETRY_BUFFER_LIMIT) {
                session.enable_retry_buffering();
            }
            let chunk = tokio::time::timeout_at(deadline, session.read_request_body())
                .await
                .map_err(|_| BodyError::Timeout(limits.read_timeout))?
                .map_err(|e| BodyError::Read(e.to_string()))?;
            let Some(chunk) = chunk else { break };
            if read + chunk.len() > limit {
                return Err(BodyError::TooLarge { limit });
            }
            if chunked {
                json_end.feed(&chunk);
            }
            if read == 0 && first.is_none() {
                first = Some(chunk);
                continue;
            }
            if let Some(f) = first.take() {
                body.reserve(length.unwrap_or(0).min(limit).max(f.len() + chunk.len()));
                body.extend_from_slice(&f);
            }
            body.extend_from_slice(&chunk);
        }
        if session.as_ref().retry_buffer_truncated() && !replay.chunked_tail_pending {
            return Err(BodyError::ChunkedTooLarge);
        }
        replay.body = first.unwrap_or_else(|| body.freeze());
        Ok(replay)
    }

    pub fn bytes(&self) -> &Bytes {
        &self.body
    }

    /// In `request_body_filter`: Pingora hands over only the retry buffer's tail; send the
    /// whole body instead, once for each attempt.
    pub fn substitute(&mut self, attempt: u32, chunk: &mut Option<Bytes>) {
        if self.body.is_empty() {
            return;
        }
        if self.sent_for == attempt {
            *chunk = None;
        } else {
            self.sent_for = attempt;
            *chunk = Some(self.body.clone());
        }
    }

    /// Whether another attempt can still be given the body: not a large chunked body whose
    /// end Pingora has already consumed from the client.
    pub fn replayable(&self, session: &mut Session) -> bool {
        !(self.chunked_tail_pending
            && session.as_ref().retry_buffer_truncated()
            && session.as_downstream_mut().is_body_done())
    }

    /// Forwards `body` in place of what the client sent (a member it may not send removed).
    pub fn replace(&mut self, body: Bytes) {
        self.body = body;
    }
}
