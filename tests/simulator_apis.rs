//! The replica simulator's Responses and Anthropic Messages APIs on their own: rendered like
//! chat (so the prefix cache warms across turns and across APIs), their usage, stream events,
//! the response store and each API's error shape.

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn post(sim: &Sim, path: &str, body: &Value) -> reqwest::blocking::Response {
    http()
        .post(sim.url(path))
        .json(body)
        .send()
        .expect("request")
}

fn post_json(sim: &Sim, path: &str, body: &Value) -> Value {
    let r = post(sim, path, body);
    assert_eq!(r.status(), 200, "{path}");
    r.json().expect("a JSON body")
}

/// The named events of an SSE response: (arrival, `event:` name, `data:` JSON), and the read
/// error that ended it, if one did.
fn named_events(
    resp: reqwest::blocking::Response,
) -> (Vec<(Instant, String, Value)>, Option<String>) {
    let mut out = vec![];
    let mut name = String::new();
    let mut reader = BufReader::new(resp);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => return (out, None),
            Ok(_) => {
                let l = line.trim_end();
                if let Some(n) = l.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = l.strip_prefix("data: ") {
                    let data = serde_json::from_str(d)
                        .unwrap_or_else(|e| panic!("data is not JSON ({e}): {d}"));
                    out.push((Instant::now(), std::mem::take(&mut name), data));
                }
            }
            Err(e) => return (out, Some(e.to_string())),
        }
    }
}

fn cached(response: &Value) -> u64 {
    response["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

fn input_tokens(response: &Value) -> u64 {
    response["usage"]["input_tokens"]
        .as_u64()
        .expect("input_tokens")
}

/// Whether `cached` tokens cover all of a `previous` prompt but its last partial block: the
/// cache holds whole 16-token blocks.
fn warm(cached: u64, previous: u64) -> bool {
    cached + 16 > previous
}

fn output_text(response: &Value) -> &str {
    response["output"][0]["content"][0]["text"]
        .as_str()
        .expect("output text")
}

#[test]
fn a_responses_chain_by_previous_response_id_finds_its_history_warm() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let instructions = "x".repeat(20_000); // 5k tokens
    let t1 = post_json(
        &sim,
        "/v1/responses",
        &json!({"model": "sim-model", "instructions": instructions, "input": "first", "max_output_tokens": 8}),
    );
    assert_eq!(t1["object"], "response");
    assert_eq!(t1["status"], "completed");
    assert!(t1["id"].as_str().unwrap().starts_with("resp_"));
    assert!(t1.get("output_text").is_none(), "the SDK computes it");
    assert_eq!(cached(&t1), 0);
    assert_eq!(t1["usage"]["output_tokens"], 8);
    assert_eq!(
        t1["usage"]["total_tokens"].as_u64().unwrap(),
        input_tokens(&t1) + 8
    );
    // Turn 2 sends only its new input, as a list of items this time.
    let t2 = post_json(
        &sim,
        "/v1/responses",
        &json!({"model": "sim-model", "previous_response_id": t1["id"], "max_output_tokens": 8,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "second"}]}]}),
    );
    assert_eq!(t2["previous_response_id"], t1["id"]);
    assert_eq!(t2["instructions"], t1["instructions"], "carried over");
    // The whole first turn, its reply included, is warm, up to the last partial block.
    assert!(
        warm(cached(&t2), input_tokens(&t1)),
        "turn 2 cached {}, turn 1 input {}",
        cached(&t2),
        input_tokens(&t1)
    );
    assert!(input_tokens(&t2) > input_tokens(&t1) + 8);
    // Turn 3 streamed, resending the same instructions (which keeps the prompt as it was).
    let r = post(
        &sim,
        "/v1/responses",
        &json!({"model": "sim-model", "previous_response_id": t2["id"], "instructions": instructions,
                "input": "third", "max_output_tokens": 4, "stream": true}),
    );
    let (events, err) = named_events(r);
    assert!(err.is_none());
    let t3 = &events.last().expect("events").2["response"];
    assert_eq!(t3["status"], "completed");
    assert!(warm(cached(t3), input_tokens(&t2)), "{t3}");
    // The replica's counters saw all three.
    let stats = sim.stats();
    assert_eq!(stats["requests"], 3);
    assert_eq!(
        stats["prompt_tokens"].as_u64().unwrap(),
        input_tokens(&t1) + input_tokens(&t2) + input_tokens(t3)
    );
    assert_eq!(
        stats["cached_tokens"].as_u64().unwrap(),
        cached(&t2) + cached(t3)
    );
    // The same history sent in full (no id) renders identically: the same prompt, all warm.
    let manual = post_json(
        &sim,
        "/v1/responses",
        &json!({"model": "sim-model", "instructions": instructions, "max_output_tokens": 1, "input": [
            {"role": "user", "content": "first"}, t1["output"][0],
            {"role": "user", "content": "second"}, t2["output"][0],
        ]}),
    );
    assert!(
        warm(cached(&manual), input_tokens(&t2)),
        "manual history cached {}, turn 2 input {}",
        cached(&manual),
        input_tokens(&t2)
    );
}

