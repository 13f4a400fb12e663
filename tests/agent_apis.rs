//! Agent APIs through inferlb: Responses (with stored responses), Anthropic Messages and
//! completions routed by their prompt; sessions; answers in each API's own shape.

mod common;

use common::*;
use serde_json::{json, Value};

/// Posts `body` to `path`; (status, replica, route, JSON body).
fn post(lb: &Lb, path: &str, body: &Value) -> (u16, String, String, Value) {
    post_with(lb, path, body, &[])
}

fn post_with(
    lb: &Lb,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, String, String, Value) {
    let mut req = http().post(lb.url(path)).json(body);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    answer(req.send().expect("send"))
}

fn answer(r: reqwest::blocking::Response) -> (u16, String, String, Value) {
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (replica, route) = (header("x-inferlb-replica"), header("x-inferlb-route"));
    let status = r.status().as_u16();
    let body = r.json().unwrap_or(Value::Null);
    (status, replica, route, body)
}

fn responses_turn(input: &str, previous: Option<&str>) -> Value {
    let mut body = json!({"model": "sim-model", "input": input, "max_output_tokens": 4});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    body
}

/// Prompt text long enough for warm and cold to differ clearly (the simulator counts 4 bytes
/// a token).
fn filler(seed: &str) -> String {
    (0..400).map(|i| format!("{seed} {i} ")).collect()
}

#[test]
fn a_responses_chain_stays_on_the_replica_that_stores_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, lb) = cluster(dir.path(), &[], test_conf());
    let (status, home, route, first) =
        post(&lb, "/v1/responses", &responses_turn(&filler("r"), None));
    assert_eq!((status, route.as_str()), (200, "spread"), "{first}");
    let mut previous = first["id"].as_str().expect("a response id").to_string();
    for turn in 1..10 {
        let body = responses_turn(&format!("turn {turn}"), Some(&previous));
        let (status, replica, route, resp) = post(&lb, "/v1/responses", &body);
        assert_eq!(status, 200, "turn {turn}: {resp}");
        assert_eq!(
            (replica.as_str(), route.as_str()),
            (home.as_str(), "stored"),
            "turn {turn}"
        );
        let cached = resp["usage"]["input_tokens_details"]["cached_tokens"].as_u64();
        assert!(cached.unwrap_or(0) > 0, "turn {turn} is warm: {resp}");
        previous = resp["id"].as_str().expect("id").to_string();
    }
    // The stored response itself, and its deletion, go to the same replica.
    let got = http()
        .get(lb.url(&format!("/v1/responses/{previous}")))
        .send()
        .expect("get");
    let (status, replica, route, resp) = answer(got);
    assert_eq!(
        (status, replica.as_str(), route.as_str()),
        (200, home.as_str(), "stored")
    );
    assert_eq!(resp["id"], previous.as_str());
    let deleted = http()
        .delete(lb.url(&format!("/v1/responses/{previous}")))
        .send()
        .expect("delete");
    let (status, replica, _, _) = answer(deleted);
    assert_eq!((status, replica.as_str()), (200, home.as_str()));
    let metric = lb.metric("inferlb_stored_responses");
    assert!(metric >= 10.0, "{metric}");
    drop((a, b));
}

#[test]
fn a_stored_response_on_a_stopped_replica_gets_a_clear_error_not_another_replicas_404() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut a, mut b, lb) = cluster(dir.path(), &[], test_conf());
    let (_, home, _, first) = post(&lb, "/v1/responses", &responses_turn("hello", None));
    let id = first["id"].as_str().expect("id").to_string();
    let (owner, other) = if home == "gpu0" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    let before = other.stats()["requests"].as_u64();
    owner.stop();
    // Until the health check notices, the first attempt finds the connection refused.
    for i in 0..3 {
        let (status, _, _, body) = post(&lb, "/v1/responses", &responses_turn("next", Some(&id)));
        let message = body["error"]["message"].as_str().unwrap_or("").to_string();
        assert!(
            status == 503 && message.contains(&id) && message.contains(&home) || status == 502,
            "attempt {i}: {status} {body}"
        );
    }
    assert_eq!(
        other.stats()["requests"].as_u64(),
        before,
        "never sent to the other replica"
    );
    // Fresh work still flows.
    let (status, replica, _, _) = post(&lb, "/v1/responses", &responses_turn("fresh", None));
    assert_eq!((status, replica.as_str()), (200, other.id.as_str()));
}

