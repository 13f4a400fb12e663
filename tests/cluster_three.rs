//! Three inferlb instances sharing one view through a real redis-server, in front of simulated
//! replicas, with a client that sends each request of a conversation to another instance than
//! the one before (issue 12, item 5). Every ratio is against a control in the same test: the
//! same arrivals through one instance alone (a fourth inferlb, without Redis, in front of the
//! same replicas). The numbers are printed: `cargo test --test cluster_three -- --nocapture`.
//!
//! The tests take turns (one lock): they measure ratios on a small shared machine, and two of
//! them at once would measure each other.

mod common;

use std::collections::BTreeMap;
use std::sync::{Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;
use inferlb_harness::{http_status, Redis};
use serde_json::{json, Value};

static SERIAL: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const INSTANCES: [&str; 3] = ["lb-a", "lb-b", "lb-c"];
/// Tokens each answer generates: the first after the prefill, the second 20 ms later (the
/// simulator's decode interval), so every answer takes at least 20 ms, the bound: the
/// next turn may reach another instance 20 ms after this one was routed.
const REPLY_TOKENS: u32 = 2;

/// Fields drop in order: the balancers stop before the replicas and Redis they use.
struct Fleet {
    /// lb-a, lb-b, lb-c: one view through Redis.
    lbs: Vec<Lb>,
    /// The control: one instance alone, in front of the same replicas.
    solo: Lb,
    sims: Vec<Sim>,
    redis: Redis,
    root: tempfile::TempDir,
}

impl Fleet {
    /// `replicas` simulated replicas (gpu0, ...), Redis, the three instances and the control,
    /// all routing `adaptive`.
    fn start(replicas: usize) -> Fleet {
        Fleet::routing(replicas, "adaptive")
    }

    fn routing(replicas: usize, routing: &str) -> Fleet {
        Fleet::with(replicas, routing, None)
    }

    /// [`Fleet::routing`], with `spill_margin` set when given (0: never spill).
    fn with(replicas: usize, routing: &str, spill_margin: Option<usize>) -> Fleet {
        let root = tempfile::tempdir().expect("tempdir");
        let redis = Redis::start(root.path());
        let sims: Vec<Sim> = (0..replicas)
            .map(|i| Sim::spawn(root.path(), &format!("gpu{i}"), &[]))
            .collect();
        sims.iter().for_each(Sim::assert_healthy);
        let lbs: Vec<Lb> = INSTANCES
            .iter()
            .map(|n| {
                let conf = LbConf {
                    extra: redis.cluster_conf(n),
                    spill_margin,
                    ..test_conf()
                };
                instance(root.path(), &sims, routing, n, conf)
            })
            .collect();
        let solo = LbConf {
            spill_margin,
            ..test_conf()
        };
        let solo = instance(root.path(), &sims, routing, "solo", solo);
        let joined = wait_until(Duration::from_secs(10), || {
            lbs.iter().all(|lb| connected(lb) && ready(lb))
        });
        assert!(joined, "the three instances did not all join the cluster");
        Fleet {
            lbs,
            solo,
            sims,
            redis,
            root,
        }
    }

    /// One more instance of the cluster, `name`, started now.
    fn join(&self, name: &str, routing: &str) -> Lb {
        let conf = LbConf {
            extra: self.redis.cluster_conf(name),
            ..test_conf()
        };
        let lb = instance(self.root.path(), &self.sims, routing, name, conf);
        let joined = wait_until(Duration::from_secs(10), || connected(&lb) && ready(&lb));
        assert!(joined, "{name} did not join the cluster");
        lb
    }

    fn three(&self) -> Vec<&Lb> {
        self.lbs.iter().collect()
    }
}

/// An inferlb named `name` in front of `sims`, routing `routing`, with `conf` (its cluster in
/// `extra`, or none).
fn instance(root: &std::path::Path, sims: &[Sim], routing: &str, name: &str, conf: LbConf) -> Lb {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("dir");
    let refs: Vec<&Sim> = sims.iter().collect();
    let conf = LbConf {
        routing: Some(routing.into()),
        ..conf
    };
    Lb::start(&dir, &refs, conf)
}

fn connected(lb: &Lb) -> bool {
    lb.metric("inferlb_cluster_connected") == 1.0
}

fn ready(lb: &Lb) -> bool {
    http_status(lb.admin_port, "/ready", Duration::from_secs(1)) == Some(200)
}

/// One client for a whole run (each blocking client runs a thread of its own).
fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .expect("http client")
}

