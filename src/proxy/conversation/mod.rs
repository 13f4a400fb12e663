//! `responses.store: balancer` in a request's life: before routing, a `previous_response_id`
//! chain is expanded into the full prompt (from [`crate::history`]) and the store's own paths
//! are answered; as the answer passes, it gets back the `store` and `previous_response_id` the
//! client sent, and its exchange is kept before the client sees its end. The bodies are
//! [`crate::protocol::conversation`]'s.

mod answer;

use answer::Answer;

use std::sync::Arc;

use bytes::Bytes;
use pingora_proxy::Session;
use serde_json::value::RawValue;

use super::answers::{self, Refusal};
use super::{Balancer, Ctx};
use crate::history::Store;
use crate::protocol::api::{classify, Family};
use crate::protocol::conversation::{self as conv, Exchange, Sent};
use crate::telemetry::metrics::METRICS;

/// One Responses exchange on its way: what the client sent, and the answer as it passes.
pub(super) struct Conversation {
    scope: u64,
    sent: Sent,
    /// The request's own input items.
    input: Box<RawValue>,
    /// The exchanges it continues, oldest first.
    chain: Vec<String>,
    /// The client asked for it to be stored.
    keep: bool,
    answer: Option<Answer>,
}

/// What the request filter does next.
pub(super) enum Next {
    /// Go on to routing (with the body expanded, when it continues a chain).
    Go,
    /// Answered here.
    Answered,
    Refused(Refusal, Option<Coded>),
}

/// An OpenAI error's `param` and `code`, as OpenAI gives them for this error.
pub(super) struct Coded {
    param: Option<&'static str>,
    code: Option<&'static str>,
}

fn refused(status: u16, reason: &'static str, message: String) -> Next {
    Next::Refused(
        Refusal {
            status,
            reason,
            message,
            close: false,
        },
        None,
    )
}

fn not_found(id: &str) -> Next {
    Next::Refused(
        Refusal {
            status: 404,
            reason: "response_not_found",
            message: format!("Response with id '{id}' not found."),
            close: false,
        },
        Some(Coded {
            param: None,
            code: None,
        }),
    )
}

/// Which of the store's own paths a request is on.
enum Path<'a> {
    Create,
    Get(&'a str),
    Delete(&'a str),
    InputItems(&'a str),
    /// Another path under `/v1/responses/` (`cancel`): a replica's.
    Other,
}

fn path_of<'a>(method: &http::Method, path: &'a str) -> Path<'a> {
    if path == "/v1/responses" {
        return if method == http::Method::POST {
            Path::Create
        } else {
            Path::Other
        };
    }
    let Some(rest) = path.strip_prefix("/v1/responses/") else {
        return Path::Other;
    };
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    match (method.as_str(), tail) {
        _ if id.is_empty() => Path::Other,
        ("GET", "") => Path::Get(id),
        ("DELETE", "") => Path::Delete(id),
        ("GET", "input_items") => Path::InputItems(id),
        _ => Path::Other,
    }
}

