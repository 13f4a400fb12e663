//! Prefill/decode disaggregation against real processes: inferlb in front of simulated
//! replicas that speak vLLM's NixlConnector handover and SGLang's bootstrap handover. Each
//! failover path of the request's life, the local-prefill decider, a prefill pool that is
//! down, and roles given through the admin API.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn sim(dir: &std::path::Path, id: &str, role: &str, extra: &[&str]) -> Sim {
    let mut args = vec!["--speed", "20", "--kv-role", role];
    args.extend_from_slice(extra);
    Sim::start(dir, id, &args)
}

fn entry(s: &Sim, role: &str) -> Replica {
    Replica {
        extra: format!("role: {role}"),
        ..Replica::of(s)
    }
}

/// A balancer in front of `prefill` and `decode` sims, with `pd` as its `pd:` section.
fn pd_lb(dir: &std::path::Path, prefill: &[&Sim], decode: &[&Sim], pd: &str) -> Lb {
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    conf.replicas = prefill
        .iter()
        .map(|s| entry(s, "prefill"))
        .chain(decode.iter().map(|s| entry(s, "decode")))
        .collect();
    conf.extra = format!("  pd: {pd}\n");
    Lb::start(dir, &[], conf)
}

/// A prefill and a decode sim speaking SGLang's protocol (the prefill's bootstrap server on
/// a port of its own), and a conf naming them, routing by prefill cost; `pd:` is the caller's.
fn sglang_pool(dir: &std::path::Path) -> (Sim, Sim, LbConf) {
    let boot = free_port().to_string();
    let p1 = sim(
        dir,
        "p1",
        "producer",
        &["--pd-protocol", "sglang", "--bootstrap-port", &boot],
    );
    let d1 = sim(dir, "d1", "consumer", &["--pd-protocol", "sglang"]);
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    conf.replicas = vec![
        Replica {
            extra: format!("role: prefill, bootstrap_port: {boot}"),
            ..Replica::of(&p1)
        },
        entry(&d1, "decode"),
    ];
    (p1, d1, conf)
}

fn stat(s: &Sim, key: &str) -> u64 {
    s.stats()[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {}", s.stats()))
}

struct Answer {
    status: u16,
    replica: String,
    prefill: String,
    route: String,
    text: String,
}

fn chat(lb: &Lb, messages: &[(&str, &str)], stream: bool) -> Answer {
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .json(&chat_body(messages, stream, 8))
        .send()
        .expect("send");
    let h = |n: &str| {
        r.headers()
            .get(n)
            .map_or(String::new(), |v| v.to_str().unwrap_or("").to_string())
    };
    let (status, replica, prefill, route) = (
        r.status().as_u16(),
        h("x-inferlb-replica"),
        h("x-inferlb-prefill"),
        h("x-inferlb-route"),
    );
    let text = r.text().expect("body");
    Answer {
        status,
        replica,
        prefill,
        route,
        text,
    }
}

/// A stream of 4000 tokens (4 s at speed 20), its header read: its decode replica is busy
/// until it is dropped.
fn long_stream(lb: &Lb) -> reqwest::blocking::Response {
    let long = http()
        .post(lb.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", "a long answer")], true, 4000))
        .send()
        .expect("send");
    assert_eq!(long.status().as_u16(), 200);
    long
}

/// A conversation's second turn, streamed: its first message, `turn1`'s answer, and `next`.
fn next_turn(lb: &Lb, first: &str, turn1: &Answer, next: &str) -> Answer {
    chat(
        lb,
        &[
            ("user", first),
            ("assistant", &content(turn1)),
            ("user", next),
        ],
        true,
    )
}

/// The generated text of a chat answer, streamed or not.
fn content(a: &Answer) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(&a.text) {
        return v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
    }
    a.text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[test]
fn vllm_handover_streams_through_both_legs_and_the_next_turn_keeps_its_decode_replica() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let (d1, d2) = (
        sim(dir.path(), "d1", "consumer", &[]),
        sim(dir.path(), "d2", "consumer", &[]),
    );
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1, &d2],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    let history = text_of("history", 3000);
    for stream in [true, false] {
        let a = chat(&lb, &[("user", &format!("{stream} {history}"))], stream);
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!((a.route.as_str(), a.prefill.as_str()), ("pd", "p1"));
        assert!(!content(&a).is_empty(), "generated text: {}", a.text);
        // The stream's usage was asked for by inferlb, not by the client: taken out again.
        assert!(!stream || !a.text.contains("\"usage\""), "{}", a.text);
    }
    assert_eq!(stat(&p1, "handover_prefill_requests"), 2);
    let decoded = stat(&d1, "handover_decode_requests") + stat(&d2, "handover_decode_requests");
    assert_eq!(decoded, 2);
    let pulled = stat(&d1, "kv_tokens_transferred") + stat(&d2, "kv_tokens_transferred");
    assert!(pulled >= 5000, "both prompts' KV pulled: {pulled}");
    // The next turn of the first conversation goes back to the decode replica holding it,
    // which pulls only the new part.
    let first = format!("true {history}");
    let turn1 = chat(&lb, &[("user", &first)], false);
    let home = turn1.replica.clone();
    let (home_sim, other) = if home == "d1" { (&d1, &d2) } else { (&d2, &d1) };
    let before = (
        stat(home_sim, "kv_tokens_transferred"),
        stat(other, "kv_pulls"),
    );
    let next = text_of("next", 600);
    let turn2 = next_turn(&lb, &first, &turn1, &next);
    assert_eq!(
        (turn2.status, turn2.route.as_str()),
        (200, "pd"),
        "{}",
        turn2.text
    );
    assert_eq!(
        turn2.replica, home,
        "the decode replica that holds the history"
    );
    let moved = stat(home_sim, "kv_tokens_transferred") - before.0;
    assert!(
        moved > 0 && moved < 1500,
        "only the new part moved, not the 3,000-token history: {moved}"
    );
    assert_eq!(stat(other, "kv_pulls"), before.1);
    // A handed-over turn's cached count says what its decode pulled, not what its cache
    // model held: no prediction is checked against it.
    let predicted = lb.samples("inferlb_cache_predicted_tokens_total");
    assert!(predicted.is_empty(), "{predicted:?}");
    // Usage is the decode leg's, once: the access log line's prompt tokens are the whole
    // prompt's, with the decode's cached count.
    let log = std::fs::read_to_string(dir.path().join("inferlb.log")).expect("log");
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("route=pd ")).collect();
    assert_eq!(lines.len(), 4, "one access line per request:\n{log}");
    assert_eq!(
        stat(&p1, "handover_fields_seen") + stat(&d1, "handover_fields_seen"),
        0
    );
    // Every P/D series the Grafana dashboard queries is in the scrape now.
    let scrape = lb.metrics();
    let mut queried = 0;
    for prefix in [
        "inferlb_pd_",
        "inferlb_replica_role",
        "inferlb_replica_kv_tokens",
    ] {
        for name in dashboard_metrics(prefix) {
            queried += 1;
            let has = scrape.lines().any(|l| l.starts_with(&name));
            // Nothing was served whole in this test: that counter has no series yet.
            assert!(
                has || name == "inferlb_pd_whole_total",
                "{name} not in the scrape"
            );
        }
    }
    assert!(queried >= 4, "the dashboard has the P/D panels");
}

