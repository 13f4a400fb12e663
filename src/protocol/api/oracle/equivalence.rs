//! The single-pass reader against this oracle, on generated bodies of every family written
//! with random key order, whitespace and escapes, tricky numbers and strings, and mutated.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::super::{classify, Family};
use super::writer::{write, RAW};

fn raw(text: &str) -> Value {
    Value::String(format!("{RAW}{text}"))
}

fn tricky() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(raw("-0")),
        Just(raw("0.0")),
        Just(raw("1e400")),
        Just(raw("-1e400")),
        Just(raw("1E+2")),
        Just(raw("1e-400")),
        Just(raw("12345678901234567890")),
        Just(raw("123456789012345678901234")),
        Just(raw("-9223372036854775809")),
        Just(raw("-123456789012345678")),
        Just(raw("1234567890123456789")),
        Just(raw("4294967295")),
        Just(raw("4294967296")),
        Just(raw("-1")),
        Just(raw("2.50")),
        Just(raw("0.1e1")),
        Just(raw("\"\\ud800\"")),
        Just(raw("\"\\udc00x\"")),
        Just(raw("\"a\\ud800\\u0041\"")),
        Just(raw("\"\\ud83d\\ude00\"")),
        Just(raw("\"\\u00e9\\/\\b\\f\"")),
        Just(raw("\"\u{ff}\"")),
        Just(raw("{\"\\ud800\":1}")),
        Just(raw("{\"a\":1,\"a\":2}")),
        Just(raw("{\"t\\u0065xt\":\"x\",\"type\":\"text\"}")),
        Just(raw("[]")),
        Just(raw("[ ]")),
        Just(raw("{}")),
        (126usize..130).prop_map(|n| raw(&format!("{}1{}", "[".repeat(n), "]".repeat(n)))),
        (126usize..130).prop_map(|n| raw(&format!(
            "{}1{}",
            "{\"a\":[".repeat(n / 2),
            "]}".repeat(n / 2)
        ))),
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u32>().prop_map(|n| json!(n)),
        (-1e9f64..1e9).prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        "[a-z\"\\\\\n\t\u{1}\u{e9}\u{1F600}/]{0,8}".prop_map(Value::String),
        tricky(),
    ]
}

const KEYS: &[&str] = &[
    "type",
    "text",
    "role",
    "content",
    "name",
    "input",
    "cache_control",
    "tool_calls",
    "arguments",
    "output",
    "summary",
    "id",
    "x",
    "a\u{e9}",
    "",
];

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..5).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

fn text() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => "\\PC{0,30}".prop_map(Value::String),
        1 => "(x{1000,1100}|y{2040,2060})".prop_map(Value::String),
        1 => scalar(),
    ]
}

fn block() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (text(), any::<bool>()).prop_map(|(t, cc)| {
            let mut b = json!({"type": "text", "text": t});
            if cc {
                b["cache_control"] = json!({"type": "ephemeral"});
            }
            b
        }),
        1 => (text(), value()).prop_map(|(n, i)| json!({"type": "tool_use", "id": "t1", "name": n, "input": i})),
        1 => prop_oneof![text(), prop::collection::vec(text(), 0..3).prop_map(|ts| {
                Value::Array(ts.into_iter().map(|t| json!({"type": "text", "text": t})).collect())
            })].prop_map(|c| json!({"type": "tool_result", "tool_use_id": "t1", "content": c})),
        1 => Just(json!({"type": "tool_result", "content": [{"type": "tool_result", "content": "deep"}]})),
        1 => text().prop_map(|u| json!({"type": "image_url", "image_url": {"url": u}})),
        1 => value(),
    ]
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => text(),
        3 => prop::collection::vec(block(), 0..4).prop_map(Value::Array),
        1 => value(),
    ]
}

fn role() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => prop::sample::select(&["user", "assistant", "system", "tool", "developer"][..])
            .prop_map(|r| json!(r)),
        1 => scalar(),
    ]
}

/// Some of `fields`, each present or not.
fn object(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> BoxedStrategy<Value> {
    let parts: Vec<_> = fields
        .into_iter()
        .map(|(k, s)| prop::option::weighted(0.7, s).prop_map(move |v| (k, v)))
        .collect();
    parts
        .prop_map(|kv| {
            Value::Object(
                kv.into_iter()
                    .filter_map(|(k, v)| Some((k.to_string(), v?)))
                    .collect::<Map<_, _>>(),
            )
        })
        .boxed()
}

fn message() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => object(vec![
            ("role", role().boxed()),
            ("content", content().boxed()),
            ("name", text().boxed()),
            ("tool_calls", value().boxed()),
            ("x", value().boxed()),
        ]),
        1 => prop::collection::vec(scalar(), 0..6).prop_map(Value::Array),
        1 => value(),
    ]
}

fn item() -> impl Strategy<Value = Value> {
    let kind = prop_oneof![
        Just(json!("message")),
        Just(json!("function_call")),
        Just(json!("function_call_output")),
        Just(json!("reasoning")),
        Just(json!("web_search_call")),
        scalar(),
    ];
    prop_oneof![
        8 => object(vec![
            ("type", kind.boxed()),
            ("role", role().boxed()),
            ("content", content().boxed()),
            ("name", text().boxed()),
            ("arguments", text().boxed()),
            ("output", content().boxed()),
            ("summary", content().boxed()),
        ]),
        1 => value(),
    ]
}

fn prompt() -> impl Strategy<Value = Value> {
    prop_oneof![
        text(),
        prop::collection::vec(any::<u32>().prop_map(|n| json!(n)), 0..8).prop_map(Value::Array),
        prop::collection::vec(text(), 0..4).prop_map(Value::Array),
        prop::collection::vec(
            prop::collection::vec(any::<u32>().prop_map(|n| json!(n)), 0..4).prop_map(Value::Array),
            0..3
        )
        .prop_map(Value::Array),
        prop::collection::vec(scalar(), 0..4).prop_map(Value::Array),
        value(),
    ]
}

