//! `responses.store: balancer`: inferlb keeps the Responses conversations, so chains by
//! `previous_response_id` work over replicas without a store of their own (vLLM's default),
//! survive a replica's restart, are shared by instances through Redis, and fail clearly.

mod common;

use std::time::Duration;

use common::*;
use inferlb_harness::Redis;
use serde_json::{json, Value};

const NO_STORE: &[&str] = &["--no-response-store"];

fn store_conf(more: &str) -> LbConf {
    LbConf {
        routing: Some("prefill_cost".into()),
        extra: format!("  responses: {{store: balancer{more}}}\n"),
        ..test_conf()
    }
}

/// (status, JSON body) of a request with `headers`.
fn send(req: reqwest::blocking::RequestBuilder, headers: &[(&str, &str)]) -> (u16, Value, String) {
    let mut req = req;
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let r = req.send().expect("send");
    let status = r.status().as_u16();
    let replica = r
        .headers()
        .get("x-inferlb-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let text = r.text().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::Null),
        replica,
    )
}

fn create(lb: &Lb, body: &Value, headers: &[(&str, &str)]) -> (u16, Value, String) {
    send(http().post(lb.url("/v1/responses")).json(body), headers)
}

/// A streamed create: (status, the `response.completed` event's response, every event type).
fn create_streamed(lb: &Lb, body: &Value) -> (u16, Value, Vec<String>) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = http()
        .post(lb.url("/v1/responses"))
        .json(&body)
        .send()
        .expect("send");
    let status = r.status().as_u16();
    let text = r.text().unwrap_or_default();
    let mut done = Value::Null;
    let mut kinds = vec![];
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        let kind = v["type"].as_str().unwrap_or("").to_owned();
        if kind.starts_with("response.") && v["response"].is_object() {
            // Every response object the client sees says what it sent.
            assert_eq!(
                v["response"]["store"],
                body["store"]
                    .clone()
                    .as_bool()
                    .map_or(json!(true), Value::from),
                "{kind}"
            );
        }
        if kind == "response.completed" {
            done = v["response"].clone();
        }
        kinds.push(kind);
    }
    (status, done, kinds)
}

fn turn(input: Value, previous: Option<&str>) -> Value {
    let mut body = json!({"model": "sim-model", "input": input, "max_output_tokens": 3});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    body
}

/// The last `/v1/responses` body a replica received, as sent.
fn last_received(sims: &[&Sim]) -> Vec<String> {
    sims.iter()
        .filter_map(|s| {
            let v: Value = http()
                .get(s.url("/sim/received?n=64"))
                .send()
                .ok()?
                .json()
                .ok()?;
            v["received"]
                .as_array()?
                .iter()
                .rev()
                .find(|r| r["path"] == "/v1/responses")
                .and_then(|r| r["body"].as_str().map(str::to_owned))
        })
        .collect()
}

fn received_count(sims: &[&Sim]) -> usize {
    sims.iter()
        .map(|s| {
            let v: Value = http()
                .get(s.url("/sim/received?n=64"))
                .send()
                .and_then(|r| r.json())
                .unwrap_or(Value::Null);
            v["received"].as_array().map_or(0, Vec::len)
        })
        .sum()
}

/// A tool-calling chain of `turns` turns, alternately JSON and streamed; each turn continues
/// the last. Returns the response ids in order.
fn tool_chain(lb: &Lb, tag: &str, turns: usize) -> Vec<String> {
    let mut ids: Vec<String> = vec![];
    for i in 0..turns {
        let input = if i % 2 == 0 {
            json!([{"type": "message", "role": "user", "content": format!("{tag} step {i}: {}", "context ".repeat(40))}])
        } else {
            json!([
                {"type": "function_call", "call_id": format!("call_{tag}_{i}"), "name": "lookup", "arguments": "{\"q\":1}"},
                {"type": "function_call_output", "call_id": format!("call_{tag}_{i}"), "output": format!("result {i}")}
            ])
        };
        let body = turn(input, ids.last().map(String::as_str));
        let (status, response) = if i % 2 == 0 {
            let (s, r, _) = create(lb, &body, &[]);
            (s, r)
        } else {
            let (s, r, kinds) = create_streamed(lb, &body);
            assert_eq!(kinds.last().map(String::as_str), Some("response.completed"));
            (s, r)
        };
        assert_eq!(status, 200, "turn {i}: {response}");
        assert_eq!(
            response["store"],
            json!(true),
            "turn {i}: what the client sent"
        );
        let previous = ids.last().map_or(Value::Null, |p| json!(p));
        assert_eq!(response["previous_response_id"], previous, "turn {i}");
        ids.push(response["id"].as_str().expect("an id").to_owned());
    }
    ids
}