#[test]
fn a_turn_its_decode_replica_mostly_holds_is_served_whole_there() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1],
        "{local_prefill_tokens: 512, local_prefill_idle_tokens: 0}",
    );
    let first = text_of("local", 4000);
    let a = chat(&lb, &[("user", &first)], false);
    assert_eq!((a.status, a.route.as_str()), (200, "pd"), "{}", a.text);
    let prefills = stat(&p1, "handover_prefill_requests");
    // 100 new tokens on a history d1 holds: below 512, no prefill hop, no KV moved.
    let b = next_turn(&lb, &first, &a, &text_of("small", 100));
    assert_eq!(
        (b.status, b.route.as_str(), b.replica.as_str()),
        (200, "pd-local", "d1"),
        "{}",
        b.text
    );
    assert_eq!(stat(&p1, "handover_prefill_requests"), prefills);
    assert!(
        !b.text.contains("\"usage\""),
        "usage taken out again: {}",
        b.text
    );
    assert_eq!(
        lb.metric("inferlb_pd_whole_total{reason=\"small_uncached\"}"),
        1.0
    );
    // The turn it prefilled itself is checked against what its cache model held: the
    // 4,000-token history, found there.
    let predicted = lb.metric("inferlb_cache_predicted_tokens_total{replica=\"d1\"}");
    let reported = lb.metric("inferlb_cache_reported_tokens_total{replica=\"d1\"}");
    assert!(
        predicted >= 3000.0 && reported >= 3000.0,
        "predicted {predicted}, reported {reported}"
    );
    let wrong = lb.samples("inferlb_cache_mispredictions_total");
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// A turn served whole on its decode replica has its answer's header held until the first
/// token, as a decode leg's is: a replica lost during that prefill (it began the answer, then
/// the connection closed) costs the client nothing, and the turn goes through the pools on
/// the other decode replica.
#[test]
fn a_local_turn_whose_decode_replica_dies_before_its_first_token_goes_through_the_pools() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let (d1, d2) = (
        sim(dir.path(), "d1", "consumer", &[]),
        sim(dir.path(), "d2", "consumer", &[]),
    );
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    conf.replicas = vec![
        entry(&p1, "prefill"),
        entry(&d1, "decode"),
        entry(&d2, "decode"),
    ];
    conf.extra = "  pd: {local_prefill_tokens: 512, local_prefill_idle_tokens: 0}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    let first = text_of("lost", 3000);
    let turn1 = chat(&lb, &[("user", &first)], false);
    assert_eq!(
        (turn1.status, turn1.route.as_str()),
        (200, "pd"),
        "{}",
        turn1.text
    );
    let (home, other) = if turn1.replica == "d1" {
        (&d1, &d2)
    } else {
        (&d2, &d1)
    };
    home.fault(json!({"fault": "cut_before_token", "count": 1}));
    let prefills = stat(&p1, "handover_prefill_requests");
    let turn2 = next_turn(&lb, &first, &turn1, &text_of("small", 100));
    assert_eq!(
        (turn2.status, turn2.route.as_str(), turn2.replica.as_str()),
        (200, "pd", other.id.as_str()),
        "{}",
        turn2.text
    );
    assert!(
        turn2.text.trim_end().ends_with("data: [DONE]"),
        "{}",
        turn2.text
    );
    assert!(!turn2.text.contains("error"), "{}", turn2.text);
    assert!(!content(&turn2).is_empty(), "{}", turn2.text);
    assert_eq!(stat(&p1, "handover_prefill_requests"), prefills + 1);
    assert!(
        lb.metric(&format!(
            "inferlb_pd_legs_total{{leg=\"local\",outcome=\"broken\",replica=\"{}\"}}",
            home.id
        )) >= 1.0,
        "{}",
        lb.metrics()
    );
    // Not served whole in the end: not counted so.
    let whole = lb.samples("inferlb_pd_whole_total");
    assert!(whole.is_empty(), "{whole:?}");
}

