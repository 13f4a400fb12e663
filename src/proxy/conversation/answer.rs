//! A stored conversation's answer as it passes: given back the `store` and
//! `previous_response_id` the client sent, and its exchange kept before the client sees its
//! end.

use std::time::Duration;

use bytes::Bytes;
use pingora_http::ResponseHeader;
use serde_json::value::RawValue;

use crate::protocol::conversation::{self as conv, EventRewriter, Exchange};
use crate::proxy::observe::is_sse;
use crate::proxy::{Balancer, Ctx};

/// The answer being given back the client's fields.
pub(super) enum Answer {
    Json(Vec<u8>),
    Events(EventRewriter),
}

/// Answers larger than this are passed on as they are, neither rewritten nor kept.
const ANSWER_CAP: usize = 32 << 20;

impl Balancer {
    /// The replica's answer header: a success is rewritten as it passes, so its length changes.
    pub(in crate::proxy) fn conversation_header(&self, resp: &mut ResponseHeader, ctx: &mut Ctx) {
        let Some(c) = ctx.conversation.as_mut() else {
            return;
        };
        if !resp.status.is_success() {
            c.answer = None;
            return;
        }
        c.answer = Some(if is_sse(resp) {
            Answer::Events(EventRewriter::new(c.sent.clone()))
        } else {
            Answer::Json(Vec::new())
        });
        resp.remove_header("content-length");
        // HTTP/1.1 then frames it in chunks; Pingora drops the header on HTTP/2.
        let _ = resp.insert_header("transfer-encoding", "chunked");
    }

    /// A chunk of a successful answer: rewritten, and the exchange kept (and written to Redis,
    /// within `responses.hold_ms`) before the chunk that ends it goes to the client.
    /// The time to wait before the chunk goes on, where the store's write could not be waited
    /// for here.
    pub(in crate::proxy) fn conversation_body(
        &self,
        body: &mut Option<Bytes>,
        end: bool,
        ctx: &mut Ctx,
    ) -> Option<Duration> {
        let (Some(c), Some(store)) = (ctx.conversation.as_mut(), self.history.as_ref()) else {
            return None;
        };
        let final_object = match c.answer.as_mut() {
            None => return None,
            Some(Answer::Events(r)) => {
                let mut out = body.as_deref().map(|b| r.feed(b)).unwrap_or_default();
                if r.pending_len() > ANSWER_CAP {
                    // An event without an end in sight: the rest passes as it comes.
                    let mut joined = out.to_vec();
                    joined.extend_from_slice(&r.finish());
                    *body = Some(Bytes::from(joined));
                    c.answer = None;
                    return None;
                }
                if end {
                    let rest = r.finish();
                    if !rest.is_empty() {
                        let mut joined = out.to_vec();
                        joined.extend_from_slice(&rest);
                        out = Bytes::from(joined);
                    }
                }
                *body = (!out.is_empty()).then_some(out);
                r.take_final()
            }
            Some(Answer::Json(buf)) => {
                if let Some(b) = body.take() {
                    buf.extend_from_slice(&b);
                }
                if buf.len() > ANSWER_CAP {
                    *body = Some(Bytes::from(std::mem::take(buf)));
                    c.answer = None;
                    return None;
                }
                if !end {
                    return None;
                }
                let whole = std::mem::take(buf);
                match conv::restore(&whole, &c.sent) {
                    Some(restored) => {
                        *body = Some(restored.clone());
                        Some(restored)
                    }
                    None => {
                        *body = Some(Bytes::from(whole));
                        None
                    }
                }
            }
        };
        let object = final_object?;
        if !c.keep {
            return None;
        }
        let (id, status) = conv::id_and_status(&object)?;
        if !conv::is_kept(&status) {
            return None;
        }
        let text = String::from_utf8(object.to_vec()).ok()?;
        let response = RawValue::from_string(text).ok()?;
        c.keep = false;
        store.keep_and_share(Exchange {
            id,
            scope: c.scope,
            ancestors: c.chain.clone(),
            input: c.input.clone(),
            response,
            stored_at: crate::history::now(),
        })
    }
}