/// POSTs `body` to `path` on `lb`: (replica, route, the JSON answer) when it is a success, or
/// what went wrong.
fn post(
    c: &reqwest::blocking::Client,
    lb: &Lb,
    path: &str,
    body: &Value,
) -> Result<(String, String, Value), String> {
    let r = c
        .post(lb.url(path))
        .json(body)
        .send()
        .map_err(|e| e.to_string())?;
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (replica, route) = (header("x-inferlb-replica"), header("x-inferlb-route"));
    let status = r.status();
    let v: Value = r.json().map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    Ok((replica, route, v))
}

/// A chat through `lb`: (replica, route, the reply's text), or what went wrong.
fn chat(
    c: &reqwest::blocking::Client,
    lb: &Lb,
    messages: &[Value],
) -> Result<(String, String, String), String> {
    let body = json!({"model": "sim-model", "messages": messages, "max_tokens": REPLY_TOKENS});
    let (replica, route, v) = post(c, lb, "/v1/chat/completions", &body)?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    Ok((replica, route, text))
}

/// One turn as the client saw it.
#[derive(Debug, Clone)]
struct Turn {
    /// loop.round: a loop starts a new conversation every `turns` turns.
    conversation: (usize, usize),
    turn: usize,
    /// When it was sent.
    sent: Instant,
    /// Which instance it went to.
    instance: usize,
    /// The replica and route that answered; `Err` when the client got an error.
    outcome: Result<(String, String), String>,
}

/// How runs of agent loops are shaped.
#[derive(Clone, Copy)]
struct Loops {
    loops: usize,
    turns: usize,
    /// Conversations each loop has, one after the other.
    rounds: usize,
    /// Tokens of each conversation's system prompt, and of each turn's new message.
    context_tokens: usize,
    turn_tokens: usize,
    /// The run ends here even if turns are left (bounded in time).
    until: Instant,
}

/// `l.loops` agent loops at once, each sending a turn as soon as the previous answer ended;
/// loop `c`'s turn `t` goes to `fronts[(c + t) % fronts.len()]`, so with three instances
/// every turn of a conversation reaches another instance than the turn before.
fn agent_loops(fronts: &[&Lb], tag: &str, l: Loops) -> Vec<Turn> {
    let c = client();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..l.loops)
            .map(|lp| {
                let c = c.clone();
                s.spawn(move || {
                    let mut turns = vec![];
                    let mut sent_total = 0usize;
                    'rounds: for round in 0..l.rounds {
                        let seed = format!("{tag} loop {lp} round {round}");
                        let mut messages = vec![
                            json!({"role": "system", "content": text_of(&seed, l.context_tokens)}),
                        ];
                        for t in 0..l.turns {
                            if Instant::now() >= l.until {
                                break 'rounds;
                            }
                            let instance = (lp + sent_total) % fronts.len();
                            sent_total += 1;
                            let ask = text_of(&format!("{seed} turn {t}"), l.turn_tokens);
                            messages.push(json!({"role": "user", "content": ask}));
                            let sent = Instant::now();
                            let outcome = chat(&c, fronts[instance], &messages);
                            match &outcome {
                                Ok((_, _, reply)) => {
                                    messages.push(json!({"role": "assistant", "content": reply}))
                                }
                                Err(_) => {
                                    messages.pop();
                                }
                            }
                            turns.push(Turn {
                                conversation: (lp, round),
                                turn: t,
                                sent,
                                instance,
                                outcome: outcome.map(|(r, route, _)| (r, route)),
                            });
                        }
                    }
                    turns
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("loop thread"))
            .collect()
    })
}

