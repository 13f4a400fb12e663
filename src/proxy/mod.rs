//! The `ProxyHttp` impl: the request's life in hook order. Each hook delegates: the body to
//! [`crate::protocol::body`], the decision to [`crate::routing`], what a failure means to [`failover`],
//! inferlb's own answers to [`answers`]; it holds no policy.

mod admission;
pub mod answers;
mod attempt;
mod conversation;
mod ctx;
mod errors;
mod exchange;
pub mod failover;
mod observe;
mod outcome;
mod pd;
mod resume;

use attempt::{Attempt, Choice};
pub mod request;

pub use ctx::Ctx;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_core::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, ProxyWarnLogContext, Session};

use crate::cluster::Cluster;
use crate::conf::Config;
use crate::fleet::affinity::AffinityTable;
use crate::fleet::registry::Registry;
use crate::fleet::replica::RANK_HEADER;
use crate::protocol::api::shape::Shape;
use crate::protocol::api::Family;
use crate::routing::Router;
use crate::telemetry::metrics::METRICS;
use errors::{failure_of, reason, Seen};
use failover::Failure;
pub use request::stored_key;

pub struct Balancer {
    registry: Arc<Registry>,
    affinity: Arc<AffinityTable>,
    /// Stored Responses ids (hashed, see [`stored_key`]) → the replica that stores each.
    stored: Arc<AffinityTable>,
    /// Other instances to share pins with, when the conf names a cluster.
    cluster: Option<Arc<Cluster>>,
    policy: Router,
    conf: Arc<Config>,
    /// Attempts allowed for one request (Pingora's `max_retries`).
    max_attempts: u32,
    /// This process is handing over to a new one or stopping.
    leaving: Arc<AtomicBool>,
    /// Overload protection, when the conf sets it.
    overload: Option<Arc<crate::overload::Overload>>,
    /// The Responses store, when the balancer keeps it (`responses.store: balancer`).
    history: Option<Arc<crate::history::Store>>,
    /// The models' tokenizers (`tokenizers:`), loaded at start.
    tokenizers: Arc<crate::protocol::tokens::Tokenizers>,
}

impl Balancer {
    pub fn new(
        registry: Arc<Registry>,
        affinity: Arc<AffinityTable>,
        stored: Arc<AffinityTable>,
        cluster: Option<Arc<Cluster>>,
        conf: Arc<Config>,
        max_attempts: usize,
        leaving: Arc<AtomicBool>,
    ) -> Balancer {
        Balancer {
            history: None,
            tokenizers: Default::default(),
            policy: Router::new(conf.routing, conf.spill_margin),
            overload: crate::overload::Overload::from_conf(
                conf.overload.clone(),
                cluster.as_ref().and_then(|c| c.link()).map(|link| {
                    crate::overload::shared::Sharing {
                        link: link.clone(),
                        instance: link.instance().to_string(),
                    }
                }),
                registry.clone(),
            ),
            registry,
            affinity,
            stored,
            cluster,
            conf,
            max_attempts: max_attempts.try_into().unwrap_or(u32::MAX),
            leaving,
        }
    }

    /// The Responses store this balancer keeps (`responses.store: balancer`).
    pub fn with_history(self, history: Option<Arc<crate::history::Store>>) -> Balancer {
        Balancer { history, ..self }
    }

    /// The models' tokenizers, for the prompts the replicas' KV events are read for.
    pub fn with_tokenizers(self, tokenizers: Arc<crate::protocol::tokens::Tokenizers>) -> Balancer {
        Balancer { tokenizers, ..self }
    }
}

/// How long a cut HTTP/2 stream waits for its error event to leave before the reset.
const H2_FLUSH_WAIT: Duration = Duration::from_millis(50);

static NOT_CHAT: Shape = Shape::Other { key: 0 };

