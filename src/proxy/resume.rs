//! A stream whose replica broke after its answer's header and before any of its body. A
//! replica sends that header as soon as it takes a streamed request, before the prefill
//! (vLLM's server does), and the proxy passes it on at once; so a replica lost during a
//! prefill leaves the client holding a 200 and nothing else. Nothing of the answer reached
//! it, so the request goes to another replica, held until that one's first token as a decode
//! leg is, and its events follow the header the client already has.
//!
//! The header names the replica that broke (`x-inferlb-replica`), as do the failover's count
//! and log line; the access log, the request counts and the affinity table name the one that
//! served. Once a byte of the body has passed, nothing is retried, as everywhere. Not resumed:
//! a request about a stored response (only its replica has it), an exchange the balancer's
//! Responses store keeps, a body that can no longer be sent again, a compressed answer.

use std::sync::Arc;

use pingora_core::upstreams::peer::Peer;
use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_proxy::Session;

use super::attempt::Attempt;
use super::errors::{failure_of, reason, Seen};
use super::exchange::{first_token, unless_client_leaves, LegError};
use super::failover::{status_fails_over, Failure};
use super::observe::is_sse;
use super::{Balancer, Ctx};
use crate::fleet::replica::Replica;
use crate::telemetry::metrics::METRICS;

/// How a resumed stream ended.
enum Resumed {
    /// Whole, from another replica.
    Served,
    /// No replica could go on with it: the stream ends with an error event saying this.
    GaveUp(String),
    /// The client left: nobody to tell.
    ClientGone,
}

/// What `fail_to_proxy` does next.
pub(super) enum GoOn {
    /// The request is over: served whole elsewhere, or its client left.
    Ended,
    /// It fails, as it would have without a resume; with why, when a resume was given up.
    Fails(Option<String>),
}

/// What one try of the resume came to, before its first token.
enum Try {
    /// Passed over (outside the allowed networks) or failed before its answer began: the
    /// next replica, after demoting this one when its failure says it is down.
    Next { demote: bool },
    /// The request cannot go on anywhere: this is why.
    Stop(String),
}