/// Warm turns (not a conversation's first) whose turn before was answered too, and how many
/// of them went to the same replica as that turn.
#[derive(Debug, Default, Clone)]
struct Agreement {
    warm: usize,
    same: usize,
    spilled: usize,
    /// The routes of the warm turns that moved, counted.
    moved: BTreeMap<String, usize>,
}

impl Agreement {
    fn share(&self) -> f64 {
        self.same as f64 / self.warm.max(1) as f64
    }

    /// Warm turns routed by an instance that knew where the turn before went: kept there, or
    /// moved on purpose because that replica was far busier (`spilled`, a load decision made
    /// knowing the home; one instance alone makes it too).
    fn agreed(&self) -> f64 {
        let spilled_away = self.moved.get("spilled").copied().unwrap_or(0);
        (self.same + spilled_away) as f64 / self.warm.max(1) as f64
    }
}

/// Agreement over the warm turns `counted` keeps (by the turn's send time).
fn agreement(turns: &[Turn], counted: impl Fn(&Turn) -> bool) -> Agreement {
    let mut by: BTreeMap<((usize, usize), usize), &Turn> = BTreeMap::new();
    for t in turns {
        by.insert((t.conversation, t.turn), t);
    }
    let mut a = Agreement::default();
    for t in turns.iter().filter(|t| t.turn > 0 && counted(t)) {
        let prev = by.get(&(t.conversation, t.turn - 1));
        let (Some(Ok((before, _))), Ok((now, route))) = (prev.map(|p| &p.outcome), &t.outcome)
        else {
            continue;
        };
        a.warm += 1;
        a.same += usize::from(before == now);
        a.spilled += usize::from(route == "spilled");
        if before != now {
            *a.moved.entry(route.clone()).or_insert(0) += 1;
        }
    }
    a
}

fn errors(turns: &[Turn]) -> Vec<String> {
    turns
        .iter()
        .filter_map(|t| t.outcome.as_ref().err().cloned())
        .collect()
}

/// The replicas' prefix-cache counters summed: (queried tokens, hit tokens), from each
/// simulator's `/metrics` as vLLM exposes them.
fn cache_counts(sims: &[Sim]) -> (f64, f64) {
    let c = client();
    let mut total = (0.0, 0.0);
    for s in sims {
        let text = c
            .get(s.url("/metrics"))
            .send()
            .and_then(|r| r.text())
            .expect("sim metrics");
        let sum = |name: &str| samples_of(&text, name).iter().map(|(_, v)| v).sum::<f64>();
        total.0 += sum("vllm:prefix_cache_queries_total");
        total.1 += sum("vllm:prefix_cache_hits_total");
    }
    total
}

fn hit_rate(before: (f64, f64), after: (f64, f64)) -> f64 {
    (after.1 - before.1) / (after.0 - before.0).max(1.0)
}

/// The `q`-quantile of `v` (nearest rank); NaN when empty.
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1]
}

