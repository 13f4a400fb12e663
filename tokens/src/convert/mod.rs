//! Anthropic Messages and OpenAI Responses bodies made into the chat body vLLM (0.33) renders
//! for them, so that their prompts tokenize as the engine's do.
//!
//! vLLM serves both APIs by converting a request into a chat request and rendering that with
//! the model's template: `AnthropicServingMessages.to_chat_completion_request` for
//! `/v1/messages`, `construct_input_messages` and `construct_tool_dicts` for `/v1/responses`
//! (with the `input_item_parsing` validator before them). The conversion here writes the chat
//! body those would produce (`messages`, `tools`, `chat_template_kwargs`), which
//! [`crate::ModelTokens::chat_ids_within`] then renders and tokenizes like any chat body. It is
//! deterministic, so a conversation's next turn converts to a body that shares the previous
//! one's bytes and the message cache serves it.
//!
//! Texts, tool inputs and schemas are copied as the client's raw JSON, never re-serialized:
//! their key order reaches the template (`tojson`), and copying costs less than parsing.
//!
//! What vLLM would render from more than the text (images, tool references), what depends on
//! state this process does not have (`previous_response_id`, a prompt template, custom tools,
//! Anthropic tool additions and removals), a partial final message that vLLM continues, and
//! what vLLM refuses, are [`Error::Body`]: the caller then keeps its estimate.

mod anthropic;
mod responses;

pub use anthropic::{anthropic_chat, AnthropicRules, ANTHROPIC_EFFORTS};
pub use responses::responses_chat;

use indexmap::IndexMap;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::Error;

fn refuse(what: impl Into<String>) -> Error {
    Error::Body(what.into())
}

/// A JSON string: the client's raw text, or one made here.
#[derive(Serialize, Clone)]
#[serde(untagged)]
enum Text<'a> {
    Raw(&'a RawValue),
    Owned(String),
}

#[derive(Serialize)]
struct Part<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: Text<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(Text<'a>),
    Parts(Vec<Part<'a>>),
    /// As the client sent it (a Responses tool output or message content).
    Raw(&'a RawValue),
}

#[derive(Serialize)]
struct Function<'a> {
    name: Text<'a>,
    arguments: Text<'a>,
}

/// A tool call, its keys in the order each conversion writes them (a template may print the
/// whole call).
#[derive(Serialize)]
#[serde(untagged)]
enum Call<'a> {
    Anthropic {
        id: Text<'a>,
        #[serde(rename = "type")]
        kind: &'static str,
        function: Function<'a>,
    },
    Responses {
        id: Text<'a>,
        function: Function<'a>,
        #[serde(rename = "type")]
        kind: &'static str,
    },
}

/// A chat message as vLLM's conversion builds it (only the fields it sets).
#[derive(Serialize, Default)]
struct Msg<'a> {
    role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Content<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Text<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Call<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<Text<'a>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Out<'a> {
    Msg(Msg<'a>),
    /// A Responses input message passed on as it came.
    Raw(&'a RawValue),
}

#[derive(Serialize)]
struct ToolFunction<'a> {
    name: Text<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<std::borrow::Cow<'a, RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    defer_loading: Option<bool>,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

/// The chat body written: the small fields first, so that successive turns share every byte up
/// to their new messages.
#[derive(Serialize)]
struct ChatOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(skip_serializing_if = "IndexMap::is_empty")]
    chat_template_kwargs: IndexMap<String, Box<RawValue>>,
    messages: Vec<Out<'a>>,
}

fn raw_json<T: Serialize>(v: &T) -> Box<RawValue> {
    let s = serde_json::to_string(v).expect("a string or a bool serializes");
    RawValue::from_string(s).expect("serde_json writes valid JSON")
}

/// The request's `chat_template_kwargs` with what vLLM's `build_chat_params` sets over them:
/// `add_generation_prompt` (always true here), and with an effort `reasoning_effort` and, unless
/// the client set it, `enable_thinking`. (`continue_final_message: false` and `documents:
/// null` are left out: a template reads them as it reads an undefined name.)
fn kwargs(user: Option<&RawValue>, effort: Option<&str>) -> Result<ChatKwargs, Error> {
    let mut kw: IndexMap<String, Box<RawValue>> = match user.filter(|r| r.get() != "null") {
        Some(r) => serde_json::from_str(r.get())
            .map_err(|e| refuse(format!("chat_template_kwargs: {e}")))?,
        None => IndexMap::new(),
    };
    let user_thinking = kw.contains_key("enable_thinking");
    kw.shift_remove("continue_final_message");
    kw.insert("add_generation_prompt".into(), raw_json(&true));
    if let Some(effort) = effort.filter(|e| *e != "auto") {
        kw.insert("reasoning_effort".into(), raw_json(&effort));
        if !user_thinking {
            kw.insert("enable_thinking".into(), raw_json(&(effort != "none")));
        }
    }
    Ok(kw)
}

