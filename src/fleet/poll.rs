//! Each replica's own view of its load, read from its `/metrics` several times a second:
//! requests waiting and running (all its clients, every balancer in front of it), and its
//! prefix cache's capacity (`vllm:cache_config_info`). A replica whose `/metrics` is missing,
//! slow or malformed falls back to this process's own counts, logged once per transition;
//! never an error for a request.
//!
//! A replica's numbers are not trusted: each is clamped where it is read (see the bounds
//! below), so a page claiming `1e19` requests waiting makes the replica look very busy, never
//! wraps its cost around to look idle.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::fleet::affinity::AffinityTable;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;
use crate::telemetry::metrics::METRICS;

/// The most requests waiting (or running) a replica is believed to report, all its samples
/// summed; more reads as this many. No server queues a million requests.
pub const MAX_REQUESTS: u64 = crate::fleet::replica::MAX_REPORTED_REQUESTS;
/// The largest prefix cache a replica is believed to report, in tokens (10^10: a hundred
/// times the largest GPU pools of 2026).
pub const MAX_CACHE_TOKENS: u64 = 10_000_000_000;

/// How far in the future a replica's process start is believed: its clock may run ahead of
/// this host's, but a start later than this is not one.
const MAX_CLOCK_AHEAD_MS: u64 = 3_600_000;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether `ms` (Unix ms) can be a process start: not later than [`MAX_CLOCK_AHEAD_MS`] ahead
/// of this host's clock. One in the future (a wrong clock, or garbage) would hide every later
/// restart, read here or kept elsewhere (the state file, Redis) alike.
pub fn plausible_start(ms: u64) -> bool {
    ms > 0 && ms <= now_ms().saturating_add(MAX_CLOCK_AHEAD_MS)
}

/// A restart of `r` was counted (`why`, for the log): its pins go with its cache, said once and
/// counted. Whoever counts a restart calls this: the poll, or the cluster's comparison with
/// the start Redis keeps.
pub fn dropped_on_restart(affinity: &AffinityTable, r: &Replica, why: &str) {
    let pins = affinity.forget_replica(&r.id);
    log::warn!(
        "replica {}: restarted ({why}): its cache is empty, and so is inferlb's view of it; {pins} pins to it dropped",
        r.id
    );
    METRICS.restarts.with_label_values(&[&r.id]).inc();
}

/// What a vLLM `/metrics` page says about load and cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reported {
    pub waiting: u64,
    pub running: u64,
    /// `num_gpu_blocks` x `block_size`, when the page has `vllm:cache_config_info`.
    pub cache_tokens: Option<u64>,
    /// The share of its KV cache in use by running requests, in millionths
    /// (`vllm:kv_cache_usage_perc`, a fraction despite its name; SGLang's `token_usage`); of
    /// several engines, the fullest.
    pub kv_usage_ppm: Option<u64>,
    /// When the server's process started, in milliseconds since the Unix epoch
    /// (`process_start_time_seconds`, which Python's Prometheus client exports unless it runs
    /// in multiprocess mode): a later one than before means it restarted.
    pub started_ms: Option<u64>,
    /// The prompt tokens it served since its process started (`vllm:prompt_tokens_total`,
    /// SGLang's and llama.cpp's alike), summed over its series: where it gives no start, a
    /// count below the one before means it restarted.
    pub prompt_tokens_total: Option<u64>,
}

/// Reads the Prometheus text of a vLLM replica (SGLang's and llama.cpp's names too); `None` when it has
/// neither a waiting nor a running gauge, or a load sample that is not a number of requests
/// (NaN, infinite, negative). Samples of several models add up, to [`MAX_REQUESTS`] at most;
/// the cache size is at most [`MAX_CACHE_TOKENS`].
pub fn parse(text: &str) -> Option<Reported> {
    parse_rank(text, None)
}

