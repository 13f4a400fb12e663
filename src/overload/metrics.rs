//! The overload metrics, registered through pingora-prometheus's re-export like the others
//! (`crate::telemetry::metrics`), so they appear in the same scrape.

use std::sync::LazyLock;

use pingora_prometheus::prometheus::{
    self, register_histogram_vec, register_int_counter_vec, register_int_gauge,
    register_int_gauge_vec, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec,
};

pub struct OverloadMetrics {
    pub queue_length: IntGaugeVec,
    pub queue_wait: HistogramVec,
    pub rejected: IntCounterVec,
    pub abandoned: IntCounterVec,
    pub tokens: IntCounterVec,
    pub saturated: IntGauge,
    pub shared: IntGauge,
}

fn build() -> Result<OverloadMetrics, prometheus::Error> {
    Ok(OverloadMetrics {
        queue_length: register_int_gauge_vec!(
            "inferlb_overload_queue_length",
            "Requests waiting inside inferlb for room on the fleet, by class.",
            &["class"]
        )?,
        queue_wait: register_histogram_vec!(
            "inferlb_overload_queue_wait_seconds",
            "Time a request admitted to a replica waited in inferlb's queue (0 when it did not), by class.",
            &["class"],
            vec![0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
        )?,
        rejected: register_int_counter_vec!(
            "inferlb_overload_rejected_total",
            "Requests answered 429 by overload protection, by key name and reason.",
            &["key", "reason"]
        )?,
        abandoned: register_int_counter_vec!(
            "inferlb_overload_abandoned_total",
            "Clients that hung up while their request waited in the queue, by class.",
            &["class"]
        )?,
        tokens: register_int_counter_vec!(
            "inferlb_overload_tokens_total",
            "Tokens counted against each key's budget: prompt (estimated at admission) and completion (from usage).",
            &["key", "kind"]
        )?,
        saturated: register_int_gauge!(
            "inferlb_overload_saturated",
            "1 while every live replica is over a limit and requests queue in inferlb."
        )?,
        shared: register_int_gauge!(
            "inferlb_overload_shared",
            "1 while per-key budgets are shared with the cluster's other instances through Redis."
        )?,
    })
}

pub static METRICS: LazyLock<OverloadMetrics> =
    LazyLock::new(|| build().expect("metric names are unique and valid"));
