//! inferlb's own exchanges with a replica, outside Pingora's proxy loop: a P/D leg
//! ([`crate::proxy::pd`]) and a stream resumed on another replica ([`crate::proxy::resume`]).
//! Over Pingora's connector (so TLS, SNI and the trusted roots are the data path's): the
//! request head as the proxy path makes one, the answer's header, bounded reads of its body,
//! held up to a stream's first token, and then relayed to the client. What can go wrong, as
//! [`LegError`].

use std::sync::LazyLock;
use std::time::Duration;

use bytes::Bytes;
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::upstreams::peer::Peer;
use pingora_core::{Error, ErrorType};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::observe::strip_usage;
use super::{Balancer, Ctx};
use crate::fleet::replica::Replica;
use crate::protocol::handover::{Start, StreamStart};

/// One connector (and connection pool) for every leg and resumed stream.
static CONNECTOR: LazyLock<Connector> = LazyLock::new(|| Connector::new(None));

/// The largest prefill answer (or refused leg's answer) read.
const MAX_ANSWER_BYTES: usize = 8 << 20;

/// Why a leg failed.
#[derive(Debug)]
pub(in crate::proxy) enum LegError {
    /// No connection: the replica is demoted.
    Connect(String),
    /// Not connected to at all: outside `admin.allowed_networks` (no fault of the replica's).
    NotAllowed(String),
    /// Its connection broke before an answer.
    Broken(String),
    /// It said nothing for the read timeout: still working, perhaps (a proxy path's read
    /// timeout never fails over; a leg's fails over without demoting it).
    TimedOut(String),
    /// It answered with this status (and this body): 4xx goes to the client as it is.
    Answered(Box<ResponseHeader>, Bytes),
    /// Its stream's first event was an error (a failed KV pull).
    StreamFailed,
    /// A prefill answer without `kv_transfer_params`: the replica has no KV connector.
    NoParams,
}

impl std::fmt::Display for LegError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LegError::Connect(why) => write!(f, "no connection: {why}"),
            LegError::NotAllowed(why) => write!(f, "not connected to: {why}"),
            LegError::Broken(why) => write!(f, "broken: {why}"),
            LegError::TimedOut(why) => write!(f, "silent: {why}"),
            LegError::Answered(h, _) => write!(f, "answered {}", h.status.as_u16()),
            LegError::StreamFailed => f.write_str("its stream's first event was an error"),
            LegError::NoParams => f.write_str("no kv_transfer_params in the answer"),
        }
    }
}

impl LegError {
    pub(in crate::proxy) fn reason(&self) -> &'static str {
        match self {
            LegError::Connect(_) => "connect",
            LegError::NotAllowed(_) => "not_allowed",
            LegError::Broken(_) => "broken",
            LegError::TimedOut(_) => "read_timeout",
            LegError::Answered(h, _) if h.status.is_server_error() => "http_5xx",
            LegError::Answered(..) => "http_4xx",
            LegError::StreamFailed => "stream_error",
            LegError::NoParams => "no_params",
        }
    }

    /// A refusal of the request itself (4xx), which another replica would refuse too.
    pub(super) fn is_refusal(&self) -> bool {
        matches!(self, LegError::Answered(h, _) if h.status.is_client_error())
    }
}

/// What a leg's exchange needs from the balancer, owned (an SGLang prefill leg runs apart).
#[derive(Clone)]
pub(in crate::proxy) struct LegCtx {
    pub(in crate::proxy) read_timeout: Duration,
    pub(in crate::proxy) networks: crate::conf::netpolicy::Networks,
}