/// A local turn that fails on a `both` replica is not prefilled there again: with no other
/// prefill replica, it is served whole on a decode replica, counted as its prefill failed.
#[test]
fn a_local_turn_failed_on_a_both_replica_is_not_prefilled_there_again() {
    let dir = tempfile::tempdir().expect("dir");
    let b1 = sim(dir.path(), "b1", "both", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    conf.replicas = vec![entry(&b1, "both"), entry(&d1, "decode")];
    conf.extra = "  pd: {local_prefill_tokens: 512, local_prefill_idle_tokens: 0}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    // The first turn on b1: the only prefill replica, and with d1 drained the only decode one.
    lb.admin("POST", "/admin/replicas/d1/drain");
    let first = text_of("both", 3000);
    let turn1 = chat(&lb, &[("user", &first)], false);
    assert_eq!(
        (turn1.status, turn1.replica.as_str()),
        (200, "b1"),
        "{}",
        turn1.text
    );
    lb.admin("POST", "/admin/replicas/d1/undrain");
    assert!(
        wait_until(Duration::from_secs(10), || lb.replica_state("d1")["live"]
            == true),
        "d1 back"
    );
    b1.fault(json!({"fault": "cut_before_token", "count": 1}));
    let prefills = stat(&b1, "handover_prefill_requests");
    let turn2 = next_turn(&lb, &first, &turn1, &text_of("small", 100));
    assert_eq!(
        (turn2.status, turn2.route.as_str(), turn2.replica.as_str()),
        (200, "pd-local", "d1"),
        "{}",
        turn2.text
    );
    assert!(!content(&turn2).is_empty(), "{}", turn2.text);
    assert!(!turn2.text.contains("error"), "{}", turn2.text);
    assert_eq!(stat(&b1, "handover_prefill_requests"), prefills);
    assert_eq!(
        lb.metric("inferlb_pd_legs_total{leg=\"local\",outcome=\"broken\",replica=\"b1\"}"),
        1.0
    );
    assert_eq!(
        lb.metric("inferlb_pd_whole_total{reason=\"prefill_failed\"}"),
        1.0
    );
}

/// A decode replica that runs nothing prefills a turn of up to `local_prefill_idle_tokens`
/// itself: no stream there to stall. The same turn, while it decodes another stream, goes
/// through the prefill pool.
#[test]
fn an_idle_decode_replica_prefills_a_larger_turn_itself_a_busy_one_hands_it_over() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1],
        "{local_prefill_tokens: 512, local_prefill_idle_tokens: 8192}",
    );
    let prefills = stat(&p1, "handover_prefill_requests");
    let a = chat(&lb, &[("user", &text_of("idle", 3000))], false);
    assert_eq!(
        (a.status, a.route.as_str(), a.replica.as_str()),
        (200, "pd-local", "d1"),
        "{}",
        a.text
    );
    assert_eq!(stat(&p1, "handover_prefill_requests"), prefills);
    assert_eq!(
        lb.metric("inferlb_pd_whole_total{reason=\"idle_decode\"}"),
        1.0
    );
    // d1 busy with a long stream.
    let long = long_stream(&lb);
    let b = chat(&lb, &[("user", &text_of("busy", 3000))], false);
    assert_eq!(
        (
            b.status,
            b.route.as_str(),
            b.replica.as_str(),
            b.prefill.as_str()
        ),
        (200, "pd", "d1", "p1"),
        "{}",
        b.text
    );
    assert_eq!(stat(&p1, "handover_prefill_requests"), prefills + 1);
    drop(long);
}