#[test]
fn the_three_apis_render_one_conversation_alike_and_share_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let system = "s".repeat(8_000);
    let chat: Value = post_json(
        &sim,
        "/v1/chat/completions",
        &chat_body(&[("system", &system), ("user", "hi")], false, 6),
    );
    let reply = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let prompt = chat["usage"]["prompt_tokens"].as_u64().unwrap();
    // The same conversation through the Responses API: the same prompt, hence the same reply.
    let resp = post_json(
        &sim,
        "/v1/responses",
        &json!({"instructions": system, "input": "hi", "max_output_tokens": 6}),
    );
    assert_eq!(input_tokens(&resp), prompt);
    assert_eq!(output_text(&resp), reply);
    // Its next turn through the Messages API finds the chat turn and its reply warm.
    let msg = post_json(
        &sim,
        "/v1/messages",
        &json!({"model": "sim-model", "max_tokens": 6, "system": system, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
            {"role": "user", "content": "next"},
        ]}),
    );
    let read = msg["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(
        warm(read, prompt),
        "cache read {read}, first prompt {prompt}"
    );
    // ... and through chat that turn is the very same prompt.
    let chat2: Value = post_json(
        &sim,
        "/v1/chat/completions",
        &chat_body(
            &[
                ("system", &system),
                ("user", "hi"),
                ("assistant", reply),
                ("user", "next"),
            ],
            false,
            6,
        ),
    );
    assert_eq!(
        chat2["usage"]["prompt_tokens"].as_u64().unwrap(),
        msg["usage"]["input_tokens"].as_u64().unwrap() + read
    );
    assert_eq!(
        chat2["choices"][0]["message"]["content"],
        msg["content"][0]["text"]
    );
}