/// [`parse`] for one data-parallel rank of the server: only the samples labelled
/// `engine="{rank}"` (vLLM labels each engine's), and those labelled with no engine.
pub fn parse_rank(text: &str, rank: Option<u16>) -> Option<Reported> {
    let mut r = Reported::default();
    let (mut waiting, mut running, mut bad_total) = (false, false, false);
    let rank = rank.map(|k| k.to_string());
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if let (Some(rank), Some(engine)) = (&rank, label(series, "engine")) {
            if engine != rank {
                continue;
            }
        }
        let name = series.split('{').next().unwrap_or("");
        let raw = value;
        let value = || requests(raw);
        match name {
            "vllm:num_requests_waiting"
            | "sglang:num_queue_reqs"
            | "llamacpp:requests_deferred" => {
                r.waiting = (r.waiting + value()?).min(MAX_REQUESTS);
                waiting = true;
            }
            "vllm:num_requests_running"
            | "sglang:num_running_reqs"
            | "llamacpp:requests_processing" => {
                r.running = (r.running + value()?).min(MAX_REQUESTS);
                running = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                // A share that is not a number is left out, not taken for the load.
                if let Some(v) = raw.trim().parse::<f64>().ok().filter(|v| v.is_finite()) {
                    let ppm = (v.clamp(0.0, 1.0) * 1e6) as u64;
                    // Several engines (data parallel) or an old name beside the new one: the
                    // fullest, never a sum that reads a half-full replica as full.
                    r.kv_usage_ppm = Some(r.kv_usage_ppm.unwrap_or(0).max(ppm));
                }
            }
            "vllm:prompt_tokens_total"
            | "sglang:prompt_tokens_total"
            | "llamacpp:prompt_tokens_total" => {
                // A count that is not one (NaN, negative) spoils the sum: none this read, lest
                // a sum without it read as a counter gone back. `as` saturates.
                match raw
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                {
                    Some(v) if !bad_total => {
                        let total = r.prompt_tokens_total.unwrap_or(0);
                        r.prompt_tokens_total = Some(total.saturating_add(v as u64));
                    }
                    _ => bad_total = true,
                }
            }
            "process_start_time_seconds" => {
                r.started_ms = raw
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .map(|v| (v * 1e3).round() as u64);
            }
            "vllm:cache_config_info" => {
                let blocks = label(series, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok());
                let size = label(series, "block_size").and_then(|v| v.parse::<u64>().ok());
                if let (Some(b), Some(s)) = (blocks, size) {
                    r.cache_tokens = Some(b.saturating_mul(s).min(MAX_CACHE_TOKENS));
                }
            }
            _ => {}
        }
    }
    if bad_total {
        r.prompt_tokens_total = None;
    }
    (waiting || running).then_some(r)
}

/// A sample's value as a count of requests, at most [`MAX_REQUESTS`]; `None` when it is not
/// a number, or NaN, infinite (`1e400` parses as infinite) or negative.
fn requests(value: &str) -> Option<u64> {
    let v = value.trim().parse::<f64>().ok()?;
    // `as` saturates; the `min` keeps the sum of a page's samples (each at most the bound)
    // far from overflow.
    (v.is_finite() && v >= 0.0).then(|| (v as u64).min(MAX_REQUESTS))
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
    /// Where conversations were served: a restarted replica's pins go.
    pub affinity: Arc<AffinityTable>,
    pub interval: Duration,
}

impl LoadReader {
    /// Reads the `/metrics` of `group`'s server once (the ranks of one data-parallel server
    /// share it) and gives each replica its own samples.
    async fn read(&self, group: &[&Arc<Replica>]) {
        let Some(first) = group.first() else {
            return;
        };
        let page = crate::fleet::probe::get(
            first,
            "/metrics",
            self.interval.max(Duration::from_millis(200)),
        )
        .await
        .filter(|(status, _)| *status == 200);
        let text = page.map(|(_, body)| String::from_utf8_lossy(&body).into_owned());
        for r in group {
            let reported = text
                .as_deref()
                .and_then(|t| parse_rank(t, r.endpoint.data_parallel_rank));
            self.apply(r, reported);
        }
    }

    fn apply(&self, r: &Replica, reported: Option<Reported>) {
        r.set_reported_load(reported.map(|x| (x.waiting, x.running)));
        r.set_reported_kv_usage(reported.and_then(|x| x.kv_usage_ppm));
        if let Some(tokens) = reported.and_then(|x| x.cache_tokens) {
            r.cache.capacity_reported();
            if !r.cache.configured && tokens != r.cache.index.capacity_tokens() && tokens > 0 {
                log::info!("replica {} caches {tokens} tokens (its /metrics)", r.id);
                r.cache.index.set_capacity_tokens(tokens);
                r.cache.resized();
            }
        }
        let started = reported
            .and_then(|x| x.started_ms)
            .filter(|ms| plausible_start(*ms));
        // By its start where it gives one; else by its prompt tokens counter going back.
        let restarted = match (started, reported.and_then(|x| x.prompt_tokens_total)) {
            (Some(ms), _) => r.started(ms).then_some("gives a later process start"),
            (None, Some(total)) => r.counted(total).then_some("counts fewer prompt tokens"),
            (None, None) => None,
        };
        if let Some(how) = restarted {
            dropped_on_restart(&self.affinity, r, &format!("its /metrics {how}"));
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
            join_all(groups(&fleet).iter().map(|g| self.read(g))).await;
        }
    }
}