/// A turn prefilled on its idle decode replica is prefilled again on the idle prefill replica,
/// off the client's path, with no `kv_transfer_params` (so no blocks held there for a
/// decode): the conversation's next turn handed over finds its history in the prefill pool,
/// instead of prefilling both turns. Off with `warm_prefill: false`.
#[test]
fn a_turn_prefilled_on_its_decode_replica_is_copied_to_an_idle_prefill_replica() {
    let dir = tempfile::tempdir().expect("dir");
    for warm in [true, false] {
        let p1 = sim(dir.path(), "p1", "producer", &[]);
        let d1 = sim(dir.path(), "d1", "consumer", &[]);
        let lb = pd_lb(
            dir.path(),
            &[&p1],
            &[&d1],
            &format!("{{local_prefill_tokens: 512, local_prefill_idle_tokens: 8192, warm_prefill: {warm}}}"),
        );
        let first = text_of(&format!("warm {warm} history"), 3000);
        let a = chat(&lb, &[("user", &first)], false);
        assert_eq!(
            (a.status, a.route.as_str(), a.replica.as_str()),
            (200, "pd-local", "d1"),
            "{}",
            a.text
        );
        let copies = || {
            lb.samples("inferlb_pd_legs_total")
                .iter()
                .filter(|(l, _)| l.contains(r#"leg="warm""#) && l.contains(r#"outcome="ok""#))
                .map(|(_, v)| *v)
                .sum::<f64>()
        };
        if warm {
            assert!(
                wait_until(Duration::from_secs(10), || copies() == 1.0),
                "{:?}",
                lb.samples("inferlb_pd_legs_total")
            );
        } else {
            // Given the time a copy takes, there is none.
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(copies(), 0.0);
        }
        assert_eq!(
            stat(&p1, "handover_prefill_requests"),
            0,
            "a copy is no handover"
        );
        assert_eq!(stat(&p1, "kv_leases_held"), 0, "a copy holds no blocks");
        // d1 busy with a long stream: the next turn goes through the prefill pool.
        let long = long_stream(&lb);
        let cached = stat(&p1, "cached_tokens");
        let reply = content(&a);
        let next = text_of(&format!("warm {warm} next turn"), 3000);
        let b = chat(
            &lb,
            &[("user", &first), ("assistant", &reply), ("user", &next)],
            false,
        );
        assert_eq!(
            (b.status, b.route.as_str(), b.prefill.as_str()),
            (200, "pd", "p1"),
            "{}",
            b.text
        );
        let found = stat(&p1, "cached_tokens") - cached;
        if warm {
            assert!(
                found >= 2900,
                "the history was in the prefill pool: {found}"
            );
        } else {
            assert!(found < 100, "the prefill pool lacked the history: {found}");
        }
        drop(long);
    }
}

/// Prefill replicas p1 and p2 and decode replica d1, every turn handed over (`more` adds to
/// the `pd:` section).
fn two_prefills(dir: &std::path::Path, more: &str) -> (Sim, Sim, Sim, Lb) {
    let (p1, p2) = (
        sim(dir, "p1", "producer", &[]),
        sim(dir, "p2", "producer", &[]),
    );
    let d1 = sim(dir, "d1", "consumer", &[]);
    let pd = format!("{{local_prefill_tokens: 0, local_prefill_idle_tokens: 0{more}}}");
    let lb = pd_lb(dir, &[&p1, &p2], &[&d1], &pd);
    (p1, p2, d1, lb)
}

/// A fresh 2000-token turn (`tag` makes it unique), streamed or not, answered through the
/// pools with p2's prefill.
fn prefilled_on_p2(lb: &Lb, tag: &str, stream: bool) {
    let a = chat(lb, &[("user", &text_of(tag, 2000))], stream);
    assert_eq!(
        (a.status, a.route.as_str(), a.prefill.as_str()),
        (200, "pd", "p2"),
        "{}",
        a.text
    );
}

#[test]
fn a_failing_prefill_fails_over_to_another_prefill_replica() {
    let dir = tempfile::tempdir().expect("dir");
    let (p1, _p2, _d1, lb) = two_prefills(dir.path(), "");
    p1.fault(json!({"fault": "error500"}));
    for i in 0..6 {
        prefilled_on_p2(&lb, &format!("f{i}"), i % 2 == 0);
    }
    let failed =
        lb.metric("inferlb_pd_legs_total{leg=\"prefill\",outcome=\"http_5xx\",replica=\"p1\"}");
    assert!(failed >= 1.0, "p1 was tried and failed over from: {failed}");
    // A prefill replica that refuses connections: demoted, the request served by the other.
    drop(p1);
    for i in 0..4 {
        let a = chat(&lb, &[("user", &text_of(&format!("g{i}"), 2000))], true);
        assert_eq!((a.status, a.prefill.as_str()), (200, "p2"), "{}", a.text);
    }
}

/// A prefill replica silent past `prefill_timeout_seconds` is a silence, not a break: the
/// request goes on to another prefill replica, the leg counts as `read_timeout`, and the
/// silent replica stays up (it may only be slow).
#[test]
fn a_silent_prefill_fails_over_as_a_timeout_without_a_demotion() {
    let dir = tempfile::tempdir().expect("dir");
    let (p1, _p2, _d1, lb) = two_prefills(dir.path(), ", prefill_timeout_seconds: 1");
    p1.fault(json!({"fault": "hang"}));
    // p1's prefill legs by outcome (a counter has no sample until its first count).
    let p1_legs = |outcome: &str| {
        let labels = format!("{{leg=\"prefill\",outcome=\"{outcome}\",replica=\"p1\"}}");
        lb.samples("inferlb_pd_legs_total")
            .into_iter()
            .find(|(l, _)| *l == labels)
            .map_or(0.0, |(_, v)| v)
    };
    // Ties between the idle prefill replicas spread: p1 is tried within a few requests.
    for i in 0..6 {
        prefilled_on_p2(&lb, &format!("s{i}"), i % 2 == 0);
        if p1_legs("read_timeout") >= 1.0 {
            break;
        }
    }
    assert!(p1_legs("read_timeout") >= 1.0, "p1 was tried and timed out");
    assert_eq!(p1_legs("broken"), 0.0);
    assert_eq!(lb.metric(r#"inferlb_replica_up{replica="p1"}"#), 1.0);
}

#[test]
fn a_decode_that_cannot_be_reached_gets_the_same_kv_on_another_replica() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let (d1, d2) = (
        sim(dir.path(), "d1", "consumer", &[]),
        sim(dir.path(), "d2", "consumer", &[]),
    );
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    // Health checks that do not notice the stop before the next turn does.
    conf.health_interval_seconds = Some(2.0);
    conf.health_failures = Some(3);
    conf.replicas = vec![
        entry(&p1, "prefill"),
        entry(&d1, "decode"),
        entry(&d2, "decode"),
    ];
    conf.extra = "  pd: {local_prefill_tokens: 0, local_prefill_idle_tokens: 0}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    let first = text_of("conv", 3000);
    let turn1 = chat(&lb, &[("user", &first)], false);
    assert_eq!(turn1.status, 200, "{}", turn1.text);
    let (mut home, other) = if turn1.replica == "d1" {
        (d1, d2)
    } else {
        (d2, d1)
    };
    home.stop();
    let prefills = stat(&p1, "handover_prefill_requests");
    let turn2 = next_turn(&lb, &first, &turn1, &text_of("more", 600));
    assert_eq!(
        (turn2.status, turn2.route.as_str()),
        (200, "pd"),
        "{}",
        turn2.text
    );
    assert_eq!(turn2.replica, other.id);
    assert_eq!(
        stat(&p1, "handover_prefill_requests"),
        prefills + 1,
        "the same kv_transfer_params went to the other decode replica: no second prefill"
    );
    assert_eq!(stat(&other, "kv_pull_failures"), 0);
    assert!(
        lb.metric(&format!(
            "inferlb_pd_legs_total{{leg=\"decode\",outcome=\"connect\",replica=\"{}\"}}",
            home.id
        )) >= 1.0
    );
}

#[test]
fn a_failed_pull_gets_a_fresh_prefill_and_another_decode_before_any_byte() {
    let dir = tempfile::tempdir().expect("dir");
    // p1's leases end at once: every pull of its KV fails, as vLLM's does for expired blocks.
    let p1 = sim(dir.path(), "p1", "producer", &["--kv-lease-seconds", "0"]);
    let p2 = sim(dir.path(), "p2", "producer", &[]);
    let (d1, d2) = (
        sim(dir.path(), "d1", "consumer", &[]),
        sim(dir.path(), "d2", "consumer", &[]),
    );
    let lb = pd_lb(
        dir.path(),
        &[&p1, &p2],
        &[&d1, &d2],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    let mut served_after_failure = 0;
    for i in 0..6 {
        let stream = i % 2 == 0;
        let a = chat(
            &lb,
            &[("user", &text_of(&format!("pull{i}"), 1500))],
            stream,
        );
        assert_eq!(a.status, 200, "{}", a.text);
        assert!(
            !content(&a).is_empty(),
            "a whole answer, not an error: {}",
            a.text
        );
        assert!(!a.text.contains("\"error\""), "{}", a.text);
        if a.prefill == "p2" {
            served_after_failure += 1;
        }
    }
    let failures = stat(&d1, "kv_pull_failures") + stat(&d2, "kv_pull_failures");
    assert!(failures >= 1, "some pull of p1's KV failed");
    assert!(served_after_failure >= 1);
    let stream_failed = lb.samples("inferlb_pd_legs_total");
    assert!(
        stream_failed
            .iter()
            .any(|(l, v)| l.contains("leg=\"decode\"")
                && (l.contains("stream_error") || l.contains("http_5xx"))
                && *v >= 1.0),
        "{stream_failed:?}"
    );
}

#[test]
fn with_no_prefill_replica_live_requests_are_served_whole_on_decode_replicas() {
    let dir = tempfile::tempdir().expect("dir");
    let mut p1 = sim(dir.path(), "p1", "producer", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    p1.stop();
    assert!(
        wait_until(Duration::from_secs(10), || lb.replica_state("p1")["live"]
            == false),
        "p1 is taken out by its health checks"
    );
    for i in 0..3 {
        let a = chat(&lb, &[("user", &text_of(&format!("w{i}"), 2000))], i == 0);
        assert_eq!(
            (a.status, a.route.as_str(), a.replica.as_str()),
            (200, "pd-local", "d1"),
            "{}",
            a.text
        );
    }
    assert_eq!(
        lb.metric("inferlb_pd_whole_total{reason=\"no_prefill_live\"}"),
        3.0
    );
    let log = std::fs::read_to_string(dir.path().join("inferlb.log")).expect("log");
    assert_eq!(
        log.matches("no prefill replica live").count(),
        1,
        "one line, not one a request"
    );
}

#[test]
fn a_client_that_leaves_during_the_prefill_leaves_no_decode_behind() {
    let dir = tempfile::tempdir().expect("dir");
    // A slow prefill: 20,000 tokens at 2,000 tokens/s (x20) take half a second.
    let p1 = sim(
        dir.path(),
        "p1",
        "producer",
        &["--prefill-tokens-per-s", "2000"],
    );
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    let body = chat_body(&[("user", &text_of("leave", 20_000))], true, 8);
    let quick = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(150))
        .no_proxy()
        .build()
        .expect("client");
    let r = quick
        .post(lb.url("/v1/chat/completions"))
        .json(&body)
        .send();
    assert!(r.is_err(), "the client gave up before an answer");
    let logged = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(dir.path().join("inferlb.log"))
            .is_ok_and(|l| l.contains("legs cancelled"))
    });
    assert!(logged, "inferlb saw the client leave");
    // The prefill was cancelled with its connection: no lease is left, no decode was sent.
    assert!(wait_until(Duration::from_secs(10), || stat(
        &p1,
        "kv_leases_held"
    ) == 0));
    assert_eq!(stat(&d1, "handover_decode_requests"), 0);
}

/// An SGLang server in a disaggregation mode refuses a request with no bootstrap room, as
/// SGLang does; so with no prefill replica live, an SGLang pool answers 503 in the caller's
/// format instead of sending its decode server a request it refuses.
#[test]
fn sglang_with_no_prefill_replica_live_answers_503_not_a_request_its_decode_server_refuses() {
    let dir = tempfile::tempdir().expect("dir");
    let (mut p1, d1, mut conf) = sglang_pool(dir.path());
    let direct = http()
        .post(d1.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", "whole")], false, 4))
        .send()
        .expect("send");
    assert_eq!(direct.status().as_u16(), 400);
    assert!(direct
        .text()
        .unwrap_or_default()
        .contains("without bootstrap room"));
    conf.extra = "  pd: {protocol: sglang}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    // Small and idle: still through the pools, which an SGLang decode server needs.
    let a = chat(&lb, &[("user", &text_of("sgsmall", 300))], false);
    assert_eq!((a.status, a.route.as_str()), (200, "pd"), "{}", a.text);
    p1.stop();
    assert!(
        wait_until(Duration::from_secs(10), || lb.replica_state("p1")["live"]
            == false),
        "p1 is taken out by its health checks"
    );
    let b = chat(&lb, &[("user", &text_of("sgdown", 2000))], false);
    assert_eq!(b.status, 503, "{}", b.text);
    let v: Value = serde_json::from_str(&b.text).expect("an OpenAI error");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("SGLang decode server")),
        "{}",
        b.text
    );
    assert_eq!(
        stat(&d1, "requests"),
        1,
        "d1 saw only the handed-over request"
    );
}

/// Under SGLang's protocol a request served whole (Responses is not handed over there) goes
/// to a replica without a connector, never to a decode server, which would refuse it.
#[test]
fn sglang_requests_served_whole_go_to_plain_replicas_not_decode_servers() {
    let dir = tempfile::tempdir().expect("dir");
    let (_p1, d1, mut conf) = sglang_pool(dir.path());
    let r1 = sim(dir.path(), "r1", "none", &[]);
    conf.replicas.push(Replica::of(&r1));
    conf.extra = "  pd: {protocol: sglang}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    for i in 0..6 {
        let r = http()
            .post(lb.url("/v1/responses"))
            .json(&json!({"model": "sim-model", "input": format!("whole {i}"), "max_output_tokens": 4, "store": false}))
            .send()
            .expect("send");
        let replica = r
            .headers()
            .get("x-inferlb-replica")
            .map(|v| v.to_str().unwrap_or("").to_string());
        let status = r.status().as_u16();
        let text = r.text().unwrap_or_default();
        assert_eq!((status, replica.as_deref()), (200, Some("r1")), "{text}");
    }
    assert_eq!(stat(&d1, "requests"), 0);
}

