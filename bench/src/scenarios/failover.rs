//! Steady traffic while one replica is stopped halfway.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::client::{scrape_sum, stream_chat};
use crate::cluster::Cluster;
use crate::Sizes;

#[derive(Debug, Default, Clone, Serialize)]
pub struct FailoverResult {
    pub requests: u64,
    /// Failed before any byte of a 200 reached the client: what failover must prevent.
    pub errors_before_streaming: u64,
    /// Streams that began and were then cut (never retried, by design).
    pub streams_cut: u64,
    pub failovers: f64,
    /// Status codes of the failed requests (0: no response at all).
    pub error_statuses: BTreeMap<u16, u64>,
}

/// What the workers saw, shared between them.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    errors_before_streaming: AtomicU64,
    streams_cut: AtomicU64,
    error_statuses: Mutex<BTreeMap<u16, u64>>,
}

/// Steady traffic from 6 workers; replica gpu0 is stopped halfway.
pub async fn failover(client: &reqwest::Client, c: &mut Cluster, s: &Sizes) -> FailoverResult {
    let base = c.target();
    let stop_at = Instant::now() + Duration::from_secs_f64(s.failover_seconds / 2.0);
    let end = Instant::now() + Duration::from_secs_f64(s.failover_seconds);
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (client, base, tally) = (client.clone(), base.clone(), tally.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while Instant::now() < end && i < 10_000 {
                    let messages =
                        vec![json!({"role": "user", "content": format!("worker {w} request {i}")})];
                    let o = stream_chat(&client, &base, &messages, 8).await;
                    tally.requests.fetch_add(1, Ordering::Relaxed);
                    if o.status != 200 {
                        tally
                            .errors_before_streaming
                            .fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut m) = tally.error_statuses.lock() {
                            *m.entry(o.status).or_insert(0) += 1;
                        }
                    } else if o.cut_after_start {
                        tally.streams_cut.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                    if o.status != 200 {
                        // Do not spin on a dead target.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep_until(stop_at.into()).await;
    c.stop_sim(0);
    for w in workers {
        let _ = w.await;
    }
    let failovers = match c.admin_port() {
        Some(admin) => scrape_sum(client, admin, "inferlb_failovers_total").await,
        None => 0.0,
    };
    FailoverResult {
        requests: tally.requests.load(Ordering::Relaxed),
        errors_before_streaming: tally.errors_before_streaming.load(Ordering::Relaxed),
        streams_cut: tally.streams_cut.load(Ordering::Relaxed),
        failovers,
        error_statuses: tally
            .error_statuses
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default(),
    }
}
