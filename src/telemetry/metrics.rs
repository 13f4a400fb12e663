//! Prometheus metrics, registered through pingora-prometheus's re-export of `prometheus`
//! (a second copy of the crate would register into a registry nobody scrapes).
//!
//! Per-replica series exist only for the replicas the registry holds: the gauges (up, in
//! flight, draining) are read from each replica's own state at scrape time, and a removed
//! replica's counter series are deleted with it, and not created again by a late count.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use pingora_prometheus::prometheus::core::{Collector, Desc};
use pingora_prometheus::prometheus::proto::MetricFamily;
use pingora_prometheus::prometheus::{
    self, register_histogram_vec, register_int_counter, register_int_counter_vec,
    register_int_gauge, register_int_gauge_vec, Encoder, GaugeVec, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

/// The `replica` label of a request no replica served.
pub const NO_REPLICA: &str = "none";

/// What a replica's gauges are read from, at each scrape.
pub trait ReplicaGauges: Send + Sync {
    /// Passes health checks and is not demoted.
    fn up(&self) -> bool;
    fn in_flight(&self) -> usize;
    fn draining(&self) -> bool;
    /// Its part in its pool (`plain`, `prefill`, `decode`, `both`).
    fn role(&self) -> &'static str;
    /// KV its running requests hold, in tokens.
    fn kv_tokens(&self) -> u64;
    /// Bytes of prompt per token of its tokenizer, by API family (`chat`, `completions`,
    /// `responses`, `messages`), for the families its answers taught one.
    fn bytes_per_token(&self) -> Vec<(&'static str, f64)>;
}

type Tracked = HashMap<Arc<str>, Weak<dyn ReplicaGauges>>;

/// The replicas the registry holds, by id.
static TRACKED: LazyLock<RwLock<Tracked>> = LazyLock::new(Default::default);

fn tracked() -> RwLockReadGuard<'static, Tracked> {
    TRACKED.read().unwrap_or_else(|e| e.into_inner())
}

fn tracked_mut() -> RwLockWriteGuard<'static, Tracked> {
    TRACKED.write().unwrap_or_else(|e| e.into_inner())
}

/// Replica `id` is in the registry: it has series from now on (it replaces an earlier
/// replica of that id).
pub fn track<R: ReplicaGauges + 'static>(id: &Arc<str>, replica: &Arc<R>) {
    LazyLock::force(&METRICS);
    let weak: Weak<dyn ReplicaGauges> = Arc::downgrade(replica) as _;
    tracked_mut().insert(id.clone(), weak);
}

/// Replica `id` left the registry: every series that names it goes. Nothing happens when
/// `replica` is no longer the one tracked under `id` (a replica of that id was added since).
pub fn forget<R: ReplicaGauges + 'static>(id: &str, replica: &Arc<R>) {
    let mut fleet = tracked_mut();
    let ours = fleet
        .get(id)
        .is_some_and(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(replica)));
    if !ours {
        return;
    }
    fleet.remove(id);
    let m = &*METRICS;
    for counters in [
        &m.requests,
        &m.failovers,
        &m.upstream_errors,
        &m.prompt_tokens,
        &m.cached_tokens,
        &m.predicted_cached_tokens,
        &m.reported_cached_tokens,
        &m.mispredictions,
        &m.restarts,
        &m.kv_events,
        &m.pd_legs,
        &m.pd_pull_tokens,
    ] {
        counters.remove(id);
    }
    let _ = m.kv_events_state.remove_label_values(&[id]);
    let _ = m.kv_blocks.remove_label_values(&[id]);
}

/// Counters whose first label is `replica`: a count for a replica that is not (or no longer)
/// in the registry is dropped, so a request that ends after its replica was removed does not
/// bring the removed replica's series back.
pub struct ReplicaCounters(IntCounterVec);

/// Where counts for replicas that are gone go: never registered, never scraped.
static DETACHED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "inferlb_detached",
        "Counts of replicas no longer in the registry.",
    )
    .expect("a valid name")
});

impl ReplicaCounters {
    /// The counter of these label values, the replica's id first (as `IntCounterVec`'s).
    pub fn with_label_values<V: AsRef<str> + std::fmt::Debug>(&self, vals: &[V]) -> IntCounter {
        // Under the read lock: `forget` (write lock) cannot run between the check and the
        // series' creation.
        let fleet = tracked();
        match vals.first().map(AsRef::as_ref) {
            Some(id) if id == NO_REPLICA || fleet.contains_key(id) => {
                self.0.with_label_values(vals)
            }
            _ => DETACHED.clone(),
        }
    }

