//! The `ProxyHttp` impl: plumbing only, in the order a request lives.
//!
//! It reads and bounds the body, asks `shape` and `routing` where the request goes, and tells
//! `replicas` and `metrics` what happened. It holds no policy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_error::RetryType;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, ProxyWarnLogContext, Session};
use subtle::ConstantTimeEq;

use crate::access;
use crate::body::JsonEnd;
use crate::config::Config;
use crate::metrics::{code_class, METRICS};
use crate::replicas::{InFlight, Replica, Replicas};
use crate::routing::{Policy, Route};
use crate::shape::{classify, RequestInfo, Shape};
use crate::usage::{Usage, UsageReader};

/// Pingora replays at most this much of a request body from its retry buffer
/// (`BODY_BUF_LIMIT` in pingora-core); see `read_body`.
const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

pub struct Balancer {
    replicas: Arc<Replicas>,
    policy: Policy,
    conf: Arc<Config>,
    peers: HashMap<String, HttpPeer>,
    /// This process is handing over to a new one or stopping.
    leaving: Arc<AtomicBool>,
}

impl Balancer {
    pub fn new(replicas: Arc<Replicas>, conf: Arc<Config>, leaving: Arc<AtomicBool>) -> Balancer {
        let peers = replicas
            .all()
            .iter()
            .map(|r| {
                let mut peer = HttpPeer::new(r.backend.addr.clone(), false, String::new());
                let o = &mut peer.options;
                o.connection_timeout = Some(conf.upstream.connect_timeout);
                o.total_connection_timeout = Some(conf.upstream.connect_timeout);
                o.read_timeout = Some(conf.upstream.read_timeout);
                o.write_timeout = Some(conf.upstream.write_timeout);
                o.idle_timeout = Some(conf.upstream.idle_timeout);
                (r.id.to_string(), peer)
            })
            .collect();
        Balancer {
            policy: Policy {
                mode: conf.routing,
                spill_margin: conf.spill_margin,
            },
            replicas,
            conf,
            peers,
            leaving,
        }
    }
}

/// One request's life.
pub struct Ctx {
    arrived: Instant,
    /// The whole request body, sent again on every attempt.
    body: Bytes,
    info: Option<RequestInfo>,
    /// Replicas this request already tried, in order; the last one is the current attempt.
    tried: Vec<Arc<Replica>>,
    in_flight: Option<InFlight>,
    route: Option<Route>,
    /// Attempt number whose body was already handed to Pingora.
    attempts: u32,
    body_sent_for: u32,
    /// Set once the first response byte went to the client: nothing is retried after it.
    first_byte_at: Option<Instant>,
    failovers: u32,
    /// A chunked body was read up to its JSON end; Pingora reads the terminator.
    chunked_tail_pending: bool,
    request_id: String,
    usage_reader: Option<UsageReader>,
    usage: Option<Usage>,
}

impl Ctx {
    fn current(&self) -> Option<&Arc<Replica>> {
        self.in_flight.as_ref().map(InFlight::replica)
    }
}

/// An error answer in OpenAI's JSON shape.
pub fn openai_error(status: u16, message: &str) -> Bytes {
    let kind = match status {
        400..=499 => "invalid_request_error",
        503 => "service_unavailable",
        _ => "server_error",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    });
    Bytes::from(body.to_string())
}

async fn respond_error(session: &mut Session, status: u16, message: &str) -> Result<()> {
    respond_json(session, status, openai_error(status, message)).await
}

/// An answer inferlb writes itself, with no replica involved.
async fn respond_json(session: &mut Session, status: u16, body: Bytes) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(3))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

