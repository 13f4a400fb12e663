//! The legs before the client's first byte: each leg's replica chosen, tried, and failed over
//! (module docs of `pd` list the steps), until a decode's answer begins or nothing can serve.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::value::RawValue;

use super::{Begun, Plan, Tries};
use crate::conf::Protocol;
use crate::fleet::pool::Leg;
use crate::fleet::registry::Registry;
use crate::fleet::replica::{InFlight, Replica};
use crate::protocol::handover;
use crate::proxy::exchange::LegError;
use crate::proxy::Balancer;
use crate::routing::{self, Ask};
use crate::telemetry::metrics::METRICS;

impl Tries {
    fn failed(&mut self, leg: &'static str, r: &Arc<Replica>, e: &LegError) {
        let why = e.reason();
        // As on the proxy path: a refused connection, or a 502/503, demotes it.
        let demote = match e {
            LegError::Connect(_) => true,
            LegError::Answered(h, _) => {
                crate::proxy::failover::status_fails_over(h.status.as_u16())
            }
            _ => false,
        };
        if demote {
            r.demote();
        }
        METRICS.pd_legs.with_label_values(&[&r.id, leg, why]).inc();
        METRICS.failovers.with_label_values(&[&r.id, why]).inc();
        log::warn!("pd failover: {leg} replica={} reason={why}: {e}", r.id);
        self.failovers += 1;
        self.last = Some((r.id.clone(), why));
        match leg {
            "prefill" => self.prefill.push(r.clone()),
            // "decode", "local"
            _ => self.decode.push(r.clone()),
        }
    }
}

fn contains(list: &[Arc<Replica>], r: &Arc<Replica>) -> bool {
    list.iter().any(|t| Arc::ptr_eq(t, r))
}

/// Logged once per transition: no prefill replica was live for a disaggregated model.
static NO_PREFILL: AtomicBool = AtomicBool::new(false);

impl Balancer {
    /// The replica for a leg, not tried yet, and the tokens of the prompt it likely holds.
    pub(super) fn pick(
        &self,
        leg: Leg,
        plan: &Plan,
        tried: &[Arc<Replica>],
    ) -> Option<(Arc<Replica>, u64)> {
        let fleet = self.registry.all();
        let model = plan.model.as_deref();
        let candidates = Registry::candidates_for(leg, &fleet, tried, model, plan.prompt());
        let served_by = |h| self.affinity.served_by(h);
        let shape = &plan.shape;
        let tick = plan.tick.wrapping_add(tried.len() as u64);
        let chosen = match leg {
            Leg::Decode => {
                let available: Vec<_> = candidates.iter().filter(|c| c.available).collect();
                if available.is_empty() {
                    return None;
                }
                let ask = Ask {
                    shape,
                    session: plan.session,
                    served_by: &served_by,
                    tick,
                };
                let home = routing::prefill_cost::home(&ask);
                let home = home.as_ref().map(|(id, t)| (&**id, *t));
                routing::pd::choose_decode(plan.prompt_tokens, home, &available, tick).id
            }
            _ => {
                self.policy
                    .decide(shape, plan.session, &candidates, &served_by, tick)?
                    .replica
            }
        };
        let held = candidates
            .iter()
            .find(|c| c.id == chosen)
            .map_or(0, |c| c.cached_tokens);
        let r = fleet.iter().find(|r| *r.id == *chosen)?.clone();
        Some((r, held))
    }

