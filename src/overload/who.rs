//! Who sent a request, as overload protection counts it: the client's key (a tenant header,
//! or its API key), the label its metrics carry, its class and its budget.

use std::sync::{Arc, LazyLock};

use crate::conf::overload::{key_id, Budget, OverloadConf};

/// Who sent a request, as overload protection counts it.
#[derive(Debug, Clone)]
pub struct Who {
    pub(super) key: u64,
    /// The metrics label: a listed key's name, `other`, or none (`anonymous`).
    pub(super) label: Option<Arc<str>>,
    pub(super) class: usize,
    pub(super) budget: Budget,
}

fn header<'h>(headers: &'h http::HeaderMap, name: Option<&str>) -> Option<&'h [u8]> {
    let v = headers.get(name?)?.as_bytes();
    (!v.is_empty()).then_some(v)
}

/// The client's key as `request::authorized` reads it: `Authorization: Bearer`, or `x-api-key`.
fn api_key(headers: &http::HeaderMap) -> Option<&[u8]> {
    headers
        .get("authorization")
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()))
        .filter(|k| !k.is_empty())
}

/// The name of the listed key in the request's API key header, if any.
pub(super) fn listed_name(c: &OverloadConf, headers: &http::HeaderMap) -> Option<Arc<str>> {
    let key = api_key(headers)?;
    c.keys.get(&key_id(key)).map(|k| k.name.clone())
}

/// The label of every key the conf does not list, made once.
static OTHER: LazyLock<Arc<str>> = LazyLock::new(|| Arc::from("other"));

/// The key, its label, class and budget, from the request's headers.
pub(super) fn identify(c: &OverloadConf, headers: &http::HeaderMap) -> Who {
    let raw = header(headers, c.key_header.as_deref()).or_else(|| api_key(headers));
    let id = raw.map_or(0, key_id);
    let listed = raw.and(c.keys.get(&id));
    let label: Option<Arc<str>> = match (listed, raw) {
        (Some(k), _) => Some(k.name.clone()),
        (None, Some(_)) => Some(OTHER.clone()),
        (None, None) => None,
    };
    let asked = header(headers, c.class_header.as_deref())
        .and_then(|v| c.classes.iter().position(|n| n.as_bytes() == v));
    // A listed key's class is also its ceiling: the header may only lower it.
    let class = match (listed.and_then(|k| k.class), asked) {
        (Some(own), Some(a)) => own.max(a),
        (Some(own), None) => own,
        (None, Some(a)) => a,
        (None, None) => c.default_class,
    };
    let budget = listed.map_or(c.budget, |k| Budget {
        max_concurrent: k.budget.max_concurrent.or(c.budget.max_concurrent),
        tokens_per_minute: k.budget.tokens_per_minute.or(c.budget.tokens_per_minute),
    });
    Who {
        key: id,
        label,
        class,
        budget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conf::overload as conf;

    fn conf() -> OverloadConf {
        let raw: conf::RawOverload = serde_yaml::from_str(
            "classes: [interactive, standard, batch]\ndefault_class: standard\n\
             class_header: x-priority\nkey_header: x-tenant\nbudget: {max_concurrent: 4}\n\
             keys:\n  - {name: agents, key: sk-agents-1, class: standard, tokens_per_minute: 9}\n",
        )
        .expect("yaml");
        conf::validate(raw).expect("valid")
    }

    fn who(headers: &[(&'static str, &'static str)]) -> Who {
        let mut h = http::HeaderMap::new();
        for (n, v) in headers {
            h.insert(*n, http::HeaderValue::from_static(v));
        }
        identify(&conf(), &h)
    }

    /// (headers, label, class, max_concurrent, tokens_per_minute)
    type Row = (
        &'static [(&'static str, &'static str)],
        Option<&'static str>,
        usize,
        Option<u32>,
        Option<u64>,
    );

    #[test]
    fn keys_classes_and_budgets_from_the_headers() {
        // (headers, label, class, max_concurrent, tokens_per_minute)
        let rows: &[Row] = &[
            (&[], None, 1, Some(4), None),
            (
                &[("authorization", "Bearer sk-agents-1")],
                Some("agents"),
                1,
                Some(4),
                Some(9),
            ),
            (
                &[("x-api-key", "sk-agents-1")],
                Some("agents"),
                1,
                Some(4),
                Some(9),
            ),
            // The header may lower a listed key's class, never raise it.
            (
                &[("x-api-key", "sk-agents-1"), ("x-priority", "batch")],
                Some("agents"),
                2,
                Some(4),
                Some(9),
            ),
            (
                &[("x-api-key", "sk-agents-1"), ("x-priority", "interactive")],
                Some("agents"),
                1,
                Some(4),
                Some(9),
            ),
            // Unlisted keys take the header's class.
            (
                &[("x-api-key", "sk-unknown"), ("x-priority", "interactive")],
                Some("other"),
                0,
                Some(4),
                None,
            ),
            (&[("x-priority", "nonsense")], None, 1, Some(4), None),
            // The tenant header names the client in place of its key.
            (
                &[("x-tenant", "sk-agents-1"), ("x-api-key", "sk-x")],
                Some("agents"),
                1,
                Some(4),
                Some(9),
            ),
        ];
        for (headers, label, class, concurrent, tpm) in rows {
            let w = who(headers);
            assert_eq!(w.label.as_deref(), *label, "{headers:?}");
            assert_eq!(w.class, *class, "{headers:?}");
            assert_eq!(w.budget.max_concurrent, *concurrent, "{headers:?}");
            assert_eq!(w.budget.tokens_per_minute, *tpm, "{headers:?}");
        }
        assert_ne!(
            who(&[("x-api-key", "a-key-one")]).key,
            who(&[("x-api-key", "a-key-two")]).key
        );
    }
}
