//! The link's one metric family, registered through pingora-prometheus's re-export like the
//! others (`crate::telemetry::metrics`), so it appears in the same scrape.

use std::sync::LazyLock;

use pingora_prometheus::prometheus::{
    self, register_int_counter_vec, register_int_gauge, IntCounterVec, IntGauge,
};

pub struct LinkMetrics {
    /// 1 while the link to Redis is up.
    pub up: IntGauge,
    /// Transitions, by the state entered (`up`, `down`).
    pub transitions: IntCounterVec,
}

fn build() -> Result<LinkMetrics, prometheus::Error> {
    let m = LinkMetrics {
        up: register_int_gauge!(
            "inferlb_redis_up",
            "1 while the link to the cluster's Redis is up (cluster state and shared budgets)."
        )?,
        transitions: register_int_counter_vec!(
            "inferlb_redis_transitions_total",
            "Times the link to the cluster's Redis went up or down, by the state entered.",
            &["to"]
        )?,
    };
    for to in ["up", "down"] {
        m.transitions.with_label_values(&[to]);
    }
    Ok(m)
}

pub static METRICS: LazyLock<LinkMetrics> =
    LazyLock::new(|| build().expect("metric names are unique and valid"));
