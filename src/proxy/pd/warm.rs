//! A turn served whole on its decode replica, prefilled again afterwards on the prefill replica
//! a handover would take, so the prefill pool does not fall a turn behind.

use std::sync::Arc;

use super::Held;
use crate::fleet::pool::Leg;
use crate::protocol::handover;
use crate::proxy::exchange::{read_all, release, LegError};
use crate::proxy::Balancer;
use crate::routing;
use crate::telemetry::metrics::METRICS;

impl Balancer {
    /// At a request's end: a turn served whole on its decode replica and answered is
    /// prefilled again on the prefill replica a handover would take, when that replica is idle
    /// and lags (`routing::pd::warm_prefill`): one token, not streamed, and no
    /// `kv_transfer_params`, so it holds no blocks for a decode. It runs apart, bounded by the
    /// prefill timeout, once the client has its answer (its body and its reply are not
    /// worked on beside the answer's stream), and its usage is no one's.
    pub(in crate::proxy) fn warm_prefill(&self, pd: &mut Held, answered: bool) {
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
                // Not over within the prefill timeout: a silence, as a leg's.
                Err(_) => "read_timeout",
            };
            METRICS
                .pd_legs
                .with_label_values(&[&p.id, "warm", outcome])
                .inc();
        });
    }
}