impl LegCtx {
    /// Sends `body` to `r` as the client's request (its path, content headers, the request
    /// id; inferlb's key for it, never the client's) and reads the answer's header.
    pub(in crate::proxy) async fn exchange_keep(
        &self,
        r: &Replica,
        client: &RequestHeader,
        request_id: &http::HeaderValue,
        body: Bytes,
    ) -> Result<(Box<ResponseHeader>, HttpSession), LegError> {
        if let Err(why) = self.networks.check_peer(r.endpoint.peer.address()) {
            return Err(LegError::NotAllowed(why.to_string()));
        }
        // A pooled connection the replica closed meanwhile fails at once: one more, fresh.
        for fresh in [false, true] {
            let (mut s, reused) = CONNECTOR
                .get_http_session(&r.endpoint.peer)
                .await
                .map_err(|e| LegError::Connect(e.to_string()))?;
            let req = leg_header(client, r, request_id, body.len())?;
            s.set_read_timeout(Some(self.read_timeout));
            // As the proxy path's: a replica that takes the connection and never reads the
            // body does not hold the request.
            s.set_write_timeout(r.endpoint.peer.options.write_timeout);
            let sent = async {
                s.write_request_header(req).await?;
                s.write_request_body(body.clone(), true).await?;
                s.finish_request_body().await?;
                s.read_response_header().await
            }
            .await;
            match sent {
                Ok(()) => {
                    let header = s
                        .response_header()
                        .cloned()
                        .ok_or_else(|| LegError::Broken("no response header".into()))?;
                    return Ok((Box::new(header), s));
                }
                // A pooled connection the replica closed meanwhile: once more. Never after a
                // timeout: the replica may be working on it, and would do it twice.
                Err(e)
                    if reused
                        && !fresh
                        && !matches!(
                            e.etype(),
                            ErrorType::ReadTimedout | ErrorType::WriteTimedout
                        ) =>
                {
                    continue
                }
                Err(e) if e.etype() == &ErrorType::ReadTimedout => {
                    return Err(LegError::TimedOut(e.to_string()))
                }
                Err(e) => return Err(LegError::Broken(e.to_string())),
            }
        }
        Err(LegError::Broken("unreachable".into()))
    }

    /// [`LegCtx::exchange_keep`], then the answer read whole and dropped (SGLang's prefill).
    pub(super) async fn exchange(
        &self,
        r: &Replica,
        client: &RequestHeader,
        request_id: &http::HeaderValue,
        body: Bytes,
    ) -> Result<(Box<ResponseHeader>, Bytes), LegError> {
        let (h, mut s) = self.exchange_keep(r, client, request_id, body).await?;
        let answer = read_all(&mut s, self.read_timeout).await?;
        release(s, r).await;
        Ok((h, answer))
    }
}

fn leg_header(
    client: &RequestHeader,
    r: &Replica,
    request_id: &http::HeaderValue,
    length: usize,
) -> Result<Box<RequestHeader>, LegError> {
    let path = client
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .as_bytes();
    let mut req = RequestHeader::build("POST", path, Some(client.headers.len() + 4))
        .map_err(|e| LegError::Broken(e.to_string()))?;
    for (name, value) in client.headers.iter() {
        let _ = req.append_header(name.clone(), value.clone());
    }
    // As the proxy path sends it: no hop-by-hop headers (nor those `Connection` names), no
    // client key, the body's own framing; and no compression, since both answers are read.
    crate::proxy::request::strip_hop_by_hop(&mut req);
    for name in [
        "authorization",
        "x-api-key",
        "content-length",
        "transfer-encoding",
        "expect",
        "accept-encoding",
        "x-request-id",
        crate::fleet::replica::RANK_HEADER,
    ] {
        req.remove_header(name);
    }
    let set = |req: &mut RequestHeader, n: &'static str, v: String| {
        req.insert_header(n, v)
            .map_err(|e| LegError::Broken(e.to_string()))
    };
    set(&mut req, "host", r.endpoint.host.clone())?;
    set(&mut req, "content-length", length.to_string())?;
    req.insert_header("x-request-id", request_id.clone())
        .map_err(|e| LegError::Broken(e.to_string()))?;
    if let Some(key) = &r.endpoint.api_key {
        set(
            &mut req,
            "authorization",
            format!("Bearer {}", key.current()),
        )?;
    }
    if let Some(rank) = r.endpoint.data_parallel_rank {
        set(
            &mut req,
            crate::fleet::replica::RANK_HEADER,
            rank.to_string(),
        )?;
    }
    Ok(Box::new(req))
}

/// A failed read of an answer's body: the session's own read timeout is a silence, anything
/// else a break.
fn read_failed(e: Box<pingora_core::Error>) -> LegError {
    match e.etype() {
        ErrorType::ReadTimedout => LegError::TimedOut(e.to_string()),
        _ => LegError::Broken(e.to_string()),
    }
}

pub(super) async fn read_all(s: &mut HttpSession, timeout: Duration) -> Result<Bytes, LegError> {
    let mut body = Vec::new();
    loop {
        let chunk = tokio::time::timeout(timeout, s.read_response_body())
            .await
            .map_err(|_| LegError::TimedOut("the answer did not end in time".into()))?
            .map_err(read_failed)?;
        let Some(chunk) = chunk else { break };
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(LegError::Broken("the answer is too large".into()));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(body))
}

