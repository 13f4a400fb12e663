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
            // The placeholder mark, raw: such a body is rendered whole.
            Just("\u{F8FF}0\u{F8FE}".to_owned()),
            Just("\t \u{3000}\r\n".to_owned()),
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
        long in any::<bool>(),
        tools in any::<bool>(),
        turns in prop::collection::vec((turn(), any::<bool>()), 1..8),
    ) {
        let template = [fixture::CHATML_TOOLS, fixture::LLAMA3_LIKE, fixture::QWEN3_LIKE][which];
        let (_dir, m) = model(template);
        // A long system prompt makes the bodies long enough to be read from where the
        // previous one's history ends.
        let system = match long {
            true => Some(format!("{} {}", "You are a careful agent. ".repeat(60), system.unwrap_or_default())),
            false => system,
        };
        let mut messages: Vec<Value> = system.into_iter().map(|s| json!({"role": "system", "content": s})).collect();
        let mut reused = 0;
        // A body can resume from the previous one where both begin alike (the keys are
        // sorted, so `add_generation_prompt` comes first).
        let mut could_resume = false;
        let mut last_agp = None;
        for (t, agp) in turns {
            could_resume |= last_agp == Some(agp);
            last_agp = Some(agp);
            messages.extend(t);
            let b = body(&messages, tools, agp);
            let full = m.chat_ids_uncached(&b).unwrap();
            let cached = m.chat_ids(&b).unwrap();
            prop_assert_eq!(&cached.ids, &full);
            reused += cached.reused;
        }
        let _ = reused;
        prop_assert!(!long || !could_resume || m.resumed_bodies() > 0, "the history was read again");
    }
}

/// A ChatML template that trims contents and looks inside them: it must not be rendered with
/// placeholders.
const CHATML_TRIM: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if '</think>' in message.content %}{{- message.content.split('</think>')[-1] }}{%- else %}{{- message.content | trim }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A template that writes contents as they are but also dumps whole messages.
const DUMPS_MESSAGES: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.content + '<|im_end|>' }}{%- if loop.last %}{{- message | tojson }}{%- endif %}{%- endfor %}";

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn cached_ids_are_exact_where_contents_are_transformed(
        which in 0..2usize,
        turns in prop::collection::vec(text(), 1..6),
    ) {
        let (_dir, m) = model([CHATML_TRIM, DUMPS_MESSAGES][which]);
        let mut messages = vec![];
        for (i, t) in turns.into_iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": format!("  {t} </think> {t}\n")}));
            let b = body(&messages, false, true);
            prop_assert_eq!(m.chat_ids(&b).unwrap().ids, m.chat_ids_uncached(&b).unwrap());
        }
        // The dumping template is only found out by a render with placeholders (a body with the
        // mark in it has none), the trimming one from its code.
        prop_assert!(which == 1 || !m.renders_with_placeholders());
    }

    /// The pre-tokenizer run by `regex` (GPT-2's pattern in `ByteLevel`, with and without the
    /// prefix space, and Llama 3's and Qwen2's in a `Split`) gives the ids the `tokenizers`
    /// crate's own (`fancy-regex`) gives; so do the kept ids of each split (`text_ids`, twice:
    /// tokenized, then kept), added tokens and an NFC normalizer among them.
    #[test]
    fn the_fast_pre_tokenizer_gives_the_same_ids(
        which in 0..5usize,
        parts in prop::collection::vec(prop_oneof![
            text(),
            "[ \t\r\n\u{a0}\u{3000}]{1,5}",
            // Every other White_Space, and near-spaces that are not.
            "[\u{b}\u{c}\u{85}\u{1680}\u{2000}-\u{200a}\u{2028}\u{2029}\u{202f}\u{205f}\u{180e}\u{200b}\u{feff} ]{1,4}",
            // Combining marks, non-ASCII digits, emoji.
            "[a-z\u{301}\u{308}\u{93f}]{1,4}",
            "[\u{660}-\u{669}\u{966}-\u{96f}\u{ff10}-\u{ff19}\u{2160}-\u{2168}0-9]{1,5}",
            "[\u{1f600}-\u{1f64f}\u{1f3fb}-\u{1f3ff}\u{200d}\u{fe0f}]{1,4}",
            "[a-z']{1,6}",
            Just("'S 'll 's".to_owned()),
            "[0-9]{1,7}",
            "[!-/:-@]{1,3}",
            // Trailing whitespace runs.
            "[a-z]{1,3}[ \t\n\u{3000}]{2,6}",
            Just("<|im_start|>".to_owned()),
            Just(" <|im_end|>\n".to_owned()),
            // Not NFC: composed by the normalizer.
            Just("e\u{301}a\u{308} \u{212b}".to_owned()),
        ], 0..16),
    ) {
        let (_dir, m) = match which {
            0 => model(fixture::CHATML_TOOLS),
            1 => byte_level_prefix_space_model(),
            2 => split_model(LLAMA3_SPLIT),
            3 => split_model(QWEN2_SPLIT),
            _ => nfc_split_model(QWEN2_SPLIT),
        };
        prop_assert!(which == 1 || m.keeps_split_ids());
        let t = parts.concat();
        let want = m.tokenizer().encode(t.as_str(), true).unwrap().get_ids().to_vec();
        prop_assert_eq!(m.prompt_ids(&t).unwrap(), want, "{:?}", t);
        let plain = m.tokenizer().encode(t.as_str(), false).unwrap().get_ids().to_vec();
        for _ in 0..2 {
            prop_assert_eq!(m.text_ids(&t).unwrap(), plain.clone(), "{:?}", t);
        }
    }
}

