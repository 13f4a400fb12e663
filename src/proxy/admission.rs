//! What is settled before a replica is chosen: the request head (size, key), the body and what
//! routing reads from it, and for a stored response, the replica that stores it.

use pingora_http::RequestHeader;
use pingora_proxy::Session;

use super::answers::{self, Refusal};
use super::{request, stored_key, Balancer, Ctx};
use crate::cluster::Table;
use crate::fleet::chain::PromptTokens;
use crate::overload::Admission;
use crate::protocol::api::classify;
use crate::protocol::body::{BodyLimits, BodyReplay};

/// The largest body tokenized for the replicas' KV events; a larger one is routed by the
/// estimate.
pub const MAX_TOKENIZED_BYTES: usize = 1 << 20;

/// Bytes of a chat prompt's text tokenized first, beyond what the message cache holds: about
/// 4k tokens, a few milliseconds cold. The rest only when a replica holds all of them.
pub const PROBE_TEXT_BYTES: usize = 16 << 10;

impl Balancer {
    /// What the request head alone settles: its size, its key, and whether its (normalised)
    /// path is forwarded at all.
    pub(super) fn check_head(&self, req: &RequestHeader) -> Option<Refusal> {
        let limit = self.conf.max_header_bytes;
        if request::header_bytes(req) > limit {
            return Some(Refusal {
                status: 431,
                reason: "headers_too_large",
                message: format!("request headers are larger than the limit of {limit} bytes"),
                close: true,
            });
        }
        let path = req.uri.path();
        let conf = &self.conf;
        if !request::authorized(&conf.api_keys.current(), &conf.public_paths, path, req) {
            return Some(Refusal {
                status: 401,
                reason: "unauthorized",
                message: "Incorrect API key provided: send `Authorization: Bearer <key>`".into(),
                close: true,
            });
        }
        if !request::forwarded(&conf.forward_paths, path) {
            return Some(Refusal {
                status: 404,
                reason: "not_forwarded",
                message: format!("{} {path} is not an endpoint inferlb serves", req.method),
                close: true,
            });
        }
        None
    }

    /// Reads the body and learns what routing needs from it; or why not.
    pub(super) async fn read_request(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> Option<Refusal> {
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

    /// The prompt's token ids, worth their cost only where a replica's KV events can be asked
    /// about them: a policy that weighs prefill, a model with a tokenizer, and a replica of it
    /// that publishes its events. Called once the request is admitted, and tokenized off the
    /// proxy's threads; a body over [`MAX_TOKENIZED_BYTES`] is left to the estimate (a cold
    /// render and tokenization costs about 0.35 ms a KB). A new chat prompt is tokenized up to
    /// [`PROBE_TEXT_BYTES`] first: where no replica holds all of that part, the part says how
    /// much each holds, and the rest is left (its length estimated).
    pub(super) async fn tokens_of(
        &self,
        path: &str,
        ctx: &Ctx,
    ) -> Option<std::sync::Arc<PromptTokens>> {
        let model = ctx.info.as_ref().and_then(|i| i.model.clone())?;
        let body = ctx.body.bytes().clone();
        if !self.policy.weighs_prefill()
            || !self.tokenizers.knows(&model)
            || body.len() > MAX_TOKENIZED_BYTES
        {
            return None;
        }
        let fleet = self.registry.all();
        if !fleet
            .iter()
            .any(|r| r.cache.blocks.is_some() && r.serves(&model))
        {
            return None;
        }
        let (tokenizers, family, path) = (self.tokenizers.clone(), ctx.family, path.to_owned());
        tokio::task::spawn_blocking(move || {
            // A new prompt's first part, then all of it only if some replica holds all of
            // that part: most of a long cold prompt is never tokenized.
            let first = tokenizers.ids(family, &path, &model, &body, PROBE_TEXT_BYTES)?;
            let part = PromptTokens::partial(first.ids, first.total);
            let held_all = || {
                fleet
                    .iter()
                    .filter(|r| r.serves(&model))
                    .filter_map(|r| r.cache.blocks.as_ref())
                    .any(|b| b.holds_all(&part))
            };
            if first.whole || !held_all() {
                return Some(std::sync::Arc::new(part));
            }
            let whole = tokenizers
                .ids(family, &path, &model, &body, usize::MAX)
                .map(|all| PromptTokens::partial(all.ids, all.total));
            Some(std::sync::Arc::new(whole.unwrap_or(part)))
        })
        .await
        .ok()?
    }

    /// The replica that stores the response this request continues (or `named` in its path),
    /// if inferlb knows it or a replica says so when asked; a refusal when that replica is
    /// unavailable (no other replica has it, and a silent 404 from one would mislead).
    pub(super) async fn find_owner(&self, named: Option<String>, ctx: &mut Ctx) -> Option<Refusal> {
        let info = ctx.info.as_ref();
        let continued = info.and_then(|i| i.previous_response_id.clone());
        let id = continued.or(named)?;
        let known = self.stored.served_by(stored_key(&id));
        let owner = match known.and_then(|owner| self.registry.get(&owner)) {
            Some(owner) => owner,
            None => {
                let among = self.registry.reachable();
                let timeout = self.conf.stored_lookup_timeout;
                let found = crate::fleet::probe::stored_response(&among, &id, timeout).await?;
                self.remember(Table::Stored, stored_key(&id), &found.id);
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

    /// Every model the replicas serve. Right after start (or an added replica's first check)
    /// the health checks may not have learnt a replica's yet: those are asked now, rather than
    /// answer a list a client would take for "no models".
    pub(super) async fn models_now(&self) -> Vec<String> {
        let among = self.registry.reachable();
        crate::fleet::probe::learn_models(&among, self.conf.health.timeout).await;
        self.registry.all_models()
    }

    /// Overload protection, when configured: the request goes on now, waits for room, or is
    /// answered 429 here. True when it was answered here (or its client left while it waited).
    pub(super) async fn admit_load(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> pingora_core::Result<bool> {
        let (Some(overload), Some(info)) = (&self.overload, &ctx.info) else {
            return Ok(false);
        };
        let who = overload.identify(&session.req_header().headers);
        let tokens = info.shape.prompt_tokens();
        // The rest of a large chunked body still on the wire is Pingora's to read: a read
        // here would take its terminator (as a pipelined request's first byte, or as data).
        // Its hang-up then goes unwatched; the queue's wait bound still holds it.
        let tail_pending = ctx.body.tail_pending(session);
        let downstream = session.as_downstream_mut();
        // The whole body is read: the next read ends only when the client hangs up.
        let gone = async {
            if tail_pending || downstream.read_body_or_idle(true).await.is_ok() {
                std::future::pending::<()>().await;
            }
        };
        let model = info.model.as_deref();
        match overload
            .admit(&mut ctx.overload, who, tokens, model, gone)
            .await
        {
            Admission::Go => Ok(false),
            Admission::Refused(too_many) => {
                answers::too_many(session, ctx.id(), ctx.family, &too_many).await?;
                Ok(true)
            }
            Admission::Gone => {
                session.set_keepalive(None);
                Ok(true)
            }
        }
    }

    /// The request ended: its key is charged the tokens its replica reported, its place given
    /// back.
    pub(super) fn release_load(&self, ctx: &mut Ctx) {
        if let Some(overload) = &self.overload {
            let usage = ctx.usage;
            let prompt = usage.map(|u| u.prompt_tokens);
            let completion = usage.map(|u| u.completion_tokens);
            overload.finish(&mut ctx.overload, prompt, completion);
        }
    }
}
