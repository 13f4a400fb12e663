//! The `inferlb.overload` section: parsed as written ([`RawOverload`]), then validated once into
//! an [`OverloadConf`] the rest of the program trusts. Every bad value is refused with its key
//! named (`inferlb.overload.queue_length: ...`).

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The section as written; see the README's "Overload and fairness" for each key.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawOverload {
    #[serde(default)]
    max_queued_prefill_tokens: Option<i64>,
    #[serde(default)]
    max_running: Option<i64>,
    #[serde(default = "default_queue_length")]
    queue_length: i64,
    #[serde(default = "default_queue_timeout")]
    queue_timeout_seconds: f64,
    #[serde(default = "default_window")]
    window_seconds: f64,
    #[serde(default)]
    key_header: Option<String>,
    #[serde(default)]
    class_header: Option<String>,
    #[serde(default)]
    classes: Option<Vec<String>>,
    #[serde(default)]
    default_class: Option<String>,
    #[serde(default)]
    budget: Option<RawBudget>,
    #[serde(default)]
    keys: Vec<RawKey>,
    #[serde(default = "default_max_keys")]
    max_keys: i64,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    #[serde(default)]
    max_concurrent: Option<i64>,
    #[serde(default)]
    tokens_per_minute: Option<i64>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// The label metrics and logs use: never the key itself.
    name: String,
    #[serde(serialize_with = "crate::conf::secrets::redact")]
    key: String,
    #[serde(default)]
    class: Option<String>,
    #[serde(default)]
    max_concurrent: Option<i64>,
    #[serde(default)]
    tokens_per_minute: Option<i64>,
}

fn default_queue_length() -> i64 {
    1000
}
fn default_queue_timeout() -> f64 {
    30.0
}
fn default_window() -> f64 {
    60.0
}
fn default_max_keys() -> i64 {
    100_000
}

/// Limits of one key (or of every key not listed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Budget {
    /// Requests inside inferlb at once (queued or at a replica).
    pub max_concurrent: Option<u32>,
    /// Prompt and completion tokens per minute, enforced over `window`.
    pub tokens_per_minute: Option<u64>,
}

/// A key listed in the conf.
#[derive(Debug, Clone)]
pub struct KeyConf {
    /// Its metrics label, shared by its requests (no allocation per request).
    pub name: std::sync::Arc<str>,
    /// Its class, also the highest a `class_header` may ask for it.
    pub class: Option<usize>,
    pub budget: Budget,
}

/// The validated section.
#[derive(Debug, Clone)]
pub struct OverloadConf {
    /// A replica with this much prefill queued (tokens) is full; `None`: no token limit.
    pub max_queued_prefill_tokens: Option<u64>,
    /// A replica running this many requests is full; `None`: no limit.
    pub max_running: Option<usize>,
    /// Requests waiting inside inferlb at most.
    pub queue_length: usize,
    /// The longest a request waits in the queue before its 429.
    pub queue_timeout: Duration,
    /// The span token budgets are counted over.
    pub window: Duration,
    /// A request header naming the client (a tenant); absent or empty: the API key.
    pub key_header: Option<String>,
    /// A request header naming the request's class.
    pub class_header: Option<String>,
    /// Class names, highest priority first.
    pub classes: Vec<String>,
    pub default_class: usize,
    /// The budget of every key not listed in `keys`.
    pub budget: Budget,
    /// Listed keys, by [`key_id`] of the key.
    pub keys: HashMap<u64, KeyConf>,
    /// Keys whose budgets are tracked at once (clients may choose keys).
    pub max_keys: usize,
}

impl OverloadConf {
    /// Whether admission by load is on (at least one per-replica limit).
    pub fn limits_load(&self) -> bool {
        self.max_queued_prefill_tokens.is_some() || self.max_running.is_some()
    }
}

/// The id a client key (or tenant header value) is counted under.
pub fn key_id(key: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"inferlb-overload-key\0");
    h.update(key);
    h.digest()
}

fn whole(key: &str, v: i64, max: i64) -> Result<u64, String> {
    if (1..=max).contains(&v) {
        Ok(v as u64)
    } else {
        Err(format!(
            "inferlb.overload.{key}: {v} is out of range (1 to {max})"
        ))
    }
}