impl Balancer {
    /// The client key's scope: the key's name (`api_keys_file`'s `name key` lines, or
    /// overload protection's `keys`), so a rotated value keeps its chains; else the key itself,
    /// hashed; one shared scope without keys.
    fn scope(&self, session: &Session) -> u64 {
        if self.conf.api_keys.current().is_empty() {
            return crate::history::memory::SHARED;
        }
        let headers = &session.req_header().headers;
        let key = super::request::presented_key(headers);
        let name = self
            .conf
            .api_keys
            .name_of(key)
            .or_else(|| self.overload.as_ref().and_then(|o| o.key_name(headers)));
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"inferlb-scope\0");
        match name {
            Some(name) => {
                h.update(b"name\0");
                h.update(name.as_bytes());
            }
            None => {
                h.update(b"key\0");
                h.update(key);
            }
        }
        // Never the shared scope's tag.
        h.digest().max(1)
    }

    /// Before routing, with the store in the balancer: a create request's chain expanded, or
    /// one of the store's paths answered. Ids the store does not hold go on to the replicas'
    /// own lookup, so a fleet that switched from `store: replica` keeps its chains.
    pub(super) async fn converse(&self, session: &mut Session, ctx: &mut Ctx) -> Next {
        let Some(store) = self.history.clone() else {
            return Next::Go;
        };
        let req = session.req_header();
        let scope = self.scope(session);
        match path_of(&req.method, req.uri.path()) {
            Path::Create => self.create(store, scope, ctx).await,
            Path::Get(id) => match store.get(scope, id).await {
                Some(e) => {
                    let body = Bytes::copy_from_slice(e.response.get().as_bytes());
                    self.answer(session, ctx, body).await
                }
                None => self.on_a_replica(id, ctx).await,
            },
            Path::Delete(id) => {
                let id = id.to_owned();
                if store.delete(scope, &id).await {
                    let body = serde_json::json!({"id": id, "object": "response.deleted", "deleted": true});
                    self.answer(session, ctx, Bytes::from(body.to_string()))
                        .await
                } else {
                    self.on_a_replica(&id, ctx).await
                }
            }
            Path::InputItems(id) => {
                let query = req.uri.query().map(str::to_owned);
                let page = match conv::page(query.as_deref()) {
                    Ok(p) => p,
                    Err(why) => return refused(400, "bad_query", format!("input_items: {why}")),
                };
                match store.get(scope, id).await {
                    Some(e) => {
                        let body = conv::input_items(&e, &page);
                        self.answer(session, ctx, body).await
                    }
                    // A replica's own, from before the switch, if one says so.
                    None => self.on_a_replica(id, ctx).await,
                }
            }
            Path::Other => Next::Go,
        }
    }

    async fn answer(&self, session: &mut Session, ctx: &Ctx, body: Bytes) -> Next {
        match answers::respond_json(session, ctx.id(), 200, body).await {
            Ok(()) => Next::Answered,
            // The client is gone; nothing to tell it.
            Err(_) => Next::Answered,
        }
    }

    /// An id the store does not hold: the replica that stores it, if one says so (`find_owner`
    /// then routes the request there), else 404.
    async fn on_a_replica(&self, id: &str, ctx: &mut Ctx) -> Next {
        if let Some(r) = self.find_owner(Some(id.to_owned()), ctx).await {
            return Next::Refused(r, None);
        }
        if ctx.owner.is_some() {
            Next::Go
        } else {
            not_found(id)
        }
    }

    async fn create(&self, store: Arc<Store>, scope: u64, ctx: &mut Ctx) -> Next {
        let turn = match conv::turn(ctx.body.bytes()) {
            Ok(t) => t,
            Err(bad) => {
                let message = if bad.param.is_empty() {
                    bad.message.to_owned()
                } else {
                    format!("`{}` {}", bad.param, bad.message)
                };
                return refused(400, "bad_body", message);
            }
        };
        if turn.background {
            return Next::Refused(
                Refusal {
                    status: 400,
                    reason: "background",
                    message: "`background: true` needs a store on the replica, and this \
                              balancer keeps the Responses store itself (responses.store: \
                              balancer)"
                        .into(),
                    close: false,
                },
                Some(Coded {
                    param: Some("background"),
                    code: None,
                }),
            );
        }
        if turn.conversation {
            // The Conversations API is the replica's: passed as it came.
            return Next::Go;
        }
        let chain = match &turn.previous {
            None => Vec::new(),
            Some(id) => match store.chain(scope, id).await {
                Some(chain) => chain,
                None => {
                    // Not held here nor in Redis: perhaps a replica's own, from before the
                    // switch.
                    if let Some(r) = self.find_owner(None, ctx).await {
                        return Next::Refused(r, None);
                    }
                    if ctx.owner.is_some() {
                        return Next::Go;
                    }
                    METRICS
                        .responses_store
                        .with_label_values(&["not_found"])
                        .inc();
                    return Next::Refused(
                        Refusal {
                            status: 400,
                            reason: "previous_response_not_found",
                            message: format!("Previous response with id '{id}' not found."),
                            close: false,
                        },
                        Some(Coded {
                            param: Some("previous_response_id"),
                            code: Some("previous_response_not_found"),
                        }),
                    );
                }
            },
        };
        let history: Vec<&Exchange> = chain.iter().map(|e| &**e).collect();
        let Some(body) = conv::expand(ctx.body.bytes(), &history, &turn.input) else {
            return refused(
                400,
                "bad_body",
                "the request body must be a JSON object".into(),
            );
        };
        let limit = self.conf.max_body_bytes;
        if body.len() > limit {
            return refused(
                413,
                "too_large",
                format!(
                    "the conversation with its previous responses is {} bytes, more than the \
                     limit of {limit} bytes",
                    body.len()
                ),
            );
        }
        if !chain.is_empty() {
            METRICS
                .responses_store
                .with_label_values(&["expanded"])
                .inc();
            // Routed on the whole prompt, as any other.
            ctx.info = Some(classify(Family::Responses, &body));
        }
        ctx.body.replace(body);
        ctx.body_replaced = true;
        ctx.conversation = Some(Conversation {
            scope,
            sent: Sent {
                store: turn.store,
                previous: turn.previous,
            },
            input: turn.input,
            chain: chain.iter().map(|e| e.id.clone()).collect(),
            keep: turn.store,
            answer: None,
        });
        Next::Go
    }
}

/// A refusal with an OpenAI `param` and `code` of its own (`previous_response_not_found`).
pub(super) async fn refuse_coded(
    session: &mut Session,
    request_id: &str,
    r: &Refusal,
    coded: &Coded,
) -> pingora_core::Result<()> {
    METRICS.rejected.with_label_values(&[r.reason]).inc();
    let body = serde_json::json!({
        "error": {
            "message": r.message,
            "type": "invalid_request_error",
            "param": coded.param,
            "code": coded.code,
        }
    });
    if r.close {
        session.set_keepalive(None);
    }
    answers::respond_json(session, request_id, r.status, Bytes::from(body.to_string())).await
}