#[async_trait]
impl ProxyHttp for Balancer {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.arrived = Instant::now();
        request::allow_pipelining(session);
        ctx.request_id = request::request_id(session.req_header().headers.get("x-request-id"));
        // The edge: one form of the target from here on, for the key check, routing and the
        // replica alike; ambiguous framing or targets go no further.
        if let Some(r) = request::settle_edge(session) {
            ctx.family = Family::of(session.req_header().uri.path());
            answers::refuse(session, ctx.id(), ctx.family, &r).await?;
            return Ok(true);
        }
        let req = session.req_header();
        ctx.family = Family::of(req.uri.path());
        ctx.session = request::session_key(self.conf.session_header.as_deref(), req);
        let refusal = match self.check_head(session.req_header()) {
            Some(r) => Some(r),
            None => self.read_request(session, ctx).await,
        };
        let refusal = match refusal {
            Some(r) => Some(r),
            None => match request::without_steering(ctx.body.bytes()) {
                Ok(stripped) => {
                    if let Some(body) = stripped {
                        ctx.body.replace(body);
                        ctx.body_replaced = true;
                    }
                    None
                }
                Err(r) => Some(r),
            },
        };
        let refusal = match refusal {
            Some(r) => Some(r),
            None => match self.converse(session, ctx).await {
                conversation::Next::Go => None,
                conversation::Next::Answered => return Ok(true),
                conversation::Next::Refused(r, None) => Some(r),
                conversation::Next::Refused(r, Some(coded)) => {
                    conversation::refuse_coded(session, ctx.id(), &r, &coded).await?;
                    return Ok(true);
                }
            },
        };
        let refusal = match refusal {
            Some(r) => Some(r),
            None => {
                let path = session.req_header().uri.path();
                let named = crate::protocol::api::stored_response_path(path).map(str::to_owned);
                self.find_owner(named, ctx).await
            }
        };
        if let Some(r) = refusal {
            answers::refuse(session, ctx.id(), ctx.family, &r).await?;
            return Ok(true);
        }
        let req = session.req_header();
        if req.method == http::Method::GET && req.uri.path() == "/v1/models" {
            let body = answers::models_list(&self.models_now().await);
            answers::respond_json(session, ctx.id(), 200, body).await?;
            return Ok(true);
        }
        if self.admit_load(session, ctx).await? {
            return Ok(true);
        }
        ctx.tokens = self.tokens_of(session.req_header().uri.path(), ctx).await;
        // Before the pools' plan: a handed-over turn's decode leg asks for usage too.
        self.ask_for_usage(session, ctx);
        if self.disaggregate(session, ctx).await? {
            return Ok(true);
        }
        Ok(false)
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        // A retry: the last attempt's prefill will not run, so the choice must not see it
        // queued (or its prompt pending) on the replica it left.
        if let Some(a) = &mut ctx.attempt {
            a.refused();
        }
        let mut chosen = self.choose(ctx);
        // A replica at an address outside admin.allowed_networks (one shared by an instance
        // with another conf) is passed over as if it refused the connection; each is tried once.
        let mut passes = self.registry.all().len();
        while let Some(Choice { replica, .. }) = &chosen {
            let Err(why) = self
                .conf
                .admin
                .allowed_networks
                .check_peer(replica.endpoint.peer.address())
            else {
                break;
            };
            log::error!("replica {} not connected to: {why}", replica.id);
            ctx.tried.push(replica.clone());
            passes = passes.saturating_sub(1);
            chosen = if passes > 0 { self.choose(ctx) } else { None };
        }
        ctx.overload.routed();
        let Some(choice) = chosen else {
            let (path, tried) = (session.req_header().uri.path(), ctx.tried.len());
            log::warn!("no live replica for {path} (tried {tried})");
            // No replica holds this request any more.
            if let Some(a) = &mut ctx.attempt {
                a.end();
            }
            let e = Error::explain(ErrorType::HTTPStatus(503), "no live replica");
            return Err(e);
        };
        let peer = Box::new(choice.replica.endpoint.peer.clone());
        let n = ctx.attempt.as_ref().map_or(0, |a| a.n) + 1;
        // The new attempt replaces the last one whole, releasing what it held.
        ctx.attempt = Some(Attempt::start(n, choice));
        Ok(peer)
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        request::strip_hop_by_hop(upstream);
        upstream.insert_header("x-request-id", ctx.request_id.clone())?;
        // The client's key is for inferlb; the replica gets its own key or none.
        upstream.remove_header("authorization");
        upstream.remove_header("x-api-key");
        // The rank is the routing's to choose.
        upstream.remove_header(RANK_HEADER);
        if ctx.body_replaced && upstream.headers.contains_key("content-length") {
            upstream.insert_header("content-length", ctx.body.bytes().len().to_string())?;
        }
        if let Some(r) = ctx.current() {
            upstream.insert_header("host", &r.endpoint.host)?;
            if let Some(key) = &r.endpoint.api_key {
                upstream.insert_header("authorization", format!("Bearer {}", key.current()))?;
            }
            if let Some(rank) = r.endpoint.data_parallel_rank {
                upstream.insert_header(RANK_HEADER, rank.to_string())?;
            }
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.body
            .substitute(ctx.attempt.as_ref().map_or(0, |a| a.n), body);
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        _ctx: &mut Ctx,
    ) -> Result<()> {
        // The request produced nothing: another replica may serve it (see `failover`).
        let code = upstream.status.as_u16();
        if failover::status_fails_over(code) {
            let why = format!("the replica answered {code}");
            return Err(Error::explain(ErrorType::HTTPStatus(code), why));
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if self.leaving.load(Ordering::Relaxed) {
            // Sends `Connection: close`: the client's next request opens a connection to the
            // process that takes over.
            session.set_keepalive(None);
        }
        if let Some(r) = ctx.current() {
            resp.insert_header("x-inferlb-replica", &*r.id)?;
        }
        if let Some(route) = ctx.route() {
            let route = http::HeaderValue::from_static(route.as_str());
            resp.insert_header("x-inferlb-route", route)?;
        }
        resp.insert_header("x-request-id", ctx.request_id.clone())?;
        if !resp.status.is_success() {
            // An error answer ends the prefill without the replica holding the prompt.
            if let Some(a) = &mut ctx.attempt {
                a.refused();
            }
        }
        // A stream whose usage inferlb asked for: one event fewer, so the length the replica
        // framed it by no longer holds.
        if resp.status.is_success()
            && ctx.route().is_some()
            && observe::read_answer(ctx, resp)
            && ctx.usage_asked
            && resp.headers.contains_key("content-length")
        {
            resp.remove_header("content-length");
            let _ = resp.insert_header("transfer-encoding", "chunked");
        }
        if ctx.route().is_some() {
            self.conversation_header(resp, ctx);
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        self.observe_response(body.as_ref(), end_of_stream, ctx);
        observe::strip_usage(body, end_of_stream, ctx);
        Ok(self.conversation_body(body, end_of_stream, ctx))
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        let verdict = failover::verdict(&self.failed(session, ctx, Failure::Connect));
        self.apply(session, ctx, &mut e, verdict);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("peer: {peer}"));
        let failure = failure_of(&e, Seen::Proxying { client_reused });
        let verdict = failover::verdict(&self.failed(session, ctx, failure));
        self.apply(session, ctx, &mut e, verdict);
        e
    }

    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        _ctx: &Ctx,
        _error: &Error,
        context: ProxyWarnLogContext,
    ) -> bool {
        // Every retry already wrote its own failover line.
        matches!(context, ProxyWarnLogContext::UpstreamRetry)
    }