/// How long a pin made on one instance takes to be known by the next: a fresh prompt is sent
/// to instance `i % 3` while instance `(i + 1) % 3`'s affinity table is watched until it
/// holds one entry more. Measured from the moment the request is sent, so it includes the
/// sending instance reading the request and choosing (the pin is shared when it chooses).
fn pin_propagation(f: &Fleet, samples: usize) -> Vec<f64> {
    let watcher = client();
    let entries = |lb: &Lb| -> f64 {
        let text = watcher
            .get(lb.admin_url("/metrics"))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default();
        sample_value(&text, "inferlb_affinity_entries").unwrap_or(-1.0)
    };
    let sender = client();
    let mut delays = vec![];
    for i in 0..samples {
        let (from, to) = (&f.lbs[i % 3], &f.lbs[(i + 1) % 3]);
        let base = entries(to);
        let messages =
            [json!({"role": "user", "content": text_of(&format!("propagation {i}"), 50)})];
        std::thread::scope(|s| {
            let sent = Instant::now();
            let request = s.spawn(|| chat(&sender, from, &messages));
            let mut seen = None;
            while sent.elapsed() < Duration::from_secs(5) {
                if entries(to) > base {
                    seen = Some(sent.elapsed());
                    break;
                }
            }
            request
                .join()
                .expect("request thread")
                .expect("propagation request answered");
            let seen = seen.unwrap_or_else(|| panic!("pin {i} never reached {:?}", to.conf));
            delays.push(seen.as_secs_f64() * 1e3);
        });
    }
    delays
}

#[test]
fn sixteen_agent_loops_keep_their_replica_whichever_instance_each_turn_reaches() {
    let _turn = one_at_a_time();
    // Spilling off: this measures whether a pin made through one instance is found through
    // the others. With it on, a first-turn placement left uneven by turns that reach two
    // instances within a message's travel (the burst test measures that) is later evened out
    // by spills, which counted here as misses (3 of 176 in one of seven runs).
    let f = Fleet::with(4, "adaptive", Some(0));
    let shape = |until| Loops {
        loops: 16,
        turns: 12,
        rounds: 1,
        context_tokens: 1000,
        turn_tokens: 40,
        until,
    };
    let limit = || Instant::now() + Duration::from_secs(60);

    let c0 = cache_counts(&f.sims);
    let solo = agent_loops(&[&f.solo], "solo", shape(limit()));
    let c1 = cache_counts(&f.sims);
    let three = agent_loops(&f.three(), "three", shape(limit()));
    let c2 = cache_counts(&f.sims);

    let (a_solo, a_three) = (agreement(&solo, |_| true), agreement(&three, |_| true));
    let (h_solo, h_three) = (hit_rate(c0, c1), hit_rate(c1, c2));
    let switched = three
        .windows(2)
        .filter(|w| w[0].conversation == w[1].conversation && w[0].instance == w[1].instance)
        .count();
    eprintln!(
        "[agent loops] 16 loops x 12 turns; warm turns on their previous turn's replica: \
         one instance {}/{} = {:.4} (spilled {}), three instances {}/{} = {:.4} (spilled {}); \
         ratio {:.4} (>= 0.99 required)",
        a_solo.same,
        a_solo.warm,
        a_solo.share(),
        a_solo.spilled,
        a_three.same,
        a_three.warm,
        a_three.share(),
        a_three.spilled,
        a_three.share() / a_solo.share()
    );
    eprintln!(
        "[agent loops] replicas' prefix-cache hits (vllm:prefix_cache_hits_total / queries): \
         one instance {:.4}, three instances {:.4}; ratio {:.4}",
        h_solo,
        h_three,
        h_three / h_solo
    );
    assert_eq!(switched, 0, "every turn reaches another instance");
    assert!(errors(&solo).is_empty() && errors(&three).is_empty());
    assert_eq!((a_solo.warm, a_three.warm), (16 * 11, 16 * 11));
    assert!(
        a_three.share() >= 0.99 * a_solo.share(),
        "three instances kept {:.4} of warm turns on their replica, one instance {:.4}",
        a_three.share(),
        a_solo.share()
    );
    assert!(
        h_three >= 0.99 * h_solo,
        "the replicas' cache hits disagree: three instances {h_three:.4}, one {h_solo:.4}"
    );

    let mut delays = pin_propagation(&f, 100);
    eprintln!(
        "[agent loops] pin propagation instance to instance (request sent -> next instance's \
         table holds it), {} samples: p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms",
        delays.len(),
        quantile(&delays, 0.5),
        quantile(&delays, 0.9),
        quantile(&delays, 0.99),
    );
    delays.sort_by(|a, b| b.total_cmp(a));
    eprintln!("[agent loops] the five longest (ms): {:.1?}", &delays[..5]);
}