#[test]
fn a_streamed_response_sends_openais_events_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(
        dir.path(),
        "s",
        &[
            "--decode-interval-ms",
            "40",
            "--prefill-tokens-per-s",
            "10000",
        ],
    );
    let sent = Instant::now();
    let r = post(
        &sim,
        "/v1/responses",
        &json!({"input": "y".repeat(8_000), "max_output_tokens": 5, "stream": true}),
    );
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(r.headers()["x-sim-replica"], "s");
    let (events, err) = named_events(r);
    assert!(err.is_none(), "{err:?}");
    let names: Vec<&str> = events.iter().map(|(_, n, _)| n.as_str()).collect();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(["response.output_text.delta"; 5]);
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, expected);
    for (i, (_, name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], *name);
        assert_eq!(data["sequence_number"], i);
    }
    let created = &events[0].2["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    let deltas: String = events[4..9]
        .iter()
        .map(|(_, _, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(events[9].2["text"], deltas);
    let done = &events.last().unwrap().2["response"];
    assert_eq!(done["id"], created["id"]);
    assert_eq!(output_text(done), deltas);
    assert_eq!(done["usage"]["output_tokens"], 5);
    // Timing as chat: the first token after the prefill (2k tokens: 200 ms), then one per
    // decode interval.
    let first = events[4].0;
    assert!(
        first - sent >= Duration::from_millis(180),
        "{:?}",
        first - sent
    );
    assert!(events[8].0 - first >= Duration::from_millis(4 * 40 - 20));
    // What the store holds is the final object.
    let stored: Value = http()
        .get(sim.url(&format!("/v1/responses/{}", done["id"].as_str().unwrap())))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(&stored, done);
}

#[test]
fn a_streamed_message_sends_anthropics_events_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let body = json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                      "system": "z".repeat(4_000), "messages": [{"role": "user", "content": "hi"}]});
    let (events, err) = named_events(post(&sim, "/v1/messages", &body));
    assert!(err.is_none());
    let names: Vec<&str> = events.iter().map(|(_, n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for (_, name, data) in &events {
        assert_eq!(data["type"], *name);
    }
    let start = &events[0].2["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["role"], "assistant");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["usage"]["output_tokens"], 1);
    assert_eq!(start["usage"]["cache_read_input_tokens"], 0);
    let prompt = start["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(
        events[1].2["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(events[3].2["delta"]["type"], "text_delta");
    assert_eq!(events[8].2["delta"]["stop_reason"], "end_turn");
    assert_eq!(events[8].2["usage"]["output_tokens"], 4);
    // The same request again: now the prompt is read from the cache but for its last block.
    let (again, _) = named_events(post(&sim, "/v1/messages", &body));
    let usage = &again[0].2["message"]["usage"];
    let read = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > 0);
    assert_eq!(usage["input_tokens"].as_u64().unwrap() + read, prompt);
}

#[test]
fn stored_responses_can_be_read_deleted_and_cancelled_and_unknown_ids_are_404() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let r = post_json(
        &sim,
        "/v1/responses",
        &json!({"input": "keep me", "max_output_tokens": 3}),
    );
    let id = r["id"].as_str().unwrap();
    let url = sim.url(&format!("/v1/responses/{id}"));
    let got = http().get(&url).send().unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(got.json::<Value>().unwrap(), r);
    // Cancelling a finished response changes nothing.
    let c = http().post(format!("{url}/cancel")).send().unwrap();
    assert_eq!(c.status(), 200);
    assert_eq!(c.json::<Value>().unwrap()["status"], "completed");
    let d = http().delete(&url).send().unwrap();
    assert_eq!(d.status(), 200);
    assert_eq!(
        d.json::<Value>().unwrap(),
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    for req in [
        http().get(&url),
        http().delete(&url),
        http().post(format!("{url}/cancel")),
    ] {
        let r = req.send().unwrap();
        assert_eq!(r.status(), 404);
        assert_eq!(
            r.json::<Value>().unwrap()["error"]["message"],
            format!("Response with id '{id}' not found.")
        );
    }
    // Continuing an unknown (here: deleted) response: 404 in OpenAI's shape, as vLLM answers.
    let r = post(
        &sim,
        "/v1/responses",
        &json!({"input": "more", "previous_response_id": id}),
    );
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().unwrap(),
        json!({"error": {"message": format!("Response with id '{id}' not found."),
                         "type": "invalid_request_error", "param": "previous_response_id", "code": null}})
    );
    // `store: false` keeps nothing.
    let r = post_json(
        &sim,
        "/v1/responses",
        &json!({"input": "forget me", "store": false, "max_output_tokens": 1}),
    );
    assert_eq!(r["store"], false);
    let url = sim.url(&format!("/v1/responses/{}", r["id"].as_str().unwrap()));
    assert_eq!(http().get(url).send().unwrap().status(), 404);
}

#[test]
fn a_response_in_progress_can_be_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let sim = Sim::start(dir.path(), "s", &["--decode-interval-ms", "50"]);
    let r = post(
        &sim,
        "/v1/responses",
        &json!({"input": "long", "max_output_tokens": 200, "stream": true}),
    );
    let mut reader = BufReader::new(r);
    let mut line = String::new();
    let mut id = None;
    while id.is_none() {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0);
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).unwrap();
            id = v["response"]["id"].as_str().map(str::to_owned);
        }
    }
    let url = sim.url(&format!("/v1/responses/{}", id.unwrap()));
    let c: Value = http()
        .post(format!("{url}/cancel"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(c["status"], "cancelled");
    // The stream ends early, without response.completed.
    let started = Instant::now();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!rest.contains("response.completed"));
    let stored: Value = http().get(&url).send().unwrap().json().unwrap();
    assert_eq!(stored["status"], "cancelled");
    let n = stored["usage"]["output_tokens"].as_u64().unwrap();
    assert!(n < 200, "{n}");
}

