//! Many connections at once for minutes: no errors, memory flat, descriptors given back. Then
//! inferlb's memory with 1,000 and 10,000 streams open at once.

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
    /// inferlb with many streams open at once.
    pub open_streams: Vec<OpenStreams>,
    /// The descriptor limit the bench (and every process it starts) ran with, or why it could
    /// not be raised.
    pub nofile_limit: String,
}

/// inferlb with `streams` streams open at once, each on its own connection.
#[derive(Debug, Default, Clone, Serialize)]
pub struct OpenStreams {
    pub streams: usize,
    /// Streams that had their first event when memory was read (the rest failed or were late).
    pub open: usize,
    pub errors: u64,
    /// Seconds until every stream was open (or the wait ended).
    pub open_seconds: f64,
    pub rss_idle_kib: u64,
    pub rss_open_kib: u64,
    pub fds_open: usize,
    /// Once the clients hung up.
    pub rss_after_kib: u64,
    pub fds_after: usize,
}

/// Raises this process's descriptor limit (soft and hard) to `want` where allowed (raising the
/// hard limit needs CAP_SYS_RESOURCE), else the soft limit to the hard one; the processes it
/// starts inherit it. What the limit is now, and why not more.
pub fn raise_nofile(want: u64) -> String {
    let mut now = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) != 0 {
            return "unknown (getrlimit failed)".into();
        }
        let wanted = libc::rlimit {
            rlim_cur: want,
            rlim_max: want.max(now.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
            return format!("{want} (raised from {} / {})", now.rlim_cur, now.rlim_max);
        }
        let why = std::io::Error::last_os_error();
        let soft = libc::rlimit {
            rlim_cur: now.rlim_max,
            rlim_max: now.rlim_max,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &soft) == 0 {
            return format!("{} (the hard limit; {want} refused: {why})", now.rlim_max);
        }
        format!("{} ({want} refused: {why})", now.rlim_cur)
    }
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
        lb_extra: "",
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

/// For each count: fresh replicas and inferlb, that many streams opened at once (each on its
/// own connection, slow enough to stay open), inferlb's RSS and descriptors once every stream
/// has its first event, and again once the clients hung up.
pub async fn open_streams(a: &Args, counts: &[usize]) -> Vec<OpenStreams> {
    // Long enough for pooled upstream connections to idle out (4 s), except in the smoke run.
    let settle = Duration::from_secs(if a.smoke { 1 } else { 6 });
    let mut out = vec![];
    for &n in counts {
        eprintln!("[soak] {n} streams open at once");
        let batch = (n + 64).to_string();
        let c = Cluster::start(&ClusterSpec {
            front: Front::Inferlb("adaptive"),
            replicas: 2,
            speed: 1.0,
            cache_tokens: 100_000,
            sim_flags: &[
                "--max-batch",
                &batch,
                "--prefill-tokens-per-s",
                "1e9",
                "--decode-interval-ms",
                "1000",
            ],
            log: Some(a.out.join("logs").join(format!("streams-{n}.log"))),
            spill_margin: None,
            lb_extra: "",
        });
        let pid = c.lb.as_ref().map(|l| l.proc.pid()).unwrap_or(0);
        let base = c.target();
        // One client: concurrent HTTP/1 requests each take a connection of their own.
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(120))
            .build()
            .expect("client");
        let mut row = OpenStreams {
            streams: n,
            rss_idle_kib: procfs::rss_kib(pid),
            ..OpenStreams::default()
        };
        let opened = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (client, base) = (client.clone(), base.clone());
                let (opened, failed) = (opened.clone(), failed.clone());
                tokio::spawn(async move {
                    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": format!("stream {i}")}], "stream": true, "max_tokens": 90});
                    let sent = client
                        .post(format!("{base}/v1/chat/completions"))
                        .json(&body)
                        .send()
                        .await;
                    let mut events = match sent {
                        Ok(r) if r.status() == 200 => r.bytes_stream(),
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    use futures::StreamExt;
                    if let Some(Ok(_)) = events.next().await {
                        opened.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    while let Some(Ok(_)) = events.next().await {}
                })
            })
            .collect();
        let limit = Instant::now() + Duration::from_secs(60);
        while Instant::now() < limit
            && opened.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed) < n as u64
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        row.open_seconds = started.elapsed().as_secs_f64();
        // Settled: the last streams' first events are through, the rest are between tokens.
        tokio::time::sleep(Duration::from_millis(500)).await;
        row.open = opened.load(Ordering::Relaxed) as usize;
        row.rss_open_kib = procfs::rss_kib(pid);
        row.fds_open = procfs::fds(pid);
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        drop(client);
        row.errors = failed.load(Ordering::Relaxed);
        tokio::time::sleep(settle).await;
        row.rss_after_kib = procfs::rss_kib(pid);
        row.fds_after = procfs::fds(pid);
        eprintln!(
            "[soak] {n} streams: {} open after {:.1} s, RSS {} -> {} -> {} KiB, {} fds open",
            row.open,
            row.open_seconds,
            row.rss_idle_kib,
            row.rss_open_kib,
            row.rss_after_kib,
            row.fds_open
        );
        out.push(row);
        drop(c);
    }
    out
}
