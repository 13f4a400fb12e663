//! Reading a request body whole and sending it again on every attempt.
//!
//! Pingora forwards a body it has already read only from its retry buffer, which holds at most
//! 64 KiB (`BODY_BUF_LIMIT` in pingora-core) and is dropped whole past that, while an agent's
//! prompt is often several hundred KB. The buffer's presence is what makes Pingora call
//! `request_body_filter`, where [`BodyReplay::substitute`] puts the whole body in its place, so
//! each way of reading makes sure it holds something, untruncated, or leaves bytes on the wire:
//! - HTTP/2: the first chunk is read into the buffer, the rest past it (no length is needed,
//!   and HTTP/2 has no chunked encoding);
//! - HTTP/1.1 with `Content-Length`: buffering is switched on only when at most 64 KiB remain,
//!   so the buffer holds just the tail;
//! - HTTP/1.1 chunked: read to its end while the buffer holds it all; past 64 KiB, reading
//!   stops as soon as the JSON value is complete ([`JsonEnd`]), leaving the rest (at least the
//!   terminator) to Pingora, whose read calls `request_body_filter`; whatever it still reads is
//!   forwarded after the body, so the replica gets exactly the client's bytes.

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

/// The body's length from its `Content-Length` headers: `None` when there is none. A value
/// that is not plain digits, or several that differ, is refused, never taken as absent: the
/// body would then be read by another rule than the one the client framed it by.
pub fn content_length(headers: &http::HeaderMap) -> Result<Option<usize>, BodyError> {
    let mut length = None;
    for v in headers.get_all(http::header::CONTENT_LENGTH) {
        let bytes = v.as_bytes();
        let n = (!bytes.is_empty() && bytes.iter().all(u8::is_ascii_digit))
            .then(|| std::str::from_utf8(bytes).ok()?.parse::<usize>().ok())
            .flatten();
        match (n, length) {
            (None, _) => return Err(BodyError::Read("invalid content-length".into())),
            (Some(n), Some(seen)) if n != seen => {
                return Err(BodyError::Read("conflicting content-length headers".into()))
            }
            (Some(n), _) => length = Some(n),
        }
    }
    Ok(length)
}

/// The next chunk of an HTTP/2 body, read past Pingora's retry buffer.
async fn read_h2_unbuffered(session: &mut Session) -> Result<Option<Bytes>, BodyError> {
    use pingora_core::protocols::http::server::Session as Downstream;
    let Downstream::H2(h2) = session.as_downstream_mut() else {
        return session
            .read_request_body()
            .await
            .map_err(|e| BodyError::Read(e.to_string()));
    };
    std::future::poll_fn(|cx| h2.poll_read_body_bytes(cx))
        .await
        .transpose()
        .map_err(|e| BodyError::Read(e.to_string()))
}

