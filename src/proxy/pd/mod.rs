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
//!
//! Here the plan (which decode replica, whether the pools are needed at all); `begin` the legs
//! and their failover; `legs` each leg's exchange; `answer` the client's stream; `warm` the
//! prefill pool's copy of a turn served whole. The HTTP of each leg is
//! [`crate::proxy::exchange`]'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use pingora_core::protocols::http::client::HttpSession;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

mod answer;
mod begin;
mod legs;
mod warm;

use super::attempt::{Attempt, Choice};
use super::exchange::LegError;
use super::{answers, Balancer, Ctx};
use crate::conf::Protocol;
use crate::fleet::chain::PromptTokens;
use crate::fleet::pool::Leg;
use crate::fleet::registry::Registry;
use crate::fleet::replica::{HeldKv, InFlight, Prompt, QueuedPrefill, Replica};
use crate::protocol::api::prompt::Link;
use crate::protocol::api::shape::Shape;
use crate::protocol::api::Family;
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
    /// Why the turn is served whole on `decode` (a `pd_whole` reason), which prefills what it
    /// lacks itself; `None` when it goes through the pools.
    local: Option<&'static str>,
    /// The prompt's tokens `decode` likely lacks (its home, the conversation's last replica,
    /// counted as holding the history).
    lacking: u64,
    /// The prompt's tokens `decode`'s cache model holds, and whether its KV events said so:
    /// the prediction a turn served whole there is checked against.
    cached: u64,
    cached_exact: bool,
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
    /// A turn served whole on the decode replica: its prefill, queued there.
    local: Option<QueuedPrefill>,
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

impl Balancer {
    /// Serves a request for a disaggregated model: through its pools, or whole on its decode
    /// replica. `Ok(true)` when it was answered here; `Ok(false)` when it goes on through the
    /// proxy, served whole (on the replica `ctx.forced` names, when one was chosen).
    pub(super) async fn disaggregate(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> pingora_core::Result<bool> {
        let Some(plan) = self.plan(session, ctx) else {
            return Ok(false);
        };
        let route = match plan.local {
            Some(_) => Route::PdLocal,
            None => Route::Pd,
        };
        // Its prefill is counted on the replicas it goes to from here, not as in transit.
        ctx.overload.routed();
        let tail_pending = ctx.body.tail_pending(session);
        let mut tries = Tries {
            decode: ctx.tried.clone(),
            ..Tries::default()
        };
        let begun = super::exchange::unless_client_leaves(
            session,
            tail_pending,
            self.begin(&plan, &mut tries),
        )
        .await;
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
                        route,
                        prefill: None,
                        // A refusal holds nothing.
                        kv_tokens: 0,
                        predicted: None,
                        predicted_exact: false,
                    },
                ));
                let resp =
                    self.client_header(&header, ctx, (&replica, route), None, Some(body.len()));
                session.write_response_header(resp, false).await?;
                session.write_response_body(Some(body), true).await?;
                Ok(true)
            }
            Begun::Started(s) => {
                let local = s.local.is_some();
                if let (true, Some(reason)) = (local, plan.local) {
                    METRICS.pd_whole.with_label_values(&[reason]).inc();
                }
                self.stream(session, ctx, &plan, *s).await?;
                if local && plan.protocol == Protocol::Vllm && self.conf.pd.warm_prefill {
                    ctx.pd.warm = Some(Box::new(plan));
                }
                Ok(true)
            }
        }
    }

    /// The plan for a request of a disaggregated pool, or `None` when it goes through the proxy:
    /// its model is not disaggregated, or its API is not handed over by the pool's protocol.
    /// A decode replica that lacks so little of the prompt that it prefills it serves the turn
    /// whole (`Plan::local`).
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
            local: None,
            lacking: uncached,
            cached: chosen.cached_tokens,
            cached_exact: chosen.cached_exact,
        };
        if whole && routing::pd::path(uncached, idle, local) == routing::pd::Path::Local {
            let reason = if uncached < local.tokens {
                "small_uncached"
            } else {
                "idle_decode"
            };
            // Served here, not through the proxy: its answer's header is held until the first
            // token, so a replica lost during the prefill fails over like a decode leg.
            return Some(Plan {
                local: Some(reason),
                ..plan
            });
        }
        Some(plan)
    }
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