#[test]
fn a_tool_calling_chain_runs_on_replicas_without_a_store_streamed_and_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, lb) = cluster(dir.path(), NO_STORE, store_conf(""));
    let ids = tool_chain(&lb, "t", 10);
    // The replicas were sent whole prompts: never an id to look up, never asked to store.
    let last = last_received(&[&a, &b]);
    assert!(!last.is_empty());
    for body in &last {
        let v: Value = serde_json::from_str(body).expect("JSON");
        assert!(v.get("previous_response_id").is_none(), "{body}");
        assert_eq!(v["store"], json!(false));
    }
    // The last turn's prompt held every earlier item: 5 user turns, 5 tool round trips, 9
    // answers (each answer's output item), then its own two items.
    let newest = last
        .iter()
        .map(|b| serde_json::from_str::<Value>(b).expect("JSON"))
        .max_by_key(|v| v["input"].as_array().map_or(0, Vec::len))
        .expect("a body");
    let items = newest["input"].as_array().expect("a list");
    assert_eq!(items.len(), 5 + 2 * 4 + 9 + 2, "{newest}");
    // The store answers for what it holds.
    let (status, got, _) = send(
        http().get(lb.url(&format!("/v1/responses/{}", ids[9]))),
        &[],
    );
    assert_eq!(status, 200);
    assert_eq!(got["id"], json!(ids[9]));
    assert_eq!(got["previous_response_id"], json!(ids[8]));
    let url = lb.url(&format!("/v1/responses/{}/input_items?order=asc", ids[9]));
    let (status, list, _) = send(http().get(url), &[]);
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], json!("list"));
    assert_eq!(list["data"][0]["type"], json!("function_call"));
    assert_eq!(list["data"].as_array().map(Vec::len), Some(2));
    assert_eq!(list["has_more"], json!(false));
    // Deleted: gone from the store and from the chain.
    let (status, del, _) = send(
        http().delete(lb.url(&format!("/v1/responses/{}", ids[9]))),
        &[],
    );
    assert_eq!((status, &del["deleted"]), (200, &json!(true)));
    let (status, _, _) = send(
        http().get(lb.url(&format!("/v1/responses/{}", ids[9]))),
        &[],
    );
    assert_eq!(status, 404);
    let (status, err, _) = create(&lb, &turn(json!("more"), Some(&ids[9])), &[]);
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], json!("previous_response_not_found"));
    let metrics = lb.metrics();
    assert!(
        sample_value(
            &metrics,
            r#"inferlb_responses_store_total{event="expanded"}"#
        )
        .unwrap_or(0.0)
            >= 9.0,
        "{metrics}"
    );
}

#[test]
fn a_replica_restarted_mid_chain_changes_nothing_in_the_prompt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut a, mut b, lb) = cluster(dir.path(), NO_STORE, store_conf(""));
    let ids = tool_chain(&lb, "r", 4);
    // Turn 5, sent once before the restart: what a replica was sent for it.
    let next = turn(json!("and then?"), Some(&ids[3]));
    let (status, _, _) = create(&lb, &next, &[]);
    assert_eq!(status, 200);
    let before = last_received(&[&a, &b]);
    let before = before.into_iter().max_by_key(String::len).expect("a body");
    // Both replicas restart (their caches and any state gone); the same turn again.
    // Restarted with the flags they had.
    a.restart(&[]);
    b.restart(&[]);
    a.assert_healthy();
    b.assert_healthy();
    let up = || {
        lb.samples("inferlb_replica_up")
            .iter()
            .filter(|(_, v)| *v == 1.0)
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(10), || up() == 2),
        "the replicas came back"
    );
    let (status, response, _) = create(&lb, &next, &[]);
    assert_eq!(status, 200, "{response}");
    let after = last_received(&[&a, &b]);
    assert_eq!(after.len(), 1, "only one replica served since the restart");
    assert_eq!(
        after[0], before,
        "the expanded prompt is byte for byte the same"
    );
}