    fn suppress_error_log(&self, _session: &Session, ctx: &Ctx, _error: &Error) -> bool {
        // A stream resumed elsewhere was served: its failover line says what broke.
        ctx.resumed
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let done = FailToProxy {
            error_code: 0,
            can_reuse_downstream: false,
        };
        // A stream cut before its first byte goes on elsewhere, if it can.
        let message = match self.go_on(session, e, ctx).await {
            resume::GoOn::Ended => return done,
            resume::GoOn::Fails(message) => message,
        };
        if session.response_written().is_some() {
            // The stream already began: end it with an error event the client can see. The
            // body is left unterminated on purpose: Pingora closes this connection next, and a
            // cleanly ended response would invite the client to reuse it and lose its next
            // request in that race.
            METRICS.stream_errors.inc();
            if ctx.info.as_ref().is_some_and(|i| i.stream) {
                let message = message.unwrap_or_else(|| {
                    let replica = ctx.current().map_or("none", |r| &*r.id);
                    format!("replica {replica}'s stream broke ({})", reason(e))
                });
                let event = answers::stream_error_event(ctx.family, &message);
                let _ = session.write_response_body(Some(event), false).await;
                if session.as_downstream().is_http2() {
                    // HTTP/2 then resets the stream, and a reset discards data frames still
                    // queued for it: let the connection task send the event first.
                    tokio::time::sleep(H2_FLUSH_WAIT).await;
                }
            }
            return done;
        }
        let Some((code, message)) = self.final_answer(e, ctx) else {
            return done;
        };
        // Pingora closes this connection after the answer (`can_reuse_downstream: false`): say
        // so in it, or a client reuses it for its next request and meets the close instead.
        session.set_keepalive(None);
        let _ = answers::respond_error(session, ctx.id(), ctx.family, code, &message).await;
        FailToProxy {
            error_code: code,
            ..done
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        self.finish(session, e, ctx);
        self.release_load(ctx);
        self.warm_prefill(&mut ctx.pd, e.is_none());
    }
}