/// `n` requests sharing one long prefix, sent at once, request `i` to `fronts[i % len]`:
/// (makespan in seconds, requests per replica, errors).
fn burst(fronts: &[&Lb], tag: &str, n: usize) -> (f64, BTreeMap<String, usize>, usize) {
    let c = client();
    let prefix = text_of(&format!("{tag} shared prefix"), 3000);
    let gate = Barrier::new(n + 1);
    let (done, start) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (c, prefix, gate) = (c.clone(), &prefix, &gate);
                s.spawn(move || {
                    let messages = [
                        json!({"role": "system", "content": prefix}),
                        json!({"role": "user", "content": format!("subtask {i}: do your part")}),
                    ];
                    gate.wait();
                    let r = chat(&c, fronts[i % fronts.len()], &messages);
                    (r.map(|(replica, _, _)| replica), Instant::now())
                })
            })
            .collect();
        gate.wait();
        let start = Instant::now();
        let done: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("burst thread"))
            .collect();
        (done, start)
    });
    let mut split = BTreeMap::new();
    let mut errors = 0;
    let mut end = start;
    for (r, at) in done {
        end = end.max(at);
        match r {
            Ok(replica) => *split.entry(replica).or_insert(0) += 1,
            Err(_) => errors += 1,
        }
    }
    ((end - start).as_secs_f64(), split, errors)
}

fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

/// Each instance counts the others' requests in flight, announced as each starts and ends, and
/// breaks ties from its rank among the instances, so three instances deciding within the same
/// millisecond split the burst as one would. Requests that reach two instances closer together
/// than a message takes between them can still split 9/7 (3 runs in 30 here), hence the median
/// of seven runs.
#[test]
fn a_same_prefix_burst_over_three_instances_finishes_as_fast_as_through_one() {
    let _turn = one_at_a_time();
    for routing in ["adaptive", "prefill_cost"] {
        burst_over_three(routing);
    }
}

fn burst_over_three(routing: &str) {
    let f = Fleet::routing(2, routing);
    let (mut solo, mut three) = (vec![], vec![]);
    // Seven of each, interleaved, compared median to median: one slow moment of a shared
    // machine, or a 9/7 split now and then, does not decide.
    for run in 0..7 {
        let (m1, s1, e1) = burst(&[&f.solo], &format!("solo {run}"), 16);
        let (m3, s3, e3) = burst(&f.three(), &format!("three {run}"), 16);
        eprintln!(
            "[burst] {routing} run {run}: one instance {m1:.3} s {s1:?}; three instances \
             {m3:.3} s {s3:?}"
        );
        assert_eq!((e1, e3), (0, 0), "errors in the burst");
        solo.push(m1);
        three.push(m3);
    }
    let ratio = median(&three) / median(&solo);
    eprintln!(
        "[burst] {routing}: 16 same-prefix requests at once: makespan median one instance \
         {:.3} s, three instances {:.3} s; ratio {ratio:.3} (<= 1.05 required)",
        median(&solo),
        median(&three)
    );
    assert!(
        ratio <= 1.05,
        "{routing}: the burst over three instances took {ratio:.3}x as long as through one"
    );
}

