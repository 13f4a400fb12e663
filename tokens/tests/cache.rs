//! The message cache gives exactly the ids of a full render and tokenize, turn after turn, with
//! each of the fixture templates (the Qwen3-like one renders earlier turns differently once a new
//! user turn follows, so its prefixes fail the check and fall back).

use inferlb_tokens::{fixture, ModelTokens};
use proptest::prelude::*;
use serde_json::{json, Value};

fn model(template: &str) -> (tempfile::TempDir, ModelTokens) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_dir(dir.path(), template).unwrap();
    let m = ModelTokens::from_dir(dir.path())
        .unwrap()
        .with_cache_bytes(1 << 20);
    (dir, m)
}

fn text() -> impl Strategy<Value = String> {
    // Words, whitespace runs, JSON-ish punctuation and a special token's text now and then.
    prop::collection::vec(
        prop_oneof![
            "[a-zA-Z]{1,8}",
            Just(" ".to_owned()),
            Just("\n\n".to_owned()),
            Just("  ".to_owned()),
            Just("{\"k\": 1}".to_owned()),
            Just("<|im_end|>".to_owned()),
            Just("é漢".to_owned()),
            "[0-9]{1,4}",
        ],
        0..12,
    )
    .prop_map(|v| v.concat())
}

/// One turn an agent loop appends: a user message, an assistant answer (maybe with reasoning or
/// a tool call), or a tool result.
fn turn() -> impl Strategy<Value = Vec<Value>> {
    prop_oneof![
        text().prop_map(|t| vec![json!({"role": "user", "content": t})]),
        (text(), text()).prop_map(|(a, b)| vec![json!({"role": "user", "content": [{"type": "text", "text": a}, {"type": "text", "text": b}]})]),
        (text(), text()).prop_map(|(c, r)| vec![json!({"role": "assistant", "content": c, "reasoning_content": r})]),
        (text(), text()).prop_map(|(a, r)| vec![
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": format!("{{\"city\": {}}}", json!(a))}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": r}),
        ]),
    ]
}

fn body(messages: &[Value], tools: bool, agp: bool) -> Vec<u8> {
    let mut b = json!({"messages": messages, "add_generation_prompt": agp});
    if tools {
        b["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    }
    serde_json::to_vec(&b).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn cached_ids_equal_a_full_tokenize(
        which in 0..3usize,
        system in prop::option::of(text()),
        tools in any::<bool>(),
        turns in prop::collection::vec((turn(), any::<bool>()), 1..8),
    ) {
        let template = [fixture::CHATML_TOOLS, fixture::LLAMA3_LIKE, fixture::QWEN3_LIKE][which];
        let (_dir, m) = model(template);
        let mut messages: Vec<Value> = system.into_iter().map(|s| json!({"role": "system", "content": s})).collect();
        let mut reused = 0;
        for (t, agp) in turns {
            messages.extend(t);
            let b = body(&messages, tools, agp);
            let full = m.chat_ids_uncached(&b).unwrap();
            let cached = m.chat_ids(&b).unwrap();
            prop_assert_eq!(&cached.ids, &full);
            reused += cached.reused;
        }
        let _ = reused;
    }
}

#[test]
fn a_new_turn_tokenizes_only_what_is_new() {
    let (_dir, m) = model(fixture::CHATML_TOOLS);
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut last = 0;
    for i in 0..5 {
        messages.push(
            json!({"role": "user", "content": format!("question {i} about the weather in Paris")}),
        );
        let t = m.chat_ids(&body(&messages, true, true)).unwrap();
        assert_eq!(
            t.ids,
            m.chat_ids_uncached(&body(&messages, true, true)).unwrap()
        );
        if i > 0 {
            // All of the last turn's ids but those after its last special token (`assistant\n`).
            assert!(
                t.reused + 4 >= last,
                "turn {i} reused {} of the last turn's {last}",
                t.reused
            );
        }
        last = t.ids.len();
        messages.push(json!({"role": "assistant", "content": format!("answer {i}: it is sunny")}));
    }
}

#[test]
fn qwen3_like_earlier_reasoning_falls_back_and_stays_exact() {
    let (_dir, m) = model(fixture::QWEN3_LIKE);
    let mut messages = vec![
        json!({"role": "user", "content": "first"}),
        json!({"role": "assistant", "content": "one", "reasoning_content": "because"}),
    ];
    let a = m.chat_ids(&body(&messages, false, false)).unwrap();
    assert_eq!(
        a.ids,
        m.chat_ids_uncached(&body(&messages, false, false)).unwrap()
    );
    messages.push(json!({"role": "user", "content": "second"}));
    let b = m.chat_ids(&body(&messages, false, true)).unwrap();
    assert_eq!(
        b.ids,
        m.chat_ids_uncached(&body(&messages, false, true)).unwrap()
    );
    // The reasoning went from the earlier turn: only the part before it could be reused.
    assert!(
        b.reused < a.ids.len(),
        "reused {} of an earlier {}",
        b.reused,
        a.ids.len()
    );
}

#[test]
fn prompts_and_token_ids() {
    let (_dir, m) = model(fixture::CHATML_TOOLS);
    assert!(!m.prompt_ids("hello world").unwrap().is_empty());
    assert_eq!(inferlb_tokens::token_prompt(&[1, 2, 3]), &[1, 2, 3]);
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let e = ModelTokens::from_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    fixture::write_dir(dir.path(), "x").unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% if %}"}"#,
    )
    .unwrap();
    let e = ModelTokens::from_dir(dir.path()).err().unwrap().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("`chat_template`"),
        "{e}"
    );
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let m = ModelTokens::from_dir(dir.path()).unwrap();
    let e = m.chat_ids(br#"{"messages": []}"#).unwrap_err().to_string();
    assert!(e.contains("chat_template"), "{e}");
}
