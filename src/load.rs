//! Each replica's own view of its load, read from its `/metrics` several times a second:
//! requests waiting and running (all its clients, every balancer in front of it), and its
//! prefix cache's capacity (`vllm:cache_config_info`). A replica whose `/metrics` is missing,
//! slow or malformed falls back to this process's own counts, logged once per transition;
//! never an error for a request.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::registry::Registry;
use crate::replica::Replica;

/// What a vLLM `/metrics` page says about load and cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reported {
    pub waiting: u64,
    pub running: u64,
    /// `num_gpu_blocks` x `block_size`, when the page has `vllm:cache_config_info`.
    pub cache_tokens: Option<u64>,
}

/// Reads the Prometheus text of a vLLM replica (SGLang's names too); `None` when it has
/// neither a waiting nor a running gauge. Samples of several models add up.
pub fn parse(text: &str) -> Option<Reported> {
    let mut r = Reported::default();
    let (mut waiting, mut running) = (false, false);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or("");
        let value = || {
            value
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                r.waiting += value()? as u64;
                waiting = true;
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                r.running += value()? as u64;
                running = true;
            }
            "vllm:cache_config_info" => {
                let blocks = label(series, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok());
                let size = label(series, "block_size").and_then(|v| v.parse::<u64>().ok());
                if let (Some(b), Some(s)) = (blocks, size) {
                    r.cache_tokens = Some(b.saturating_mul(s));
                }
            }
            _ => {}
        }
    }
    (waiting || running).then_some(r)
}

/// The value of label `key` in a series like `name{a="1",key="2"}`.
fn label<'t>(series: &'t str, key: &str) -> Option<&'t str> {
    let labels = series.split_once('{')?.1.strip_suffix('}')?;
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

pub struct LoadReader {
    pub registry: Arc<Registry>,
    pub interval: Duration,
}

impl LoadReader {
    async fn read(&self, r: &Replica) {
        let page = crate::probe::get(r, "/metrics", self.interval.max(Duration::from_millis(200)))
            .await
            .filter(|(status, _)| *status == 200);
        let reported = page.and_then(|(_, body)| parse(&String::from_utf8_lossy(&body)));
        r.set_reported_load(reported.map(|x| (x.waiting, x.running)));
        if let Some(tokens) = reported.and_then(|x| x.cache_tokens) {
            if !r.cache_configured && tokens != r.index.capacity_tokens() && tokens > 0 {
                log::info!("replica {} caches {tokens} tokens (its /metrics)", r.id);
                r.index.set_capacity_tokens(tokens);
            }
        }
        let ok = reported.is_some();
        if r.note_metrics_read(ok) {
            if ok {
                log::info!("replica {}: load read from its /metrics again", r.id);
            } else {
                log::warn!(
                    "replica {}: /metrics missing, slow or not vLLM's: routing on this process's own counts",
                    r.id
                );
            }
        }
    }
}

#[async_trait]
impl BackgroundService for LoadReader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            let fleet = self.registry.all();
            join_all(fleet.iter().map(|r| self.read(r))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics_give_load_and_cache_size() {
        let page = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="n"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="12500"} 1.0
vllm:prefix_cache_hits_total{model_name="m"} 1.2e6
"#;
        assert_eq!(
            parse(page),
            Some(Reported {
                waiting: 4,
                running: 7,
                cache_tokens: Some(200_000)
            })
        );
    }

    #[test]
    fn pages_without_load_or_with_garbage_are_none() {
        assert_eq!(parse(""), None);
        assert_eq!(parse("not prometheus at all"), None);
        assert_eq!(parse("vllm:num_requests_waiting NaN"), None);
        assert_eq!(parse("vllm:num_requests_waiting{a=\"1\"} -3"), None);
        let no_cache = parse("vllm:num_requests_running 2").expect("load");
        assert_eq!((no_cache.running, no_cache.cache_tokens), (2, None));
        assert_eq!(label("x{a=\"1\",b=\"two\"}", "b"), Some("two"));
        assert_eq!(label("x", "b"), None);
    }
}