/// Under `prefill_cost` (the default), what each replica prefilled is shared: a sibling of a
/// prompt (the same long history, another question) that reaches another instance goes to the
/// replica holding the history, by the index alone (route `prefix`: no exact continuation and no
/// pin names it). The control, one instance without Redis next to the three, has never seen the
/// history and spreads each sibling.
///
/// An index learns a prompt when its prefill is over (the first byte), here and at the peers:
/// the first question streams, as agents do, and the sibling is sent as soon as its stream
/// ends.
#[test]
fn a_sibling_reaching_another_instance_goes_to_the_replica_holding_its_history() {
    let _turn = one_at_a_time();
    let started = Instant::now();
    let f = Fleet::routing(2, "prefill_cost");
    let c = client();
    let messages = |family: usize, question: &str| {
        let history = text_of(&format!("family {family} history"), 3000);
        [
            json!({"role": "system", "content": history}),
            json!({"role": "user", "content": question}),
        ]
    };
    let ask = |lb: &Lb, family: usize, question: &str| {
        chat(&c, lb, &messages(family, question)).map(|(replica, route, _)| (replica, route))
    };
    let (mut found, mut control) = (vec![], vec![]);
    for family in 0..6 {
        let home = streamed(&c, &f.lbs[family % 3], &messages(family, "first question"));
        let sibling = ask(&f.lbs[(family + 1) % 3], family, "another question").expect("sibling");
        let cousin = ask(&f.lbs[(family + 2) % 3], family, "a third question").expect("cousin");
        found.push((home, sibling, cousin));
        control.push(ask(&f.solo, family, "another question").expect("control").1);
    }
    eprintln!(
        "[index] first replica, then the sibling's replica and route on the next instance and \
         the third question's on the one after: {found:?}; the control's routes: {control:?}"
    );
    for (home, sibling, cousin) in &found {
        for (replica, route) in [sibling, cousin] {
            assert_eq!((replica, route.as_str()), (home, "prefix"), "{found:?}");
        }
    }
    assert!(control.iter().all(|r| r == "spread"), "{control:?}");

    // An instance that starts later adopts the indexes saved in Redis (every 10 s, by the
    // instance of the lowest id), and sends each family's next sibling home too.
    let version = inferlb::protocol::api::prompt::HASH_VERSION;
    let saved = wait_until(Duration::from_secs(30), || {
        (0..2).all(|i| f.redis.exists(&format!("inferlb:v{version}:index:gpu{i}")))
    });
    assert!(saved, "no index saved in 30 s");
    let late = f.join("lb-d", "prefill_cost");
    let late: Vec<(String, String)> = (0..found.len())
        .map(|family| ask(&late, family, "a late question").expect("late sibling"))
        .collect();
    eprintln!(
        "[index] on an instance started after the indexes were saved ({:.1} s in): {late:?}",
        started.elapsed().as_secs_f64()
    );
    for ((home, _, _), (replica, route)) in found.iter().zip(&late) {
        assert_eq!((replica, route.as_str()), (home, "prefix"), "{late:?}");
    }
}