impl BodyReplay {
    /// Reads the whole body, bounded in size and total time. Answers `Expect: 100-continue`
    /// itself (the replica must not see it: the client waits for inferlb's answer).
    pub async fn read(session: &mut Session, limits: BodyLimits) -> Result<BodyReplay, BodyError> {
        let length = content_length(&session.req_header().headers)?;
        let chunked = header(session, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let expects_continue =
            header(session, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        let h2 = session.as_downstream().is_http2();
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
        if chunked || h2 {
            // Chunked: holds bodies up to 64 KiB for every retry. HTTP/2: holds its first
            // chunk (one frame, at most 16 KiB), all Pingora needs to call the body filter.
            session.enable_retry_buffering();
        }
        loop {
            if chunked && json_end.complete() && session.as_ref().retry_buffer_truncated() {
                replay.chunked_tail_pending = true;
                break;
            }
            let read = first.as_ref().map_or(body.len(), Bytes::len);
            if length.is_some_and(|n| n.saturating_sub(read) <= RETRY_BUFFER_LIMIT) {
                session.enable_retry_buffering();
            }
            let next = async {
                if h2 && read > 0 {
                    read_h2_unbuffered(session).await
                } else {
                    let r = session.read_request_body().await;
                    r.map_err(|e| BodyError::Read(e.to_string()))
                }
            };
            let chunk = tokio::time::timeout_at(deadline, next)
                .await
                .map_err(|_| BodyError::Timeout(limits.read_timeout))??;
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
    /// whole body instead, once for each attempt. After a chunked body's JSON end, what
    /// Pingora still reads from the client follows the body as it came, and is kept for the
    /// next attempt.
    pub fn substitute(&mut self, attempt: u32, chunk: &mut Option<Bytes>) {
        if self.body.is_empty() {
            return;
        }
        let more = chunk
            .take()
            .filter(|c| self.chunked_tail_pending && !c.is_empty());
        if let Some(more) = &more {
            let mut whole = BytesMut::with_capacity(self.body.len() + more.len());
            whole.extend_from_slice(&self.body);
            whole.extend_from_slice(more);
            self.body = whole.freeze();
        }
        if self.sent_for == attempt {
            *chunk = more;
        } else {
            self.sent_for = attempt;
            *chunk = Some(self.body.clone());
        }
    }

    /// Whether the client's body has bytes Pingora has not read yet: then nothing may read
    /// the client's connection but Pingora's proxy loop.
    pub fn tail_pending(&self, session: &mut Session) -> bool {
        self.chunked_tail_pending && !session.as_downstream_mut().is_body_done()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_length_that_does_not_parse_is_refused_never_taken_as_absent() {
        type Case<'a> = (&'a [&'a str], Result<Option<usize>, ()>);
        let cases: [Case; 11] = [
            (&[], Ok(None)),
            (&["0"], Ok(Some(0))),
            (&["100"], Ok(Some(100))),
            (&["100", "100"], Ok(Some(100))),
            (&["100, 100"], Err(())),
            (&["100", "101"], Err(())),
            (&["+100"], Err(())),
            (&[" 100"], Err(())),
            (&["1e3"], Err(())),
            (&[""], Err(())),
            (&["99999999999999999999999999"], Err(())),
        ];
        for (values, want) in cases {
            let mut headers = http::HeaderMap::new();
            for v in values {
                headers.append("content-length", http::HeaderValue::from_str(v).unwrap());
            }
            let got = content_length(&headers).map_err(|e| assert_eq!(e.status(), 400));
            assert_eq!(got, want, "{values:?}");
        }
    }

    fn replay(body: &'static [u8], tail: bool) -> BodyReplay {
        BodyReplay {
            body: Bytes::from_static(body),
            chunked_tail_pending: tail,
            sent_for: 0,
        }
    }

    /// What `substitute` hands on for each chunk Pingora gives, over two attempts.
    fn handed(mut r: BodyReplay, attempts: &[&[Option<&'static [u8]>]]) -> Vec<Option<Vec<u8>>> {
        let mut out = vec![];
        for (n, chunks) in attempts.iter().enumerate() {
            for c in *chunks {
                let mut chunk = c.map(Bytes::from_static);
                r.substitute(n as u32 + 1, &mut chunk);
                out.push(chunk.map(|b| b.to_vec()));
            }
        }
        out
    }

    #[test]
    fn each_attempt_gets_the_whole_body_once_and_what_follows_a_json_end_is_kept() {
        let some = |b: &[u8]| Some(b.to_vec());
        // A buffered tail, then the end: the whole body, then nothing, on each attempt.
        assert_eq!(
            handed(
                replay(b"{\"a\":1}", false),
                &[&[Some(b"1}"), None], &[Some(b"1}")]]
            ),
            vec![some(b"{\"a\":1}"), None, some(b"{\"a\":1}")]
        );
        // A chunked body read to its JSON end: what Pingora reads after it follows it.
        assert_eq!(
            handed(
                replay(b"{\"a\":1}", true),
                &[&[Some(b"\n "), Some(b"x"), None], &[None]]
            ),
            vec![
                some(b"{\"a\":1}\n "),
                some(b"x"),
                None,
                some(b"{\"a\":1}\n x")
            ]
        );
        assert_eq!(handed(replay(b"{}", true), &[&[None]]), vec![some(b"{}")]);
        assert_eq!(handed(replay(b"", false), &[&[None]]), vec![None]);
    }
}
