//! A disaggregated request's life: the decode replica chosen first (what it lacks of the
//! prompt decides whether the turn needs the prefill pool at all), then the legs, each failing
//! over on its own, all before the client sees a byte; then the decode's answer streamed to
//! the client.
//!
//! Both legs are inferlb's own exchanges (not Pingora's proxy loop): a decode stream's first
//! event may be the error of a failed KV pull, after a 200 header, and that must not reach the
//! client while another prefill and decode can still serve it. So the header and the events
//! before the first token are held, and passed on once a token comes.
//!
//! Failover, step by step (nothing has reached the client in any of them):
//! - a prefill that fails (connect, 5xx, timeout) goes to another prefill replica;
//! - a decode that cannot be connected to goes to another decode replica with the same
//!   `kv_transfer_params` (the prefill's blocks are held under a lease);
//! - a decode that answers 5xx, or whose stream errs before its first token, gets a fresh
//!   prefill and another decode;
//! - a client that hangs up between the legs drops them: the replicas see their connections
//!   close and abort. An aborted prefill frees its blocks at once, and so does an aborted
//!   decode (vLLM's decode side tells its prefill); in the moment between the prefill's
//!   answer and the decode leg's start, its blocks wait for their lease to end.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::{Error, ErrorType};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use serde_json::value::RawValue;

mod exchange;

use exchange::{read_all, release, LegCtx, LegError};

use super::attempt::{Attempt, Choice};
use super::{answers, Balancer, Ctx};
use crate::cluster::Table;
use crate::conf::Protocol;
use crate::fleet::blocks::PromptTokens;
use crate::fleet::pool::Leg;
use crate::fleet::registry::Registry;
use crate::fleet::replica::{HeldKv, InFlight, Prompt, Replica};
use crate::protocol::api::prompt::Link;
use crate::protocol::api::shape::Shape;
use crate::protocol::api::Family;
use crate::protocol::handover::{self, Start, StreamStart};
use crate::protocol::usage::UsageReader;
use crate::routing::{self, Ask, Route};
use crate::telemetry::metrics::METRICS;

/// What a disaggregated request holds until it ends: the decode's place and KV, and an
/// SGLang prefill leg still finishing its answer (dropped with the request, which cancels it).
#[derive(Default)]
pub struct Held {
    _kv: Option<HeldKv>,
    _prefill_leg: Option<Background>,
    /// A turn served whole on its decode replica, for a warm copy once it was answered.
    warm: Option<Box<Plan>>,
}

/// A spawned leg, aborted when dropped.
struct Background(tokio::task::JoinHandle<Result<(), LegError>>);

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a request needs for its legs, taken from its ctx.
struct Plan {
    family: Family,
    protocol: Protocol,
    header: RequestHeader,
    body: Bytes,
    links: Vec<Link>,
    /// The prompt's token ids, when its model has a tokenizer.
    tokens: Option<Arc<PromptTokens>>,
    shape: Shape,
    prompt_tokens: u64,
    model: Option<String>,
    request_id: http::HeaderValue,
    session: Option<u64>,
    /// The request's draw of the balancer's counter: it breaks ties (each leg's choice adds
    /// the legs tried before it, so that a retry among equals moves on).
    tick: u64,
    /// The decode replica chosen first.
    decode: Arc<Replica>,
}

impl Plan {
    fn prompt(&self) -> Prompt<'_> {
        Prompt {
            links: &self.links,
            tokens: self.tokens.as_deref(),
        }
    }
}

/// A decode leg that began: its answer's header and what came before the first token.
struct Started {
    decode: Arc<Replica>,
    prefill: Option<Arc<Replica>>,
    session: HttpSession,
    header: Box<ResponseHeader>,
    held: Vec<Bytes>,
    in_flight: InFlight,
    kv: HeldKv,
    prefill_leg: Option<Background>,
}