#[test]
fn anthropic_input_tokens_exclude_the_cache_and_cache_control_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let system = "c".repeat(6_000);
    let turn = |sim: &Sim, marked: bool, history: &[Value]| -> Value {
        let cc = |block: Value| {
            let mut b = block;
            if marked {
                b["cache_control"] = json!({"type": "ephemeral"});
            }
            b
        };
        let mut messages = history.to_vec();
        if let Some(last) = messages.last_mut() {
            let text = last["content"].as_str().unwrap().to_owned();
            last["content"] = json!([cc(json!({"type": "text", "text": text}))]);
        }
        post_json(
            sim,
            "/v1/messages",
            &json!({"model": "sim-model", "max_tokens": 5,
                    "system": [cc(json!({"type": "text", "text": system}))], "messages": messages}),
        )
    };
    let mut usages = vec![];
    for marked in [true, false] {
        let sim = Sim::start(dir.path(), &format!("s{marked}"), &["--speed", "100"]);
        let mut history = vec![json!({"role": "user", "content": "one"})];
        let m1 = turn(&sim, marked, &history);
        assert_eq!(m1["type"], "message");
        assert_eq!(m1["stop_reason"], "end_turn");
        assert_eq!(m1["stop_sequence"], Value::Null);
        assert_eq!(m1["usage"]["cache_read_input_tokens"], 0);
        assert_eq!(m1["usage"]["cache_creation_input_tokens"], 0);
        let reply = m1["content"][0]["text"].as_str().unwrap().to_owned();
        history.push(json!({"role": "assistant", "content": reply}));
        history.push(json!({"role": "user", "content": "two"}));
        let m2 = turn(&sim, marked, &history);
        let (input, read) = (
            m2["usage"]["input_tokens"].as_u64().unwrap(),
            m2["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        );
        assert!(warm(read, m1["usage"]["input_tokens"].as_u64().unwrap()));
        assert!(input < 32, "only the uncached tail: {input}");
        // The replica counts the whole prompt, as vLLM does; the API reports the split.
        let stats = sim.stats();
        assert_eq!(stats["cached_tokens"].as_u64().unwrap(), read);
        assert_eq!(
            stats["prompt_tokens"].as_u64().unwrap(),
            m1["usage"]["input_tokens"].as_u64().unwrap() + input + read
        );
        usages.push((m1["usage"].clone(), m2["usage"].clone(), reply));
    }
    assert_eq!(usages[0], usages[1], "cache_control changed the prompt");
}

#[test]
fn bad_requests_get_400_in_each_apis_own_shape() {
    let dir = tempfile::tempdir().unwrap();
    let mut sim = Sim::start(dir.path(), "s", &["--speed", "100"]);
    let r = post(
        &sim,
        "/v1/messages",
        &json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().unwrap(),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}})
    );
    for bad in [
        json!({"max_tokens": "ten", "messages": [{"role": "user", "content": "hi"}]}),
        json!({"max_tokens": 5, "messages": "hi"}),
        json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}),
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
        json!({"max_tokens": 5, "system": 7, "messages": [{"role": "user", "content": "hi"}]}),
        json!([1, 2]),
    ] {
        let r = post(&sim, "/v1/messages", &bad);
        assert_eq!(r.status(), 400, "{bad}");
        let v: Value = r.json().unwrap();
        assert_eq!(v["type"], "error", "{bad}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{bad}");
    }
    for bad in [
        json!({"input": 5}),
        json!({"input": [{"role": "user", "content": 5}]}),
        json!({"input": [{"type": "function_call", "name": "f"}]}),
        json!({"input": "x", "max_output_tokens": -1}),
        json!({"input": "x", "stream": "yes"}),
        json!({"input": "x", "previous_response_id": 12}),
        json!({"input": []}),
        json!("just a string"),
    ] {
        let r = post(&sim, "/v1/responses", &bad);
        assert_eq!(r.status(), 400, "{bad}");
        let v: Value = r.json().unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{bad}");
        assert!(v["error"]["message"].is_string(), "{bad}");
    }
    let r = post(
        &sim,
        "/v1/messages",
        &json!({"model": "other", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().unwrap()["error"]["type"],
        "not_found_error"
    );
    assert_eq!(sim.stats()["requests"], 0, "none of them ran");
    // Faults answer in each API's shape too.
    sim.fault(json!({"fault": "error503", "count": 2}));
    let r = post(
        &sim,
        "/v1/messages",
        &json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.json::<Value>().unwrap()["error"]["type"],
        "overloaded_error"
    );
    let r = post(&sim, "/v1/responses", &json!({"input": "hi"}));
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().unwrap()["error"]["type"], "server_error");
    // A stream cut by the cut_stream fault: three tokens, then the connection drops; the stored
    // response says it failed.
    sim.fault(json!({"fault": "cut_stream", "count": 2}));
    let (events, err) = named_events(post(
        &sim,
        "/v1/responses",
        &json!({"input": "cut", "max_output_tokens": 10, "stream": true}),
    ));
    assert!(err.is_some(), "the stream was cut");
    let deltas = events
        .iter()
        .filter(|(_, n, _)| n == "response.output_text.delta")
        .count();
    assert_eq!(deltas, 3);
    let id = events[0].2["response"]["id"].as_str().unwrap();
    let url = sim.url(&format!("/v1/responses/{id}"));
    let status = || http().get(&url).send().unwrap().json::<Value>().unwrap()["status"].clone();
    assert!(wait_until(Duration::from_secs(2), || status() == "failed"));
    let (events, err) = named_events(post(
        &sim,
        "/v1/messages",
        &json!({"max_tokens": 10, "stream": true, "messages": [{"role": "user", "content": "cut"}]}),
    ));
    assert!(err.is_some());
    assert_eq!(
        events
            .iter()
            .filter(|(_, n, _)| n == "content_block_delta")
            .count(),
        3
    );
    // Starting up: 503 in each shape.
    sim.restart(&["--unhealthy-for", "30"]);
    assert!(wait_until(Duration::from_secs(5), || http()
        .get(sim.url("/health"))
        .send()
        .is_ok()));
    let r = post(&sim, "/v1/responses", &json!({"input": "hi"}));
    assert_eq!(r.status(), 503);
    assert!(r.json::<Value>().unwrap()["error"]["message"].is_string());
}