    /// Deletes every series whose `replica` label is `id`.
    fn remove(&self, id: &str) {
        for family in self.0.collect() {
            for metric in family.get_metric() {
                let labels: HashMap<&str, &str> = metric
                    .get_label()
                    .iter()
                    .map(|l| (l.name(), l.value()))
                    .collect();
                if labels.get("replica") == Some(&id) {
                    let _ = self.0.remove(&labels);
                }
            }
        }
    }
}

/// `inferlb_replica_up`, `_in_flight` and `_draining`, filled from the tracked replicas at
/// each scrape: a value set from a count read earlier could be stale (two concurrent
/// requests ending could leave 1 in flight), one read at the scrape cannot.
struct ReplicaGaugeFamilies {
    up: IntGaugeVec,
    in_flight: IntGaugeVec,
    draining: IntGaugeVec,
    role: IntGaugeVec,
    kv_tokens: IntGaugeVec,
    bytes_per_token: GaugeVec,
    /// One scrape fills the vectors at a time.
    filling: Mutex<()>,
}

impl ReplicaGaugeFamilies {
    fn new() -> Result<Self, prometheus::Error> {
        let vec = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["replica"]);
        Ok(ReplicaGaugeFamilies {
            up: vec(
                "inferlb_replica_up",
                "1 when the replica passes health checks and is not demoted.",
            )?,
            in_flight: vec(
                "inferlb_replica_in_flight",
                "Requests in flight on the replica.",
            )?,
            draining: vec(
                "inferlb_replica_draining",
                "1 while the replica is drained by the admin endpoint.",
            )?,
            role: IntGaugeVec::new(
                Opts::new(
                    "inferlb_replica_role",
                    "1 for the replica's role in its pool (plain, prefill, decode, both).",
                ),
                &["replica", "role"],
            )?,
            kv_tokens: vec(
                "inferlb_replica_kv_tokens",
                "KV its running requests hold, in tokens (this process's and its /metrics').",
            )?,
            bytes_per_token: GaugeVec::new(
                Opts::new(
                    "inferlb_replica_bytes_per_token",
                    "Bytes of prompt per token of the replica's tokenizer, learnt from its answers' usage, by API family.",
                ),
                &["replica", "api"],
            )?,
            filling: Mutex::new(()),
        })
    }
}

impl Collector for ReplicaGaugeFamilies {
    fn desc(&self) -> Vec<&Desc> {
        [
            &self.up,
            &self.in_flight,
            &self.draining,
            &self.role,
            &self.kv_tokens,
        ]
        .into_iter()
        .flat_map(|v| v.desc())
        .chain(self.bytes_per_token.desc())
        .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let _one = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        let vecs = [
            &self.up,
            &self.in_flight,
            &self.draining,
            &self.role,
            &self.kv_tokens,
        ];
        vecs.iter().for_each(|v| v.reset());
        self.bytes_per_token.reset();
        for (id, r) in tracked().iter() {
            let Some(r) = r.upgrade() else { continue };
            let id: &str = id;
            self.up.with_label_values(&[id]).set(r.up() as i64);
            self.in_flight
                .with_label_values(&[id])
                .set(i64::try_from(r.in_flight()).unwrap_or(i64::MAX));
            self.draining
                .with_label_values(&[id])
                .set(r.draining() as i64);
            self.role.with_label_values(&[id, r.role()]).set(1);
            self.kv_tokens
                .with_label_values(&[id])
                .set(i64::try_from(r.kv_tokens()).unwrap_or(i64::MAX));
            for (api, ratio) in r.bytes_per_token() {
                self.bytes_per_token
                    .with_label_values(&[id, api])
                    .set(ratio);
            }
        }
        vecs.iter()
            .flat_map(|v| v.collect())
            .chain(self.bytes_per_token.collect())
            .collect()
    }
}