    /// The legs, until a decode's answer begins, or the request cannot be handed over.
    pub(super) async fn begin(&self, plan: &Plan, tries: &mut Tries) -> Begun {
        let mut params: Option<(Box<RawValue>, Arc<Replica>)> = None;
        let mut decode = Some(plan.decode.clone());
        // The decode replica chosen counts this request in flight from its choice on, through
        // the prefill leg (no other turn takes it for idle meanwhile), and its decode leg
        // takes that place over.
        // A decode replica chosen on failover is held the same way, from its pass's start.
        let mut held = Some(plan.decode.start());
        if plan.local.is_some() {
            // Served whole on its decode replica; if that fails before the first token, the
            // turn goes through the pools on another one.
            let d = plan.decode.clone();
            let queued = d.queue_prefill(plan.lacking);
            match self
                .decode_leg(plan, (&d, place(&mut held, &d)), plan.body.clone(), "local")
                .await
            {
                Ok(mut s) => {
                    s.local = Some(queued);
                    return Begun::Started(s);
                }
                Err(e) if e.is_refusal() => return refused(d, e),
                Err(e) => {
                    tries.failed("local", &d, &e);
                    // A `both` replica that failed is not asked to prefill it either: its
                    // prefill failed (no token came).
                    if d.role.prefills() {
                        tries.prefill.push(d.clone());
                    }
                    decode = None;
                }
            }
        }
        // Each pass is one leg or two: bounded by the attempts a request is allowed, twice.
        for _ in 0..self.max_attempts.saturating_mul(2).max(2) {
            let d = match decode.take().filter(|d| !contains(&tries.decode, d)) {
                Some(d) => d,
                None => match self.pick(Leg::Decode, plan, &tries.decode) {
                    Some((d, _)) => d,
                    None => {
                        return Begun::Failed(503, no_replica_left("decode", tries.last.as_ref()))
                    }
                },
            };
            if !held.as_ref().is_some_and(|c| Arc::ptr_eq(c.replica(), &d)) {
                held = Some(d.start());
            }
            if params.is_none() || plan.protocol == Protocol::Sglang {
                let Some((p, cached)) = self.pick(Leg::Prefill, plan, &tries.prefill) else {
                    // A prefill failed: a prefill leg, the pull of its KV, or a local turn on a
                    // `both` replica (before its first token: in its prefill).
                    let failed = !tries.prefill.is_empty();
                    if !failed && !NO_PREFILL.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "pd: no prefill replica live for {}: serving whole on decode replicas (an SGLang pool answers 503: its decode servers serve nothing whole)",
                            plan.model.as_deref().unwrap_or("the model")
                        );
                    }
                    // Not on an SGLang decode server, which refuses it.
                    if !d.role.serves_whole_by(plan.protocol) {
                        return if failed {
                            Begun::Failed(502, no_replica_left("prefill", tries.last.as_ref()))
                        } else {
                            Begun::Failed(
                                503,
                                "no prefill replica is live, and an SGLang decode server serves no request whole"
                                    .into(),
                            )
                        };
                    }
                    // Every prefill replica failed this request, or none is live: served
                    // whole, not lost.
                    let reason = if failed {
                        "prefill_failed"
                    } else {
                        "no_prefill_live"
                    };
                    return Begun::Whole(d, reason);
                };
                if NO_PREFILL.load(Ordering::Relaxed) && NO_PREFILL.swap(false, Ordering::Relaxed) {
                    log::info!("pd: a prefill replica is live again");
                }
                if Arc::ptr_eq(&p, &d) {
                    // A `both` replica chosen for both legs serves the request whole.
                    return Begun::Whole(d, "same_replica");
                }
                if plan.protocol == Protocol::Sglang {
                    match self
                        .sglang_pair(plan, &p, cached, (&d, place(&mut held, &d)))
                        .await
                    {
                        Ok(s) => return Begun::Started(s),
                        Err((leg, e)) if e.is_refusal() => {
                            let r = if leg == "prefill" { p } else { d };
                            return refused(r, e);
                        }
                        Err((leg, e)) => {
                            tries.failed(leg, if leg == "prefill" { &p } else { &d }, &e);
                            if leg == "prefill" {
                                decode = Some(d);
                            }
                            continue;
                        }
                    }
                }
                match self.prefill_leg(plan, &p, cached).await {
                    Ok(k) => params = Some((k, p)),
                    Err(LegError::NoParams) => {
                        log::warn!("pd: prefill replica {} answered without kv_transfer_params (no KV connector?): serving whole", p.id);
                        return Begun::Whole(d, "no_handover");
                    }
                    Err(e) if e.is_refusal() => return refused(p, e),
                    Err(e) => {
                        tries.failed("prefill", &p, &e);
                        decode = Some(d);
                        continue;
                    }
                }
            }
            let Some((k, p)) = &params else { continue };
            let body = match handover::vllm_decode(&plan.body, k) {
                Ok(b) => b,
                Err(_) => return Begun::Whole(d, "no_handover"),
            };
            match self
                .decode_leg(plan, (&d, place(&mut held, &d)), body, "decode")
                .await
            {
                Ok(mut s) => {
                    s.prefill = Some(p.clone());
                    return Begun::Started(s);
                }
                Err(e) if e.is_refusal() => return refused(d, e),
                Err(e @ LegError::Connect(_)) => {
                    // Nothing reached it: the same params go to another decode replica.
                    tries.failed("decode", &d, &e);
                }
                Err(e) => {
                    // It may have pulled (or failed to): a fresh prefill, another decode.
                    // The pull may have failed on the prefill's side (its lease, its
                    // transfer), so that prefill replica is not asked again either.
                    tries.failed("decode", &d, &e);
                    tries.prefill.push(p.clone());
                    params = None;
                }
            }
        }
        Begun::Failed(
            502,
            no_replica_left("prefill or decode", tries.last.as_ref()),
        )
    }
}

/// The decode replica's place in flight for its leg: the one held for it since its choice,
/// or a new one.
fn place(held: &mut Option<InFlight>, d: &Arc<Replica>) -> InFlight {
    held.take()
        .filter(|c| Arc::ptr_eq(c.replica(), d))
        .unwrap_or_else(|| d.start())
}

fn refused(r: Arc<Replica>, e: LegError) -> Begun {
    match e {
        LegError::Answered(h, body) => Begun::Refused(r, h, body),
        _ => Begun::Failed(502, "a leg failed".into()),
    }
}

fn no_replica_left(leg: &str, last: Option<&(Arc<str>, &'static str)>) -> String {
    match last {
        Some((id, why)) => format!(
            "no {leg} replica could serve this request: the last tried, {id}, failed ({why})"
        ),
        None => format!("no live {leg} replica can serve this request"),
    }
}