/// Why a request was refused before any replica saw it.
struct Refusal(u16, &'static str, String);

impl Balancer {
    /// Reads the whole body, bounded in size and total time.
    ///
    /// Pingora forwards a body it has already read only from its retry buffer, which holds at
    /// most 64 KiB and is dropped whole past that. So buffering is switched on only when at most
    /// 64 KiB remain: the buffer then holds just the tail, is never truncated, and its presence
    /// makes Pingora call `request_body_filter`, where the full body is substituted.
    async fn read_body(&self, session: &mut Session, ctx: &mut Ctx) -> Result<(), Refusal> {
        let limit = self.conf.max_body_bytes;
        let headers = &session.req_header().headers;
        let length = headers
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<usize>().ok());
        let chunked = headers
            .get("transfer-encoding")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let expects_continue = headers
            .get("expect")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if length.is_some_and(|n| n > limit) {
            return Err(too_large(limit));
        }
        if expects_continue {
            // The client waits for this before sending the body; the replica must not see it.
            session.req_header_mut().remove_header("expect");
            if let Err(e) = session.write_continue_response().await {
                return Err(Refusal(400, "invalid_request_error", format!("{e}")));
            }
        }
        if session.is_body_empty() {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + self.conf.body_read_timeout;
        let mut body = BytesMut::with_capacity(length.unwrap_or(0).min(limit));
        let mut json_end = JsonEnd::default();
        if chunked {
            // Covers chunked bodies up to 64 KiB on every retry; larger ones are replayed by
            // leaving their terminator to Pingora (see `body`).
            session.enable_retry_buffering();
        }
        loop {
            if chunked && json_end.complete() {
                ctx.chunked_tail_pending = true;
                break;
            }
            if length.is_some_and(|n| n.saturating_sub(body.len()) <= RETRY_BUFFER_LIMIT) {
                session.enable_retry_buffering();
            }
            let read = tokio::time::timeout_at(deadline, session.read_request_body()).await;
            match read {
                Err(_) => {
                    return Err(Refusal(
                        408,
                        "timeout",
                        format!(
                            "the request body did not arrive within {:?}",
                            self.conf.body_read_timeout
                        ),
                    ))
                }
                Ok(Err(e)) => {
                    return Err(Refusal(
                        400,
                        "bad_body",
                        format!("reading the request body: {e}"),
                    ))
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => {
                    if body.len() + chunk.len() > limit {
                        return Err(too_large(limit));
                    }
                    if chunked {
                        json_end.feed(&chunk);
                    }
                    body.extend_from_slice(&chunk);
                }
            }
        }
        if session.as_ref().retry_buffer_truncated() && !ctx.chunked_tail_pending {
            // A chunked body over 64 KiB that is not JSON: its end cannot be seen early.
            return Err(Refusal(
                411,
                "chunked_too_large",
                format!(
                    "chunked request bodies over {RETRY_BUFFER_LIMIT} bytes must be JSON: send Content-Length"
                ),
            ));
        }
        ctx.body = body.freeze();
        Ok(())
    }

    /// Client keys guard the OpenAI API (`/v1/...`), as vLLM's `--api-key` does. Every key is
    /// compared in constant time, so timing does not reveal how much of a key matched.
    fn authorized(&self, session: &Session) -> bool {
        if self.conf.api_keys.is_empty() || !session.req_header().uri.path().starts_with("/v1") {
            return true;
        }
        let given = session
            .req_header()
            .headers
            .get("authorization")
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or(b"");
        self.conf
            .api_keys
            .iter()
            .fold(subtle::Choice::from(0), |ok, key| {
                ok | key.as_bytes().ct_eq(given)
            })
            .into()
    }

    /// `GET /v1/models`: the union of what the replicas serve, answered here.
    async fn answer_models(&self, session: &mut Session) -> Result<()> {
        let data: Vec<serde_json::Value> = self
            .replicas
            .all_models()
            .into_iter()
            .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "inferlb"}))
            .collect();
        let body = Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string());
        respond_json(session, 200, body).await
    }

    /// The current attempt's replica failed before the client got a byte: demote it, count and
    /// log the failover once, and let upstream_peer pick another replica.
    fn fail_over(&self, session: &Session, ctx: &mut Ctx, e: &mut Error) {
        if let Some(r) = ctx.current().cloned() {
            self.replicas.demote(&r);
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
        e.set_retry(true);
    }
}

/// Headers that describe one connection, not the request: never forwarded.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

fn strip_hop_by_hop(req: &mut RequestHeader) {
    let listed: Vec<String> = req
        .headers
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty() && n != "close" && n != "keep-alive")
        .collect();
    for name in listed.iter().map(String::as_str).chain(HOP_BY_HOP) {
        // Framing headers are Pingora's to manage.
        if name != "transfer-encoding" && name != "content-length" {
            req.remove_header(name);
        }
    }
}

/// The client's `x-request-id` when it is a sane token, else a fresh one.
fn request_id(given: Option<&http::HeaderValue>) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let sane = |v: &&str| {
        !v.is_empty()
            && v.len() <= 128
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    };
    if let Some(v) = given.and_then(|v| v.to_str().ok()).filter(sane) {
        return v.to_owned();
    }
    // Unique across processes too (an upgrade runs two): pid, start time, counter.
    static PREFIX: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("{:x}{:05x}", t & 0xffff_ffff, std::process::id() & 0xfffff)
    });
    format!("{}-{:x}", *PREFIX, NEXT.fetch_add(1, Ordering::Relaxed))
}

fn too_large(limit: usize) -> Refusal {
    Refusal(
        413,
        "too_large",
        format!("the request body is larger than the limit of {limit} bytes"),
    )
}

