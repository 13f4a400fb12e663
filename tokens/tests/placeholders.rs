//! Renders with placeholders for contents give the ids of a full render, tokenized with the plain
//! `tokenizers::Tokenizer`, for templates that qualify; and they really are used (a process-wide
//! counter, so each test here holds one lock while it counts).

use std::sync::Mutex;

use inferlb_tokens::{fixture, placeholder_renders, ModelTokens};
use serde_json::{json, Value};

static COUNTING: Mutex<()> = Mutex::new(());

fn model(template: &str) -> (tempfile::TempDir, ModelTokens) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_dir(dir.path(), template).unwrap();
    let m = ModelTokens::from_dir(dir.path())
        .unwrap()
        .with_cache_bytes(1 << 20);
    (dir, m)
}

fn body(messages: &[Value]) -> Vec<u8> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    serde_json::to_vec(
        &json!({"messages": messages, "tools": tools, "add_generation_prompt": true}),
    )
    .unwrap()
}

/// The ids of a full render, without the cache or the fast pre-tokenizer.
fn reference(m: &ModelTokens, b: &[u8]) -> Vec<u32> {
    let text = m.render_chat(b).unwrap();
    m.tokenizer()
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// An agent conversation: a system prompt, user turns, answers, tool calls with and without
/// content, tool results, and whitespace at the edges of contents.
fn conversation() -> Vec<Vec<Value>> {
    let call = |content: Value| {
        json!({"role": "assistant", "content": content, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]})
    };
    vec![
        vec![
            json!({"role": "system", "content": "You are a helpful assistant."}),
            json!({"role": "user", "content": "What is the weather like today in Paris?"}),
        ],
        vec![
            call(json!("Let me check the weather.")),
            json!({"role": "tool", "tool_call_id": "c1", "content": "{\"unit\": \"celsius\", \"t\": 21}"}),
        ],
        vec![
            json!({"role": "assistant", "content": "  It is 21 degrees.\n\n"}),
            json!({"role": "user", "content": "and tomorrow? é漢 <|im_end|>"}),
        ],
        vec![
            call(json!(null)),
            json!({"role": "tool", "tool_call_id": "c1", "content": ""}),
        ],
        vec![
            json!({"role": "assistant", "content": ""}),
            json!({"role": "user", "content": [{"type": "text", "text": "thanks"}, {"type": "text", "text": "bye"}]}),
        ],
    ]
}

/// Each turn of the conversation gives the reference ids, cold and then warm, and renders with
/// placeholders from the start to the end.
fn exact_with_placeholders(template: &str) {
    let _count = COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, m) = model(template);
    assert!(m.renders_with_placeholders(), "{template}");
    let mut messages = Vec::new();
    let mut reused = 0;
    for turn in conversation() {
        messages.extend(turn);
        let b = body(&messages);
        let before = placeholder_renders();
        let t = m.chat_ids(&b).unwrap();
        assert!(
            placeholder_renders() > before,
            "no placeholders: {template}"
        );
        let want = reference(&m, &b);
        assert_eq!(t.ids, want, "{template}");
        assert_eq!(m.chat_ids_uncached(&b).unwrap(), want, "{template}");
        reused += t.reused;
    }
    assert!(reused > 0, "nothing reused: {template}");
    assert!(m.renders_with_placeholders(), "{template}");
}

#[test]
fn the_chatml_fixture_renders_with_placeholders_turn_after_turn() {
    exact_with_placeholders(fixture::CHATML_TOOLS);
}

const TAIL: &str =
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

#[test]
fn templates_that_write_contents_as_they_are() {
    let templates = [
        // Contents tested for truth.
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}",
        // `~` concatenation.
        "{%- for m in messages %}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' }}",
        // `is string`, and tool calls beside the content.
        "{%- for m in messages %}{%- if m.content is string %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' }}{%- endif %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}{{- '<tool_call>' + c.function.name + (c.function.arguments | tojson) + '</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}",
        // The system message apart, the others after it; a computed index read an attribute of.
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '\\nAnswer with the content only.<|im_end|>\\n' }}{%- set rest = messages[1:] %}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- set rest = messages %}{%- endif %}{%- for m in rest %}{%- if loop.first or rest[loop.index0 - 1].role != m.role %}{{- '<|im_start|>' + m.role + '\\n' }}{%- endif %}{{- m.content }}{{- '<|im_end|>\\n' }}",
        // A whole message tested for truth and counted, without reading its content.
        "{%- for m in messages %}{%- if m and m|length > 1 %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}",
    ];
    for t in templates {
        exact_with_placeholders(&format!("{t}{TAIL}"));
    }
}

#[test]
fn a_body_with_the_mark_escaped_is_rendered_whole() {
    let _count = COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, m) = model(fixture::CHATML_TOOLS);
    let mut messages = vec![json!({"role": "user", "content": "hello"})];
    m.chat_ids(&body(&messages)).unwrap();
    messages.push(json!({"role": "assistant", "content": "x"}));
    messages.push(json!({"role": "user", "content": "MARK"}));
    // The mark as JSON escapes, in both cases, as a client could write it.
    for mark in [r"\uF8FF0\uF8FE", r"\uf8ff1\uf8fe"] {
        let b = String::from_utf8(body(&messages))
            .unwrap()
            .replace("MARK", mark);
        let before = placeholder_renders();
        let t = m.chat_ids(b.as_bytes()).unwrap();
        assert_eq!(placeholder_renders(), before, "{mark}");
        assert_eq!(t.ids, reference(&m, b.as_bytes()), "{mark}");
        assert!(m.render_chat(b.as_bytes()).unwrap().contains('\u{F8FF}'));
    }
    assert!(m.renders_with_placeholders());
}
