//! `responses:`, where the Responses API's stored conversations are kept: on the replicas
//! (vLLM's own store, today's behaviour) or in the balancer, which then expands each
//! `previous_response_id` chain into a full prompt any replica can serve.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Who keeps the Responses exchanges a `previous_response_id` names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreAt {
    /// Each replica keeps its own (vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1`); a chained
    /// request goes to the replica that stores its previous response.
    #[default]
    Replica,
    /// inferlb keeps them (in memory, and in the cluster's Redis when there is one).
    Balancer,
}

/// `responses:` as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawResponses {
    store: StoreAt,
    max_items: usize,
    max_mib: usize,
    ttl_seconds: f64,
    key_max_items: Option<usize>,
    key_max_mib: Option<usize>,
    hold_ms: u64,
}

/// A key's quota when the conf sets none: this, or the store's bound if smaller.
const KEY_ITEMS: usize = 20_000;
const KEY_MIB: usize = 256;

impl Default for RawResponses {
    fn default() -> Self {
        RawResponses {
            store: StoreAt::Replica,
            max_items: 100_000,
            max_mib: 1024,
            ttl_seconds: 30.0 * 86_400.0,
            key_max_items: None,
            key_max_mib: None,
            hold_ms: 50,
        }
    }
}

/// The store's settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesConf {
    pub store: StoreAt,
    /// Exchanges kept in this process's memory, least recently used evicted first.
    pub max_items: usize,
    /// ... and at most this many bytes of them.
    pub max_bytes: usize,
    /// How long an exchange is kept after it was stored (here and in Redis).
    pub ttl: Duration,
    /// What one client key (by its conf name) may hold; past it, its own oldest go first.
    pub key_max_items: usize,
    pub key_max_bytes: usize,
    /// How long a stream's final event may wait for the exchange to reach Redis.
    pub hold: Duration,
}

impl ResponsesConf {
    pub fn in_balancer(&self) -> bool {
        self.store == StoreAt::Balancer
    }
}

impl Default for ResponsesConf {
    fn default() -> Self {
        validate(RawResponses::default()).expect("the defaults are valid")
    }
}

pub fn validate(raw: RawResponses) -> Result<ResponsesConf, String> {
    let positive = |name: &str, n: usize| {
        if n == 0 {
            Err(format!("inferlb.responses.{name} must be positive"))
        } else {
            Ok(n)
        }
    };
    positive("max_items", raw.max_items)?;
    positive("max_mib", raw.max_mib)?;
    let key_items = raw.key_max_items.unwrap_or(KEY_ITEMS.min(raw.max_items));
    let key_mib = raw.key_max_mib.unwrap_or(KEY_MIB.min(raw.max_mib));
    positive("key_max_items", key_items)?;
    positive("key_max_mib", key_mib)?;
    if key_items > raw.max_items || key_mib > raw.max_mib {
        return Err(
            "inferlb.responses: a key's quota (key_max_items, key_max_mib) may not exceed the \
             store's (max_items, max_mib)"
                .into(),
        );
    }
    let t = raw.ttl_seconds;
    if !(t.is_finite() && (1.0..=365.0 * 86_400.0).contains(&t)) {
        return Err(format!(
            "inferlb.responses.ttl_seconds: {t} must be at least 1 and at most a year"
        ));
    }
    if raw.hold_ms > 5_000 {
        return Err(format!(
            "inferlb.responses.hold_ms: {} is more than 5000 (a stream's end would wait that long \
             on a slow Redis)",
            raw.hold_ms
        ));
    }
    let mib = |n: usize| n.saturating_mul(1 << 20);
    Ok(ResponsesConf {
        store: raw.store,
        max_items: raw.max_items,
        max_bytes: mib(raw.max_mib),
        ttl: Duration::from_secs_f64(t),
        key_max_items: key_items,
        key_max_bytes: mib(key_mib),
        hold: Duration::from_millis(raw.hold_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(yaml: &str) -> Result<ResponsesConf, String> {
        let raw: RawResponses = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        validate(raw)
    }

    #[test]
    fn the_default_is_the_replicas_store() {
        let c = raw("{}").expect("defaults");
        assert!(!c.in_balancer());
        assert_eq!(c.hold, Duration::from_millis(50));
        assert!(raw("store: balancer").expect("balancer").in_balancer());
        let small = raw("max_items: 10\nmax_mib: 2").expect("a key's quota follows the store's");
        assert_eq!((small.key_max_items, small.key_max_bytes), (10, 2 << 20));
        assert_eq!(c.key_max_items, 20_000);
    }

    #[test]
    fn bounds_are_checked_with_the_key_named() {
        for (yaml, named) in [
            ("max_items: 0", "max_items"),
            ("key_max_mib: 0", "key_max_mib"),
            ("max_items: 10\nkey_max_items: 11", "quota"),
            ("ttl_seconds: 0.5", "ttl_seconds"),
            ("ttl_seconds: .nan", "ttl_seconds"),
            ("hold_ms: 60000", "hold_ms"),
            ("store: nowhere", "unknown variant"),
            ("stor: balancer", "unknown field"),
        ] {
            let e = raw(yaml).expect_err(yaml);
            assert!(e.contains(named), "{yaml}: {e}");
        }
    }
}