#[test]
fn bad_chains_and_other_keys_ids_get_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = ["sk-test-alice-0001", "sk-test-bob-00002"];
    let conf = LbConf {
        api_keys: keys.iter().map(|k| k.to_string()).collect(),
        max_body_bytes: Some(64 * 1024),
        ..store_conf("")
    };
    let (a, b, lb) = cluster(dir.path(), NO_STORE, conf);
    let alice = [("authorization", "Bearer sk-test-alice-0001")];
    let bob = [("authorization", "Bearer sk-test-bob-00002")];
    let sent_before = received_count(&[&a, &b]);
    let code = |v: &Value| v["error"]["code"].clone();
    // Unknown id: 400 previous_response_not_found, no replica asked to serve it.
    let (status, err, _) = create(&lb, &turn(json!("x"), Some("resp_unknown")), &alice);
    assert_eq!(
        (status, code(&err)),
        (400, json!("previous_response_not_found"))
    );
    assert_eq!(err["error"]["param"], json!("previous_response_id"));
    assert_eq!(received_count(&[&a, &b]), sent_before);
    // A stored turn: alice's alone.
    let (status, first, _) = create(&lb, &turn(json!("hello"), None), &alice);
    assert_eq!(status, 200);
    let id = first["id"].as_str().expect("id").to_owned();
    for path in [
        format!("/v1/responses/{id}"),
        format!("/v1/responses/{id}/input_items"),
    ] {
        let (status, _, _) = send(http().get(lb.url(&path)), &bob);
        assert_eq!(status, 404, "bob sees no {path}");
        let (status, _, _) = send(http().get(lb.url(&path)), &alice);
        assert_eq!(status, 200, "alice sees {path}");
    }
    let (status, err, _) = create(&lb, &turn(json!("x"), Some(&id)), &bob);
    assert_eq!(
        (status, code(&err)),
        (400, json!("previous_response_not_found"))
    );
    let (status, _, _) = send(http().delete(lb.url(&format!("/v1/responses/{id}"))), &bob);
    assert_eq!(status, 404, "bob cannot delete it");
    // GET, DELETE, input_items of an unknown id: 404.
    for req in [
        http().get(lb.url("/v1/responses/resp_nope")),
        http().delete(lb.url("/v1/responses/resp_nope")),
        http().get(lb.url("/v1/responses/resp_nope/input_items")),
    ] {
        let (status, err, _) = send(req, &alice);
        assert_eq!(status, 404, "{err}");
    }
    // store: false is not kept.
    let mut unstored = turn(json!("not kept"), None);
    unstored["store"] = json!(false);
    let (status, r, _) = create(&lb, &unstored, &alice);
    assert_eq!((status, &r["store"]), (200, &json!(false)));
    let gone = r["id"].as_str().expect("id").to_owned();
    let (status, err, _) = create(&lb, &turn(json!("x"), Some(&gone)), &alice);
    assert_eq!(
        (status, code(&err)),
        (400, json!("previous_response_not_found"))
    );
    // background needs a store on the replica.
    let mut background = turn(json!("x"), None);
    background["background"] = json!(true);
    let (status, err, _) = create(&lb, &background, &alice);
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("background"));
    // A chain whose expanded body passes max_body_bytes: 413.
    let mut last = id.clone();
    let big = "y".repeat(20 * 1024);
    let mut refused = None;
    for _ in 0..5 {
        let (status, r, _) = create(&lb, &turn(json!(big.clone()), Some(&last)), &alice);
        if status != 200 {
            refused = Some((status, r));
            break;
        }
        last = r["id"].as_str().expect("id").to_owned();
    }
    let (status, err) = refused.expect("the chain outgrew the limit");
    assert_eq!(status, 413, "{err}");
}