type ChatKwargs = IndexMap<String, Box<RawValue>>;

fn write(out: &ChatOut) -> Vec<u8> {
    serde_json::to_vec(out).expect("raw JSON and strings serialize")
}

fn is_empty_string(raw: &RawValue) -> bool {
    raw.get() == "\"\""
}

fn string(raw: &RawValue, what: &str) -> Result<String, Error> {
    serde_json::from_str(raw.get()).map_err(|_| refuse(format!("{what}: not a string")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const KEEP: AnthropicRules = AnthropicRules {
        merge_inline_system: false,
        disabled_thinking_effort: "none",
    };
    const MERGE: AnthropicRules = AnthropicRules {
        merge_inline_system: true,
        disabled_thinking_effort: "low",
    };

    fn anthropic(body: Value, rules: &AnthropicRules) -> Value {
        let out = anthropic_chat(body.to_string().as_bytes(), rules).expect("converts");
        serde_json::from_slice(&out).expect("JSON")
    }

    fn responses(body: Value) -> Value {
        let out = responses_chat(body.to_string().as_bytes()).expect("converts");
        serde_json::from_slice(&out).expect("JSON")
    }

    /// Each case's want is what vLLM 0.33's `to_chat_completion_request` gives (its
    /// `messages`, `tools` and chat template kwargs), read from its code.
    #[test]
    fn anthropic_bodies_convert_as_vllm_converts_them() {
        let gen = json!({"add_generation_prompt": true});
        let cases = [
            (
                "a string system and contents",
                json!({"model": "m", "max_tokens": 5, "system": "Be brief.",
                       "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": ""}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": ""}]}),
            ),
            (
                "system blocks joined without a separator, the billing header left out",
                json!({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                                  {"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "AB"},
                    {"role": "user", "content": "Hi"}]}),
            ),
            (
                "text blocks kept as parts, empty ones dropped",
                json!({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": ""},
                    {"type": "text", "text": "b"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}]}),
            ),
            (
                "thinking, a tool call, its result before the user's text",
                json!({"messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Use ", "signature": "s"},
                        {"type": "thinking", "thinking": "the tool."},
                        {"type": "redacted_thinking", "data": "zz"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "tu_1", "name": "get_weather",
                         "input": {"city": "Paris", "unit": "c"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "tu_1",
                         "content": [{"type": "text", "text": "20"}, {"type": "text", "text": "sunny"}]},
                        {"type": "text", "text": "Thanks"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Checking.", "reasoning": "Use the tool.",
                     "tool_calls": [{"id": "tu_1", "type": "function", "function": {
                         "name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"c\"}"}}]},
                    {"role": "tool", "content": "20\nsunny", "tool_call_id": "tu_1"},
                    {"role": "user", "content": "Thanks"}]}),
            ),
            (
                "a user message of tool results only is not sent; an empty input is {}",
                json!({"messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": null}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "t", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "content": "ok", "tool_call_id": "t"}]}),
            ),
            (
                "tools as functions; an effort and the user's kwargs",
                json!({"messages": [{"role": "user", "content": "Hi"}],
                       "tools": [{"name": "f", "description": "d",
                                  "input_schema": {"type": "object", "b": 1, "a": 2}, "strict": true}],
                       "output_config": {"effort": "high"},
                       "chat_template_kwargs": {"x": 1, "add_generation_prompt": false}}),
                json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                           "parameters": {"type": "object", "b": 1, "a": 2}, "strict": true}}],
                       "chat_template_kwargs": {"x": 1, "add_generation_prompt": true,
                           "reasoning_effort": "high", "enable_thinking": true},
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
            (
                "a schema without a type is an object's",
                json!({"messages": [{"role": "user", "content": "Hi"}],
                       "tools": [{"name": "f", "input_schema": {"properties": {}}}]}),
                json!({"tools": [{"type": "function", "function": {"name": "f",
                           "parameters": {"properties": {}, "type": "object"}}}],
                       "chat_template_kwargs": gen,
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ];
        for (name, body, want) in cases {
            assert_eq!(anthropic(body, &KEEP), want, "{name}");
        }
    }

    #[test]
    fn inline_system_messages_are_merged_where_the_template_wants_one_system_message() {
        let body = json!({"system": "A", "messages": [
            {"role": "user", "content": "u1"},
            {"role": "system", "content": "B"},
            {"role": "system", "content": "x-anthropic-billing-header: 1"},
            {"role": "user", "content": "u2"}]});
        let msgs = |v: Value| v["messages"].clone();
        assert_eq!(
            msgs(anthropic(body.clone(), &MERGE)),
            json!([{"role": "system", "content": "AB"},
                   {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}])
        );
        assert_eq!(
            msgs(anthropic(body, &KEEP)),
            json!([{"role": "system", "content": "A"}, {"role": "user", "content": "u1"},
                   {"role": "system", "content": "B"}, {"role": "user", "content": "u2"}])
        );
    }

    #[test]
    fn thinking_turned_off_becomes_the_models_effort() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                          "output_config": {"effort": "max"}, "thinking": {"type": "disabled"},
                          "chat_template_kwargs": {"enable_thinking": true}});
        let kw = |rules| anthropic(body.clone(), rules)["chat_template_kwargs"].clone();
        // The client's enable_thinking stands; the effort is the model's for "off".
        assert_eq!(
            kw(&KEEP),
            json!({"enable_thinking": true, "add_generation_prompt": true, "reasoning_effort": "none"})
        );
        assert_eq!(kw(&MERGE)["reasoning_effort"], "low");
    }

    #[test]
    fn anthropic_bodies_beyond_text_are_refused() {
        for body in [
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result",
                "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}),
            json!({"messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {"name": "f"}}]},
                                {"role": "user", "content": "Hi"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
            json!({"messages": "Hi"}),
        ] {
            assert!(
                anthropic_chat(body.to_string().as_bytes(), &KEEP).is_err(),
                "{body}"
            );
        }
    }

    /// Each case's want is what vLLM 0.33's `construct_input_messages` and
    /// `construct_tool_dicts` give, after its `input_item_parsing`.
    #[test]
    fn responses_bodies_convert_as_vllm_converts_them() {
        let gen = json!({"add_generation_prompt": true});
        let cases = [
            (
                "instructions and a string input",
                json!({"model": "m", "instructions": "Be brief.", "input": "Hi", "tools": []}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
            ),
            (
                "reasoning, an output message and calls go into one assistant message",
                json!({"input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                     "content": [{"type": "reasoning_text", "text": "think"}]},
                    {"type": "message", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                    {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"a\": 1}"},
                    {"type": "function_call", "call_id": "c2", "name": "get", "namespace": "wx", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "20"},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
                    {"role": "assistant", "content": "Done."}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"role": "assistant", "content": "Checking.", "reasoning": "think", "tool_calls": [
                        {"id": "c1", "function": {"name": "get", "arguments": "{\"a\": 1}"}, "type": "function"},
                        {"id": "c2", "function": {"name": "wx__get", "arguments": "{}"}, "type": "function"}]},
                    {"role": "tool", "content": "20", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "Done.", "reasoning": "only a summary"}]}),
            ),
            (
                "function and namespace tools, built-in ones dropped; an effort",
                json!({"input": "Hi", "reasoning": {"effort": "low"}, "tools": [
                    {"type": "function", "name": "f", "parameters": {"z": 1, "a": 2}, "strict": null},
                    {"type": "web_search"},
                    {"type": "namespace", "name": "wx", "description": "ns", "tools": [
                        {"type": "function", "name": "get", "description": "d", "parameters": null, "strict": true}]}]}),
                json!({"tools": [
                        {"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}},
                        {"type": "function", "function": {"name": "wx__get", "description": "d", "strict": true}}],
                       "chat_template_kwargs": {"add_generation_prompt": true,
                           "reasoning_effort": "low", "enable_thinking": true},
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
            (
                "only built-in tools: an empty list",
                json!({"input": "Hi", "tools": [{"type": "web_search"}]}),
                json!({"tools": [], "chat_template_kwargs": gen,
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ];
        for (name, body, want) in cases {
            assert_eq!(responses(body), want, "{name}");
        }
    }

    #[test]
    fn responses_bodies_this_process_cannot_render_are_refused() {
        for body in [
            json!({"input": "Hi", "previous_response_id": "resp_1"}),
            json!({"input": "Hi", "prompt": {"id": "p"}}),
            json!({"input": [{"role": "user", "content": "Hi"},
                             {"type": "message", "role": "assistant", "status": "in_progress",
                              "content": [{"type": "output_text", "text": "Par"}]}]}),
            json!({"input": [{"type": "reasoning", "encrypted_content": "xx", "summary": []}]}),
            json!({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]}),
            json!({"input": "Hi", "tools": [{"type": "custom", "name": "f"}]}),
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            json!({"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}),
        ] {
            assert!(
                responses_chat(body.to_string().as_bytes()).is_err(),
                "{body}"
            );
        }
    }

    /// A conversation's next turn converts to a body that starts with the previous one's bytes
    /// up to its last message: the message cache reads it from there.
    #[test]
    fn a_next_turn_converts_to_a_body_sharing_the_previous_ones_bytes() {
        let turn1 = json!({"system": "S", "tools": [{"name": "f", "input_schema": {}}],
                           "messages": [{"role": "user", "content": "one"}]});
        let mut turn2 = turn1.clone();
        turn2["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": "two"}),
            json!({"role": "user", "content": "three"}),
        ]);
        let a = anthropic_chat(turn1.to_string().as_bytes(), &KEEP).unwrap();
        let b = anthropic_chat(turn2.to_string().as_bytes(), &KEEP).unwrap();
        let upto = a.len() - 2; // before `]}`
        assert_eq!(a[..upto], b[..upto]);
    }

    fn model(template: &str) -> (tempfile::TempDir, crate::ModelTokens) {
        let dir = tempfile::tempdir().expect("tempdir");
        crate::fixture::write_dir(dir.path(), template).expect("fixture");
        let t = crate::ModelTokens::from_dir(dir.path()).expect("load");
        (dir, t)
    }

    #[test]
    fn the_rules_are_probed_from_the_template() {
        let (_d, chatml) = model(crate::fixture::CHATML_TOOLS);
        assert!(!chatml.anthropic_rules().merge_inline_system);
        let (_d, llama) = model(crate::fixture::LLAMA3_LIKE);
        assert!(llama.anthropic_rules().merge_inline_system);
        // Neither template reads an effort: "none" renders as every effort does.
        assert_eq!(chatml.anthropic_rules().disabled_thinking_effort, "low");
        let reads = "{%- for m in messages %}{{ m.content }}{% endfor %}\
                     {%- if reasoning_effort == 'none' %}/no_think{% else %}/think{% endif %}";
        let (_d, effort) = model(reads);
        assert_eq!(effort.anthropic_rules().disabled_thinking_effort, "none");
    }

    /// The ids are the chat body's that vLLM makes of the request, cold and as a next turn.
    #[test]
    fn messages_and_responses_tokenize_as_their_chat_bodies() {
        for template in [crate::fixture::CHATML_TOOLS, crate::fixture::QWEN3_LIKE] {
            let (_d, t) = model(template);
            let history = |n: usize| -> Vec<Value> {
                (0..n)
                    .map(|i| match i % 2 {
                        0 => json!({"role": "user", "content": format!("The quick brown fox {i} ").repeat(20)}),
                        _ => json!({"role": "assistant", "content": [
                            {"type": "thinking", "thinking": "reasoning"},
                            {"type": "text", "text": format!("The lazy dog {i}").repeat(20)}]}),
                    })
                    .collect()
            };
            for n in [1, 3, 5] {
                let body = json!({"system": "You are a helpful assistant.",
                                  "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                                  "messages": history(n)});
                let bytes = body.to_string();
                let chat = anthropic_chat(bytes.as_bytes(), &t.anthropic_rules()).unwrap();
                let want = t.chat_ids_uncached(&chat).unwrap();
                let got = t.messages_ids_within(bytes.as_bytes(), usize::MAX).unwrap();
                assert_eq!(got.ids.to_vec(), want, "{n} messages");
                if n > 1 {
                    assert!(got.reused > 0, "turn {n} reuses the previous turn's ids");
                }
            }
            let body = json!({"instructions": "Be brief.", "input": [
                {"role": "user", "content": "What is the weather like today?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "20"}],
                "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
            let bytes = body.to_string();
            let chat = responses_chat(bytes.as_bytes()).unwrap();
            assert_eq!(
                t.responses_ids_within(bytes.as_bytes(), usize::MAX)
                    .unwrap()
                    .ids
                    .to_vec(),
                t.chat_ids_uncached(&chat).unwrap()
            );
        }
        let (_d, harmony) =
            model("{{ '<|channel|>' }}{% for m in messages %}{{ m.content }}{% endfor %}");
        assert!(harmony
            .responses_ids_within(br#"{"input":"Hi"}"#, usize::MAX)
            .is_err());
    }
}