/// Reads an SSE answer up to its first token and returns what came until then, to be passed
/// on once the answer is known to flow. A stream that ends or breaks first, or whose first
/// event is the replica's own error, produced nothing for the client: another replica may
/// serve it.
pub(in crate::proxy) async fn first_token(
    s: &mut HttpSession,
    timeout: Duration,
) -> Result<Vec<Bytes>, LegError> {
    let mut start = StreamStart::default();
    let mut held = Vec::new();
    loop {
        // The session's own read timeout is as long: whichever fires first, a silence.
        let chunk = tokio::time::timeout(timeout, s.read_response_body())
            .await
            .map_err(|_| LegError::TimedOut("no first token in time".into()))?
            .map_err(read_failed)?;
        let Some(chunk) = chunk else {
            // Ended with nothing generated (a Responses stream whose pull failed breaks off
            // after its preamble): nothing of it reached the client.
            return Err(LegError::Broken("the stream ended before a token".into()));
        };
        let verdict = start.feed(&chunk);
        held.push(chunk);
        match verdict {
            Start::Held => {}
            Start::Flowing => return Ok(held),
            Start::Failed => return Err(LegError::StreamFailed),
        }
    }
}

/// `work`, unless the client hangs up first (`None`). The whole body is read: the next read
/// ends only when the client hangs up. A large chunked body's terminator is still Pingora's
/// to read (`tail_pending`): then, as in the overload queue, the hang-up goes unwatched until
/// the answer is written.
pub(in crate::proxy) async fn unless_client_leaves<T>(
    session: &mut pingora_proxy::Session,
    tail_pending: bool,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    let downstream = session.as_downstream_mut();
    let gone = async {
        if tail_pending || downstream.read_body_or_idle(true).await.is_ok() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        t = work => Some(t),
        _ = gone => None,
    }
}

/// A connection whose answer ended goes back to the pool.
pub(in crate::proxy) async fn release(mut s: HttpSession, r: &Replica) {
    if s.response_done() {
        CONNECTOR
            .release_http_session(s, &r.endpoint.peer, r.endpoint.peer.options.idle_timeout)
            .await;
    }
}

impl Balancer {
    /// What a leg's exchange needs; `read_timeout` bounds each read of its answer.
    pub(in crate::proxy) fn leg_ctx(&self, read_timeout: Duration) -> LegCtx {
        LegCtx {
            read_timeout,
            networks: self.conf.admin.allowed_networks.clone(),
        }
    }

    /// An answer whose header the client has: the events held until its first token, then
    /// the rest as it comes, to its end (the connection back to the pool). Nothing is
    /// retried from here on: a cut or a silence is an error for `fail_to_proxy`, which ends a
    /// stream with its API's error event and leaves the body unterminated, so the client sees
    /// it cut, never complete.
    pub(in crate::proxy) async fn relay(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        (mut upstream, replica): (HttpSession, &Replica),
        held: Vec<Bytes>,
    ) -> pingora_core::Result<()> {
        for chunk in held {
            pass(self, session, ctx, Some(chunk)).await?;
        }
        let read_timeout = self.conf.upstream.read_timeout;
        loop {
            let next = tokio::time::timeout(read_timeout, upstream.read_response_body()).await;
            match next {
                Ok(Ok(Some(chunk))) => pass(self, session, ctx, Some(chunk)).await?,
                Ok(Ok(None)) => {
                    self.observe_response(None, true, ctx);
                    let mut tail = None;
                    strip_usage(&mut tail, true, ctx);
                    session
                        .write_response_body(tail, true)
                        .await
                        .map_err(|_| client_left())?;
                    release(upstream, replica).await;
                    return Ok(());
                }
                Ok(Err(e)) => return Err(e.into_up()),
                Err(_) => {
                    let why = format!("replica {} went silent for {read_timeout:?}", replica.id);
                    return Err(Error::explain(ErrorType::ReadTimedout, why).into_up());
                }
            }
        }
    }
}

/// One chunk of the answer to the client: read for its usage, the usage event inferlb asked
/// for taken out, written.
async fn pass(
    lb: &Balancer,
    session: &mut Session,
    ctx: &mut Ctx,
    chunk: Option<Bytes>,
) -> pingora_core::Result<()> {
    lb.observe_response(chunk.as_ref(), false, ctx);
    let mut body = chunk;
    strip_usage(&mut body, false, ctx);
    if body.is_none() {
        return Ok(());
    }
    // On failure the client left: the decode's connection closes with this request.
    session
        .write_response_body(body, false)
        .await
        .map_err(|_| client_left())
}

/// The client went away while its answer was being written.
fn client_left() -> Box<Error> {
    Error::explain(ErrorType::WriteError, "the client left during the answer").into_down()
}