pub struct Metrics {
    pub requests: ReplicaCounters,
    pub failovers: ReplicaCounters,
    pub affinity_entries: IntGauge,
    pub stored_responses: IntGauge,
    pub cluster_connected: IntGauge,
    pub cluster_dropped: IntCounter,
    pub ttfb: HistogramVec,
    pub stream_errors: IntCounter,
    pub rejected: IntCounterVec,
    pub upstream_errors: ReplicaCounters,
    pub prompt_tokens: ReplicaCounters,
    pub cached_tokens: ReplicaCounters,
    /// Over the answers that reported a cached count: what the cache model predicted, and
    /// what the replica said.
    pub predicted_cached_tokens: ReplicaCounters,
    pub reported_cached_tokens: ReplicaCounters,
    pub mispredictions: ReplicaCounters,
    /// Restarts found from a replica's `/metrics` (its process start moved on).
    pub restarts: ReplicaCounters,
    /// KV events read from the replicas, by kind; the state of each replica's stream.
    pub kv_events: ReplicaCounters,
    pub kv_events_state: IntGaugeVec,
    pub kv_blocks: IntGaugeVec,
    pub cache_source: IntCounterVec,
    pub tls_reloads: IntCounter,
    /// Secret files read again: `changed` (swapped in) or `failed` (the old one kept).
    pub secret_reloads: IntCounterVec,
    /// Legs of disaggregated requests, by replica, leg (`prefill`, `decode`) and outcome.
    pub pd_legs: ReplicaCounters,
    /// Disaggregated-pool requests served whole (`pd-local`) and why: `small_uncached`,
    /// `idle_decode`, `no_prefill_live`, `prefill_failed`, `same_replica`, `no_handover` (a
    /// body or answer the handover cannot carry).
    pub pd_whole: IntCounterVec,
    /// KV tokens a decode replica was expected to pull (the prompt minus what it holds).
    pub pd_pull_tokens: ReplicaCounters,
    /// The balancer's Responses store: exchanges held here and their bytes.
    pub responses_items: IntGauge,
    pub responses_bytes: IntGauge,
    /// What befell stored exchanges and chains, by `event`.
    pub responses_store: IntCounterVec,
}