fn body() -> BoxedStrategy<Value> {
    let list = |s: BoxedStrategy<Value>| {
        prop_oneof![
            6 => prop::collection::vec(s, 0..5).prop_map(Value::Array),
            1 => value(),
        ]
        .boxed()
    };
    object(vec![
        (
            "model",
            prop_oneof![4 => Just(json!("m")), 1 => scalar()].boxed(),
        ),
        ("stream", scalar().boxed()),
        ("messages", list(message().boxed())),
        (
            "tools",
            prop_oneof![list(value().boxed()), Just(raw("[]"))].boxed(),
        ),
        ("system", content().boxed()),
        ("instructions", text().boxed()),
        ("input", prop_oneof![text(), list(item().boxed())].boxed()),
        ("prompt", prompt().boxed()),
        ("previous_response_id", text().boxed()),
        ("metadata", value().boxed()),
    ])
}

fn family() -> impl Strategy<Value = Family> {
    prop_oneof![
        Just(Family::Chat),
        Just(Family::Completions),
        Just(Family::Responses),
        Just(Family::Messages)
    ]
}

fn same(family: Family, body: &[u8]) -> Result<(), TestCaseError> {
    let (got, want) = (classify(family, body), super::classify(family, body));
    prop_assert_eq!(
        &got,
        &want,
        "{:?} {}",
        family,
        String::from_utf8_lossy(body)
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn generated_bodies_read_as_the_oracle_reads_them(
        family in family(), v in body(), seed in any::<u64>(),
    ) {
        same(family, &write(&v, seed))?;
    }

    #[test]
    fn mutated_bodies_read_as_the_oracle_reads_them(
        family in family(), v in body(), seed in any::<u64>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
    ) {
        let mut b = write(&v, seed);
        for (at, byte, how) in edits {
            let i = at.index(b.len() + 1);
            match how {
                0 => b.insert(i, byte),
                1 if i < b.len() => { b.remove(i); }
                _ if i < b.len() => b[i] = byte,
                _ => b.push(byte),
            }
        }
        same(family, &b)?;
    }

    #[test]
    fn top_level_arrays_and_odd_tops_read_as_the_oracle_reads_them(
        family in family(), items in prop::collection::vec(prop_oneof![value(), prompt(), content()], 0..11),
        seed in any::<u64>(),
    ) {
        same(family, &write(&Value::Array(items), seed))?;
    }

    #[test]
    fn any_bytes_read_as_the_oracle_reads_them(
        family in family(), body in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        same(family, &body)?;
    }
}

#[test]
fn hand_picked_edges_read_as_the_oracle_reads_them() {
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    let mut bodies: Vec<String> = vec![
        r#"["m", true, [{"role":"user","content":"x"}]]"#.into(),
        r#"["m", true, [["user","x"]], null, "s", "i", "in", "p", "r"]"#.into(),
        r#"["m", true, [["user","x"]], null, "s", "i", "in", "p", "r", 1]"#.into(),
        r#"{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}"#.into(),
        r#"{"mod\u0065l":"a","messages":[{"role":"user","content":"x","role":"a"}]}"#.into(),
        r#"{"messages":[{"role":"user","content":"x"}],"x":"\ud800"}"#.into(),
        r#"{"messages":[{"role":"user","content":"x"}],"\ud800":1}"#.into(),
        r#"{"messages":[{"role":"user","content":"\ud800"}]}"#.into(),
        r#"{"messages":[{"role":"user","content":null,"tool_calls":null,"name":null}]}"#.into(),
        r#"{"model":null,"stream":null,"tools":null,"messages":[{"role":"u","content":"x"}]}"#
            .into(),
        r#"{"prompt":[-0]}"#.into(),
        r#"{"prompt":[1.0]}"#.into(),
        r#"{"prompt":[[1],[-1]]}"#.into(),
        r#"{"prompt":[[],[]]}"#.into(),
        r#"{"prompt":[]}"#.into(),
        r#"{"input":[]}"#.into(),
        r#"{"input":[], "instructions":"i"}"#.into(),
        r#"{"input":[{"type":"message"},{"role":5},{"type":7,"role":"user"}]}"#.into(),
        r#"{"messages":[1]} "#.into(),
        r#"{"messages":[1]} x"#.into(),
        r#" {"messages":[01]}"#.into(),
        r#"{"messages":[1,]}"#.into(),
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}"#
            .into(),
    ];
    for n in [126, 127, 128, 129] {
        bodies.push(format!(
            r#"{{"messages":[{{"role":"u","content":"x","tool_calls":{}}}]}}"#,
            deep(n)
        ));
        bodies.push(format!(r#"{{"messages":[{}]}}"#, deep(n)));
    }
    for b in &bodies {
        for family in [
            Family::Chat,
            Family::Completions,
            Family::Responses,
            Family::Messages,
        ] {
            let (got, want) = (
                classify(family, b.as_bytes()),
                super::classify(family, b.as_bytes()),
            );
            assert_eq!(got, want, "{family:?} {b}");
        }
    }
    // Invalid UTF-8: refused in the fields read, ignored in the strings skipped.
    for b in [
        &b"{\"model\":\"\xff\"}"[..],
        b"{\"x\":\"\xff\",\"prompt\":\"p\"}",
        b"{\"\xff\":1}",
    ] {
        for family in [Family::Chat, Family::Completions] {
            assert_eq!(classify(family, b), super::classify(family, b), "{b:?}");
        }
    }
}
