//! Prometheus metrics, registered through pingora-prometheus's re-export of `prometheus`
//! (a second copy of the crate would register into a registry nobody scrapes).

use std::sync::LazyLock;

use pingora_prometheus::prometheus::{
    self, register_histogram_vec, register_int_counter, register_int_counter_vec,
    register_int_gauge, register_int_gauge_vec, Encoder, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec,
};

pub struct Metrics {
    pub requests: IntCounterVec,
    pub failovers: IntCounterVec,
    pub up: IntGaugeVec,
    pub in_flight: IntGaugeVec,
    pub draining: IntGaugeVec,
    pub affinity_entries: IntGauge,
    pub stored_responses: IntGauge,
    pub cluster_connected: IntGauge,
    pub cluster_dropped: IntCounter,
    pub ttfb: HistogramVec,
    pub stream_errors: IntCounter,
    pub rejected: IntCounterVec,
    pub upstream_errors: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub cached_tokens: IntCounterVec,
    pub tls_reloads: IntCounter,
    /// Secret files read again: `changed` (swapped in) or `failed` (the old one kept).
    pub secret_reloads: IntCounterVec,
}

fn build() -> Result<Metrics, prometheus::Error> {
    Ok(Metrics {
        requests: register_int_counter_vec!(
            "inferlb_requests_total",
            "Requests answered, by replica, route decision and status class.",
            &["replica", "route", "code"]
        )?,
        failovers: register_int_counter_vec!(
            "inferlb_failovers_total",
            "Attempts that failed before the client got a byte and were retried elsewhere.",
            &["replica", "reason"]
        )?,
        up: register_int_gauge_vec!(
            "inferlb_replica_up",
            "1 when the replica passes health checks and is not demoted.",
            &["replica"]
        )?,
        in_flight: register_int_gauge_vec!(
            "inferlb_replica_in_flight",
            "Requests in flight on the replica.",
            &["replica"]
        )?,
        draining: register_int_gauge_vec!(
            "inferlb_replica_draining",
            "1 while the replica is drained by the admin endpoint.",
            &["replica"]
        )?,
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
            "Changes not shared because the queue to Redis was full."
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
        upstream_errors: register_int_counter_vec!(
            "inferlb_upstream_errors_total",
            "Requests that ended in a replica's failure, not retried (timeouts, cut streams), by reason.",
            &["replica", "reason"]
        )?,
        prompt_tokens: register_int_counter_vec!(
            "inferlb_prompt_tokens_total",
            "Prompt tokens of answered requests, as the replicas report them in `usage`.",
            &["replica"]
        )?,
        cached_tokens: register_int_counter_vec!(
            "inferlb_cached_prompt_tokens_total",
            "Prompt tokens the replicas served from their prefix cache (usage.prompt_tokens_details.cached_tokens).",
            &["replica"]
        )?,
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