/// With no replica that serves a request whole, a Responses or Messages request to an SGLang
/// pool gets a 503 in its own format that says why, and the decode server sees nothing.
#[test]
fn sglang_without_a_plain_replica_says_why_responses_and_messages_are_not_served() {
    let dir = tempfile::tempdir().expect("dir");
    let (_p1, d1, mut conf) = sglang_pool(dir.path());
    conf.extra = "  pd: {protocol: sglang}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    let responses = http()
        .post(lb.url("/v1/responses"))
        .json(&json!({"model": "sim-model", "input": "whole", "max_output_tokens": 4, "store": false}))
        .send()
        .expect("send");
    assert_eq!(responses.status().as_u16(), 503);
    let v: Value = serde_json::from_str(&responses.text().unwrap_or_default()).expect("json");
    let m = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        m.contains("bootstrap room") && m.contains("`plain` or `both`"),
        "{v}"
    );
    let messages = http()
        .post(lb.url("/v1/messages"))
        .json(&json!({"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "whole"}]}))
        .send()
        .expect("send");
    assert_eq!(messages.status().as_u16(), 503);
    let v: Value = serde_json::from_str(&messages.text().unwrap_or_default()).expect("json");
    assert_eq!(v["type"], "error", "the Anthropic format: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("bootstrap room")),
        "{v}"
    );
    assert_eq!(stat(&d1, "requests"), 0);
}

#[test]
fn sglang_handover_sends_both_legs_to_one_bootstrap_room() {
    let dir = tempfile::tempdir().expect("dir");
    let (p1, d1, mut conf) = sglang_pool(dir.path());
    conf.extra =
        "  pd: {protocol: sglang, local_prefill_tokens: 0, local_prefill_idle_tokens: 0}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    for stream in [true, false] {
        let a = chat(
            &lb,
            &[("user", &text_of(&format!("sg{stream}"), 2500))],
            stream,
        );
        assert_eq!(
            (a.status, a.route.as_str(), a.prefill.as_str()),
            (200, "pd", "p1"),
            "{}",
            a.text
        );
        assert!(!content(&a).is_empty(), "{}", a.text);
    }
    assert_eq!(stat(&p1, "handover_prefill_requests"), 2);
    assert_eq!(stat(&d1, "handover_decode_requests"), 2);
    assert!(stat(&d1, "kv_tokens_transferred") >= 4000);
}

#[test]
fn roles_come_through_the_admin_api_and_plain_replicas_never_see_handover_fields() {
    let dir = tempfile::tempdir().expect("dir");
    let plain = Sim::start(dir.path(), "plain", &["--speed", "20"]);
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let mut conf = test_conf();
    conf.routing = Some("prefill_cost".into());
    conf.replicas = vec![Replica::of(&plain), entry(&p1, "prefill")];
    conf.extra = "  pd: {local_prefill_tokens: 0, local_prefill_idle_tokens: 0}\n".into();
    let lb = Lb::start(dir.path(), &[], conf);
    // No decode replica yet: served whole, on the plain replica.
    let a = chat(&lb, &[("user", &text_of("before", 2000))], false);
    assert_eq!((a.status, a.replica.as_str()), (200, "plain"), "{}", a.text);
    let added = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&json!({"id": "d1", "address": d1.addr(), "role": "decode"}))
        .send()
        .expect("add");
    assert!(added.status().is_success(), "{:?}", added.text());
    assert!(wait_until(Duration::from_secs(10), || lb
        .replica_state("d1")["live"]
        == true));
    assert_eq!(lb.replica_state("d1")["role"], "decode");
    assert_eq!(lb.replica_state("p1")["role"], "prefill");
    assert_eq!(lb.replica_state("plain")["role"], "plain");
    let mut handed = 0;
    for i in 0..6 {
        let a = chat(&lb, &[("user", &text_of(&format!("after{i}"), 2000))], true);
        assert_eq!(a.status, 200, "{}", a.text);
        assert_ne!(
            a.replica, "p1",
            "a prefill replica never serves a request whole"
        );
        handed += usize::from(a.route == "pd");
    }
    assert!(handed >= 1, "the pool is disaggregated once d1 joined");
    assert_eq!(stat(&plain, "handover_fields_seen"), 0);
    assert!(lb.metric("inferlb_replica_role{replica=\"d1\",role=\"decode\"}") == 1.0);
}

