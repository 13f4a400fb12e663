//! Choosing a replica for an attempt, and what became of it: a failed attempt's verdict
//! applied, the final answer when nothing reached the client, the response observed as it
//! passes, and the request's end (counts, the affinity table, the access log).

use std::sync::Arc;

use pingora_core::Error;
use pingora_proxy::Session;

use super::attempt::Choice;
use super::errors::{failure_of, reason, Seen};
use super::failover::{self, Failed, Failure, Retry, Verdict};
use super::{Balancer, Ctx, NOT_CHAT};
use crate::cluster::Table;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Prompt;
use crate::routing::{self, Route};
use crate::telemetry::access;
use crate::telemetry::metrics::{code_class, METRICS};

impl Balancer {
    /// Records a pin here, and shares it with the cluster when there is one.
    pub(super) fn remember(&self, table: Table, key: u64, replica: &Arc<str>) {
        match table {
            Table::Affinity => self.affinity.record(key, replica),
            Table::Stored => self.stored.record(key, replica),
        }
        if let Some(c) = &self.cluster {
            c.pin(table, key, replica);
        }
    }

    /// The replica for the next attempt and why; `None` when no replica can take it. Under
    /// a policy that weighs prefill the chosen replica's queued prefill accounts for it at
    /// once, so the next request of a burst sees it; its index, once the prefill is over.
    pub(super) fn choose(&self, ctx: &Ctx) -> Option<Choice> {
        let shape = ctx.info.as_ref().map_or(&NOT_CHAT, |i| &i.shape);
        let model = ctx.info.as_ref().and_then(|i| i.model.as_deref());
        // Only a policy that weighs prefill looks at what each replica holds and has queued.
        let cost = self.policy.weighs_prefill();
        let links = if cost { shape.links() } else { &[] };
        let prompt = Prompt {
            links,
            tokens: ctx.tokens.as_deref(),
        };
        let fleet = self.registry.all();
        let candidates =
            Registry::candidates(&fleet, &ctx.tried, model, prompt, self.conf.pd.protocol);
        let served_by = |h| self.affinity.served_by(h);
        let tick = self.registry.tick();
        // A disaggregated pool's request served whole goes where the pool's plan put it,
        // until that replica fails it.
        let forced = ctx
            .forced
            .as_ref()
            .filter(|(r, _)| !ctx.tried.iter().any(|t| Arc::ptr_eq(t, r)) && r.is_live())
            .map(|(r, route)| routing::Decision {
                replica: &r.id,
                route: *route,
            });
        let decision = match (&ctx.owner, forced) {
            (Some(owner), _) => routing::stored(&owner.id, &candidates),
            (None, Some(f)) => Some(f),
            (None, None) => self
                .policy
                .decide(shape, ctx.session, &candidates, &served_by, tick),
        }?;
        let replica = fleet.iter().find(|r| *r.id == *decision.replica)?.clone();
        // Other instances learn where this prompt went now, not after the answer: a client's
        // next turn may reach one of them as soon as this answer ends.
        if let Some(c) = &self.cluster {
            for key in shape.served_key().into_iter().chain(ctx.session) {
                c.pin(Table::Affinity, key, &replica.id);
            }
        }
        let held = candidates.iter().find(|c| c.id == &*replica.id);
        let cached = held.map_or(0, |c| c.cached_tokens);
        if cost && !links.is_empty() {
            let source = match held.is_some_and(|c| c.cached_exact) {
                true => "events",
                false => "estimate",
            };
            METRICS.cache_source.with_label_values(&[source]).inc();
        }
        // Overload protection reads queued prefill whatever the policy. A request that rides
        // on a pending prompt's prefill is queued as if it did not: the next request of a
        // burst must not find this replica cheaper for it.
        let shares_pending = held.is_some_and(|c| c.pending_tokens > c.cached_tokens);
        let prefill = (cost || self.overload.is_some()).then(|| {
            let uncached = shape.prompt_tokens().saturating_sub(cached);
            replica.queue_prompt(uncached, links, shares_pending)
        });
        Some(Choice {
            replica,
            route: decision.route,
            prefill,
            kv_tokens: shape.prompt_tokens(),
            predicted: Some(cached),
            predicted_exact: held.is_some_and(|c| c.cached_exact),
        })
    }

    /// Why no replica could take a request none was tried for. Under SGLang's handover a
    /// disaggregated model's decode servers refuse a request without a bootstrap room, so a
    /// request served whole (only chat and completions are handed over) needs a `plain` or
    /// `both` replica: where the model has none, say so.
    fn none_serves(&self, ctx: &Ctx) -> String {
        let protocol = self.conf.pd.protocol;
        let model = ctx.info.as_ref().and_then(|i| i.model.as_deref());
        let fleet = self.registry.all();
        let serving = || fleet.iter().filter(|r| model.is_none_or(|m| r.serves(m)));
        if protocol == crate::conf::pd::Protocol::Sglang
            && Registry::disaggregated(&fleet, model)
            && !serving().any(|r| r.role.serves_whole_by(protocol))
        {
            return "this model is served disaggregated over SGLang's protocol, whose decode \
                servers refuse a request without a bootstrap room; only chat and completions \
                are handed over, and no `plain` or `both` replica serves this model"
                .into();
        }
        "no live replica can serve this request".into()
    }