fn seconds(key: &str, v: f64, min: f64, max: f64) -> Result<Duration, String> {
    if v.is_finite() && v >= min && v <= max {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(format!(
            "inferlb.overload.{key}: {v} is out of range ({min} to {max} seconds)"
        ))
    }
}

fn header(key: &str, v: Option<&str>) -> Result<Option<String>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(name) => http::HeaderName::from_bytes(name.as_bytes())
            .map(|h| Some(h.as_str().to_owned()))
            .map_err(|_| format!("inferlb.overload.{key}: {name:?} is not a header name")),
    }
}

fn budget(
    key: &str,
    max_concurrent: Option<i64>,
    tokens_per_minute: Option<i64>,
) -> Result<Budget, String> {
    Ok(Budget {
        max_concurrent: max_concurrent
            .map(|v| whole(&format!("{key}max_concurrent"), v, 1_000_000))
            .transpose()?
            .map(|v| v as u32),
        tokens_per_minute: tokens_per_minute
            .map(|v| whole(&format!("{key}tokens_per_minute"), v, 1_000_000_000_000))
            .transpose()?,
    })
}

fn label_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Checks the section; an error names the key.
pub fn validate(raw: RawOverload) -> Result<OverloadConf, String> {
    let classes = raw.classes.unwrap_or_else(|| vec!["default".into()]);
    if classes.is_empty() || classes.len() > 16 {
        return Err("inferlb.overload.classes: 1 to 16 class names, highest first".into());
    }
    for (i, c) in classes.iter().enumerate() {
        if !label_ok(c) || classes[..i].contains(c) {
            return Err(format!(
                "inferlb.overload.classes[{i}]: {c:?} must be a unique name of letters, digits, '-', '_' or '.'"
            ));
        }
    }
    let class_of = |key: &str, name: &str| {
        classes.iter().position(|c| c == name).ok_or_else(|| {
            format!("inferlb.overload.{key}: {name:?} is not one of the classes {classes:?}")
        })
    };
    let default_class = match raw.default_class.as_deref() {
        None => classes.len() - 1,
        Some(name) => class_of("default_class", name)?,
    };
    let raw_budget = raw.budget.unwrap_or_default();
    let mut keys = HashMap::new();
    let mut names = std::collections::HashSet::new();
    for (i, k) in raw.keys.iter().enumerate() {
        let at = format!("keys[{i}].");
        if !label_ok(&k.name) || !names.insert(k.name.as_str()) {
            return Err(format!(
                "inferlb.overload.{at}name: {:?} must be a unique label of letters, digits, '-', '_' or '.'",
                k.name
            ));
        }
        if k.key.is_empty() {
            return Err(format!("inferlb.overload.{at}key: must not be empty"));
        }
        let class = k
            .class
            .as_deref()
            .map(|c| class_of(&format!("{at}class"), c))
            .transpose()?;
        let conf = KeyConf {
            name: std::sync::Arc::from(k.name.as_str()),
            class,
            budget: budget(&at, k.max_concurrent, k.tokens_per_minute)?,
        };
        if keys.insert(key_id(k.key.as_bytes()), conf).is_some() {
            return Err(format!("inferlb.overload.{at}key: listed twice"));
        }
    }
    Ok(OverloadConf {
        max_queued_prefill_tokens: raw
            .max_queued_prefill_tokens
            .map(|v| whole("max_queued_prefill_tokens", v, 1_000_000_000))
            .transpose()?,
        max_running: raw
            .max_running
            .map(|v| whole("max_running", v, 100_000))
            .transpose()?
            .map(|v| v as usize),
        queue_length: whole("queue_length", raw.queue_length, 1_000_000)? as usize,
        queue_timeout: seconds(
            "queue_timeout_seconds",
            raw.queue_timeout_seconds,
            0.01,
            3600.0,
        )?,
        window: seconds("window_seconds", raw.window_seconds, 0.5, 86_400.0)?,
        key_header: header("key_header", raw.key_header.as_deref())?,
        class_header: header("class_header", raw.class_header.as_deref())?,
        classes,
        default_class,
        budget: budget(
            "budget.",
            raw_budget.max_concurrent,
            raw_budget.tokens_per_minute,
        )?,
        keys,
        max_keys: whole("max_keys", raw.max_keys, 100_000_000)? as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<OverloadConf, String> {
        let raw: RawOverload = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        validate(raw)
    }

    #[test]
    fn a_full_section_reads_with_classes_and_keys() {
        let c = parse(
            "max_queued_prefill_tokens: 8192\nmax_running: 32\nqueue_length: 500\n\
             queue_timeout_seconds: 5\nwindow_seconds: 2\nkey_header: X-Tenant\n\
             class_header: x-priority\nclasses: [interactive, batch]\n\
             budget: {max_concurrent: 8}\n\
             keys:\n  - {name: alice, key: sk-alice-1, class: interactive, tokens_per_minute: 60000}\n",
        )
        .expect("valid");
        assert_eq!(c.max_queued_prefill_tokens, Some(8192));
        assert_eq!(c.max_running, Some(32));
        assert_eq!(c.queue_length, 500);
        assert_eq!(c.window, Duration::from_secs(2));
        assert_eq!(c.key_header.as_deref(), Some("x-tenant"));
        assert_eq!(c.default_class, 1, "the lowest class unless named");
        assert_eq!(c.budget.max_concurrent, Some(8));
        let alice = &c.keys[&key_id(b"sk-alice-1")];
        assert_eq!((&*alice.name, alice.class), ("alice", Some(0)), "{alice:?}");
        assert_eq!(alice.budget.tokens_per_minute, Some(60000));
        assert!(c.limits_load());
    }

    #[test]
    fn an_empty_section_has_defaults_and_no_load_limit() {
        let c = parse("{}").expect("valid");
        assert_eq!(c.queue_length, 1000);
        assert_eq!(c.classes, vec!["default"]);
        assert_eq!(c.max_keys, 100_000);
        assert!(!c.limits_load());
    }

    #[test]
    fn zero_negative_absurd_and_unknown_values_are_refused_with_the_key_named() {
        let cases = [
            ("queue_length: 0", "overload.queue_length"),
            ("max_keys: 0", "overload.max_keys"),
            ("queue_length: -5", "overload.queue_length"),
            ("queue_length: 100000000000", "overload.queue_length"),
            ("max_running: 0", "overload.max_running"),
            (
                "max_queued_prefill_tokens: -1",
                "overload.max_queued_prefill_tokens",
            ),
            (
                "max_queued_prefill_tokens: 99999999999",
                "overload.max_queued_prefill_tokens",
            ),
            ("queue_timeout_seconds: 0", "overload.queue_timeout_seconds"),
            (
                "queue_timeout_seconds: .nan",
                "overload.queue_timeout_seconds",
            ),
            ("window_seconds: -60", "overload.window_seconds"),
            ("window_seconds: 1e12", "overload.window_seconds"),
            (
                "budget: {max_concurrent: 0}",
                "overload.budget.max_concurrent",
            ),
            (
                "budget: {tokens_per_minute: -100}",
                "overload.budget.tokens_per_minute",
            ),
            ("key_header: \"x tenant\"", "overload.key_header"),
            ("classes: []", "overload.classes"),
            ("classes: [a, a]", "overload.classes[1]"),
            ("default_class: gold", "overload.default_class"),
            (
                "keys: [{name: a, key: k1, class: gold}]",
                "overload.keys[0].class",
            ),
            (
                "keys: [{name: a, key: k1}, {name: a, key: k2}]",
                "overload.keys[1].name",
            ),
            (
                "keys: [{name: a, key: k1}, {name: b, key: k1}]",
                "overload.keys[1].key",
            ),
            (
                "keys: [{name: a, key: k1, max_concurrent: 0}]",
                "overload.keys[0].max_concurrent",
            ),
            ("keys: [{name: \"a b\", key: k1}]", "overload.keys[0].name"),
        ];
        for (yaml, needle) in cases {
            let e = parse(yaml)
                .err()
                .unwrap_or_else(|| panic!("accepted: {yaml}"));
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
        let e = parse("queue_lenght: 5").expect_err("unknown key refused");
        assert!(e.contains("queue_lenght"), "{e}");
    }
}