fn post(lb: &Lb, path: &str, body: Value) -> Answer {
    let r = http().post(lb.url(path)).json(&body).send().expect("send");
    let h = |n: &str| {
        r.headers()
            .get(n)
            .map_or(String::new(), |v| v.to_str().unwrap_or("").to_string())
    };
    let (status, replica, prefill, route) = (
        r.status().as_u16(),
        h("x-inferlb-replica"),
        h("x-inferlb-prefill"),
        h("x-inferlb-route"),
    );
    Answer {
        status,
        replica,
        prefill,
        route,
        text: r.text().expect("body"),
    }
}

/// vLLM takes `kv_transfer_params` on the Responses API and Anthropic's Messages too: both are
/// disaggregated, and a failed pull in either (a Messages stream's error event, a Responses
/// stream that breaks off) gets a fresh prefill and another decode before the client sees it.
#[test]
fn responses_and_messages_are_handed_over_and_fail_over_too() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &["--kv-lease-seconds", "0"]);
    let p2 = sim(dir.path(), "p2", "producer", &[]);
    let (d1, d2) = (
        sim(dir.path(), "d1", "consumer", &[]),
        sim(dir.path(), "d2", "consumer", &[]),
    );
    let lb = pd_lb(
        dir.path(),
        &[&p1, &p2],
        &[&d1, &d2],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    // Each request twice in a row: ties between the two idle prefill replicas alternate, so
    // one of the two meets p1's expired KV first, whatever the parity.
    for i in 0..8 {
        let stream = (i / 2) % 2 == 1;
        let r = post(
            &lb,
            "/v1/responses",
            json!({"model": "sim-model", "input": text_of(&format!("resp{i}"), 1500), "stream": stream, "max_output_tokens": 8}),
        );
        assert_eq!((r.status, r.route.as_str()), (200, "pd"), "{}", r.text);
        assert!(r.text.contains("output_text"), "{}", r.text);
        if stream {
            assert!(
                r.text.contains("response.completed"),
                "a whole stream: {}",
                r.text
            );
        }
    }
    for i in 0..8 {
        let stream = (i / 2) % 2 == 1;
        let m = post(
            &lb,
            "/v1/messages",
            json!({"model": "sim-model", "max_tokens": 8, "stream": stream,
                   "messages": [{"role": "user", "content": text_of(&format!("msg{i}"), 1500)}]}),
        );
        assert_eq!((m.status, m.route.as_str()), (200, "pd"), "{}", m.text);
        assert!(!m.text.contains("\"error\""), "{}", m.text);
        if stream {
            assert!(m.text.contains("message_stop"), "{}", m.text);
        }
    }
    assert_eq!(
        stat(&p1, "handover_fields_seen") + stat(&d1, "handover_fields_seen"),
        0
    );
    let prefilled = stat(&p1, "handover_prefill_requests") + stat(&p2, "handover_prefill_requests");
    assert!(
        prefilled >= 16,
        "every request went through a prefill leg: {prefilled}"
    );
    let decoded = stat(&d1, "handover_decode_requests") + stat(&d2, "handover_decode_requests");
    assert!(decoded >= 16, "{decoded}");
    let failed = stat(&d1, "kv_pull_failures") + stat(&d2, "kv_pull_failures");
    assert!(
        failed >= 1,
        "some pull of p1's expired KV failed, unseen by the client"
    );
}

