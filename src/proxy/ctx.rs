//! One request's state through the hooks: what was read of it, where it was tried, what it
//! holds (its attempt, its overload pass, a disaggregated request's legs), and what its answer
//! said.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::fleet::replica::Replica;
use crate::protocol::api::{Family, RequestInfo};
use crate::protocol::body::BodyReplay;
use crate::protocol::stream_usage::UsageStripper;
use crate::protocol::usage::{Usage, UsageReader};
use crate::routing::Route;
use crate::telemetry::metrics::METRICS;

use super::attempt::Attempt;
use super::{conversation, pd};

/// One request's life.
pub struct Ctx {
    pub(super) arrived: Instant,
    /// The request's id, as sent to the replica and the client (see [`super::request::request_id`]).
    pub(super) request_id: http::HeaderValue,
    pub(super) family: Family,
    pub(super) body: BodyReplay,
    /// The body forwarded is not the one the client sent (see [`super::request::without_steering`]).
    pub(super) body_replaced: bool,
    pub(super) info: Option<RequestInfo>,
    /// The prompt's token ids, when its model has a tokenizer and a replica of it publishes
    /// its KV events.
    pub(super) tokens: Option<Arc<crate::fleet::chain::PromptTokens>>,
    /// The session key from the configured session header.
    pub(super) session: Option<u64>,
    /// The replica that stores the response this request is about, and that response's id.
    pub(super) owner: Option<Arc<Replica>>,
    pub(super) stored_id: Option<String>,
    /// This answer's stored response id was recorded.
    pub(super) id_learnt: bool,
    /// Replicas given up on, in order: no later attempt of this request goes to them.
    pub(super) tried: Vec<Arc<Replica>>,
    /// The current (or last) try; each try replaces it whole.
    pub(super) attempt: Option<Attempt>,
    /// Set once the first response byte went to the client: nothing is retried after it.
    pub(super) first_byte_at: Option<Instant>,
    /// Its stream broke before its first byte and ended whole on another replica
    /// ([`super::resume`]): served, though Pingora saw the first replica's error.
    pub(super) resumed: bool,
    pub(super) failovers: u32,
    /// The replica whose failure made the last failover, and why: what a client is told when
    /// no replica is left.
    pub(super) last_failure: Option<(Arc<str>, &'static str)>,
    pub(super) usage_reader: Option<UsageReader>,
    pub(super) usage: Option<Usage>,
    /// The stream's usage was asked for on the client's behalf: its usage event is taken out
    /// of the answer again (see [`crate::protocol::stream_usage`]).
    pub(super) usage_asked: bool,
    pub(super) usage_stripper: Option<UsageStripper>,
    /// Its place under overload protection (its key's budget, its prefill in transit).
    pub(super) overload: crate::overload::Pass,
    /// The replica a disaggregated pool's request is served whole on, and why, until it fails.
    pub(super) forced: Option<(Arc<Replica>, Route)>,
    /// A disaggregated request's decode KV and pending leg, held until it ends.
    pub(super) pd: pd::Held,
    /// A Responses exchange the balancer's store expands and keeps.
    pub(super) conversation: Option<conversation::Conversation>,
}

impl Ctx {
    /// A request that has just arrived: nothing read, nothing chosen.
    pub(super) fn new() -> Ctx {
        Ctx {
            arrived: Instant::now(),
            request_id: http::HeaderValue::from_static(""),
            family: Family::Chat,
            body: BodyReplay::default(),
            body_replaced: false,
            info: None,
            tokens: None,
            session: None,
            owner: None,
            stored_id: None,
            id_learnt: false,
            tried: Vec::new(),
            attempt: None,
            first_byte_at: None,
            resumed: false,
            failovers: 0,
            last_failure: None,
            usage_reader: None,
            usage: None,
            usage_asked: false,
            usage_stripper: None,
            overload: Default::default(),
            forced: None,
            pd: Default::default(),
            conversation: None,
        }
    }

    /// The request id as text: always visible ASCII.
    pub(super) fn id(&self) -> &str {
        self.request_id.to_str().unwrap_or("-")
    }

    /// The replica the current attempt holds a place on.
    pub(super) fn current(&self) -> Option<&Arc<Replica>> {
        self.attempt.as_ref().and_then(Attempt::current)
    }

    /// Why the last attempt's replica was chosen.
    pub(super) fn route(&self) -> Option<Route> {
        self.attempt.as_ref().map(|a| a.route)
    }

    /// `r` is given up on for this request: no later try goes to it, and it is the last
    /// failure a client is told of.
    pub(super) fn given_up(&mut self, r: &Arc<Replica>, why: &'static str) {
        self.last_failure = Some((r.id.clone(), why));
        if !self.tried.iter().any(|t| Arc::ptr_eq(t, r)) {
            self.tried.push(r.clone());
        }
    }

    /// `r` failed for `why` and another try follows: given up on, and the failover counted
    /// and logged (`path` the request's, `next` what happens now).
    pub(super) fn failed_over(
        &mut self,
        r: &Arc<Replica>,
        why: &'static str,
        path: &str,
        next: fmt::Arguments<'_>,
    ) {
        self.given_up(r, why);
        self.failovers += 1;
        METRICS.failovers.with_label_values(&[&r.id, why]).inc();
        log::warn!(
            "failover: replica={} reason={why} path={path} attempt={}: {next}",
            r.id,
            self.attempt.as_ref().map_or(0, |a| a.n),
        );
    }
}