/// What the legs before the client's first byte came to.
enum Begun {
    Started(Box<Started>),
    /// A leg's 4xx: the client gets it as the replica wrote it.
    Refused(Arc<Replica>, Box<ResponseHeader>, Bytes),
    /// Served whole on this replica through the proxy, for this reason.
    Whole(Arc<Replica>, &'static str),
    /// Nothing could serve it.
    Failed(u16, String),
}

/// What the legs' failures leave for the request's record.
#[derive(Default)]
struct Tries {
    prefill: Vec<Arc<Replica>>,
    decode: Vec<Arc<Replica>>,
    failovers: u32,
    last: Option<(Arc<str>, &'static str)>,
}

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
    /// Serves a request for a disaggregated model through its pools. `Ok(true)` when it was
    /// answered here; `Ok(false)` when it goes on through the proxy, served whole (on the
    /// replica `ctx.forced` names, when one was chosen).
    pub(super) async fn disaggregate(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> pingora_core::Result<bool> {
        let Some(plan) = self.plan(session, ctx) else {
            return Ok(false);
        };
        // The decode replica counts this request in flight from its choice on, through the
        // prefill leg: no other turn takes it for idle meanwhile.
        let chosen = plan.decode.start();
        // Its prefill is counted on the replicas it goes to from here, not as in transit.
        ctx.overload.routed();
        let tail_pending = ctx.body.tail_pending(session);
        let mut tries = Tries {
            decode: ctx.tried.clone(),
            ..Tries::default()
        };
        let begun = {
            let downstream = session.as_downstream_mut();
            // The whole body is read: the next read ends only when the client hangs up. A
            // large chunked body's terminator is still Pingora's to read: then, as in the
            // overload queue, the hang-up goes unwatched until the answer is written.
            let gone = async {
                if tail_pending || downstream.read_body_or_idle(true).await.is_ok() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                b = self.begin(&plan, &mut tries) => Some(b),
                _ = gone => None,
            }
        };
        drop(chosen);
        ctx.failovers += tries.failovers;
        if tries.last.is_some() {
            ctx.last_failure = tries.last.take();
        }
        // A chunked terminator still on the wire: this connection is not reused. Leaving (an
        // upgrade): as on the proxy path, the client's next request goes to the new process.
        if tail_pending || self.leaving.load(Ordering::Relaxed) {
            session.set_keepalive(None);
        }
        let Some(begun) = begun else {
            log::info!(
                "pd: client of {} left before its answer began: legs cancelled",
                ctx.id()
            );
            session.set_keepalive(None);
            return Ok(true);
        };
        match begun {
            Begun::Whole(replica, reason) => {
                METRICS.pd_whole.with_label_values(&[reason]).inc();
                ctx.forced = Some((replica, Route::PdLocal));
                ctx.tried = tries.decode;
                Ok(false)
            }
            Begun::Failed(status, message) => {
                answers::respond_error(session, ctx.id(), ctx.family, status, &message).await?;
                Ok(true)
            }
            Begun::Refused(replica, header, body) => {
                ctx.attempt = Some(Attempt::start(
                    1,
                    Choice {
                        replica: replica.clone(),
                        route: Route::Pd,
                        prefill: None,
                        // A refusal holds nothing.
                        kv_tokens: 0,
                        predicted: 0,
                        predicted_exact: false,
                    },
                ));
                let resp =
                    self.client_header(&header, ctx, (&replica, Route::Pd), None, Some(body.len()));
                session.write_response_header(resp, false).await?;
                session.write_response_body(Some(body), true).await?;
                Ok(true)
            }
            Begun::Started(s) => {
                self.stream(session, ctx, &plan, *s).await?;
                Ok(true)
            }
        }
    }

    /// The plan for a request that goes through the pools, or `None` when it is served whole:
    /// its model is not disaggregated, its API is not handed over by the pool's protocol, or
    /// its decode replica lacks so little of the prompt that it prefills it (`ctx.forced`).
    fn plan(&self, session: &Session, ctx: &mut Ctx) -> Option<Plan> {
        let info = ctx.info.as_ref()?;
        let req = session.req_header();
        let protocol = self.conf.pd.protocol;
        let handed_over = req.method == http::Method::POST
            && ctx.owner.is_none()
            && info.previous_response_id.is_none()
            // The balancer's Responses store reads the answer as the proxy path passes it.
            && ctx.conversation.is_none()
            && handed_over_by(protocol, req.uri.path());
        let fleet = self.registry.all();
        let model = info.model.as_deref();
        if !handed_over || !Registry::disaggregated(&fleet, model) {
            return None;
        }
        let shape = &info.shape;
        let links = shape.links();
        let prompt = Prompt {
            links,
            tokens: ctx.tokens.as_deref(),
        };
        let candidates = Registry::candidates_for(Leg::Decode, &fleet, &ctx.tried, model, prompt);
        let available: Vec<_> = candidates.iter().filter(|c| c.available).collect();
        if available.is_empty() {
            return None;
        }
        let served_by = |h| self.affinity.served_by(h);
        let ask = Ask {
            shape,
            session: ctx.session,
            served_by: &served_by,
            tick: self.registry.tick(),
        };
        let home = routing::prefill_cost::home(&ask);
        let home = home.as_ref().map(|(id, t)| (&**id, *t));
        let prompt = shape.prompt_tokens();
        let chosen = routing::pd::choose_decode(prompt, home, &available, ask.tick);
        let uncached = prompt.saturating_sub(routing::pd::held(chosen, home));
        let decode = fleet.iter().find(|r| *r.id == *chosen.id)?.clone();
        let idle = chosen.running == 0 && chosen.in_flight == 0 && chosen.queued_tokens == 0;
        let local = routing::pd::Local {
            tokens: self.conf.pd.local_prefill_tokens,
            idle_tokens: self.conf.pd.local_prefill_idle_tokens,
        };
        // Not an SGLang decode server, which refuses it (`Role::serves_whole_by`).
        let whole = decode.role.serves_whole_by(protocol);
        let plan = Plan {
            family: ctx.family,
            protocol,
            header: req.clone(),
            body: ctx.body.bytes().clone(),
            links: links.to_vec(),
            tokens: ctx.tokens.clone(),
            shape: shape.clone(),
            prompt_tokens: prompt,
            model: info.model.clone(),
            request_id: ctx.request_id.clone(),
            session: ctx.session,
            tick: ask.tick,
            decode,
        };
        if whole && routing::pd::path(uncached, idle, local) == routing::pd::Path::Local {
            let reason = if uncached < local.tokens {
                "small_uncached"
            } else {
                "idle_decode"
            };
            METRICS.pd_whole.with_label_values(&[reason]).inc();
            ctx.forced = Some((plan.decode.clone(), Route::PdLocal));
            if protocol == Protocol::Vllm && self.conf.pd.warm_prefill {
                ctx.pd.warm = Some(Box::new(plan));
            }
            return None;
        }
        Some(plan)
    }

    /// At a request's end: a turn served whole on its decode replica and answered is
    /// prefilled again on the prefill replica a handover would take, when that replica is idle
    /// and lags (`routing::pd::warm_prefill`): one token, not streamed, and no
    /// `kv_transfer_params`, so it holds no blocks for a decode. It runs apart, bounded by the
    /// prefill timeout, once the client has its answer (its body and its reply are not
    /// worked on beside the answer's stream), and its usage is no one's.
    pub(super) fn warm_prefill(&self, pd: &mut Held, answered: bool) {
        let Some(plan) = pd.warm.take().filter(|_| answered) else {
            return;
        };
        let Some((p, held)) = self.pick(Leg::Prefill, &plan, &[]) else {
            return;
        };
        let lacking = plan.prompt_tokens.saturating_sub(held);
        let idle = p.running() == 0 && p.in_flight_everywhere() == 0 && p.queued_tokens() == 0;
        let local = routing::pd::Local {
            tokens: self.conf.pd.local_prefill_tokens,
            idle_tokens: self.conf.pd.local_prefill_idle_tokens,
        };
        // A `both` replica serving the turn holds it already.
        if Arc::ptr_eq(&p, &plan.decode) || !routing::pd::warm_prefill(lacking, idle, local) {
            return;
        }
        let Ok(body) = handover::vllm_warm(plan.family, &plan.body) else {
            return;
        };
        // Its own id: the replica may still be running the turn's id of another request.
        let Ok(request_id) = http::HeaderValue::from_str(&format!(
            "{}-warm",
            plan.request_id.to_str().unwrap_or("")
        )) else {
            return;
        };
        let limit = self.conf.pd.prefill_timeout;
        let legs = self.leg_ctx(limit);
        // Counted on the replica before the next request looks: it is busy from here.
        let flight = p.start();
        let queued = p.queue_prefill(lacking);
        tokio::spawn(async move {
            let _flight = flight;
            let leg = async {
                let (header, mut s) = legs
                    .exchange_keep(&p, &plan.header, &request_id, body)
                    .await?;
                let answer = read_all(&mut s, limit).await?;
                release(s, &p).await;
                if !header.status.is_success() {
                    return Err(LegError::Answered(header, answer));
                }
                Ok(())
            };
            let outcome = match tokio::time::timeout(limit, leg).await {
                Ok(Ok(())) => {
                    queued.prefilled(&plan.links);
                    "ok"
                }
                Ok(Err(e)) => {
                    if matches!(e, LegError::Connect(_)) {
                        p.demote();
                    }
                    log::info!("pd: warm prefill on {} failed: {e}", p.id);
                    e.reason()
                }
                Err(_) => "broken",
            };
            METRICS
                .pd_legs
                .with_label_values(&[&p.id, "warm", outcome])
                .inc();
        });
    }

    /// The replica for a leg, not tried yet, and the tokens of the prompt it likely holds.
    fn pick(&self, leg: Leg, plan: &Plan, tried: &[Arc<Replica>]) -> Option<(Arc<Replica>, u64)> {
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
    async fn begin(&self, plan: &Plan, tries: &mut Tries) -> Begun {
        let mut params: Option<(Box<RawValue>, Arc<Replica>)> = None;
        let mut decode = Some(plan.decode.clone());
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
            if params.is_none() || plan.protocol == Protocol::Sglang {
                let Some((p, held)) = self.pick(Leg::Prefill, plan, &tries.prefill) else {
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
                    match self.sglang_pair(plan, &p, held, &d).await {
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
                match self.prefill_leg(plan, &p, held).await {
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
            match self.decode_leg(plan, &d, body).await {
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

    /// SGLang: both legs at once, meeting in a fresh bootstrap room on the prefill server.
    async fn sglang_pair(
        &self,
        plan: &Plan,
        p: &Arc<Replica>,
        held: u64,
        d: &Arc<Replica>,
    ) -> Result<Box<Started>, (&'static str, LegError)> {
        let Some(boot) = p.endpoint.bootstrap else {
            let e = LegError::Connect(format!("prefill replica {} has no bootstrap_port", p.id));
            return Err(("prefill", e));
        };
        let room = bootstrap_room(&plan.request_id);
        let body = handover::sglang_legs(&plan.body, &boot.ip().to_string(), boot.port(), room)
            .map_err(|_| ("prefill", LegError::NoParams))?;
        let prefill = {
            let (this, plan_header, body, p) = (
                self.leg_ctx(self.conf.pd.prefill_timeout),
                plan.header.clone(),
                body.clone(),
                p.clone(),
            );
            let links = plan.links.clone();
            let request_id = plan.request_id.clone();
            let prompt_tokens = plan.prompt_tokens;
            let limit = self.conf.pd.prefill_timeout;
            tokio::spawn(async move {
                let _flight = p.start();
                let queued = p.queue_prefill(prompt_tokens.saturating_sub(held));
                let leg = this.exchange(&p, &plan_header, &request_id, body);
                let (status, answer) = tokio::time::timeout(limit, leg)
                    .await
                    .map_err(|_| LegError::Broken("the prefill did not end in time".into()))??;
                if !status.status.is_success() {
                    return Err(LegError::Answered(status, answer));
                }
                queued.prefilled(&links);
                Ok(())
            })
        };
        let mut prefill = Background(prefill);
        let decode = self.decode_leg(plan, d, body);
        tokio::pin!(decode);
        tokio::select! {
            r = &mut decode => {
                let mut s = r.map_err(|e| ("decode", e))?;
                s.prefill = Some(p.clone());
                s.prefill_leg = Some(prefill);
                Ok(s)
            }
            r = &mut prefill.0 => {
                // The prefill ended first: failed, the decode waits in vain; else it goes on.
                match r {
                    Ok(Ok(())) => {
                        let mut s = decode.await.map_err(|e| ("decode", e))?;
                        s.prefill = Some(p.clone());
                        Ok(s)
                    }
                    Ok(Err(e)) => Err(("prefill", e)),
                    Err(join) => Err(("prefill", LegError::Broken(join.to_string()))),
                }
            }
        }
    }

    /// What a leg's exchange needs; `read_timeout` bounds each read of its answer.
    fn leg_ctx(&self, read_timeout: Duration) -> LegCtx {
        LegCtx {
            read_timeout,
            networks: self.conf.admin.allowed_networks.clone(),
        }
    }

    /// The vLLM prefill leg: one token, not streamed; its answer's `kv_transfer_params`.
    async fn prefill_leg(
        &self,
        plan: &Plan,
        p: &Arc<Replica>,
        held: u64,
    ) -> Result<Box<RawValue>, LegError> {
        let body =
            handover::vllm_prefill(plan.family, &plan.body).map_err(|_| LegError::NoParams)?;
        let _flight = p.start();
        let queued = p.queue_prefill(plan.prompt_tokens.saturating_sub(held));
        let leg = async {
            // The prefill's first (and only) token may take as long as the prefill: its
            // reads are bounded by the prefill's own timeout, the whole by the same below.
            let limit = self.conf.pd.prefill_timeout;
            let (header, mut s) = self
                .leg_ctx(limit)
                .exchange_keep(p, &plan.header, &plan.request_id, body)
                .await?;
            let answer = read_all(&mut s, limit).await?;
            release(s, p).await;
            Ok::<_, LegError>((header, answer))
        };
        let (header, answer) = tokio::time::timeout(self.conf.pd.prefill_timeout, leg)
            .await
            .map_err(|_| LegError::Broken("the prefill did not end in time".into()))??;
        if !header.status.is_success() {
            return Err(LegError::Answered(header, answer));
        }
        let params = handover::vllm_params(&answer).ok_or(LegError::NoParams)?;
        METRICS
            .pd_legs
            .with_label_values(&[&p.id, "prefill", "ok"])
            .inc();
        queued.prefilled(&plan.links);
        Ok(params)
    }

    /// A decode leg up to its first token (or its whole answer when it does not stream).
    async fn decode_leg(
        &self,
        plan: &Plan,
        d: &Arc<Replica>,
        body: Bytes,
    ) -> Result<Box<Started>, LegError> {
        let in_flight = d.start();
        let kv = d.hold_kv(plan.prompt_tokens);
        let (header, mut s) = self
            .leg_ctx(self.conf.upstream.read_timeout)
            .exchange_keep(d, &plan.header, &plan.request_id, body)
            .await?;
        if !header.status.is_success() {
            let answer = read_all(&mut s, self.conf.upstream.read_timeout)
                .await
                .unwrap_or_default();
            return Err(LegError::Answered(header, answer));
        }
        let sse = header
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let mut held = Vec::new();
        if sse {
            let mut start = StreamStart::default();
            loop {
                let chunk =
                    tokio::time::timeout(self.conf.upstream.read_timeout, s.read_response_body())
                        .await
                        .map_err(|_| LegError::Broken("no first token in time".into()))?
                        .map_err(|e| LegError::Broken(e.to_string()))?;
                let Some(chunk) = chunk else {
                    // Ended with nothing generated (a Responses stream whose pull failed
                    // breaks off after its preamble): nothing of it reached the client.
                    return Err(LegError::Broken("the stream ended before a token".into()));
                };
                let verdict = start.feed(&chunk);
                held.push(chunk);
                match verdict {
                    Start::Held => {}
                    Start::Flowing => break,
                    Start::Failed => return Err(LegError::StreamFailed),
                }
            }
        }
        METRICS
            .pd_legs
            .with_label_values(&[&d.id, "decode", "ok"])
            .inc();
        Ok(Box::new(Started {
            decode: d.clone(),
            prefill: None,
            session: s,
            header,
            held,
            in_flight,
            kv,
            prefill_leg: None,
        }))
    }

    /// The client's answer: the decode's header and what was held, then the rest as it comes.
    async fn stream(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        plan: &Plan,
        s: Started,
    ) -> pingora_core::Result<()> {
        let Started {
            decode,
            prefill,
            session: mut upstream,
            header,
            held,
            in_flight,
            kv,
            prefill_leg,
        } = s;
        drop(in_flight);
        let pulled = plan
            .prompt_tokens
            .saturating_sub(decode.cache.likely_cached(plan.prompt()).0);
        METRICS
            .pd_pull_tokens
            .with_label_values(&[&decode.id])
            .inc_by(pulled);
        // Other instances learn the conversation's decode replica now.
        if let (Some(c), Some(info)) = (&self.cluster, &ctx.info) {
            for key in info.shape.served_key().into_iter().chain(ctx.session) {
                c.pin(Table::Affinity, key, &decode.id);
            }
        }
        let n = ctx.attempt.as_ref().map_or(0, |a| a.n) + 1;
        ctx.attempt = Some(Attempt::start(
            n,
            Choice {
                replica: decode.clone(),
                route: Route::Pd,
                // Nothing to prefill there: the guard records the prompt in its index once
                // the first token passes (it pulled the KV).
                prefill: Some(decode.queue_prefill(0)),
                // Held by the decode leg's own guard (`Held::_kv`).
                kv_tokens: 0,
                predicted: 0,
                predicted_exact: false,
            },
        ));
        ctx.pd = Held {
            _kv: Some(kv),
            _prefill_leg: prefill_leg,
            warm: None,
        };
        let length = header
            .headers
            .get("content-length")
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        let sse = header
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        ctx.usage_reader = Some(UsageReader::new(ctx.family, sse));
        let resp = self.client_header(
            &header,
            ctx,
            (&decode, Route::Pd),
            prefill.as_ref(),
            length.filter(|_| !sse),
        );
        session.write_response_header(resp, false).await?;
        for chunk in held {
            self.observe_response(Some(&chunk), false, ctx);
            if session
                .write_response_body(Some(chunk), false)
                .await
                .is_err()
            {
                return Err(client_left());
            }
        }
        let read_timeout = self.conf.upstream.read_timeout;
        loop {
            let next = tokio::time::timeout(read_timeout, upstream.read_response_body()).await;
            match next {
                Ok(Ok(Some(chunk))) => {
                    self.observe_response(Some(&chunk), false, ctx);
                    if session
                        .write_response_body(Some(chunk), false)
                        .await
                        .is_err()
                    {
                        // The client left: the decode's connection closes with this request.
                        return Err(client_left());
                    }
                }
                Ok(Ok(None)) => {
                    self.observe_response(None, true, ctx);
                    session.write_response_body(None, true).await?;
                    release(upstream, &decode).await;
                    return Ok(());
                }
                Ok(Err(e)) => {
                    // Cut after the first byte: never retried. As on the proxy path,
                    // `fail_to_proxy` ends a stream with its API's error event and leaves
                    // the body unterminated, so the client sees it cut, never complete.
                    return Err(e.into_up());
                }
                Err(_) => {
                    let why = format!("replica {} went silent for {read_timeout:?}", decode.id);
                    return Err(Error::explain(ErrorType::ReadTimedout, why).into_up());
                }
            }
        }
    }

    /// The client's header from a leg's: its status and content headers, inferlb's own.
    fn client_header(
        &self,
        upstream: &ResponseHeader,
        ctx: &Ctx,
        (replica, route): (&Replica, Route),
        prefill: Option<&Arc<Replica>>,
        length: Option<usize>,
    ) -> Box<ResponseHeader> {
        let mut resp = ResponseHeader::build(upstream.status, Some(upstream.headers.len() + 5))
            .expect("a status from a parsed header");
        for (name, value) in upstream.headers.iter() {
            let n = name.as_str();
            let framing = matches!(
                n,
                "content-length"
                    | "transfer-encoding"
                    | "connection"
                    | "keep-alive"
                    | "te"
                    | "trailer"
                    | "upgrade"
                    | "proxy-connection"
            );
            if !framing {
                let _ = resp.append_header(name.clone(), value.clone());
            }
        }
        let _ = match length {
            Some(n) => resp.insert_header("content-length", n.to_string()),
            None => resp.insert_header("transfer-encoding", "chunked"),
        };
        let _ = resp.insert_header("x-inferlb-replica", &*replica.id);
        if let Some(p) = prefill {
            let _ = resp.insert_header("x-inferlb-prefill", &*p.id);
        }
        let _ = resp.insert_header("x-inferlb-route", route.as_str());
        let _ = resp.insert_header("x-request-id", ctx.request_id.clone());
        Box::new(resp)
    }
}

/// The client went away while its answer was being written.
fn client_left() -> Box<Error> {
    Error::explain(ErrorType::WriteError, "the client left during the answer").into_down()
}

/// The APIs each protocol disaggregates (vLLM 0.33 takes `kv_transfer_params` on all four;
/// SGLang's bootstrap, on chat and completions); anything else is served whole.
pub fn handed_over_by(protocol: Protocol, path: &str) -> bool {
    matches!(
        (protocol, path),
        (_, "/v1/chat/completions" | "/v1/completions")
            | (Protocol::Vllm, "/v1/responses" | "/v1/messages")
    )
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

/// A room number no other request of this process or another uses at once.
fn bootstrap_room(request_id: &http::HeaderValue) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(request_id.as_bytes());
    h.update(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.update(&t.to_le_bytes());
    // SGLang reads the room as a signed 64-bit integer in places: keep it positive.
    h.digest() >> 1
}