/// A short name for why an upstream attempt failed, for logs and metric labels.
fn reason(e: &Error) -> &'static str {
    match e.etype() {
        ErrorType::ConnectRefused => "connect_refused",
        ErrorType::ConnectTimedout => "connect_timeout",
        ErrorType::ConnectNoRoute => "connect_no_route",
        ErrorType::TLSHandshakeFailure | ErrorType::ConnectError | ErrorType::SocketError => {
            "connect_error"
        }
        ErrorType::ReadTimedout => "read_timeout",
        ErrorType::WriteTimedout => "write_timeout",
        ErrorType::ConnectionClosed => "connection_closed",
        ErrorType::ReadError | ErrorType::WriteError => "reset",
        ErrorType::HTTPStatus(502) => "http_502",
        ErrorType::HTTPStatus(503) => "http_503",
        ErrorType::HTTPStatus(_) => "http_status",
        _ => "upstream_error",
    }
}

static NOT_CHAT: Shape = Shape::Other { key: 0 };

#[async_trait]
impl ProxyHttp for Balancer {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            arrived: Instant::now(),
            body: Bytes::new(),
            info: None,
            tried: Vec::new(),
            in_flight: None,
            route: None,
            attempts: 0,
            body_sent_for: 0,
            first_byte_at: None,
            failovers: 0,
            chunked_tail_pending: false,
            request_id: String::new(),
            usage_reader: None,
            usage: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.arrived = Instant::now();
        ctx.request_id = request_id(session.req_header().headers.get("x-request-id"));
        let header_bytes: usize = session
            .req_header()
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 4)
            .sum();
        if header_bytes > self.conf.max_header_bytes {
            METRICS
                .rejected
                .with_label_values(&["headers_too_large"])
                .inc();
            session.set_keepalive(None);
            let message = format!(
                "request headers are larger than the limit of {} bytes",
                self.conf.max_header_bytes
            );
            respond_error(session, 431, &message).await?;
            return Ok(true);
        }
        if !self.authorized(session) {
            METRICS.rejected.with_label_values(&["unauthorized"]).inc();
            session.set_keepalive(None);
            respond_error(
                session,
                401,
                "Incorrect API key provided: send `Authorization: Bearer <key>`",
            )
            .await?;
            return Ok(true);
        }
        if let Err(Refusal(status, why, message)) = self.read_body(session, ctx).await {
            METRICS.rejected.with_label_values(&[why]).inc();
            // The rest of an unread body is still on the wire: do not reuse the connection.
            session.set_keepalive(None);
            respond_error(session, status, &message).await?;
            // Read and drop what the client is still sending, for a moment, before closing:
            // closing on unread data resets the connection, and a client still uploading would
            // see the reset instead of this answer (a lingering close, as nginx does). Not when
            // it waits for `100 Continue`: it sends nothing.
            let waits_for_continue = session.req_header().headers.contains_key("expect");
            if status == 413 && !waits_for_continue {
                let downstream = session.as_downstream_mut();
                downstream.set_total_drain_timeout(Some(Duration::from_secs(2)));
                let _ = downstream.drain_request_body().await;
            }
            return Ok(true);
        }
        if !ctx.body.is_empty() {
            ctx.info = Some(classify(&ctx.body));
        }
        if let Some(model) = ctx.info.as_ref().and_then(|i| i.model.as_deref()) {
            if !self.replicas.knows_model(model) {
                METRICS.rejected.with_label_values(&["unknown_model"]).inc();
                let message = format!("The model `{model}` does not exist.");
                respond_error(session, 404, &message).await?;
                return Ok(true);
            }
        }
        let req = session.req_header();
        if req.method == http::Method::GET && req.uri.path() == "/v1/models" {
            self.answer_models(session).await?;
            return Ok(true);
        }
        Ok(false)
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let shape = ctx.info.as_ref().map_or(&NOT_CHAT, |i| &i.shape);
        let model = ctx.info.as_ref().and_then(|i| i.model.as_deref());
        let candidates = self.replicas.candidates(&ctx.tried, model);
        let decision = self.policy.decide(
            shape,
            &candidates,
            |h| self.replicas.served_by(h),
            self.replicas.tick(),
        );
        let Some(decision) = decision else {
            let tried = ctx.tried.len();
            log::warn!(
                "no live replica for {} (tried {tried})",
                session.req_header().uri.path()
            );
            return Err(Error::explain(
                ErrorType::HTTPStatus(503),
                "no live replica",
            ));
        };
        let replica = self
            .replicas
            .get(decision.replica)
            .cloned()
            .ok_or_else(|| {
                Error::explain(ErrorType::InternalError, "routing chose an unknown id")
            })?;
        let peer = self
            .peers
            .get(&*replica.id)
            .cloned()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "no peer for replica"))?;
        ctx.attempts += 1;
        ctx.route = Some(decision.route);
        // Replacing the guard releases the previous attempt's in-flight count.
        ctx.in_flight = Some(self.replicas.start(&replica));
        ctx.tried.push(replica);
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        strip_hop_by_hop(upstream);
        upstream.insert_header("x-request-id", &ctx.request_id)?;
        // Origin-form only: whatever the client wrote, the request goes to the chosen replica.
        if !upstream.raw_path().starts_with(b"/") {
            let path = upstream
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_owned();
            upstream.set_uri(
                path.parse()
                    .map_err(|_| Error::explain(ErrorType::InvalidHTTPHeader, "request target"))?,
            );
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
        if ctx.body.is_empty() {
            return Ok(());
        }
        // Pingora hands over only the retry buffer's tail; send the whole body, once per attempt.
        if ctx.body_sent_for == ctx.attempts {
            *body = None;
        } else {
            ctx.body_sent_for = ctx.attempts;
            *body = Some(ctx.body.clone());
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        _ctx: &mut Ctx,
    ) -> Result<()> {
        // vLLM answers 503 while starting or overloaded, and a gateway in front of it 502: the
        // request produced nothing, so another replica may serve it (see error_while_proxy).
        match upstream.status.as_u16() {
            code @ (502 | 503) => Err(Error::explain(
                ErrorType::HTTPStatus(code),
                format!("the replica answered {code}"),
            )),
            _ => Ok(()),
        }
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
            ctx.usage_reader = Some(UsageReader::new(sse));
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
        if let Some(reader) = ctx.usage_reader.as_mut() {
            if let Some(b) = body.as_ref() {
                reader.feed(b);
            }
            if end_of_stream {
                ctx.usage = reader.finish();
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
            let route = ctx.route.map_or("none", Route::as_str);
            METRICS
                .ttfb
                .with_label_values(&[route])
                .observe((now - ctx.arrived).as_secs_f64());
        }
        Ok(None)
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // Nothing reached the replica.
        self.fail_over(session, ctx, &mut e);
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
        let client_got_bytes = session.response_written().is_some() || ctx.first_byte_at.is_some();
        if client_got_bytes || e.esource() == &ErrorSource::Downstream {
            e.set_retry(false);
            return e;
        }
        if ctx.chunked_tail_pending
            && session.as_ref().retry_buffer_truncated()
            && session.as_downstream_mut().is_body_done()
        {
            // A large chunked body whose end Pingora already consumed cannot be sent again.
            e.set_retry(false);
            return e;
        }
        if client_reused && matches!(e.retry, RetryType::ReusedOnly) {
            // A pooled connection that was already closed: the replica may be fine, so it is
            // not demoted and may be tried again (a dead one then fails to connect).
            e.set_retry(true);
            if let Some(r) = ctx.tried.pop() {
                log::debug!("stale pooled connection to {}, retrying", r.id);
            }
            return e;
        }
        match e.etype() {
            // A replica that is slow to answer is still working: re-sending would double its load.
            ErrorType::ReadTimedout => e.set_retry(false),
            _ => self.fail_over(session, ctx, &mut e),
        }
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
        if e.esource() == &ErrorSource::Upstream {
            if let Some(r) = ctx.current() {
                METRICS
                    .upstream_errors
                    .with_label_values(&[&r.id, reason(e)])
                    .inc();
            }
        }
        let code = match e.etype() {
            ErrorType::HTTPStatus(code) => *code,
            ErrorType::ReadTimedout if e.esource() == &ErrorSource::Upstream => 504,
            _ => match e.esource() {
                ErrorSource::Upstream => 502,
                ErrorSource::Downstream => match e.etype() {
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => 0,
                    _ => 400,
                },
                ErrorSource::Internal | ErrorSource::Unset => 500,
            },
        };
        if session.response_written().is_some() {
            // The stream already began: send an error event the client can see, never a silent
            // truncation that looks like success. The body is left unterminated on purpose:
            // Pingora closes this connection next, and a cleanly ended response would invite the
            // client to reuse it and lose its next request in that race.
            METRICS.stream_errors.inc();
            if ctx.info.as_ref().is_some_and(|i| i.stream) {
                let event = format!(
                    "data: {}\n\n",
                    String::from_utf8_lossy(&openai_error(
                        502,
                        &format!("the replica's stream broke: {e}")
                    ))
                );
                let _ = session
                    .write_response_body(Some(Bytes::from(event)), false)
                    .await;
            }
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        if code > 0 {
            let message = match code {
                503 => "no live replica can serve this request".to_string(),
                504 => format!("the replica did not answer in time: {e}"),
                _ => format!("{e}"),
            };
            let _ = respond_error(session, code, &message).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        // Taking the guard releases the in-flight count now, not when Pingora drops the ctx.
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
        if let (true, Some(key), Some(r)) = (
            served_whole,
            ctx.info.as_ref().and_then(|i| i.shape.served_key()),
            served_by.as_ref(),
        ) {
            self.replicas.record_served(key, r);
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