/// The replicas grouped by the `/metrics` page that tells their load: the ranks of one
/// data-parallel server (by address) together, every other replica alone (two replicas
/// configured on one address are read each on its own, as they are checked).
fn groups(fleet: &[Arc<Replica>]) -> Vec<Vec<&Arc<Replica>>> {
    let mut out: Vec<Vec<&Arc<Replica>>> = Vec::with_capacity(fleet.len());
    let mut servers: std::collections::HashMap<&str, usize> = Default::default();
    for r in fleet {
        if r.endpoint.data_parallel_rank.is_none() {
            out.push(vec![r]);
            continue;
        }
        match servers.get(r.endpoint.address.as_str()) {
            Some(&i) => out[i].push(r),
            None => {
                servers.insert(&r.endpoint.address, out.len());
                out.push(vec![r]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::replica::Prompt;
    use proptest::prelude::*;

    #[test]
    fn vllm_metrics_give_load_and_cache_size() {
        let page = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="n"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="12500"} 1.0
vllm:prefix_cache_hits_total{model_name="m"} 1.2e6
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1500.0
vllm:prompt_tokens_total{engine="0",model_name="n"} 500.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.74262400557e+09
"#;
        assert_eq!(
            parse(page),
            Some(Reported {
                waiting: 4,
                running: 7,
                cache_tokens: Some(200_000),
                kv_usage_ppm: Some(250_000),
                started_ms: Some(1_742_624_005_570),
                prompt_tokens_total: Some(2_000),
            })
        );
    }

    /// llama.cpp's page (`--metrics`): its deferred and processing requests are the load, its
    /// prompt tokens counter tells restarts; it gives no start and no cache size.
    #[test]
    fn a_llama_cpp_page_gives_the_load_and_the_prompt_tokens_counter() {
        let page = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n\
# TYPE llamacpp:prompt_tokens_total counter\n\
llamacpp:prompt_tokens_total 33065\n\
llamacpp:prompt_seconds_total 235.743\n\
llamacpp:requests_processing 2\n\
llamacpp:requests_deferred 5\n";
        assert_eq!(
            parse(page),
            Some(Reported {
                waiting: 5,
                running: 2,
                prompt_tokens_total: Some(33_065),
                ..Reported::default()
            })
        );
        // One series that is not a count spoils the sum, before or after the others.
        for odd in [
            "llamacpp:requests_processing 1\nllamacpp:prompt_tokens_total NaN\n",
            "vllm:num_requests_running 1\nvllm:prompt_tokens_total{model_name=\"a\"} 9\n\
             vllm:prompt_tokens_total{model_name=\"b\"} -1\n",
            "vllm:num_requests_running 1\nvllm:prompt_tokens_total{model_name=\"b\"} x\n\
             vllm:prompt_tokens_total{model_name=\"a\"} 9\n",
        ] {
            assert_eq!(
                parse(odd).and_then(|r| r.prompt_tokens_total),
                None,
                "{odd}"
            );
        }
    }

    /// A data-parallel server's page (vLLM labels each engine's samples): each rank reads
    /// its own engine's load, usage and cache; the unlabelled samples belong to all.
    #[test]
    fn each_rank_reads_its_own_engine() {
        let page = r#"vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="10",model_name="m"} 50.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2000"} 1.0
"#;
        let rank = |k| parse_rank(page, Some(k)).expect("load");
        assert_eq!(
            rank(0),
            Reported {
                waiting: 3,
                running: 7,
                cache_tokens: Some(32_000),
                kv_usage_ppm: Some(500_000),
                started_ms: None,
                prompt_tokens_total: None,
            }
        );
        assert_eq!(
            rank(1),
            Reported {
                waiting: 0,
                running: 2,
                cache_tokens: Some(16_000),
                kv_usage_ppm: Some(125_000),
                started_ms: None,
                prompt_tokens_total: None,
            }
        );
        assert_eq!(rank(10).running, 50);
        assert_eq!(parse_rank(page, Some(2)), None, "no such engine");
        // Not a rank: the whole server.
        assert_eq!(parse(page).map(|r| (r.waiting, r.running)), Some((3, 59)));
        let unlabelled = "vllm:num_requests_running{model_name=\"m\"} 4\n";
        assert_eq!(parse_rank(unlabelled, Some(3)).map(|r| r.running), Some(4));
    }

    /// A conf's data-parallel entries are a replica per rank; the ranks of one server are
    /// read from one page, two servers' ranks apart, and every other replica alone.
    #[test]
    fn the_ranks_of_a_server_share_one_page_read() {
        let text = [
            "inferlb:",
            "  replicas:",
            "    - {id: solo-a, address: \"127.0.0.1:9001\"}",
            "    - {id: dp, address: \"127.0.0.1:9100\", data_parallel_size: 2}",
            "    - {id: solo-b, address: \"127.0.0.1:9100\"}",
            "    - {id: other, address: \"127.0.0.1:9200\", data_parallel_size: 3}",
        ]
        .join("\n");
        let l = crate::conf::parse(&text, None).expect("conf");
        let reg = Registry::new(&l.inferlb.replicas, &l.inferlb.upstream);
        let fleet = reg.all();
        let ids: Vec<Vec<&str>> = groups(&fleet)
            .iter()
            .map(|g| g.iter().map(|r| &*r.id).collect())
            .collect();
        assert_eq!(
            ids,
            [
                vec!["solo-a"],
                vec!["dp-dp0", "dp-dp1"],
                vec!["solo-b"],
                vec!["other-dp0", "other-dp1", "other-dp2"]
            ]
        );
        let ranks: Vec<_> = fleet
            .iter()
            .map(|r| r.endpoint.data_parallel_rank)
            .collect();
        assert_eq!(
            ranks,
            [None, Some(0), Some(1), None, Some(0), Some(1), Some(2)]
        );
        assert!(
            l.inferlb.warnings().iter().all(|w| !w.contains("dp-dp1")),
            "ranks of one server do not share a cache: {:?}",
            l.inferlb.warnings()
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

    /// A number a replica reports is clamped where it is read: no sum of samples wraps, NaN,
    /// infinities and negative counts refuse the page (local counts are used instead).
    #[test]
    fn hostile_numbers_are_clamped_or_refused() {
        let max = MAX_REQUESTS;
        let rows: &[(&str, Option<(u64, u64)>)] = &[
            ("vllm:num_requests_waiting 1e19\nvllm:num_requests_waiting 1e19", Some((max, 0))),
            // 2^63 twice: wraps to exactly 0 when added unchecked.
            (
                "vllm:num_requests_waiting 9223372036854775808\nvllm:num_requests_waiting 9223372036854775808",
                Some((max, 0)),
            ),
            ("vllm:num_requests_running 18446744073709551615", Some((0, max))),
            ("vllm:num_requests_running 1e300\nsglang:num_running_reqs 1e300", Some((0, max))),
            ("vllm:num_requests_waiting 1000001", Some((max, 0))),
            ("vllm:num_requests_waiting 1000000", Some((max, 0))),
            ("vllm:num_requests_waiting 999999\nvllm:num_requests_waiting 2", Some((max, 0))),
            ("vllm:num_requests_waiting 2.9", Some((2, 0))),
            ("vllm:num_requests_waiting -0", Some((0, 0))),
            ("vllm:num_requests_waiting 1e-300", Some((0, 0))),
            ("vllm:num_requests_waiting -1", None),
            ("vllm:num_requests_waiting NaN", None),
            ("vllm:num_requests_waiting +Inf", None),
            ("vllm:num_requests_waiting inf", None),
            ("vllm:num_requests_waiting 1e400", None),
            ("vllm:num_requests_waiting -1e400", None),
            ("vllm:num_requests_waiting 0x10", None),
            ("vllm:num_requests_running 3\nvllm:num_requests_waiting NaN", None),
        ];
        for (page, want) in rows {
            assert_eq!(
                parse(page).map(|r| (r.waiting, r.running)),
                *want,
                "{page:?}"
            );
        }
        let cache = |blocks: &str, size: &str| {
            parse(&format!(
                "vllm:num_requests_running 1\nvllm:cache_config_info{{block_size=\"{size}\",num_gpu_blocks=\"{blocks}\"}} 1"
            ))
            .and_then(|r| r.cache_tokens)
        };
        assert_eq!(cache("18446744073709551615", "16"), Some(MAX_CACHE_TOKENS));
        assert_eq!(cache("4294967296", "4294967296"), Some(MAX_CACHE_TOKENS));
        assert_eq!(cache("18446744073709551616", "16"), None, "not a u64");
        assert_eq!(cache("-1", "16"), None);
        assert_eq!(cache("1e9", "16"), None);
        assert_eq!(cache("100", "16"), Some(1600));
        let started = |v: &str| {
            parse(&format!(
                "vllm:num_requests_running 1\nprocess_start_time_seconds {v}"
            ))
            .and_then(|r| r.started_ms)
        };
        assert_eq!(started("1.7e9"), Some(1_700_000_000_000));
        for v in ["NaN", "-1.7e9", "0", "+Inf", "1e400", "x"] {
            assert_eq!(started(v), None, "{v}");
        }
    }

    /// A replica whose page claims an absurd load (2^63 requests waiting and running, twice:
    /// unchecked, the sums wrap to 0) looks busier than a busy one, never idle: under
    /// `prefill_cost` it gets no traffic while the busy one has room. Before, it got all.
    #[test]
    fn a_replica_reporting_absurd_load_is_not_preferred() {
        use crate::conf::Mode;
        use crate::protocol::api::{classify, Family};
        use crate::routing::Router;

        let reg = crate::fleet::registry::test_registry(&["load-busy", "load-absurd"]);
        let fleet = reg.all();
        let absurd = "vllm:num_requests_waiting 9223372036854775808\n\
            vllm:num_requests_waiting 9223372036854775808\n\
            vllm:num_requests_running 9223372036854775808\n\
            vllm:num_requests_running 9223372036854775808\n";
        let busy = "vllm:num_requests_waiting 8\nvllm:num_requests_running 24\n";
        for (r, page) in fleet.iter().zip([busy, absurd]) {
            // Requests sent from here averaged 2,000 uncached tokens.
            drop(r.queue_prefill(2_000));
            let reported = parse(page).expect("a load page");
            r.set_reported_load(Some((reported.waiting, reported.running)));
        }
        let policy = Router::new(Mode::PrefillCost, None);
        let mut got = [0usize; 2];
        for i in 0..20 {
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"question {i}"}}]}}"#
            );
            let info = classify(Family::Chat, body.as_bytes());
            let links = info.shape.links();
            let candidates = Registry::candidates(
                &fleet,
                &[],
                None,
                Prompt::of_links(links),
                crate::conf::Protocol::Vllm,
            );
            let d = policy
                .decide(&info.shape, None, &candidates, &|_| None, i)
                .expect("a replica");
            got[fleet
                .iter()
                .position(|r| *r.id == *d.replica)
                .expect("ours")] += 1;
        }
        assert!(got[1] <= got[0], "busy {} absurd {}", got[0], got[1]);
        assert_eq!(got, [20, 0]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        /// Whatever the page (load lines with any number-like text, any bytes), reading it
        /// never panics and what it gives stays in bounds.
        #[test]
        fn any_page_reads_within_bounds(
            lines in prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "vllm:num_requests_waiting",
                        "vllm:num_requests_running",
                        "sglang:num_queue_reqs",
                        "sglang:num_running_reqs",
                        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1\"}",
                        "other",
                    ]),
                    prop_oneof![
                        any::<f64>().prop_map(|v| v.to_string()),
                        any::<u64>().prop_map(|v| v.to_string()),
                        "[-+0-9.eEinfatyNI]{0,12}",
                        "\\PC{0,16}",
                    ],
                ),
                0..12,
            ),
            junk in "\\PC{0,64}",
        ) {
            let mut page: String = lines.iter().map(|(n, v)| format!("{n} {v}\n")).collect();
            page.push_str(&junk);
            if let Some(r) = parse(&page) {
                prop_assert!(r.waiting <= MAX_REQUESTS && r.running <= MAX_REQUESTS);
                prop_assert!(r.cache_tokens.is_none_or(|t| t <= MAX_CACHE_TOKENS));
            }
        }
    }
}
