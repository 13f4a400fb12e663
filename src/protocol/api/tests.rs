//! Each family read into the prompt model: what must and must not change the chain.

use super::*;
use proptest::prelude::*;
use serde_json::json;

fn classify_json(family: Family, v: serde_json::Value) -> RequestInfo {
    classify(family, &serde_json::to_vec(&v).expect("json"))
}

fn ends(info: &RequestInfo) -> Vec<u64> {
    info.shape.part_ends().collect()
}

fn chat(msgs: &[(&str, &str)]) -> serde_json::Value {
    let messages: Vec<_> = msgs
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "m", "messages": messages})
}

#[test]
fn a_chat_continuation_extends_the_chain_of_its_earlier_turn() {
    let turn1 = classify_json(Family::Chat, chat(&[("system", "S"), ("user", "hi")]));
    let turn2 = classify_json(
        Family::Chat,
        chat(&[
            ("system", "S"),
            ("user", "hi"),
            ("assistant", "yo"),
            ("user", "more"),
        ]),
    );
    let (p1, p2) = (ends(&turn1), ends(&turn2));
    assert_eq!(p2.len(), 4);
    assert_eq!(&p2[..2], &p1[..]);
    let strict: Vec<u64> = turn2.shape.strict_prefixes().collect();
    assert_eq!(strict, vec![p2[2], p2[1], p2[0]]);
}

#[test]
fn formatting_and_key_order_do_not_change_the_hash() {
    let a = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
    let b = b"{ \"messages\" : [ {\"content\": \"x\", \"role\": \"user\"} ], \"model\": \"m\" }";
    assert_eq!(
        classify(Family::Chat, a).shape,
        classify(Family::Chat, b).shape
    );
    // An escaped string is the same text.
    let c = br#"{"model":"m","messages":[{"role":"user","content":"\u0078"}]}"#;
    assert_eq!(
        classify(Family::Chat, a).shape,
        classify(Family::Chat, c).shape
    );
}

