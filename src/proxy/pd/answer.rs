//! The client's answer to a handed-over request: the decode's header and the events held
//! before its first token, then the rest as it comes. Nothing is retried from here on.

use std::sync::Arc;

use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use super::{Held, Plan, Started};
use crate::cluster::Table;
use crate::fleet::replica::Replica;
use crate::proxy::attempt::{Attempt, Choice};
use crate::proxy::observe::read_answer;
use crate::proxy::{Balancer, Ctx};
use crate::routing::Route;
use crate::telemetry::metrics::METRICS;

impl Balancer {
    /// The client's answer: the decode's header and what was held, then the rest as it comes.
    pub(super) async fn stream(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        plan: &Plan,
        s: Started,
    ) -> pingora_core::Result<()> {
        let Started {
            decode,
            prefill,
            session: upstream,
            header,
            held,
            in_flight,
            kv,
            prefill_leg,
            local,
        } = s;
        drop(in_flight);
        if local.is_none() {
            let pulled = plan
                .prompt_tokens
                .saturating_sub(decode.cache.likely_cached(plan.prompt()).0);
            METRICS
                .pd_pull_tokens
                .with_label_values(&[&decode.id])
                .inc_by(pulled);
        }
        // Other instances learn the conversation's decode replica now.
        if let (Some(c), Some(info)) = (&self.cluster, &ctx.info) {
            for key in info.shape.served_key().into_iter().chain(ctx.session) {
                c.pin(Table::Affinity, key, &decode.id);
            }
        }
        let n = ctx.attempt.as_ref().map_or(0, |a| a.n) + 1;
        let route = match local {
            Some(_) => Route::PdLocal,
            None => Route::Pd,
        };
        // What its cache model held of a turn it prefilled itself; a handed-over turn's
        // cached count says what it pulled, not what it held.
        let predicted = local.is_some().then_some(plan.cached);
        ctx.attempt = Some(Attempt::start(
            n,
            Choice {
                replica: decode.clone(),
                route,
                // A handed-over turn has nothing to prefill there: the guard records the
                // prompt in its index once the first token passes (it pulled the KV).
                prefill: Some(local.unwrap_or_else(|| decode.queue_prefill(0))),
                // Held by the decode leg's own guard (`Held::_kv`).
                kv_tokens: 0,
                predicted,
                predicted_exact: predicted.is_some() && plan.cached_exact,
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
        let sse = read_answer(ctx, &header);
        let resp = self.client_header(
            &header,
            ctx,
            (&decode, route),
            prefill.as_ref(),
            length.filter(|_| !sse),
        );
        session.write_response_header(resp, false).await?;
        self.relay(session, ctx, (upstream, &decode), held).await
    }

    /// The client's header from a leg's: its status and content headers, inferlb's own.
    pub(super) fn client_header(
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