#[test]
fn an_unknown_stored_id_is_found_by_asking_the_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, lb) = cluster(dir.path(), &[], test_conf());
    // A response created behind inferlb's back (as after a restart of inferlb).
    let direct = http()
        .post(b.url("/v1/responses"))
        .json(&responses_turn("made directly", None))
        .send()
        .and_then(|r| r.json::<Value>())
        .expect("direct");
    let id = direct["id"].as_str().expect("id");
    for _ in 0..3 {
        let (status, replica, route, body) =
            post(&lb, "/v1/responses", &responses_turn("continue", Some(id)));
        assert_eq!(
            (status, replica.as_str(), route.as_str()),
            (200, "gpu1", "stored"),
            "{body}"
        );
    }
    // An id nobody has goes on as fresh work, and the replica answers for it.
    let (status, _, route, body) = post(
        &lb,
        "/v1/responses",
        &responses_turn("x", Some("resp_nobody_has_this")),
    );
    assert_eq!((status, route.as_str()), (404, "spread"), "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("resp_nobody_has_this"));
    drop(a);
}

#[test]
fn a_drained_replica_keeps_serving_the_responses_it_stores() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), &[], test_conf());
    let (_, home, _, first) = post(&lb, "/v1/responses", &responses_turn("hello", None));
    let id = first["id"].as_str().expect("id").to_string();
    lb.admin("POST", &format!("/admin/replicas/{home}/drain"));
    let (status, replica, route, _) = post(&lb, "/v1/responses", &responses_turn("on", Some(&id)));
    assert_eq!(
        (status, replica.as_str(), route.as_str()),
        (200, home.as_str(), "stored")
    );
    // New conversations go elsewhere.
    for i in 0..4 {
        let (_, replica, _, _) = post(
            &lb,
            "/v1/responses",
            &responses_turn(&format!("new {i}"), None),
        );
        assert_ne!(replica, home);
    }
}

/// The same 5-turn agent loop through each API: every warm turn lands on its warm replica.
#[test]
fn an_agent_loop_through_each_api_stays_warm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), &[], test_conf());
    let system = filler("system");
    for api in ["chat", "responses", "messages"] {
        let mut history: Vec<(String, String)> = vec![];
        let mut home = String::new();
        for turn in 0..5 {
            history.push(("user".into(), format!("{api} turn {turn}: {}", filler("u"))));
            let (path, body) = match api {
                "chat" => {
                    let mut m = vec![json!({"role": "system", "content": system})];
                    m.extend(
                        history
                            .iter()
                            .map(|(r, c)| json!({"role": r, "content": c})),
                    );
                    (
                        "/v1/chat/completions",
                        json!({"model": "sim-model", "messages": m, "max_tokens": 4}),
                    )
                }
                "responses" => {
                    let items: Vec<Value> = history
                        .iter()
                        .map(|(r, c)| json!({"type": "message", "role": r, "content": c}))
                        .collect();
                    (
                        "/v1/responses",
                        json!({"model": "sim-model", "instructions": system,
                        "input": items, "max_output_tokens": 4, "store": false}),
                    )
                }
                _ => {
                    let m: Vec<Value> = history
                        .iter()
                        .map(|(r, c)| json!({"role": r, "content": [{"type": "text", "text": c}]}))
                        .collect();
                    (
                        "/v1/messages",
                        json!({"model": "sim-model", "system": system,
                        "messages": m, "max_tokens": 4}),
                    )
                }
            };
            let (status, replica, route, resp) = post(&lb, path, &body);
            assert_eq!(status, 200, "{api} turn {turn}: {resp}");
            // Fresh traffic in between must not move the loop.
            post(
                &lb,
                "/v1/chat/completions",
                &chat_body(&[("user", &format!("noise {turn}"))], false, 2),
            );
            if turn == 0 {
                home = replica;
            } else {
                assert_eq!(
                    (replica.as_str(), route.as_str()),
                    (home.as_str(), "pinned"),
                    "{api} turn {turn}"
                );
            }
            let reply = match api {
                "chat" => resp["choices"][0]["message"]["content"].as_str(),
                "responses" => resp["output"][0]["content"][0]["text"].as_str(),
                _ => resp["content"][0]["text"].as_str(),
            };
            history.push(("assistant".into(), reply.unwrap_or("").to_string()));
        }
    }
}