#[test]
fn the_store_evicts_the_least_recently_used_by_count_and_bytes_and_by_age() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = store_conf(", max_items: 2");
    let (_a, _b, lb) = cluster(dir.path(), NO_STORE, conf);
    let new = |input: &str, previous: Option<&str>| {
        let (status, r, _) = create(&lb, &turn(json!(input), previous), &[]);
        assert_eq!(status, 200, "{r}");
        r["id"].as_str().expect("id").to_owned()
    };
    let get = |id: &str| send(http().get(lb.url(&format!("/v1/responses/{id}"))), &[]).0;
    let (x, y) = (new("x", None), new("y", None));
    assert_eq!(
        get(&x),
        200,
        "x is used again: y is the least recently used"
    );
    let z = new("z", None);
    assert_eq!((get(&x), get(&y), get(&z)), (200, 404, 200));
    // A chain whose first turn was evicted is never served as a fresh start.
    let w = new("w", Some(&z));
    assert_eq!(get(&w), 200);
    let _ = new("v", None);
    let _ = new("u", None);
    let (status, err, _) = create(&lb, &turn(json!("more"), Some(&w)), &[]);
    assert_eq!(
        (status, err["error"]["code"].clone()),
        (400, json!("previous_response_not_found"))
    );
    drop(lb);

    // By bytes: 1 MiB holds three of these and not four.
    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), NO_STORE, store_conf(", max_mib: 1"));
    let big = "b".repeat(300 * 1024);
    let ids: Vec<String> = (0..4)
        .map(|i| {
            let (status, r, _) = create(&lb, &turn(json!(format!("{i} {big}")), None), &[]);
            assert_eq!(status, 200);
            r["id"].as_str().expect("id").to_owned()
        })
        .collect();
    assert_eq!(lb.metric("inferlb_responses_store_items"), 3.0);
    assert!(lb.metric("inferlb_responses_store_bytes") <= (1 << 20) as f64);
    let get = |id: &str| send(http().get(lb.url(&format!("/v1/responses/{id}"))), &[]).0;
    assert_eq!(get(&ids[0]), 404);
    assert_eq!(get(&ids[3]), 200);
    drop(lb);

    let dir = tempfile::tempdir().expect("tempdir");
    let (_a, _b, lb) = cluster(dir.path(), NO_STORE, store_conf(", ttl_seconds: 1"));
    let (status, r, _) = create(&lb, &turn(json!("short-lived"), None), &[]);
    assert_eq!(status, 200);
    let id = r["id"].as_str().expect("id").to_owned();
    let expired = wait_until(Duration::from_secs(5), || {
        send(http().get(lb.url(&format!("/v1/responses/{id}"))), &[]).0 == 404
    });
    assert!(expired, "kept past its TTL");
    let (status, err, _) = create(&lb, &turn(json!("x"), Some(&id)), &[]);
    assert_eq!(
        (status, err["error"]["code"].clone()),
        (400, json!("previous_response_not_found"))
    );
}

struct Three {
    lbs: Vec<Lb>,
    redis: Redis,
    _sims: Vec<Sim>,
    _dir: tempfile::TempDir,
}

fn three_instances() -> Three {
    let dir = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(dir.path());
    let (a, b) = two_sims(dir.path(), NO_STORE);
    let lbs: Vec<Lb> = ["lb-a", "lb-b", "lb-c"]
        .iter()
        .map(|n| {
            let d = dir.path().join(n);
            std::fs::create_dir_all(&d).expect("dir");
            let mut conf = store_conf("");
            conf.extra.push_str(&redis.cluster_conf(n));
            Lb::start(&d, &[&a, &b], conf)
        })
        .collect();
    let joined = wait_until(Duration::from_secs(10), || {
        lbs.iter()
            .all(|lb| lb.metric("inferlb_cluster_connected") == 1.0)
    });
    assert!(joined, "the instances did not reach Redis");
    Three {
        lbs,
        redis,
        _sims: vec![a, b],
        _dir: dir,
    }
}

