//! docs/configuration.md against the parser: every key the `inferlb:` section accepts has a row
//! with the parser's default, and every row is a key the parser accepts.
//!
//! The keys and defaults come from the parser itself, not from a list kept here: each raw struct
//! is asked for its field names through its own `Deserialize` (the names `deny_unknown_fields`
//! accepts), deserialised from the smallest mapping it accepts (a field it reports missing is
//! `required` and given a placeholder) and serialised back, so what is left out comes out as the
//! parser's default. The only thing listed here is where a struct sits behind an `Option` or a
//! list (its default, `null` or `[]`, does not show its fields): see [`parser_keys`].

use std::collections::BTreeMap;

use serde::de::{DeserializeOwned, Deserializer, Visitor};
use serde::Serialize;
use serde_json::{Map, Value};

/// What the parser takes for a key left out.
#[derive(Debug, Clone, PartialEq)]
enum Default {
    /// No default: the key must be given.
    Required,
    Value(Value),
}

impl std::fmt::Display for Default {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Default::Required => f.write_str("required"),
            Default::Value(v) => write!(f, "`{v}`"),
        }
    }
}

/// A `Deserializer` that only reads the field names a derived `Deserialize` passes to
/// `deserialize_struct`, then stops.
struct FieldNames<'a>(&'a mut Option<&'static [&'static str]>);