#[test]
fn the_model_seeds_the_chain_and_tools_are_part_of_it() {
    let a = classify_json(Family::Chat, chat(&[("user", "x")]));
    let mut other = chat(&[("user", "x")]);
    other["model"] = json!("n");
    assert_ne!(a.shape, classify_json(Family::Chat, other).shape);
    let mut tooled = chat(&[("user", "x")]);
    tooled["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let t = classify_json(Family::Chat, tooled);
    assert_eq!(ends(&t).len(), 2);
    assert_ne!(ends(&t)[1], ends(&a)[0]);
}

#[test]
fn unreadable_bodies_are_other_and_record_nothing() {
    let cases: &[(Family, &[u8])] = &[
        (Family::Chat, b""),
        (Family::Chat, b"not json"),
        (Family::Chat, b"[1,2,3]"),
        (Family::Chat, b"\xff\xfe\x00"),
        (Family::Chat, br#"{"prompt":"hello"}"#),
        (Family::Chat, br#"{"messages":"a string"}"#),
        (Family::Chat, br#"{"messages":[]}"#),
        (Family::Responses, br#"{"input": 42}"#),
        (Family::Responses, br#"{"model":"m"}"#),
        (Family::Messages, br#"{"messages": {"role":"user"}}"#),
        (Family::Completions, br#"{"prompt": ["a", 1]}"#),
        (Family::Completions, br#"{"prompt": {"x": 1}}"#),
    ];
    for (family, body) in cases {
        let info = classify(*family, body);
        assert!(
            matches!(info.shape, Shape::Other { .. }),
            "{family:?} {body:?}"
        );
        assert_eq!(info.shape.served_key(), None);
        assert_eq!(info.shape.strict_prefixes().count(), 0);
    }
}

#[test]
fn model_stream_and_previous_response_id_are_read() {
    let info = classify(
        Family::Completions,
        br#"{"model":"llama","stream":true,"prompt":"p"}"#,
    );
    assert_eq!(info.model.as_deref(), Some("llama"));
    assert!(info.stream);
    let info = classify(Family::Chat, br#"{"model":3,"stream":"yes"}"#);
    assert_eq!((info.model, info.stream), (None, false));
    let info = classify(
        Family::Responses,
        br#"{"input":"x","previous_response_id":"resp_1"}"#,
    );
    assert_eq!(info.previous_response_id.as_deref(), Some("resp_1"));
    let info = classify(
        Family::Chat,
        br#"{"messages":[],"previous_response_id":"resp_1"}"#,
    );
    assert_eq!(
        info.previous_response_id, None,
        "only the Responses API has it"
    );
}

#[test]
fn anthropic_system_and_content_as_string_or_blocks_are_one_prompt() {
    let plain = json!({"model": "m", "max_tokens": 5, "system": "S",
        "messages": [{"role": "user", "content": "hi"}]});
    let blocks = json!({"model": "m", "max_tokens": 5,
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
            "cache_control": {"type": "ephemeral"}}]}]});
    assert_eq!(
        classify_json(Family::Messages, plain).shape,
        classify_json(Family::Messages, blocks).shape
    );
}

#[test]
fn anthropic_tool_loops_extend_the_chain_and_cache_control_never_counts() {
    let tools = json!([{"name": "ls", "input_schema": {"type": "object"}}]);
    let turn1 = json!({"model": "m", "system": "S", "tools": tools,
        "messages": [{"role": "user", "content": "list files"}]});
    let mut turn2 = turn1.clone();
    turn2["messages"] = json!([
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
            "content": [{"type": "text", "text": "a b c"}]}, {"type": "mystery", "x": 1}]}
    ]);
    let (a, b) = (
        classify_json(Family::Messages, turn1.clone()),
        classify_json(Family::Messages, turn2.clone()),
    );
    assert_eq!(ends(&a).len(), 3, "system, tools, one message");
    assert_eq!(&ends(&b)[..3], &ends(&a)[..]);
    assert_eq!(ends(&b).len(), 5);
    // A cache breakpoint moved to another block changes nothing.
    let mut marked = turn2.clone();
    marked["tools"][0]["cache_control"] = json!({"type": "ephemeral"});
    marked["messages"][1]["content"][0]["cache_control"] = json!({"type": "ephemeral"});
    assert_eq!(classify_json(Family::Messages, marked).shape, b.shape);
    // Another tool input is another prompt.
    let mut edited = turn2;
    edited["messages"][1]["content"][1]["input"]["path"] = json!("/");
    assert_ne!(
        ends(&classify_json(Family::Messages, edited))[3],
        ends(&b)[3]
    );
}

#[test]
fn responses_items_extend_the_chain_turn_by_turn() {
    let turn1 = json!({"model": "m", "instructions": "be brief",
        "input": [{"role": "user", "content": "hi"}]});
    let turn2 = json!({"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]},
        {"type": "web_search_call", "id": "w1"}
    ]});
    let (a, b) = (
        classify_json(Family::Responses, turn1),
        classify_json(Family::Responses, turn2),
    );
    assert_eq!(ends(&a).len(), 2);
    assert_eq!(&ends(&b)[..2], &ends(&a)[..]);
    assert_eq!(ends(&b).len(), 7);
    // A string input is one user message.
    let s = classify_json(Family::Responses, json!({"model": "m", "input": "hi"}));
    let l = classify_json(
        Family::Responses,
        json!({"model": "m", "input": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(s.shape, l.shape);
}

#[test]
fn completions_prompts_of_each_form() {
    let s = classify(Family::Completions, br#"{"model":"m","prompt":"abc"}"#);
    assert_eq!(ends(&s).len(), 1);
    let batch = classify(
        Family::Completions,
        br#"{"model":"m","prompt":["abc","d"]}"#,
    );
    assert_eq!(ends(&batch).len(), 2);
    assert_eq!(ends(&batch)[0], ends(&s)[0]);
    let ids = classify(Family::Completions, br#"{"model":"m","prompt":[1,2,3]}"#);
    let ids2 = classify(
        Family::Completions,
        br#"{"model":"m","prompt":[[1,2,3],[4]]}"#,
    );
    assert_eq!(ends(&ids2)[0], ends(&ids)[0]);
    // A growing prompt shares its leading chunks with the shorter one.
    let long = "x".repeat(3000);
    let longer = format!("{long}{}", "y".repeat(3000));
    let (a, b) = (
        classify_json(Family::Completions, json!({"prompt": long})),
        classify_json(Family::Completions, json!({"prompt": longer})),
    );
    let (Shape::Prompt { links: la }, Shape::Prompt { links: lb }) = (&a.shape, &b.shape) else {
        panic!("prompts");
    };
    assert_eq!(la[..2], lb[..2], "the first two 1 KiB chunks");
}

#[test]
fn paths_name_families_and_stored_responses() {
    assert_eq!(Family::of("/v1/chat/completions"), Family::Chat);
    assert_eq!(Family::of("/v1/responses"), Family::Responses);
    assert_eq!(Family::of("/v1/messages"), Family::Messages);
    assert_eq!(Family::of("/v1/completions"), Family::Completions);
    assert_eq!(Family::of("/anything"), Family::Chat);
    assert_eq!(stored_response_path("/v1/responses/resp_1"), Some("resp_1"));
    assert_eq!(
        stored_response_path("/v1/responses/resp_1/cancel"),
        Some("resp_1")
    );
    assert_eq!(stored_response_path("/v1/responses/"), None);
    assert_eq!(stored_response_path("/v1/responses/a/b"), None);
    assert_eq!(stored_response_path("/v1/responses"), None);
}

fn any_family() -> impl Strategy<Value = Family> {
    prop_oneof![
        Just(Family::Chat),
        Just(Family::Completions),
        Just(Family::Responses),
        Just(Family::Messages)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]
    #[test]
    fn any_bytes_classify_without_panic(family in any_family(), body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let info = classify(family, &body);
        let _ = info.shape.affinity_key();
        // Every strict prefix, and only those: one fewer than the parts, or none.
        let parts: Vec<u64> = info.shape.part_ends().collect();
        let strict: Vec<u64> = info.shape.strict_prefixes().collect();
        prop_assert_eq!(strict.len(), parts.len().saturating_sub(1));
        prop_assert_eq!(info.shape.served_key(), parts.last().copied());
        if let Shape::Prompt { links } = &info.shape {
            prop_assert!(links.last().is_some_and(|l| l.part_end));
        }
    }

    /// Any well-formed prompt of any family is read as a prompt with one part per message,
    /// and the prompt one message shorter is its prefix.
    #[test]
    fn every_familys_prompts_are_read_part_by_part(
        family in any_family(),
        msgs in proptest::collection::vec((0usize..3, "\\PC{1,40}"), 1..6),
    ) {
        let body = |msgs: &[(usize, String)]| {
            let roles = ["user", "assistant", "system"];
            let items: Vec<_> = msgs.iter().map(|(r, c)| {
                // Anthropic's messages carry no system role: it is a top-level field there.
                let role = if family == Family::Messages { roles[r % 2] } else { roles[*r] };
                json!({"role": role, "content": c})
            }).collect();
            let texts: Vec<_> = msgs.iter().map(|(_, c)| json!(c)).collect();
            match family {
                Family::Chat | Family::Messages => json!({"model": "m", "messages": items}),
                Family::Responses => json!({"model": "m", "input": items}),
                Family::Completions => json!({"model": "m", "prompt": texts}),
            }
        };
        let full = classify_json(family, body(&msgs));
        prop_assert!(matches!(full.shape, Shape::Prompt { .. }), "{:?}", full.shape);
        prop_assert_eq!(ends(&full).len(), msgs.len());
        if msgs.len() > 1 {
            let shorter = classify_json(family, body(&msgs[..msgs.len() - 1]));
            prop_assert_eq!(&ends(&full)[..msgs.len() - 1], &ends(&shorter)[..]);
        }
    }

    /// Key order and whitespace never matter, for any message list.
    #[test]
    fn reserialising_a_chat_never_changes_its_hash(
        msgs in proptest::collection::vec(("[a-z]{1,9}", "\\PC{0,40}"), 1..6),
        family in prop_oneof![Just(Family::Chat), Just(Family::Messages)],
    ) {
        let messages: Vec<_> = msgs.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
        let v = json!({"model": "m", "messages": messages});
        let compact = serde_json::to_vec(&v).expect("json");
        let pretty = serde_json::to_vec_pretty(&v).expect("json");
        // Reversed key order, written by hand.
        let reversed: String = format!(
            "{{\"messages\": [{}], \"model\": \"m\"}}",
            msgs.iter()
                .map(|(r, c)| format!("{{ \"content\" : {}, \"role\" : {} }}", json!(c), json!(r)))
                .collect::<Vec<_>>()
                .join(" , ")
        );
        let a = classify(family, &compact).shape;
        prop_assert_eq!(&a, &classify(family, &pretty).shape);
        prop_assert_eq!(&a, &classify(family, reversed.as_bytes()).shape);
    }
}

/// Bodies of every family whose chain is pinned to the values version 2 gave before the
/// single-pass reader: the hasher and the readers may change only with `HASH_VERSION`.
fn golden_bodies() -> Vec<(Family, &'static [u8])> {
    vec![
        (
            Family::Chat,
            br#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{"b":1.5,"a":[null,true]}}}],"messages":[{"role":"system","content":"S \u00e9\ud83d\ude00"},{"role":"user","name":"u","content":[{"type":"text","text":"hi\n"},{"type":"image_url","image_url":{"url":"data:x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},7]}"#,
        ),
        (
            Family::Messages,
            br#"{"model":"claude","system":[{"type":"text","text":"S","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"ls","input_schema":{"type":"object"}}],"messages":[{"role":"user","content":"list"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"ls","input":{"path":"."}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"a b"}]},{"type":"mystery","x":-2e3}]}]}"#,
        ),
        (
            Family::Responses,
            br#"{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi"},{"type":"function_call","name":"f","arguments":"{\"a\":1}"},{"type":"function_call_output","output":"42"},{"type":"reasoning","summary":[{"type":"summary_text","text":"t"}]},{"type":"web_search_call","id":"w"}]}"#,
        ),
        (Family::Completions, br#"{"model":"m","prompt":[[1,2,3],[4294967295]]}"#),
        (Family::Completions, br#"{"model":"m","prompt":["a","b\t"]}"#),
    ]
}

#[test]
fn hashes_are_those_version_2_always_gave() {
    let got: Vec<Vec<u64>> = golden_bodies()
        .into_iter()
        .map(|(f, b)| {
            classify(f, b)
                .shape
                .links()
                .iter()
                .map(|l| l.hash)
                .collect()
        })
        .collect();
    let want: Vec<Vec<u64>> = vec![
        vec![
            0x787844ba10d6d850,
            0xa6ef62d0ed255ee6,
            0x21c53825828a1d25,
            0xd8f5f6fbd16ca667,
            0x15aa1033f57813d1,
        ],
        vec![
            0x10209462ee438c5c,
            0x59de3bda9efa10b4,
            0x530f51d62e508393,
            0x4c6014f01123cda2,
            0xdc56d8fd6263ab5,
        ],
        vec![
            0x26f6decf27c3de6e,
            0xcffd4c5674a8965c,
            0xc213792bc42f7db3,
            0x53aafc4631fc616e,
            0xc3e3b1a5ac765cb,
            0x5c707afde7ae718d,
        ],
        vec![0xb1048e3cadc376a9, 0x85aa182c0f7bbc4b],
        vec![0xadc90555573485f8, 0x3251a1742e8e286e],
    ];
    assert_eq!(got, want);
}