#[test]
fn anthropic_clients_get_anthropic_errors_and_may_send_x_api_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = LbConf {
        api_keys: vec!["sk-inferlb-test-1".into()],
        ..test_conf()
    };
    let (_a, _b, lb) = cluster(dir.path(), &[], conf);
    let body = json!({"model": "sim-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _, err) = post(&lb, "/v1/messages", &body);
    assert_eq!(status, 401);
    assert_eq!(err["type"], "error", "{err}");
    assert_eq!(err["error"]["type"], "authentication_error", "{err}");
    let key = [("x-api-key", "sk-inferlb-test-1")];
    let (status, _, _, ok) = post_with(&lb, "/v1/messages", &body, &key);
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["type"], "message");
    let unknown = json!({"model": "no-such-model", "max_tokens": 4, "messages": []});
    let (status, _, _, err) = post_with(&lb, "/v1/messages", &unknown, &key);
    assert_eq!(
        (status, err["error"]["type"].as_str()),
        (404, Some("not_found_error")),
        "{err}"
    );
    // OpenAI clients keep OpenAI's shape.
    let (status, _, _, err) = post(&lb, "/v1/responses", &responses_turn("x", None));
    assert_eq!(
        (status, err["error"]["type"].as_str()),
        (401, Some("invalid_request_error"))
    );
    // Usage is counted in Anthropic's terms: input_tokens excludes the cached part.
    let turn1 = json!({"model": "sim-model", "max_tokens": 4, "system": filler("s"),
        "messages": [{"role": "user", "content": "hi"}]});
    let (_, _, _, reply) = post_with(&lb, "/v1/messages", &turn1, &key);
    let turn2 = json!({"model": "sim-model", "max_tokens": 4, "system": filler("s"),
        "messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": reply["content"].clone()},
            {"role": "user", "content": "more"}]});
    let (_, replica, route, warm) = post_with(&lb, "/v1/messages", &turn2, &key);
    assert_eq!(route, "pinned");
    let read = warm["usage"]["cache_read_input_tokens"]
        .as_f64()
        .expect("cache read");
    assert!(read > 0.0, "{warm}");
    let cached = lb.metric(&format!(
        "inferlb_cached_prompt_tokens_total{{replica=\"{replica}\"}}"
    ));
    assert!(cached >= read, "{cached} < {read}");
}

#[test]
fn a_cut_stream_ends_in_each_apis_own_error_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, lb) = cluster(dir.path(), &[], test_conf());
    for (path, body, marker) in [
        (
            "/v1/messages",
            json!({"model": "sim-model", "max_tokens": 50, "stream": true,
            "messages": [{"role": "user", "content": "go"}]}),
            "event: error",
        ),
        (
            "/v1/responses",
            json!({"model": "sim-model", "max_output_tokens": 50, "stream": true,
            "input": "go"}),
            "event: error",
        ),
    ] {
        a.fault(json!({"fault": "cut_stream", "count": 1}));
        b.fault(json!({"fault": "cut_stream", "count": 1}));
        let r = http().post(lb.url(path)).json(&body).send().expect("send");
        assert_eq!(r.status(), 200);
        let text = read_until_cut(r);
        assert!(text.contains(marker), "{path}: {text}");
        let last = text.trim_end().rsplit("\n\n").next().unwrap_or("");
        assert!(
            last.starts_with(marker),
            "{path} ends with the error event: {last}"
        );
        // Clear the other replica's fault.
        a.fault(json!({"fault": "none"}));
        b.fault(json!({"fault": "none"}));
    }
}

/// Everything a response delivered before it ended or was cut.
fn read_until_cut(mut r: reqwest::blocking::Response) -> String {
    use std::io::Read;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = r.read(&mut buf) {
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn a_session_header_pins_a_session_whatever_its_prompts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = LbConf {
        session_header: Some("x-session-id".into()),
        ..test_conf()
    };
    let (_a, _b, lb) = cluster(dir.path(), &[], conf);
    let mut homes = std::collections::HashMap::new();
    for round in 0..4 {
        for s in ["alpha", "beta", "gamma", "delta"] {
            let body = chat_body(&[("user", &format!("{s} unrelated {round}"))], false, 2);
            let (status, replica, route, _) =
                post_with(&lb, "/v1/chat/completions", &body, &[("x-session-id", s)]);
            assert_eq!(status, 200);
            let home = homes.entry(s).or_insert_with(|| replica.clone());
            assert_eq!(&replica, home, "{s} round {round}");
            if round > 0 {
                assert_eq!(route, "pinned");
            }
        }
    }
    let distinct: std::collections::HashSet<_> = homes.values().collect();
    assert_eq!(
        distinct.len(),
        2,
        "sessions spread over both replicas: {homes:?}"
    );
}