/// A streamed chat request read to its end: the replica that answered.
fn streamed(c: &reqwest::blocking::Client, lb: &Lb, messages: &[Value]) -> String {
    let body = json!({"model": "sim-model", "messages": messages, "max_tokens": REPLY_TOKENS,
        "stream": true});
    let r = c
        .post(lb.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .expect("streamed request");
    assert!(r.status().is_success(), "{}", r.status());
    let replica = r.headers()["x-inferlb-replica"]
        .to_str()
        .unwrap_or("")
        .to_string();
    let text = r.text().expect("stream");
    assert!(text.contains("[DONE]"), "{text}");
    replica
}

/// A Responses turn: `input`, chained to `previous` when given; (response id, replica, route).
fn responses_turn(
    c: &reqwest::blocking::Client,
    lb: &Lb,
    input: &str,
    previous: Option<&str>,
) -> Result<(String, String, String), String> {
    let mut body = json!({"model": "sim-model", "input": input, "max_output_tokens": REPLY_TOKENS});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    let (replica, route, v) = post(c, lb, "/v1/responses", &body)?;
    let id = v["id"].as_str().ok_or(format!("no id: {v}"))?;
    Ok((id.to_string(), replica, route))
}

#[test]
fn a_responses_chain_through_a_different_instance_every_turn_has_no_errors() {
    let _turn = one_at_a_time();
    let f = Fleet::start(2);
    let c = client();
    let mut previous: Option<String> = None;
    let mut home: Option<String> = None;
    let mut routes = vec![];
    let mut errors = vec![];
    for turn in 0..10 {
        let lb = &f.lbs[turn % 3];
        let input = text_of(&format!("responses chain turn {turn}"), 200);
        match responses_turn(&c, lb, &input, previous.as_deref()) {
            Ok((id, replica, route)) => {
                let home = home.get_or_insert_with(|| replica.clone());
                assert_eq!(
                    &replica, home,
                    "turn {turn} left the replica storing the chain"
                );
                routes.push(route);
                previous = Some(id);
            }
            Err(e) => errors.push(format!("turn {turn}: {e}")),
        }
    }
    eprintln!(
        "[responses] 10-turn chain with previous_response_id, each turn through the next \
         instance: {} errors; routes {routes:?}",
        errors.len()
    );
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn a_drain_on_one_instance_stops_new_work_on_every_instance_within_a_second() {
    let _turn = one_at_a_time();
    let f = Fleet::start(2);
    let gpu0_requests = || f.sims[0].stats()["requests"].as_u64().unwrap_or(0);
    let started = Instant::now();
    let drain_at = started + Duration::from_millis(1500);
    let end = drain_at + Duration::from_secs(3);
    let shape = Loops {
        loops: 12,
        turns: 12,
        rounds: 50,
        context_tokens: 500,
        turn_tokens: 40,
        until: end,
    };
    let (turns, visible, counted) = std::thread::scope(|s| {
        let loops = s.spawn(|| agent_loops(&f.three(), "drain", shape));
        std::thread::sleep(drain_at.saturating_duration_since(Instant::now()));
        let t0 = Instant::now();
        let r = http()
            .post(f.lbs[0].admin_url("/admin/replicas/gpu0/drain"))
            .send()
            .expect("drain");
        assert_eq!(r.status(), 200);
        // When each instance shows the drain on its admin API.
        let mut visible = vec![];
        for lb in &f.lbs {
            let seen = wait_until(Duration::from_secs(2), || {
                lb.replica_state("gpu0")["draining"] == true
            });
            assert!(seen, "the drain did not reach {:?}", lb.conf);
            visible.push(t0.elapsed());
        }
        // What gpu0 had received one second after the drain, and at the end.
        std::thread::sleep((t0 + Duration::from_secs(1)).saturating_duration_since(Instant::now()));
        let at_one_second = gpu0_requests();
        let turns = loops.join().expect("loops");
        (turns, visible, (t0, at_one_second))
    });
    let (t0, at_one_second) = counted;
    let at_end = gpu0_requests();
    let late: Vec<&Turn> = turns
        .iter()
        .filter(|t| t.sent >= t0 + Duration::from_secs(1))
        .filter(|t| matches!(&t.outcome, Ok((r, _)) if r == "gpu0"))
        .collect();
    let after = turns.iter().filter(|t| t.sent >= t0).count();
    let last_gpu0 = turns
        .iter()
        .filter(|t| matches!(&t.outcome, Ok((r, _)) if r == "gpu0"))
        .map(|t| t.sent)
        .max()
        .map(|s| {
            (s.saturating_duration_since(t0).as_secs_f64()
                - t0.saturating_duration_since(s).as_secs_f64())
                * 1e3
        });
    eprintln!(
        "[drain] drain on lb-a; shown draining by lb-a/lb-b/lb-c after {:?}; {} requests sent \
         after the drain, {} of them to gpu0 more than 1 s after it; the last request gpu0 \
         served was sent {:.1} ms after the drain (negative: before it); gpu0 received {} \
         requests between 1 s after the drain and the end; errors {}",
        visible,
        after,
        late.len(),
        last_gpu0.unwrap_or(f64::NAN),
        at_end - at_one_second,
        errors(&turns).len()
    );
    assert!(errors(&turns).is_empty(), "{:?}", errors(&turns));
    assert!(after > 100, "traffic went on after the drain");
    assert!(late.is_empty(), "new work reached gpu0: {late:?}");
    assert_eq!(at_end, at_one_second, "gpu0 received requests after 1 s");
}

#[test]
fn redis_killed_mid_run_costs_no_request_and_agreement_returns_after_its_restart() {
    let _turn = one_at_a_time();
    let mut f = Fleet::start(4);
    let start = Instant::now();
    let kill_at = start + Duration::from_secs(2);
    let restart_at = kill_at + Duration::from_secs(3);
    let end = restart_at + Duration::from_secs(9);
    let shape = Loops {
        loops: 16,
        turns: 12,
        rounds: 100,
        context_tokens: 500,
        turn_tokens: 40,
        until: end,
    };
    let lbs: Vec<&Lb> = f.lbs.iter().collect();
    let redis = &mut f.redis;
    let (turns, killed, restarted, reconnected) = std::thread::scope(|s| {
        let loops = s.spawn(|| agent_loops(&lbs, "outage", shape));
        std::thread::sleep(kill_at.saturating_duration_since(Instant::now()));
        redis.kill();
        let killed = Instant::now();
        std::thread::sleep(restart_at.saturating_duration_since(Instant::now()));
        redis.restart();
        let restarted = Instant::now();
        let back = wait_until(Duration::from_secs(5), || {
            lbs.iter().all(|lb| connected(lb))
        });
        let reconnected = back.then(|| restarted.elapsed());
        (loops.join().expect("loops"), killed, restarted, reconnected)
    });
    let window = |from: Instant, to: Instant| agreement(&turns, |t| t.sent >= from && t.sent < to);
    let before = window(start, killed);
    let outage = window(killed, restarted);
    let settled = window(restarted + Duration::from_secs(5), end);
    let mut timeline = vec![];
    let mut second = killed;
    while second < end {
        let a = window(second, second + Duration::from_secs(1));
        let offset = second.saturating_duration_since(restarted).as_secs_f64()
            - restarted.saturating_duration_since(second).as_secs_f64();
        timeline.push(format!("{offset:+.1}s: {:.3} of {}", a.agreed(), a.warm));
        second += Duration::from_secs(1);
    }
    let errs = errors(&turns);
    eprintln!(
        "[redis outage] {} requests, {} client errors; instances reconnected {:?} after the \
         restart; agreement (warm turns kept on the previous turn's replica, or spilled from \
         it knowing it): before the kill {:.4} of {}, during the outage {:.4} of {}, from 5 s \
         after the restart {:.4} of {} (>= 0.98 required); of those, kept on the same replica: \
         {:.4} / {:.4} / {:.4}; routes of the turns that moved from 5 s after the restart: {:?}",
        turns.len(),
        errs.len(),
        reconnected,
        before.agreed(),
        before.warm,
        outage.agreed(),
        outage.warm,
        settled.agreed(),
        settled.warm,
        before.share(),
        outage.share(),
        settled.share(),
        settled.moved
    );
    eprintln!("[redis outage] per second, relative to the restart: {timeline:?}");
    assert!(errs.is_empty(), "{errs:?}");
    assert!(reconnected.is_some(), "the instances did not reconnect");
    assert!(settled.warm > 100, "too few warm turns after the restart");
    // 0.98: agreement is 1.0 before the kill and about 0.3 during the outage; after the
    // restart it returns to 0.99-1.0 alone, but a full `make test` run once measured 0.9894
    // with one second at 0.953 seven seconds after the restart, while the cluster was
    // unchanged (the machine's 2 cores, shared with every process of the test, stalled).
    assert!(
        settled.agreed() >= 0.98,
        "agreement {:.4} from 5 s after the restart: {:?}",
        settled.agreed(),
        settled.moved
    );
}
