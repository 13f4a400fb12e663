//! The `ProxyHttp` impl: the request's life in hook order. Each hook delegates: the body to
//! [`crate::body`], the decision to [`crate::routing`], what a failure means to [`failover`],
//! inferlb's own answers to [`answers`]; it holds no policy.

pub mod answers;
mod errors;
pub mod failover;
pub mod request;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, ProxyWarnLogContext, Session};

use crate::access;
use crate::affinity::AffinityTable;
use crate::api::{classify, stored_response_path, Family, RequestInfo};
use crate::body::{BodyLimits, BodyReplay};
use crate::config::Config;
use crate::metrics::{code_class, METRICS};
use crate::registry::Registry;
use crate::replica::{InFlight, QueuedPrefill, Replica};
use crate::routing::{self, Mode, Policy, Route};
use crate::shape::Shape;
use crate::usage::{Usage, UsageReader};
use answers::Refusal;
use errors::{failure_of, reason, Seen};
use failover::{Attempt, Failure, Retry, Verdict};

pub struct Balancer {
    registry: Arc<Registry>,
    affinity: Arc<AffinityTable>,
    /// Stored Responses ids (hashed, see [`stored_key`]) → the replica that stores each.
    stored: Arc<AffinityTable>,
    policy: Policy,
    conf: Arc<Config>,
    /// Attempts allowed for one request (Pingora's `max_retries`).
    max_attempts: u32,
    /// This process is handing over to a new one or stopping.
    leaving: Arc<AtomicBool>,
}

impl Balancer {
    pub fn new(
        registry: Arc<Registry>,
        affinity: Arc<AffinityTable>,
        stored: Arc<AffinityTable>,
        conf: Arc<Config>,
        max_attempts: usize,
        leaving: Arc<AtomicBool>,
    ) -> Balancer {
        Balancer {
            policy: Policy {
                mode: conf.routing,
                spill_margin: conf.spill_margin,
            },
            registry,
            affinity,
            stored,
            conf,
            max_attempts: max_attempts.try_into().unwrap_or(u32::MAX),
            leaving,
        }
    }
}