    /// The status and message a request that failed before any byte ends with; `None` when
    /// the client is gone. Messages name the replica and the reason, never its address.
    pub(super) fn final_answer(&self, e: &Error, ctx: &Ctx) -> Option<(u16, String)> {
        let code = failover::final_status(failure_of(e, Seen::Final))?;
        let replica = ctx.current().map_or("none", |r| &*r.id);
        let why = reason(e);
        Some(match (code, &ctx.stored_id) {
            // Only that replica has the response: say so, whatever broke.
            (502..=504, Some(id)) => {
                let owner = ctx.owner.as_ref().map_or(replica, |o| &*o.id);
                let message = format!(
                    "the stored response {id} is on replica {owner}, which is unavailable ({why}); no other replica has it"
                );
                (503, message)
            }
            // Every replica tried failed it: say what the last one did, not "none was live".
            (503, _) if ctx.current().is_none() => match &ctx.last_failure {
                Some((id, "http_503")) => (
                    503,
                    format!(
                        "replica {id} answered 503 and no other replica could take the request"
                    ),
                ),
                Some((id, why)) => (
                    503,
                    format!(
                        "no replica could serve this request: the last tried, {id}, failed ({why})"
                    ),
                ),
                None => (503, self.none_serves(ctx)),
            },
            (503, _) => {
                let message = format!(
                    "replica {replica} answered 503 and no other replica could take the request"
                );
                (503, message)
            }
            (504, _) => {
                let limit = self.conf.upstream.read_timeout;
                (
                    504,
                    format!("replica {replica} did not answer within {limit:?}"),
                )
            }
            (502, _) => (
                502,
                format!("replica {replica} failed before answering ({why})"),
            ),
            (400, _) => (400, format!("the request could not be read ({why})")),
            (code, _) => (code, format!("inferlb could not serve the request ({why})")),
        })
    }

    /// Applies a failed attempt's verdict: demotion, the failover count and log line, and
    /// whether Pingora tries again.
    pub(super) fn apply(&self, session: &Session, ctx: &mut Ctx, e: &mut Error, v: Verdict) {
        let replica = ctx.current().cloned();
        if let (true, Some(r)) = (v.demote, &replica) {
            r.demote();
        }
        match (v.retry, &replica) {
            (Retry::Elsewhere, Some(r)) => ctx.failed_over(
                r,
                reason(e),
                session.req_header().uri.path(),
                format_args!("demoted, retrying on another replica ({e})"),
            ),
            (Retry::Same, Some(r)) => {
                // Not tried in earnest: it may be chosen again.
                log::debug!("stale pooled connection to {}, retrying", r.id);
            }
            (Retry::No, Some(r)) => ctx.tried.push(r.clone()),
            _ => {}
        }
        e.set_retry(v.retry != Retry::No);
    }

    pub(super) fn failed(&self, session: &mut Session, ctx: &Ctx, failure: Failure) -> Failed {
        Failed {
            failure,
            client_got_bytes: session.response_written().is_some() || ctx.first_byte_at.is_some(),
            body_replayable: ctx.body.replayable(session),
            attempt: ctx.attempt.as_ref().map_or(0, |a| a.n),
            max_attempts: self.max_attempts,
            stateful: ctx.owner.is_some(),
        }
    }

    /// The request is over: count it, remember what was served, write the access log.
    pub(super) fn finish(&self, session: &Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        // Ending the attempt releases its counts now, not when Pingora drops the ctx.
        let served_by = ctx.current().cloned();
        if let Some(a) = &mut ctx.attempt {
            a.end();
        }
        let replica = served_by.as_ref().map_or("none", |r| &*r.id);
        let route = ctx.route().map_or("none", Route::as_str);
        if ctx.route().is_some() {
            METRICS
                .requests
                .with_label_values(&[replica, route, code_class(status)])
                .inc();
        }
        let served_whole = (e.is_none() || ctx.resumed) && (200..300).contains(&status);
        let key = ctx.info.as_ref().and_then(|i| i.shape.served_key());
        // Shared with the cluster at decision time already (see `choose`).
        if let (true, Some(r)) = (served_whole, served_by.as_ref()) {
            for key in key.into_iter().chain(ctx.session) {
                self.affinity.record(key, &r.id);
            }
        }
        if !log::log_enabled!(target: "access", log::Level::Info) {
            return;
        }
        let record = access::Record {
            request_id: ctx.id(),
            method: session.req_header().method.as_str(),
            path: session.req_header().uri.path(),
            model: ctx.info.as_ref().and_then(|i| i.model.as_deref()),
            route,
            replica,
            attempts: ctx.attempt.as_ref().map_or(0, |a| a.n),
            failovers: ctx.failovers,
            status,
            ttfb_ms: ctx
                .first_byte_at
                .map(|t| (t - ctx.arrived).as_secs_f64() * 1e3),
            duration_ms: ctx.arrived.elapsed().as_secs_f64() * 1e3,
            prompt_tokens: ctx.usage.map(|u| u.prompt_tokens),
            cached_tokens: ctx.usage.map(|u| u.cached_tokens),
            overload: ctx.overload.note,
            queue_ms: ctx.overload.waited.map(|w| w.as_secs_f64() * 1e3),
        };
        if let Some(line) = record.render(self.conf.access_log) {
            log::info!(target: "access", "{line}");
        }
    }
}
