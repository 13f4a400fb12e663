//! Many connections at once for minutes: no errors, memory flat, descriptors given back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::client::stream_chat;
use crate::cluster::{Cluster, ClusterSpec, Front};
use crate::procfs;
use crate::Args;

#[derive(Debug, Default, Clone, Serialize)]
pub struct SoakResult {
    pub connections: usize,
    pub seconds: f64,
    pub requests: u64,
    pub streams: u64,
    pub errors: u64,
    pub rss_start_kib: u64,
    pub rss_end_kib: u64,
    pub fds_start: usize,
    pub fds_under_load: usize,
    pub fds_after: usize,
    /// RSS sampled every tenth of the run, KiB.
    pub rss_series_kib: Vec<u64>,
}

/// What the clients saw, shared between them.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    streams: AtomicU64,
    errors: AtomicU64,
}

/// `connections` clients, one connection each, for `seconds`: half streams of 25 tokens, half
/// small requests; inferlb's RSS and descriptors sampled along the way.
pub async fn soak(a: &Args, connections: usize, seconds: f64) -> SoakResult {
    let c = Cluster::start(&ClusterSpec {
        front: Front::Inferlb("adaptive"),
        replicas: 2,
        speed: 1.0,
        cache_tokens: 100_000,
        sim_flags: &["--max-batch", "2048", "--decode-interval-ms", "20"],
        log: Some(a.out.join("logs").join("soak.log")),
        spill_margin: None,
    });
    let pid = c.lb.as_ref().map(|l| l.proc.pid()).unwrap_or(0);
    let base = c.target();
    // One connection per client task, so the count of open connections is the task count.
    let clients: Vec<reqwest::Client> = (0..connections)
        .map(|_| {
            reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(1)
                .timeout(Duration::from_secs(60))
                .build()
                .expect("client")
        })
        .collect();
    let warm = Instant::now() + Duration::from_secs_f64((seconds * 0.1).min(10.0));
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let tally = Arc::new(Tally::default());
    let mut result = SoakResult {
        connections,
        seconds,
        ..Default::default()
    };
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, client)| {
            let (base, tally) = (base.clone(), tally.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end && n < 100_000 {
                    let messages =
                        vec![json!({"role": "user", "content": format!("soak {i} {n}")})];
                    let ok = if (i + n as usize).is_multiple_of(2) {
                        tally.streams.fetch_add(1, Ordering::Relaxed);
                        !stream_chat(&client, &base, &messages, 25).await.failed
                    } else {
                        let body =
                            json!({"model": "sim-model", "messages": messages, "max_tokens": 5});
                        match client
                            .post(format!("{base}/v1/chat/completions"))
                            .json(&body)
                            .send()
                            .await
                        {
                            Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                            _ => false,
                        }
                    };
                    tally.requests.fetch_add(1, Ordering::Relaxed);
                    if !ok {
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                }
            })
        })
        .collect();
    let sampler = tokio::spawn(async move {
        let mut series = vec![];
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs_f64(seconds / 10.0)).await;
            series.push(procfs::rss_kib(pid));
        }
        series
    });
    tokio::time::sleep_until(warm.into()).await;
    result.rss_start_kib = procfs::rss_kib(pid);
    result.fds_start = procfs::fds(pid);
    tokio::time::sleep_until((end - Duration::from_secs_f64((seconds * 0.05).min(5.0))).into())
        .await;
    result.fds_under_load = procfs::fds(pid);
    for t in tasks {
        let _ = t.await;
    }
    // Every client and its connection is gone now; pooled upstream connections idle out after
    // 4 s (upstream.idle_timeout_seconds).
    tokio::time::sleep(Duration::from_secs(6)).await;
    result.rss_end_kib = procfs::rss_kib(pid);
    result.fds_after = procfs::fds(pid);
    result.rss_series_kib = sampler.await.unwrap_or_default();
    result.requests = tally.requests.load(Ordering::Relaxed);
    result.streams = tally.streams.load(Ordering::Relaxed);
    result.errors = tally.errors.load(Ordering::Relaxed);
    drop(c);
    result
}