impl<'de> Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = Some(fields);
        Err(serde::de::Error::custom("field names read"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The keys `T` accepts, as its `Deserialize` names them.
fn field_names<T: DeserializeOwned>(at: &str) -> &'static [&'static str] {
    let mut names = None;
    let _ = T::deserialize(FieldNames(&mut names));
    names.unwrap_or_else(|| panic!("{at}: not deserialised as a struct"))
}

/// Adds the keys of the struct `T` found at `at` (`inferlb.tls`, `inferlb.replicas[]`) to
/// `keys`, each with its default; a field whose default is a mapping has its own keys too.
/// `same`: how to tell two values apart, for a type whose `Serialize` leaves out some fields
/// (a field it leaves out is `null` by default if writing it as `null` changes nothing).
fn walk<T: DeserializeOwned + Serialize>(
    at: &str,
    keys: &mut BTreeMap<String, Default>,
    same: Option<fn(&T, &T) -> bool>,
) {
    let fields = field_names::<T>(at);
    // The smallest mapping `T` accepts: whatever it says is missing is required.
    let mut given = Map::new();
    let value: T = loop {
        match serde_json::from_value(Value::Object(given.clone())) {
            Ok(v) => break v,
            Err(e) => {
                let msg = e.to_string();
                let missing = msg
                    .strip_prefix("missing field `")
                    .and_then(|rest| rest.split('`').next())
                    .filter(|f| !given.contains_key(*f))
                    .unwrap_or_else(|| panic!("{at}: {msg}"));
                given.insert(missing.to_string(), Value::String("x".into()));
            }
        }
    };
    let Value::Object(out) = serde_json::to_value(&value).unwrap() else {
        panic!("{at}: not serialised as a mapping")
    };
    for name in out.keys() {
        assert!(
            fields.contains(&name.as_str()),
            "{at}.{name}: serialised but not a key its Deserialize accepts"
        );
    }
    for &name in fields {
        let key = format!("{at}.{name}");
        let default = if given.contains_key(name) {
            Default::Required
        } else if let Some(v) = out.get(name) {
            if v.is_object() {
                object_keys(&key, v, keys);
            }
            Default::Value(v.clone())
        } else {
            let same = same
                .unwrap_or_else(|| panic!("{key}: not serialised (a skip_serializing attribute?)"));
            let mut with_null = given.clone();
            with_null.insert(name.to_string(), Value::Null);
            let written: T = serde_json::from_value(Value::Object(with_null))
                .unwrap_or_else(|e| panic!("{key}: `null` not accepted: {e}"));
            assert!(
                same(&value, &written),
                "{key}: not serialised, and its default is not what `null` gives"
            );
            Default::Value(Value::Null)
        };
        keys.insert(key, default);
    }
}

/// The keys inside a struct-valued default (`inferlb.health`), from the value itself.
fn object_keys(at: &str, v: &Value, keys: &mut BTreeMap<String, Default>) {
    if let Value::Object(m) = v {
        for (name, v) in m {
            let key = format!("{at}.{name}");
            object_keys(&key, v, keys);
            keys.insert(key, Default::Value(v.clone()));
        }
    }
}

/// Every key of the `inferlb:` section with its default, from the parser.
fn parser_keys() -> BTreeMap<String, Default> {
    use crate::conf::overload::{RawBudget, RawKey, RawOverload};
    let mut keys = BTreeMap::new();
    walk::<super::RawSection>("inferlb", &mut keys, None);
    // Structs whose default (`null`, `[]`) does not show their fields.
    walk::<super::ReplicaConf>(
        "inferlb.replicas[]",
        &mut keys,
        Some(<super::ReplicaConf as PartialEq>::eq),
    );
    walk::<crate::conf::tls::RawTls>("inferlb.tls", &mut keys, None);
    walk::<super::admin::RawAdmin>("inferlb.admin", &mut keys, None);
    walk::<super::cluster::RawCluster>("inferlb.cluster", &mut keys, None);
    walk::<RawOverload>("inferlb.overload", &mut keys, None);
    walk::<RawBudget>("inferlb.overload.budget", &mut keys, None);
    walk::<RawKey>("inferlb.overload.keys[]", &mut keys, None);
    // Each of those is a key of the struct around it (a renamed field would leave it behind).
    for at in [
        "inferlb.replicas",
        "inferlb.tls",
        "inferlb.admin",
        "inferlb.cluster",
        "inferlb.overload",
        "inferlb.overload.budget",
        "inferlb.overload.keys",
    ] {
        assert!(keys.contains_key(at), "{at}: not a key of the parser");
    }
    keys
}

const HEADER: &str = "| key | type | default | range | description |";
const RULE: &str = "|---|---|---|---|---|";

/// The rows of the doc's key tables: key, default and line number, in order. Malformed rows
/// are reported in `problems`.
fn doc_rows(doc: &str, problems: &mut Vec<String>) -> Vec<(String, Default, usize)> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut rows = vec![];
    let mut heading = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_end();
        if let Some(h) = line.strip_prefix("## ") {
            heading = h.trim().strip_prefix('`').and_then(|h| h.strip_suffix('`'));
        }
        if line != HEADER || lines.get(i + 1).map(|l| l.trim_end()) != Some(RULE) {
            i += 1;
            continue;
        }
        i += 2;
        while i < lines.len() && lines[i].starts_with('|') {
            let n = i + 1;
            let cells: Vec<&str> = lines[i].split('|').map(str::trim).collect();
            i += 1;
            let (Some(key), Some(default)) = (cells.get(1), cells.get(3)) else {
                problems.push(format!("line {n}: not a row of five cells"));
                continue;
            };
            let Some(key) = key.strip_prefix('`').and_then(|k| k.strip_suffix('`')) else {
                problems.push(format!("line {n}: key {key} is not in backticks"));
                continue;
            };
            let default = if *default == "required" {
                Default::Required
            } else {
                match default
                    .strip_prefix('`')
                    .and_then(|d| d.strip_suffix('`'))
                    .map(serde_json::from_str)
                {
                    Some(Ok(v)) => Default::Value(v),
                    _ => {
                        problems.push(format!(
                            "line {n}: `{key}`: default {default} is neither JSON in backticks \
                             nor `required`"
                        ));
                        continue;
                    }
                }
            };
            let parent = key.rsplit_once('.').map(|(p, _)| p);
            if heading.is_some() && parent != heading {
                problems.push(format!(
                    "line {n}: `{key}` is in the table of `{}`",
                    heading.unwrap_or_default()
                ));
            }
            rows.push((key.to_string(), default, n));
        }
    }
    if rows.is_empty() {
        problems.push(format!("no table starting with {HEADER:?} then {RULE:?}"));
    }
    rows
}

/// Whether two JSON values are the same, numbers compared as numbers (`5` is `5.0`).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// Everything wrong with `doc` against `parser`: rows that cannot be read, keys missing from
/// the doc, rows for keys the parser does not have, rows listed twice and differing defaults.
fn problems(doc: &str, parser: &BTreeMap<String, Default>) -> Vec<String> {
    let mut problems = vec![];
    let mut documented = BTreeMap::new();
    for (key, default, line) in doc_rows(doc, &mut problems) {
        if documented.insert(key.clone(), (default, line)).is_some() {
            problems.push(format!("line {line}: `{key}` is listed twice"));
        }
    }
    for (key, want) in parser {
        let Some((got, line)) = documented.get(key) else {
            problems.push(format!(
                "missing from the doc: `{key}` (the parser's default: {want})"
            ));
            continue;
        };
        let agree = match (want, got) {
            (Default::Required, Default::Required) => true,
            (Default::Value(a), Default::Value(b)) => same(a, b),
            _ => false,
        };
        if !agree {
            problems.push(format!(
                "line {line}: `{key}`: the doc says {got}, the parser's default is {want}"
            ));
        }
    }
    for (key, (_, line)) in &documented {
        if !parser.contains_key(key) {
            problems.push(format!(
                "line {line}: `{key}` is in the doc but not a key of the parser"
            ));
        }
    }
    problems
}