/// A decode stream cut after its first token is never retried, and the client sees it cut:
/// its API's error event, and a body that does not end cleanly (a cleanly ended one would look
/// like a whole answer).
#[test]
fn a_decode_stream_cut_after_its_first_token_reaches_the_client_as_cut() {
    let dir = tempfile::tempdir().expect("dir");
    let p1 = sim(dir.path(), "p1", "producer", &[]);
    let d1 = sim(dir.path(), "d1", "consumer", &[]);
    let lb = pd_lb(
        dir.path(),
        &[&p1],
        &[&d1],
        "{local_prefill_tokens: 0, local_prefill_idle_tokens: 0}",
    );
    d1.fault(json!({"fault": "cut_stream", "count": 1}));
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .json(&chat_body(&[("user", &text_of("cut", 2000))], true, 20))
        .send()
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-inferlb-route"], "pd");
    let body = r.text();
    assert!(body.is_err(), "the body must not end cleanly: {body:?}");
    assert_eq!(stat(&p1, "handover_prefill_requests"), 1, "never retried");
    let log = std::fs::read_to_string(dir.path().join("inferlb.log")).expect("log");
    let line = log
        .lines()
        .find(|l| l.contains("route=pd "))
        .unwrap_or_else(|| panic!("an access line:\n{log}"));
    assert!(line.contains("status=200"), "{line}");
    assert!(lb.metric("inferlb_stream_errors_total") >= 1.0);
}
