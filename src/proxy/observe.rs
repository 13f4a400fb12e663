//! An answer as it passes: the usage a stream is asked for on the client's behalf (and taken
//! out again), the usage read, the first byte timed (when the replica holds the prompt), and
//! the cache model's prediction checked against what the replica reports.

use std::time::Instant;

use bytes::Bytes;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use super::attempt::Attempt;
use super::{stored_key, Balancer, Ctx};
use crate::cluster::Table;
use crate::fleet::index::Recency;
use crate::fleet::replica::{Check, Prediction, Replica};
use crate::protocol::api::prompt::Link;
use crate::protocol::api::Family;
use crate::protocol::stream_usage::{self, UsageStripper};
use crate::protocol::usage::{Usage, UsageReader};
use crate::routing::Route;
use crate::telemetry::metrics::METRICS;

impl Balancer {
    /// A streamed chat or completions request that does not ask for its usage is sent
    /// asking, under a policy that learns from usage: the answer's usage event is taken out
    /// again ([`strip_usage`]). A body Pingora has not read whole is left as it is.
    pub(super) fn ask_for_usage(&self, session: &mut Session, ctx: &mut Ctx) {
        let path = session.req_header().uri.path();
        let streams_completions = matches!(
            (ctx.family, path),
            (Family::Chat, "/v1/chat/completions") | (Family::Completions, "/v1/completions")
        );
        if !streams_completions
            || !self.policy.weighs_prefill()
            || ctx.info.is_none()
            || ctx.body.tail_pending(session)
        {
            return;
        }
        if let Some(body) = stream_usage::asking_for_usage(ctx.body.bytes()) {
            ctx.body.replace(body);
            ctx.body_replaced = true;
            ctx.usage_asked = true;
        }
    }

    /// A response body chunk passed: read its usage, time the first byte.
    pub(super) fn observe_response(
        &self,
        body: Option<&Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) {
        // First: an answer whole in one chunk is recorded before its usage is checked.
        if ctx.first_byte_at.is_none() {
            let now = Instant::now();
            ctx.first_byte_at = Some(now);
            // The replica holds the prompt once its prefill is over, not when it was sent: a
            // request with the same prefix arriving meanwhile would not find it in its cache
            // (a same-prefix burst must spread, not queue behind its first request).
            if let Some(a) = ctx.attempt.as_mut() {
                if let Some(prefill) = a.answering() {
                    if self.policy.weighs_prefill() {
                        let links = ctx.info.as_ref().map_or(&[][..], |i| i.shape.links());
                        a.recency = prefill.prefilled(links);
                    }
                }
            }
            let route = ctx.route().map_or("none", Route::as_str);
            METRICS
                .ttfb
                .with_label_values(&[route])
                .observe((now - ctx.arrived).as_secs_f64());
        }
        if let Some(reader) = ctx.usage_reader.as_mut() {
            if let Some(b) = body {
                reader.feed_bytes(b);
            }
            if end_of_stream {
                ctx.usage = reader.finish();
            }
            // A stream announces its id first; a JSON answer has it once finished.
            let replica = ctx.attempt.as_ref().and_then(Attempt::current);
            // With the store in the balancer, no replica holds the id: never sent there.
            let learns = !ctx.id_learnt && ctx.conversation.is_none();
            if let (true, Some(id), Some(r)) = (learns, reader.response_id(), replica) {
                self.remember(Table::Stored, stored_key(id), &r.id);
                ctx.id_learnt = true;
            }
            if end_of_stream {
                ctx.usage_reader = None;
                if let (Some(u), Some(a)) = (ctx.usage, ctx.attempt.as_ref()) {
                    if let Some(r) = a.current() {
                        METRICS
                            .prompt_tokens
                            .with_label_values(&[&r.id])
                            .inc_by(u.prompt_tokens);
                        METRICS
                            .cached_tokens
                            .with_label_values(&[&r.id])
                            .inc_by(u.cached_tokens);
                        // A body that refers to a response the replica stores does not hold
                        // the prompt whole: its usage says nothing of what was sent.
                        if self.policy.weighs_prefill() && ctx.owner.is_none() {
                            let links = ctx.info.as_ref().map_or(&[][..], |i| i.shape.links());
                            self.check_prediction(
                                r,
                                ctx.family,
                                links,
                                a.predicted.map(|tokens| Prediction {
                                    tokens,
                                    exact: a.predicted_exact,
                                    recency: &a.recency,
                                }),
                                &u,
                            );
                        }
                    }
                }
            }
        }
    }

    /// What the replica's answer says of its cache against what its cache model predicted:
    /// the model learns from it (its ratio of bytes to tokens, what it wrongly held), and the
    /// metrics show both counts side by side. A prediction the replica's KV events made
    /// corrects no estimate. Without a prediction (a handed-over turn: its decode pulled what
    /// it lacked, so its cached count says nothing of its cache) it learns only the ratio.
    fn check_prediction(
        &self,
        r: &Replica,
        family: Family,
        links: &[Link],
        prediction: Option<Prediction<'_>>,
        u: &Usage,
    ) {
        let cached = u
            .cached_reported
            .then_some(u.cached_tokens)
            .filter(|_| prediction.is_some());
        let none = Recency::default();
        let prediction = prediction.unwrap_or(Prediction {
            tokens: 0,
            exact: false,
            recency: &none,
        });
        let check = r
            .cache
            .answered(family, links, prediction, u.prompt_tokens, cached);
        if check == Check::Unreported {
            return;
        }
        let id: &str = &r.id;
        METRICS
            .predicted_cached_tokens
            .with_label_values(&[id])
            .inc_by(r.cache.to_replica_tokens(family, prediction.tokens));
        METRICS
            .reported_cached_tokens
            .with_label_values(&[id])
            .inc_by(u.cached_tokens);
        if let Check::Wrong { evicted } = check {
            let cause = if evicted { "evicted" } else { "absent" };
            METRICS.mispredictions.with_label_values(&[id, cause]).inc();
        }
    }
}

/// Whether an answer streams (SSE).
pub(super) fn is_sse(header: &ResponseHeader) -> bool {
    header
        .headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// An answer about to pass to the client: its usage is read as it passes, and the usage event
/// inferlb asked for is taken out of a stream. Whether it streams (SSE).
pub(super) fn read_answer(ctx: &mut Ctx, header: &ResponseHeader) -> bool {
    let sse = is_sse(header);
    ctx.usage_reader = Some(UsageReader::new(ctx.family, sse));
    if sse && ctx.usage_asked {
        ctx.usage_stripper = Some(UsageStripper::default());
    }
    sse
}

/// The usage event inferlb asked for on the client's behalf, taken out of the stream as it
/// passes (after the usage reader saw it). An event without an end in sight passes as it is.
pub(super) fn strip_usage(body: &mut Option<Bytes>, end: bool, ctx: &mut Ctx) {
    let Some(s) = ctx.usage_stripper.as_mut() else {
        return;
    };
    let mut out = body.as_deref().map(|b| s.feed(b)).unwrap_or_default();
    if end || s.pending_len() > STRIP_PENDING_CAP {
        let rest = s.finish();
        if !rest.is_empty() {
            let mut joined = out.to_vec();
            joined.extend_from_slice(&rest);
            out = Bytes::from(joined);
        }
        if !end {
            ctx.usage_stripper = None;
        }
    }
    *body = (!out.is_empty()).then_some(out);
}

/// The most bytes of one unfinished event held back while looking for the usage event.
const STRIP_PENDING_CAP: usize = 1024 * 1024;