const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// The fixture with another pre-tokenizer in its `tokenizer.json`.
fn with_pre_tokenizer(pre: Value) -> (tempfile::TempDir, ModelTokens) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_dir(dir.path(), fixture::CHATML_TOOLS).unwrap();
    let path = dir.path().join("tokenizer.json");
    let mut tk: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tk["pre_tokenizer"] = pre;
    std::fs::write(&path, tk.to_string()).unwrap();
    let m = ModelTokens::from_dir(dir.path()).unwrap();
    (dir, m)
}

/// A split regex (Llama 3's, Qwen2's), then the byte mapping alone.
fn split_model(pattern: &str) -> (tempfile::TempDir, ModelTokens) {
    with_pre_tokenizer(json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]}))
}

/// Qwen2's: NFC, then the split.
fn nfc_split_model(pattern: &str) -> (tempfile::TempDir, ModelTokens) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_dir(dir.path(), fixture::CHATML_TOOLS).unwrap();
    let path = dir.path().join("tokenizer.json");
    let mut tk: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tk["normalizer"] = json!({"type": "NFC"});
    tk["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]});
    std::fs::write(&path, tk.to_string()).unwrap();
    let m = ModelTokens::from_dir(dir.path()).unwrap();
    (dir, m)
}

/// GPT-2's `ByteLevel` with a space put before each split that lacks one.
fn byte_level_prefix_space_model() -> (tempfile::TempDir, ModelTokens) {
    with_pre_tokenizer(
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
    )
}

#[test]
fn placeholders_only_where_the_template_writes_contents_as_they_are() {
    assert!(model(fixture::CHATML_TOOLS).1.renders_with_placeholders());
    for t in [CHATML_TRIM, fixture::LLAMA3_LIKE, fixture::QWEN3_LIKE] {
        assert!(!model(t).1.renders_with_placeholders(), "{t}");
    }
    // Whole messages are only seen reading them: the first render turns placeholders off.
    let (_dir, m) = model(DUMPS_MESSAGES);
    assert!(m.renders_with_placeholders());
    let b = body(
        &[json!({"role": "user", "content": "a \"quoted\" word"})],
        false,
        true,
    );
    assert_eq!(
        m.chat_ids(&b).unwrap().ids,
        m.chat_ids_uncached(&b).unwrap()
    );
    assert!(!m.renders_with_placeholders());
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