fn build() -> Result<Metrics, prometheus::Error> {
    prometheus::register(Box::new(ReplicaGaugeFamilies::new()?))?;
    Ok(Metrics {
        requests: ReplicaCounters(register_int_counter_vec!(
            "inferlb_requests_total",
            "Requests answered, by replica, route decision and status class.",
            &["replica", "route", "code"]
        )?),
        failovers: ReplicaCounters(register_int_counter_vec!(
            "inferlb_failovers_total",
            "Attempts that failed before the client got a byte and were retried elsewhere.",
            &["replica", "reason"]
        )?),
        affinity_entries: register_int_gauge!(
            "inferlb_affinity_entries",
            "Served message lists remembered in the affinity table."
        )?,
        stored_responses: register_int_gauge!(
            "inferlb_stored_responses",
            "Stored Responses ids remembered, each with the replica that stores it."
        )?,
        cluster_connected: register_int_gauge!(
            "inferlb_cluster_connected",
            "1 while this instance shares its routing state through Redis."
        )?,
        cluster_dropped: register_int_counter!(
            "inferlb_cluster_dropped_total",
            "Changes not shared: the queue to Redis was full, or too many were made while Redis was away."
        )?,
        ttfb: register_histogram_vec!(
            "inferlb_time_to_first_byte_seconds",
            "From the request's arrival to the first response byte from the replica.",
            &["route"],
            vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
        )?,
        stream_errors: register_int_counter!(
            "inferlb_stream_errors_total",
            "Responses cut after the client got bytes (never retried)."
        )?,
        pd_legs: ReplicaCounters(register_int_counter_vec!(
            "inferlb_pd_legs_total",
            "Legs of disaggregated requests, by replica, leg and outcome.",
            &["replica", "leg", "outcome"]
        )?),
        pd_whole: register_int_counter_vec!(
            "inferlb_pd_whole_total",
            "Requests for a disaggregated model served whole on a decode replica, by reason.",
            &["reason"]
        )?,
        pd_pull_tokens: ReplicaCounters(register_int_counter_vec!(
            "inferlb_pd_pull_tokens_total",
            "KV tokens decode replicas were expected to pull (prompt tokens they lacked).",
            &["replica"]
        )?),
        responses_items: register_int_gauge!(
            "inferlb_responses_store_items",
            "Responses exchanges this instance holds in memory (responses.store: balancer)."
        )?,
        responses_bytes: register_int_gauge!(
            "inferlb_responses_store_bytes",
            "Bytes of the Responses exchanges this instance holds in memory."
        )?,
        responses_store: {
            let events = register_int_counter_vec!(
                "inferlb_responses_store_total",
                "The balancer's Responses store, by event: stored, expanded (a chain made into a prompt), not_found (a previous_response_id nowhere this instance can reach), broken (a chain missing a part), unsent (a write Redis did not take, retried), hold_expired (an answer that went on before Redis had its exchange), read_slow (a read that went on without Redis after 250 ms).",
                &["event"]
            )?;
            // Every event has a series from the start, so dashboards and alerts find them.
            for event in [
                "stored",
                "expanded",
                "not_found",
                "broken",
                "unsent",
                "hold_expired",
                "read_slow",
            ] {
                events.with_label_values(&[event]);
            }
            events
        },
        upstream_errors: ReplicaCounters(register_int_counter_vec!(
            "inferlb_upstream_errors_total",
            "Requests that ended in a replica's failure, not retried (timeouts, cut streams), by reason.",
            &["replica", "reason"]
        )?),
        prompt_tokens: ReplicaCounters(register_int_counter_vec!(
            "inferlb_prompt_tokens_total",
            "Prompt tokens of answered requests, as the replicas report them in `usage`.",
            &["replica"]
        )?),
        cached_tokens: ReplicaCounters(register_int_counter_vec!(
            "inferlb_cached_prompt_tokens_total",
            "Prompt tokens the replicas served from their prefix cache (usage.prompt_tokens_details.cached_tokens).",
            &["replica"]
        )?),
        predicted_cached_tokens: ReplicaCounters(register_int_counter_vec!(
            "inferlb_cache_predicted_tokens_total",
            "Cached prompt tokens inferlb's cache model predicted, over answers whose usage reports a cached count (in the replica's tokens).",
            &["replica"]
        )?),
        reported_cached_tokens: ReplicaCounters(register_int_counter_vec!(
            "inferlb_cache_reported_tokens_total",
            "Cached prompt tokens the replicas reported, over the same answers as inferlb_cache_predicted_tokens_total.",
            &["replica"]
        )?),
        kv_events: ReplicaCounters(register_int_counter_vec!(
            "inferlb_kv_events_total",
            "What the replica's KV events said, by kind: stored, removed (blocks), untrusted (blocks stored on a parent never seen, not kept), cleared (events), batches (applied from the stream), replayed (batches applied from the replay socket: a connect's catch-up, a gap healed), undecodable (batches).",
            &["replica", "kind"]
        )?),
        kv_blocks: register_int_gauge_vec!(
            "inferlb_kv_blocks",
            "Blocks in the replica's block index, built from its KV events.",
            &["replica"]
        )?,
        cache_source: register_int_counter_vec!(
            "inferlb_cache_lookups_total",
            "Requests routed by prefix cost, by where the chosen replica's cached prefix came from: events (its KV events, for a prompt whose tokens are known) or estimate.",
            &["source"]
        )?,
        kv_events_state: register_int_gauge_vec!(
            "inferlb_kv_events_state",
            "The replica's KV event stream: 2 live (seen whole), 1 partial (a gap not healed), 0 gone.",
            &["replica"]
        )?,
        mispredictions: ReplicaCounters(register_int_counter_vec!(
            "inferlb_cache_mispredictions_total",
            "Answers whose replica cached less than predicted (by more than a block and a token), by cause: evicted (part held), absent (none held).",
            &["replica", "cause"]
        )?),
        restarts: ReplicaCounters(register_int_counter_vec!(
            "inferlb_replica_restarts_total",
            "Restarts of the replica found from its /metrics (process_start_time_seconds moved later): each emptied inferlb's view of its cache.",
            &["replica"]
        )?),
        tls_reloads: register_int_counter!(
            "inferlb_tls_certificate_reloads_total",
            "Times the listener's certificate was replaced from its changed files."
        )?,
        secret_reloads: register_int_counter_vec!(
            "inferlb_secret_reloads_total",
            "Secret files (client keys, replica keys, tokens) read again after a change, by result: changed (in use now) or failed (the old value kept).",
            &["result"]
        )?,
        rejected: register_int_counter_vec!(
            "inferlb_rejected_total",
            "Requests answered by the balancer itself, by reason.",
            &["reason"]
        )?,
    })
}

pub static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| build().expect("metric names are unique and valid"));

/// The text exposition of every registered metric.
pub fn render() -> Vec<u8> {
    LazyLock::force(&METRICS);
    let mut out = Vec::new();
    let families = prometheus::gather();
    // Encoding into a Vec cannot fail for well-formed families.
    let _ = prometheus::TextEncoder::new().encode(&families, &mut out);
    out
}

/// "2xx", "4xx", ...: the status class label.
pub fn code_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "none",
    }
}