#[test]
fn three_instances_share_every_chain_turn_by_turn() {
    let t = three_instances();
    let mut last: Option<String> = None;
    for i in 0..12 {
        let lb = &t.lbs[i % 3];
        let body = turn(
            json!(format!("turn {i} {}", "words ".repeat(30))),
            last.as_deref(),
        );
        let (status, r) = if i % 2 == 0 {
            let (s, r, _) = create(lb, &body, &[]);
            (s, r)
        } else {
            let (s, r, _) = create_streamed(lb, &body);
            (s, r)
        };
        assert_eq!(status, 200, "turn {i} through instance {}: {r}", i % 3);
        last = Some(r["id"].as_str().expect("id").to_owned());
    }
    // Deleted through one instance: gone through the one that made it and holds it too.
    let last = last.expect("an id");
    let url = |lb: &Lb| lb.url(&format!("/v1/responses/{last}"));
    let maker = &t.lbs[11 % 3];
    assert_eq!(send(http().get(url(maker)), &[]).0, 200);
    let (status, _, _) = send(http().delete(url(&t.lbs[0])), &[]);
    assert_eq!(status, 200);
    for lb in &t.lbs {
        assert_eq!(
            send(http().get(url(lb)), &[]).0,
            404,
            "a tombstone hides every copy"
        );
    }
    let (status, err, _) = create(maker, &turn(json!("after"), Some(&last)), &[]);
    assert_eq!(
        (status, err["error"]["code"].clone()),
        (400, json!("previous_response_not_found"))
    );
}

#[test]
fn redis_killed_mid_chain_keeps_the_chain_where_it_is_held() {
    let mut t = three_instances();
    let mut last: Option<String> = None;
    let step = |lb: &Lb, i: usize, last: &mut Option<String>| -> (u16, Value) {
        let (status, r, _) = create(lb, &turn(json!(format!("step {i}")), last.as_deref()), &[]);
        if status == 200 {
            *last = Some(r["id"].as_str().expect("id").to_owned());
        }
        (status, r)
    };
    // Turns through every instance; the last before the kill through lb-a.
    for (i, at) in [1, 2, 1, 0].into_iter().enumerate() {
        let (status, r) = step(&t.lbs[at], i, &mut last);
        assert_eq!(status, 200, "{r}");
    }
    t.redis.kill();
    assert!(!t.redis.is_running());
    // lb-a holds the whole chain: it goes on.
    for i in 4..7 {
        let (status, r) = step(&t.lbs[0], i, &mut last);
        assert_eq!(
            status, 200,
            "through the instance that holds the chain: {r}"
        );
    }
    // lb-b cannot reach lb-a's newest exchanges.
    let probe = turn(json!("elsewhere"), last.as_deref());
    let (status, err, _) = create(&t.lbs[1], &probe, &[]);
    assert_eq!(
        (status, err["error"]["code"].clone()),
        (400, json!("previous_response_not_found"))
    );
    // Redis back (empty): lb-a writes what it made again, and every instance serves the chain.
    t.redis.restart();
    let shared = wait_until(Duration::from_secs(15), || {
        create(&t.lbs[1], &probe, &[]).0 == 200
    });
    assert!(shared, "lb-b never found the chain after Redis came back");
    for i in 7..10 {
        let (status, r) = step(&t.lbs[i % 3], i, &mut last);
        assert_eq!(status, 200, "after Redis came back: {r}");
    }
}

#[test]
fn a_named_key_keeps_its_chains_when_its_value_rotates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("keys");
    std::fs::write(&file, "alice sk-alice-old-0001\nbob sk-bob-000000001\n").expect("keys");
    let mut conf = store_conf("");
    conf.extra.push_str(&format!(
        "  api_keys_file: {:?}\n  secrets_reload_interval_seconds: 0.2\n",
        file.display().to_string()
    ));
    let (_a, _b, lb) = cluster(dir.path(), NO_STORE, conf);
    let old = [("authorization", "Bearer sk-alice-old-0001")];
    let new = [("authorization", "Bearer sk-alice-new-0002")];
    let bob = [("authorization", "Bearer sk-bob-000000001")];
    let (status, first, _) = create(&lb, &turn(json!("hello"), None), &old);
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().expect("id").to_owned();
    // Rotated: alice's new value replaces the old one.
    std::fs::write(&file, "alice sk-alice-new-0002\nbob sk-bob-000000001\n").expect("keys");
    let rotated = wait_until(Duration::from_secs(5), || {
        create(&lb, &turn(json!("x"), None), &old).0 == 401
    });
    assert!(rotated, "the old value still works");
    let (status, next, _) = create(&lb, &turn(json!("again"), Some(&id)), &new);
    assert_eq!(status, 200, "the chain outlives the key's value: {next}");
    let (status, err, _) = create(&lb, &turn(json!("x"), Some(&id)), &bob);
    assert_eq!(
        (status, err["error"]["code"].clone()),
        (400, json!("previous_response_not_found"))
    );
}