impl Balancer {
    /// A request that failed with `e`: resumed when it can be, and the replica whose failure
    /// ended it counted (`inferlb_upstream_errors_total`): none when it was served elsewhere,
    /// the last one tried when the resume gave up.
    pub(super) async fn go_on(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> GoOn {
        if !self.resumable(session, e, ctx) {
            if let (ErrorSource::Upstream, Some(r)) = (e.esource(), ctx.current()) {
                METRICS
                    .upstream_errors
                    .with_label_values(&[&r.id, reason(e)])
                    .inc();
            }
            return GoOn::Fails(None);
        }
        match self.resume(session, e, ctx).await {
            // Ended whole. Pingora closes an HTTP/1.1 connection next, though its header
            // (sent before the first replica broke) promised no close: a client reusing it at
            // once may meet the close, as after any cut stream. Pingora 0.9.1 decides that
            // reuse from the upstream's failure alone; `fail_to_proxy`'s
            // `can_reuse_downstream` is read only after a filter's error (tried: a test of the
            // kept connection still met the close).
            Resumed::Served | Resumed::ClientGone => GoOn::Ended,
            Resumed::GaveUp(why) => {
                if let Some((id, last)) = &ctx.last_failure {
                    METRICS
                        .upstream_errors
                        .with_label_values(&[&**id, last])
                        .inc();
                }
                GoOn::Fails(Some(why))
            }
        }
    }

    /// Whether the request that failed with `e` can go on elsewhere: a stream whose replica
    /// broke after a successful, uncompressed header and before its first body byte, with
    /// tries left.
    fn resumable(&self, session: &mut Session, e: &Error, ctx: &Ctx) -> bool {
        let header_only = session.response_written().is_some_and(|h| {
            h.status.is_success()
                && is_sse(h)
                // The exchange asks for no compression: its events could not follow.
                && !h.headers.contains_key("content-encoding")
        }) && ctx.first_byte_at.is_none();
        header_only
            && ctx.info.as_ref().is_some_and(|i| i.stream)
            && failure_of(e, Seen::Final) == Failure::Broken
            && ctx.owner.is_none()
            && ctx.conversation.is_none()
            && ctx
                .attempt
                .as_ref()
                .is_some_and(|a| a.n < self.max_attempts)
            && ctx.body.replayable(session)
    }

    /// Serves the rest of a [`Balancer::resumable`] request on other replicas, one try at a
    /// time within the request's attempts (each read bounded by the read timeout), and given
    /// up as soon as the client leaves.
    async fn resume(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> Resumed {
        if let Some(r) = ctx.current().cloned() {
            // It took the request and broke before answering: demoted, as on any failover.
            r.demote();
            self.count_failover(session, ctx, &r, reason(e), &e.to_string());
        }
        let leg = self.leg_ctx(self.conf.upstream.read_timeout);
        let header = session.req_header().clone();
        let body = ctx.body.bytes().clone();
        let tail_pending = ctx.body.tail_pending(session);
        // Replicas outside the allowed networks are passed over without a try, each once.
        let mut passes = self.registry.all().len();
        while ctx
            .attempt
            .as_ref()
            .is_some_and(|a| a.n < self.max_attempts)
        {
            // The last try's prefill will not run: the choice must not see it queued.
            if let Some(a) = &mut ctx.attempt {
                a.refused();
            }
            let Some(choice) = self.choose(ctx) else {
                return Resumed::GaveUp(self.none_left(ctx));
            };
            let r = choice.replica.clone();
            if let Err(why) = leg.networks.check_peer(r.endpoint.peer.address()) {
                log::error!("replica {} not connected to: {why}", r.id);
                ctx.tried.push(r);
                passes = passes.saturating_sub(1);
                if passes == 0 {
                    return Resumed::GaveUp(self.none_left(ctx));
                }
                continue;
            }
            let n = ctx.attempt.as_ref().map_or(0, |a| a.n) + 1;
            // Replaces the last try whole, releasing what it held.
            ctx.attempt = Some(Attempt::start(n, choice));
            let started = async {
                let (h, mut s) = leg
                    .exchange_keep(&r, &header, &ctx.request_id, body.clone())
                    .await?;
                if !h.status.is_success() || !is_sse(&h) {
                    return Err(LegError::Answered(h, Default::default()));
                }
                let held = first_token(&mut s, self.conf.upstream.read_timeout).await?;
                Ok((s, held))
            };
            let (s, held) = match unless_client_leaves(session, tail_pending, started).await {
                None => return Resumed::ClientGone,
                Some(Ok(started)) => started,
                Some(Err(le)) => match self.judge(&r, &le) {
                    Try::Next { demote } => {
                        if demote {
                            r.demote();
                        }
                        self.count_failover(session, ctx, &r, le.reason(), &le.to_string());
                        continue;
                    }
                    Try::Stop(why) => {
                        ctx.last_failure = Some((r.id.clone(), le.reason()));
                        ctx.tried.push(r);
                        return Resumed::GaveUp(why);
                    }
                },
            };
            return match self.relay(session, ctx, (s, &r), held).await {
                Ok(()) => {
                    ctx.resumed = true;
                    Resumed::Served
                }
                Err(e) if e.esource() == &ErrorSource::Downstream => Resumed::ClientGone,
                // Cut or silent after its first token: never retried.
                Err(e) => {
                    let why = reason(&e);
                    ctx.last_failure = Some((r.id.clone(), why));
                    Resumed::GaveUp(match e.etype() {
                        ErrorType::ReadTimedout => format!("replica {} went silent", r.id),
                        _ => format!("replica {}'s stream broke ({why})", r.id),
                    })
                }
            };
        }
        Resumed::GaveUp(self.none_left(ctx))
    }

    /// What a try that failed before its first token means, as the proxy path's failover
    /// table reads the same failures: no connection, a connection that broke or an answer of
    /// 502 or 503 demote the replica and go on elsewhere; a stream whose first event is the
    /// replica's own error goes on elsewhere; a silence or any other answer ends the request
    /// (the client already has a 200, so it gets an error event).
    fn judge(&self, r: &Replica, e: &LegError) -> Try {
        match e {
            LegError::NotAllowed(why) => {
                log::error!("replica {} not connected to: {why}", r.id);
                Try::Next { demote: false }
            }
            LegError::Connect(_) | LegError::Broken(_) => Try::Next { demote: true },
            LegError::Answered(h, _) if status_fails_over(h.status.as_u16()) => {
                Try::Next { demote: true }
            }
            LegError::StreamFailed => Try::Next { demote: false },
            LegError::TimedOut(_) => Try::Stop(format!(
                "replica {} did not answer within {:?}",
                r.id, self.conf.upstream.read_timeout
            )),
            LegError::Answered(h, _) => Try::Stop(format!(
                "replica {} answered {} where the stream was to go on",
                r.id,
                h.status.as_u16()
            )),
            LegError::NoParams => Try::Stop(format!("replica {} failed ({e})", r.id)),
        }
    }

    /// Why the stream ends: the last replica that failed it, and how.
    fn none_left(&self, ctx: &Ctx) -> String {
        match &ctx.last_failure {
            Some((id, why)) => format!(
                "no replica could go on with this stream: the last tried, {id}, failed ({why})"
            ),
            None => "no replica could go on with this stream".into(),
        }
    }

    /// A failed try: the replica is given up on for this request, and, when another try
    /// follows, the failover's count and log line, as the proxy path's failover writes them.
    fn count_failover(
        &self,
        session: &Session,
        ctx: &mut Ctx,
        r: &Arc<Replica>,
        why: &'static str,
        detail: &str,
    ) {
        let last = ctx
            .attempt
            .as_ref()
            .is_some_and(|a| a.n >= self.max_attempts);
        if last {
            ctx.given_up(r, why);
        } else {
            ctx.failed_over(
                r,
                why,
                session.req_header().uri.path(),
                format_args!(
                    "resuming the stream on another replica before its first byte ({detail})"
                ),
            );
        }
    }
}
