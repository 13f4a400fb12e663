//! Each leg's exchange: the vLLM prefill (one token, its `kv_transfer_params`), the decode up
//! to its first token, and SGLang's two legs at once in a bootstrap room.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{Background, Plan, Started};
use crate::fleet::replica::{InFlight, Replica};
use crate::protocol::handover;
use crate::proxy::exchange::{first_token, read_all, release, LegError};
use crate::proxy::observe::is_sse;
use crate::proxy::Balancer;
use crate::telemetry::metrics::METRICS;

impl Balancer {
    /// SGLang: both legs at once, meeting in a fresh bootstrap room on the prefill server.
    pub(super) async fn sglang_pair(
        &self,
        plan: &Plan,
        p: &Arc<Replica>,
        held: u64,
        (d, in_flight): (&Arc<Replica>, InFlight),
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
                    .map_err(|_| LegError::TimedOut("the prefill did not end in time".into()))??;
                if !status.status.is_success() {
                    return Err(LegError::Answered(status, answer));
                }
                queued.prefilled(&links);
                Ok(())
            })
        };
        let mut prefill = Background(prefill);
        let decode = self.decode_leg(plan, (d, in_flight), body, "decode");
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

    /// The vLLM prefill leg: one token, not streamed; its answer's `kv_transfer_params`.
    pub(super) async fn prefill_leg(
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
            .map_err(|_| LegError::TimedOut("the prefill did not end in time".into()))??;
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

    /// A decode leg up to its first token (or its whole answer when it does not stream);
    /// `leg` names it in the metrics: `decode`, or `local` for a turn served whole there.
    pub(super) async fn decode_leg(
        &self,
        plan: &Plan,
        (d, in_flight): (&Arc<Replica>, InFlight),
        body: Bytes,
        leg: &'static str,
    ) -> Result<Box<Started>, LegError> {
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
        let held = if is_sse(&header) {
            first_token(&mut s, self.conf.upstream.read_timeout).await?
        } else {
            Vec::new()
        };
        METRICS.pd_legs.with_label_values(&[&d.id, leg, "ok"]).inc();
        Ok(Box::new(Started {
            decode: d.clone(),
            prefill: None,
            session: s,
            header,
            held,
            in_flight,
            kv,
            prefill_leg: None,
            local: None,
        }))
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