/// The key of a stored response id in the `stored` table.
pub fn stored_key(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

/// One request's life.
pub struct Ctx {
    arrived: Instant,
    request_id: String,
    family: Family,
    body: BodyReplay,
    info: Option<RequestInfo>,
    /// The session key from the configured session header.
    session: Option<u64>,
    /// The replica that stores the response this request is about, and that response's id.
    owner: Option<Arc<Replica>>,
    stored_id: Option<String>,
    /// This answer's stored response id was recorded.
    id_learnt: bool,
    /// Replicas this request already tried, in order; the last one is the current attempt.
    tried: Vec<Arc<Replica>>,
    in_flight: Option<InFlight>,
    /// The current attempt's prefill, queued on its replica until the first byte.
    prefill: Option<QueuedPrefill>,
    route: Option<Route>,
    attempts: u32,
    /// Set once the first response byte went to the client: nothing is retried after it.
    first_byte_at: Option<Instant>,
    failovers: u32,
    usage_reader: Option<UsageReader>,
    usage: Option<Usage>,
}

impl Ctx {
    fn current(&self) -> Option<&Arc<Replica>> {
        self.in_flight.as_ref().map(InFlight::replica)
    }
}

static NOT_CHAT: Shape = Shape::Other { key: 0 };

impl Balancer {
    /// What the request head alone settles: its size and its key.
    fn check_head(&self, req: &RequestHeader) -> Option<Refusal> {
        let limit = self.conf.max_header_bytes;
        if request::header_bytes(req) > limit {
            return Some(Refusal {
                status: 431,
                reason: "headers_too_large",
                message: format!("request headers are larger than the limit of {limit} bytes"),
                close: true,
            });
        }
        if !request::authorized(&self.conf.api_keys, req) {
            return Some(Refusal {
                status: 401,
                reason: "unauthorized",
                message: "Incorrect API key provided: send `Authorization: Bearer <key>`".into(),
                close: true,
            });
        }
        None
    }

    /// Reads the body and learns what routing needs from it; or why not.
    async fn read_request(&self, session: &mut Session, ctx: &mut Ctx) -> Option<Refusal> {
        let limits = BodyLimits {
            max_bytes: self.conf.max_body_bytes,
            read_timeout: self.conf.body_read_timeout,
        };
        match BodyReplay::read(session, limits).await {
            Ok(body) => ctx.body = body,
            // The rest of an unread body may still be on the wire: close after answering.
            Err(e) => {
                return Some(Refusal {
                    status: e.status(),
                    reason: e.reason(),
                    message: e.message(),
                    close: true,
                })
            }
        }
        if !ctx.body.bytes().is_empty() {
            ctx.info = Some(classify(ctx.family, ctx.body.bytes()));
        }
        let model = ctx.info.as_ref().and_then(|i| i.model.as_deref())?;
        (!self.registry.knows_model(model)).then(|| Refusal {
            status: 404,
            reason: "unknown_model",
            message: format!("The model `{model}` does not exist."),
            close: false,
        })
    }

    /// The replica that stores the response this request continues or names, if inferlb knows
    /// it or a replica says so when asked; a refusal when that replica is unavailable (no other
    /// replica has it, and a silent 404 from one would mislead).
    async fn find_owner(&self, path: &str, ctx: &mut Ctx) -> Option<Refusal> {
        let info = ctx.info.as_ref();
        let id = info.and_then(|i| i.previous_response_id.as_deref());
        let id = id.or_else(|| stored_response_path(path))?.to_owned();
        let known = self.stored.served_by(stored_key(&id));
        let owner = match known.and_then(|owner| self.registry.get(&owner).cloned()) {
            Some(owner) => owner,
            None => {
                let among = self.registry.reachable();
                let timeout = self.conf.stored_lookup_timeout;
                let found = crate::probe::stored_response(&among, &id, timeout).await?;
                self.stored.record(stored_key(&id), &found.id);
                found
            }
        };
        if owner.is_reachable() {
            ctx.owner = Some(owner);
            ctx.stored_id = Some(id);
            return None;
        }
        Some(Refusal {
            status: 503,
            reason: "stored_unavailable",
            message: format!(
                "the stored response {id} is on replica {}, which is unavailable; no other replica has it",
                owner.id
            ),
            close: false,
        })
    }

    /// The status and message a request that failed before any byte ends with; `None` when
    /// the client is gone. Messages name the replica and the reason, never its address.
    fn final_answer(&self, e: &Error, ctx: &Ctx) -> Option<(u16, String)> {
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
            (503, _) if ctx.current().is_none() => {
                (503, "no live replica can serve this request".into())
            }
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
    fn apply(&self, session: &Session, ctx: &mut Ctx, e: &mut Error, v: Verdict) {
        let replica = ctx.current().cloned();
        if let (true, Some(r)) = (v.demote, &replica) {
            r.demote();
        }
        match (v.retry, &replica) {
            (Retry::Elsewhere, Some(r)) => {
                ctx.failovers += 1;
                let why = reason(e);
                METRICS.failovers.with_label_values(&[&r.id, why]).inc();
                log::warn!(
                    "failover: replica={} reason={} path={} attempt={}: demoted, retrying on another replica",
                    r.id,
                    why,
                    session.req_header().uri.path(),
                    ctx.attempts
                );
            }
            (Retry::Same, Some(r)) => {
                // Not tried in earnest: it may be chosen again.
                ctx.tried.pop();
                log::debug!("stale pooled connection to {}, retrying", r.id);
            }
            _ => {}
        }
        e.set_retry(v.retry != Retry::No);
    }

    fn attempt(&self, session: &mut Session, ctx: &Ctx, failure: Failure) -> Attempt {
        Attempt {
            failure,
            client_got_bytes: session.response_written().is_some() || ctx.first_byte_at.is_some(),
            body_replayable: ctx.body.replayable(session),
            attempt: ctx.attempts,
            max_attempts: self.max_attempts,
            stateful: ctx.owner.is_some(),
        }
    }

    /// A response body chunk passed: read its usage, time the first byte.
    fn observe_response(&self, body: Option<&Bytes>, end_of_stream: bool, ctx: &mut Ctx) {
        if let Some(reader) = ctx.usage_reader.as_mut() {
            if let Some(b) = body {
                reader.feed(b);
            }
            if end_of_stream {
                ctx.usage = reader.finish();
            }
            // A stream announces its id first; a JSON answer has it once finished.
            let replica = ctx.in_flight.as_ref().map(InFlight::replica);
            if let (false, Some(id), Some(r)) = (ctx.id_learnt, reader.response_id(), replica) {
                self.stored.record(stored_key(id), &r.id);
                ctx.id_learnt = true;
            }
            if end_of_stream {
                ctx.usage_reader = None;
                if let (Some(u), Some(r)) = (ctx.usage, ctx.current()) {
                    METRICS
                        .prompt_tokens
                        .with_label_values(&[&r.id])
                        .inc_by(u.prompt_tokens);
                    METRICS
                        .cached_tokens
                        .with_label_values(&[&r.id])
                        .inc_by(u.cached_tokens);
                }
            }
        }
        if ctx.first_byte_at.is_none() {
            let now = Instant::now();
            ctx.first_byte_at = Some(now);
            ctx.prefill = None;
            let route = ctx.route.map_or("none", Route::as_str);
            METRICS
                .ttfb
                .with_label_values(&[route])
                .observe((now - ctx.arrived).as_secs_f64());
        }
    }

    /// The request is over: count it, remember what was served, write the access log.
    fn finish(&self, session: &Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        // Taking the guards releases the counts now, not when Pingora drops the ctx.
        ctx.prefill = None;
        let served_by = ctx.in_flight.take().map(|f| f.replica().clone());
        let replica = served_by.as_ref().map_or("none", |r| &*r.id);
        let route = ctx.route.map_or("none", Route::as_str);
        if ctx.route.is_some() {
            METRICS
                .requests
                .with_label_values(&[replica, route, code_class(status)])
                .inc();
        }
        let served_whole = e.is_none() && (200..300).contains(&status);
        let key = ctx.info.as_ref().and_then(|i| i.shape.served_key());
        if let (true, Some(r)) = (served_whole, served_by.as_ref()) {
            for key in key.into_iter().chain(ctx.session) {
                self.affinity.record(key, &r.id);
            }
        }
        if !log::log_enabled!(target: "access", log::Level::Info) {
            return;
        }
        let record = access::Record {
            request_id: &ctx.request_id,
            method: session.req_header().method.as_str(),
            path: session.req_header().uri.path(),
            model: ctx.info.as_ref().and_then(|i| i.model.as_deref()),
            route,
            replica,
            attempts: ctx.attempts,
            failovers: ctx.failovers,
            status,
            ttfb_ms: ctx
                .first_byte_at
                .map(|t| (t - ctx.arrived).as_secs_f64() * 1e3),
            duration_ms: ctx.arrived.elapsed().as_secs_f64() * 1e3,
            prompt_tokens: ctx.usage.map(|u| u.prompt_tokens),
            cached_tokens: ctx.usage.map(|u| u.cached_tokens),
        };
        if let Some(line) = record.render(self.conf.access_log) {
            log::info!(target: "access", "{line}");
        }
    }
}

#[async_trait]
impl ProxyHttp for Balancer {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            arrived: Instant::now(),
            request_id: String::new(),
            family: Family::Chat,
            body: BodyReplay::default(),
            info: None,
            session: None,
            owner: None,
            stored_id: None,
            id_learnt: false,
            tried: Vec::new(),
            in_flight: None,
            prefill: None,
            route: None,
            attempts: 0,
            first_byte_at: None,
            failovers: 0,
            usage_reader: None,
            usage: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.arrived = Instant::now();
        let req = session.req_header();
        ctx.request_id = request::request_id(req.headers.get("x-request-id"));
        ctx.family = Family::of(req.uri.path());
        ctx.session = request::session_key(self.conf.session_header.as_deref(), req);
        let refusal = match self.check_head(session.req_header()) {
            Some(r) => Some(r),
            None => self.read_request(session, ctx).await,
        };
        let refusal = match refusal {
            Some(r) => Some(r),
            None => {
                let path = session.req_header().uri.path().to_owned();
                self.find_owner(&path, ctx).await
            }
        };
        if let Some(r) = refusal {
            answers::refuse(session, &ctx.request_id, ctx.family, &r).await?;
            return Ok(true);
        }
        let req = session.req_header();
        if req.method == http::Method::GET && req.uri.path() == "/v1/models" {
            let body = answers::models_list(&self.registry.all_models());
            answers::respond_json(session, &ctx.request_id, 200, body).await?;
            return Ok(true);
        }
        Ok(false)
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let shape = ctx.info.as_ref().map_or(&NOT_CHAT, |i| &i.shape);
        let model = ctx.info.as_ref().and_then(|i| i.model.as_deref());
        // Only the cost policy looks at what each replica holds and has queued.
        let cost = self.policy.mode == Mode::PrefillCost;
        let links = if cost { shape.links() } else { &[] };
        let candidates = self.registry.candidates(&ctx.tried, model, links);
        let served_by = |h| self.affinity.served_by(h);
        let decision = match &ctx.owner {
            Some(owner) => routing::stored(&owner.id, &candidates),
            None => self.policy.decide(
                shape,
                ctx.session,
                &candidates,
                served_by,
                self.registry.tick(),
            ),
        };
        let Some(decision) = decision else {
            let (path, tried) = (session.req_header().uri.path(), ctx.tried.len());
            log::warn!("no live replica for {path} (tried {tried})");
            // No replica holds this request any more.
            ctx.in_flight = None;
            ctx.prefill = None;
            return Err(Error::explain(
                ErrorType::HTTPStatus(503),
                "no live replica",
            ));
        };
        let replica = decision.replica.clone();
        if cost {
            let held = candidates.iter().find(|c| Arc::ptr_eq(c.handle, &replica));
            let uncached = shape
                .prompt_tokens()
                .saturating_sub(held.map_or(0, |c| c.cached_tokens));
            ctx.prefill = Some(replica.queue_prefill(uncached));
            replica.index.record(links);
        }
        let peer = Box::new(replica.peer.clone());
        ctx.attempts += 1;
        ctx.route = Some(decision.route);
        // Replacing the guard releases the previous attempt's in-flight count.
        ctx.in_flight = Some(replica.start());
        ctx.tried.push(replica);
        Ok(peer)
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        request::strip_hop_by_hop(upstream);
        upstream.insert_header("x-request-id", &ctx.request_id)?;
        // Origin-form only: whatever the client wrote, the request goes to the chosen replica.
        if !upstream.raw_path().starts_with(b"/") {
            let path = upstream.uri.path_and_query().map_or("/", |p| p.as_str());
            let uri = path
                .to_owned()
                .parse()
                .map_err(|_| Error::explain(ErrorType::InvalidHTTPHeader, "request target"))?;
            upstream.set_uri(uri);
        }
        if let Some(r) = ctx.current() {
            upstream.insert_header("host", &r.address)?;
            if let Some(key) = &r.api_key {
                upstream.insert_header("authorization", format!("Bearer {key}"))?;
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
        ctx.body.substitute(ctx.attempts, body);
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
        if let Some(route) = ctx.route {
            resp.insert_header("x-inferlb-route", route.as_str())?;
        }
        resp.insert_header("x-request-id", &ctx.request_id)?;
        if resp.status.is_success() && ctx.route.is_some() {
            let sse = resp
                .headers
                .get("content-type")
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            ctx.usage_reader = Some(UsageReader::new(ctx.family, sse));
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
        Ok(None)
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        let verdict = failover::verdict(&self.attempt(session, ctx, Failure::Connect));
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
        let verdict = failover::verdict(&self.attempt(session, ctx, failure));
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

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        if let (pingora_core::ErrorSource::Upstream, Some(r)) = (e.esource(), ctx.current()) {
            METRICS
                .upstream_errors
                .with_label_values(&[&r.id, reason(e)])
                .inc();
        }
        let done = FailToProxy {
            error_code: 0,
            can_reuse_downstream: false,
        };
        if session.response_written().is_some() {
            // The stream already began: end it with an error event the client can see. The
            // body is left unterminated on purpose: Pingora closes this connection next, and a
            // cleanly ended response would invite the client to reuse it and lose its next
            // request in that race.
            METRICS.stream_errors.inc();
            if ctx.info.as_ref().is_some_and(|i| i.stream) {
                let replica = ctx.current().map_or("none", |r| &*r.id);
                let message = format!("replica {replica}'s stream broke ({})", reason(e));
                let event = answers::stream_error_event(ctx.family, &message);
                let _ = session.write_response_body(Some(event), false).await;
            }
            return done;
        }
        let Some((code, message)) = self.final_answer(e, ctx) else {
            return done;
        };
        let _ = answers::respond_error(session, &ctx.request_id, ctx.family, code, &message).await;
        FailToProxy {
            error_code: code,
            ..done
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        self.finish(session, e, ctx);
    }
}