const DOC: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/docs/configuration.md"
));

#[test]
fn configuration_md_lists_every_key_with_the_parsers_default() {
    let found = problems(DOC, &parser_keys());
    assert!(
        found.is_empty(),
        "docs/configuration.md disagrees with the parser ({} problems):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn a_removed_row_a_changed_default_and_an_unknown_key_are_reported() {
    let parser = parser_keys();
    let row = |key: &str| {
        DOC.lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("no row for {key}"))
            .to_string()
    };
    let removed = row("inferlb.health.failures");
    let changed = row("inferlb.upstream.read_timeout_seconds");
    let doc = DOC.replace(&format!("{removed}\n"), "").replace(
        &format!("{changed}\n"),
        &format!(
            "{}\n| `inferlb.upstream.retries` | integer | `3` | | Not a key. |\n",
            changed.replacen("| `300.0` |", "| `30.0` |", 1)
        ),
    );
    let found = problems(&doc, &parser);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(
        found[0].contains("`inferlb.health.failures`") && found[0].contains("missing"),
        "{found:#?}"
    );
    assert!(
        found[1].contains("`inferlb.upstream.read_timeout_seconds`")
            && found[1].contains("`30.0`")
            && found[1].contains("`300.0`"),
        "{found:#?}"
    );
    assert!(
        found[2].contains("`inferlb.upstream.retries`") && found[2].contains("not a key"),
        "{found:#?}"
    );
}

#[test]
fn required_keys_and_defaults_come_from_the_parser() {
    let keys = parser_keys();
    let required: Vec<&str> = keys
        .iter()
        .filter(|(_, d)| **d == Default::Required)
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(
        required,
        [
            "inferlb.cluster.redis_url",
            "inferlb.overload.keys[].key",
            "inferlb.overload.keys[].name",
            "inferlb.replicas[].address",
            "inferlb.replicas[].id",
            "inferlb.tls.cert_file",
            "inferlb.tls.key_file",
        ]
    );
    let value = |k: &str| match &keys[k] {
        Default::Value(v) => v.clone(),
        Default::Required => panic!("{k} is required"),
    };
    assert_eq!(value("inferlb.routing"), "prefill_cost");
    assert_eq!(value("inferlb.health.failures"), 2);
    assert_eq!(value("inferlb.replicas[].api_key"), Value::Null);
    assert_eq!(value("inferlb.overload.queue_length"), 1000);
    assert!(same(
        &value("inferlb.cluster.pin_ttl_seconds"),
        &86_400.into()
    ));
    // `#[serde(skip)]` fields are not keys.
    assert!(!keys.contains_key("inferlb.replicas[].tls"));
    assert!(!keys.contains_key("inferlb.replicas[].socket"));
}

#[test]
fn secrets_written_in_the_conf_serialise_redacted() {
    let section: super::RawSection =
        serde_json::from_value(serde_json::json!({"api_keys": ["sk-hunter2-client"]})).unwrap();
    let key: crate::conf::overload::RawKey =
        serde_json::from_value(serde_json::json!({"name": "n", "key": "sk-hunter2-tenant"}))
            .unwrap();
    let replica: super::ReplicaConf = serde_json::from_value(
        serde_json::json!({"id": "a", "address": "h:1", "api_key": "sk-hunter2-replica"}),
    )
    .unwrap();
    let out = format!(
        "{}{}{}",
        serde_json::to_string(&section).unwrap(),
        serde_json::to_string(&key).unwrap(),
        serde_json::to_string(&replica).unwrap()
    );
    assert!(!out.contains("hunter2"), "{out}");
    assert!(out.contains(r#""api_keys":["<redacted>"]"#), "{out}");
    assert!(out.contains(r#""key":"<redacted>""#), "{out}");
}

#[test]
fn numbers_are_compared_as_numbers() {
    assert!(same(&serde_json::json!(5), &serde_json::json!(5.0)));
    assert!(same(
        &serde_json::json!({"a": [1, 2.5]}),
        &serde_json::json!({"a": [1.0, 2.5]})
    ));
    assert!(!same(&serde_json::json!(5), &serde_json::json!("5")));
    assert!(!same(
        &serde_json::json!({"a": 1}),
        &serde_json::json!({"a": 1, "b": null})
    ));
}
