//! Two inferlb instances sharing one view through a real Redis: a conversation's turns go to
//! the same replica whichever instance they reach, drains are everyone's, and Redis going away
//! costs no request; when it is back, what was pinned meanwhile is shared. An operator's change
//! is answered once Redis has it, or said to be applied here only and written later; a replica
//! removed while an instance was cut off is gone there when it is back; a replica that restarted
//! leaves Redis's pins and saved indexes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use inferlb_harness::Redis;

fn instance(root: &Path, name: &str, sims: &[&Sim], redis: &Redis) -> Lb {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("dir");
    let conf = LbConf {
        extra: redis.cluster_conf(name),
        ..test_conf()
    };
    Lb::start(&dir, sims, conf)
}
fn connected(lb: &Lb) -> bool {
    lb.metric("inferlb_cluster_connected") == 1.0
}

/// A conversation's next turn, sent to `lb`: (replica, route).
fn turn(lb: &Lb, conversation: &str, n: usize) -> (String, String) {
    let mut history: Vec<(String, String)> =
        vec![("system".into(), format!("{conversation} context"))];
    for i in 0..n {
        history.push(("user".into(), format!("{conversation} question {i}")));
        history.push(("assistant".into(), format!("{conversation} answer {i}")));
    }
    history.push(("user".into(), format!("{conversation} question {n}")));
    let refs: Vec<(&str, &str)> = history
        .iter()
        .map(|(r, c)| (r.as_str(), c.as_str()))
        .collect();
    let (replica, route, _) = routed_chat(lb, &refs);
    (replica, route)
}

#[test]
fn two_instances_route_a_conversation_alike_and_share_drains() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    let one = instance(root.path(), "one", &[&a, &b], &redis);
    let two = instance(root.path(), "two", &[&a, &b], &redis);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)
        && connected(&two)));

    // Each conversation's first turn through one instance, the next through the other.
    for c in 0..6 {
        let name = format!("conv{c}");
        let (first, _) = turn(&one, &name, 0);
        let shared = wait_until(Duration::from_secs(5), || {
            two.metric("inferlb_affinity_entries") >= (c + 1) as f64
        });
        assert!(shared, "{name}'s pin reached the other instance");
        let (second, route) = turn(&two, &name, 1);
        assert_eq!(
            (second.as_str(), route.as_str()),
            (first.as_str(), "pinned"),
            "{name}"
        );
    }

    // A drain on one instance's admin API drains the replica on both.
    one.admin("POST", "/admin/replicas/gpu0/drain");
    let drained = wait_until(Duration::from_secs(5), || {
        two.replica_state("gpu0")["draining"] == true
    });
    assert!(drained, "{}", two.admin("GET", "/admin/replicas"));
    for i in 0..4 {
        let (replica, _, _) = routed_chat(&two, &[("user", &format!("fresh {i}"))]);
        assert_eq!(replica, "gpu1");
    }
    one.admin("POST", "/admin/replicas/gpu0/undrain");
    let undrained = wait_until(Duration::from_secs(5), || {
        two.replica_state("gpu0")["draining"] == false
    });
    assert!(undrained);

    // A replica added on one instance's admin API joins on both; removed, it leaves both.
    let third = Sim::start(root.path(), "gpu2", &[]);
    let added = http()
        .post(one.admin_url("/admin/replicas"))
        .json(&serde_json::json!({"id": "gpu2", "address": third.addr()}))
        .send()
        .expect("add");
    assert_eq!(added.status(), 201);
    let listed = |lb: &Lb| {
        lb.admin("GET", "/admin/replicas")["replicas"]
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["id"] == "gpu2" && r["live"] == true))
    };
    assert!(
        wait_until(Duration::from_secs(10), || listed(&two)),
        "shared add"
    );
    let removed = http()
        .delete(one.admin_url("/admin/replicas/gpu2"))
        .send()
        .expect("delete");
    assert_eq!(removed.status(), 200);
    assert!(
        wait_until(Duration::from_secs(5), || !listed(&two)),
        "shared removal"
    );
}

#[test]
fn without_redis_each_instance_goes_on_alone_and_resyncs_when_it_is_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    let one = instance(root.path(), "one", &[&a, &b], &redis);
    let two = instance(root.path(), "two", &[&a, &b], &redis);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)
        && connected(&two)));

    redis.stop();
    assert!(wait_until(Duration::from_secs(10), || !connected(&one)
        && !connected(&two)));
    // Every request is served meanwhile, on both.
    let mut homes = vec![];
    for c in 0..4 {
        let name = format!("outage{c}");
        let (first, _) = turn(&one, &name, 0);
        let (again, route) = turn(&one, &name, 1);
        assert_eq!((again.as_str(), route.as_str()), (first.as_str(), "pinned"));
        routed_chat(&two, &[("user", &format!("alone {c}"))]);
        homes.push((name, first));
    }
    let log = one.proc.log_text();
    assert_eq!(
        log.matches("redis unreachable").count(),
        1,
        "logged once:\n{log}"
    );

    // Redis is back: both reconnect, and the pins made meanwhile reach the other instance.
    redis.restart();
    assert!(wait_until(Duration::from_secs(15), || connected(&one)
        && connected(&two)));
    for (name, home) in &homes {
        let reached = wait_until(Duration::from_secs(5), || turn(&two, name, 2).1 == "pinned");
        assert!(reached, "{name}'s outage pin reached the other instance");
        assert_eq!(&turn(&two, name, 2).0, home, "{name}");
    }
}

/// Two processes given the same `instance_id` would each take the other's messages for its
/// own and ignore them: each says so in its log.
#[test]
fn two_processes_given_one_instance_id_each_say_so() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    let start = |name: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        let conf = LbConf {
            extra: redis.cluster_conf("twin"),
            ..test_conf()
        };
        Lb::start(&dir, &[&a, &b], conf)
    };
    let (one, two) = (start("one"), start("two"));
    let said = "another inferlb process uses instance_id \"twin\"";
    let both = wait_until(Duration::from_secs(10), || {
        [&one, &two]
            .iter()
            .all(|lb| lb.proc.log_text().contains(said))
    });
    assert!(
        both,
        "logs:\n{}\n---\n{}",
        one.proc.log_text(),
        two.proc.log_text()
    );
}

/// One inline command to `redis` (no spaces in its arguments), and its first reply line.
fn redis_says(redis: &Redis, command: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", redis.port)).expect("connect to redis");
    s.set_read_timeout(Some(Duration::from_secs(2))).ok();
    s.write_all(format!("{command}\r\n").as_bytes())
        .expect("send");
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).expect("reply");
    line.trim_end().to_string()
}

/// A TCP relay to a port that can be cut: its connections closed, new ones closed at once,
/// until it is opened again. Cuts one instance from Redis while the others stay connected.
struct Relay {
    port: u16,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(to: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (o, c) = (open.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if !o.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
                let pairs = [(&client, &server), (&server, &client)];
                for (from, to) in pairs {
                    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
                        continue;
                    };
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
                c.lock().unwrap().extend([client, server]);
            }
        });
        Relay { port, open, conns }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    fn reopen(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// An admin call's status and JSON answer.
fn admin_call(req: reqwest::blocking::RequestBuilder) -> (u16, serde_json::Value) {
    let r = req.send().expect("admin call");
    let status = r.status().as_u16();
    (status, r.json().expect("json"))
}

#[test]
fn a_drain_is_answered_once_redis_has_it_or_said_local_and_written_when_redis_is_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    let one = instance(root.path(), "one", &[&a, &b], &redis);
    let two = instance(root.path(), "two", &[&a, &b], &redis);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)
        && connected(&two)));

    // Redis holds every write for half a second: the 200 comes after the drain is written.
    assert_eq!(redis_says(&redis, "CLIENT PAUSE 500 WRITE"), "+OK");
    let (status, state) = admin_call(http().post(one.admin_url("/admin/replicas/gpu0/drain")));
    assert_eq!(
        (status, &state["applied"]),
        (200, &"cluster".into()),
        "{state}"
    );
    assert!(
        redis.exists("inferlb:drain:gpu0"),
        "answered 200 before Redis had it"
    );
    assert!(wait_until(Duration::from_secs(5), || two
        .replica_state("gpu0")["draining"]
        == true));

    // Redis away: applied here, said so, and written once Redis is back (empty: it kept nothing).
    redis.stop();
    assert!(wait_until(Duration::from_secs(10), || !connected(&one)
        && !connected(&two)));
    let (status, state) = admin_call(http().post(one.admin_url("/admin/replicas/gpu1/drain")));
    assert_eq!(
        (status, &state["applied"]),
        (202, &"local".into()),
        "{state}"
    );
    assert_eq!(one.replica_state("gpu1")["draining"], true);
    assert_eq!(two.replica_state("gpu1")["draining"], false);
    redis.restart();
    assert!(wait_until(Duration::from_secs(15), || connected(&one)
        && connected(&two)));
    let landed = wait_until(Duration::from_secs(5), || {
        redis.exists("inferlb:drain:gpu1") && two.replica_state("gpu1")["draining"] == true
    });
    assert!(landed, "{}", two.admin("GET", "/admin/replicas"));
}

#[test]
fn a_replica_removed_while_an_instance_was_cut_off_is_gone_there_when_it_is_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let relay = Relay::start(redis.port);
    let (a, b) = two_sims(root.path(), &[]);
    let one = instance(root.path(), "one", &[&a, &b], &redis);
    let dir = root.path().join("two");
    std::fs::create_dir_all(&dir).expect("dir");
    let through_relay = LbConf {
        extra: format!(
            "  cluster: {{redis_url: \"redis://127.0.0.1:{}\", instance_id: \"two\"}}\n",
            relay.port
        ),
        ..test_conf()
    };
    let two = Lb::start(&dir, &[&a, &b], through_relay);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)
        && connected(&two)));

    let third = Sim::start(root.path(), "gpu2", &[]);
    let (status, _) = admin_call(
        http()
            .post(one.admin_url("/admin/replicas"))
            .json(&serde_json::json!({"id": "gpu2", "address": third.addr()})),
    );
    assert_eq!(status, 201);
    let listed = |lb: &Lb| {
        lb.admin("GET", "/admin/replicas")["replicas"]
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["id"] == "gpu2"))
    };
    assert!(wait_until(Duration::from_secs(10), || listed(&two)));

    relay.cut();
    assert!(wait_until(Duration::from_secs(10), || !connected(&two)));
    let (status, state) = admin_call(http().delete(one.admin_url("/admin/replicas/gpu2")));
    assert_eq!(
        (status, &state["applied"]),
        (200, &"cluster".into()),
        "{state}"
    );
    assert!(listed(&two), "two was cut off: it could not know yet");

    relay.reopen();
    assert!(wait_until(Duration::from_secs(15), || connected(&two)));
    assert!(
        wait_until(Duration::from_secs(5), || !listed(&two)),
        "{}",
        two.proc.log_text()
    );
    // And two did not write its stale copy back for the others.
    assert!(!redis.exists("inferlb:replica:gpu2"));
    assert!(!listed(&one));
}

/// Pins in `redis` to `replica`.
fn pins_to(redis: &Redis, replica: &str) -> usize {
    let keys = redis.cli(&["--scan", "--pattern", "inferlb:v2:a:*"]);
    keys.unwrap_or_default()
        .lines()
        .filter(|k| redis.cli(&["GET", k]).is_some_and(|v| v.trim() == replica))
        .count()
}

/// An instance sharing through `redis` (or `url`), routing by prefill cost.
fn costed(root: &Path, name: &str, sims: &[&Sim], redis: &Redis, url: Option<String>) -> Lb {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("dir");
    let extra = match url {
        Some(url) => format!("  cluster: {{redis_url: \"{url}\", instance_id: \"{name}\"}}\n"),
        None => redis.cluster_conf(name),
    };
    let conf = LbConf {
        extra,
        routing: Some("prefill_cost".into()),
        ..test_conf()
    };
    Lb::start(&dir, sims, conf)
}

/// Conversations long enough to be indexed, their first turns through `lb`: each one's text
/// and replica, once Redis holds every pin `lb` made.
fn first_turns(lb: &Lb, redis: &Redis, n: usize) -> Vec<(String, String)> {
    let turns: Vec<(String, String)> = (0..n)
        .map(|c| {
            let text = text_of(&format!("restart{c}"), 1500);
            let replica = turn(lb, &text, 0).0;
            (text, replica)
        })
        .collect();
    let written = wait_until(Duration::from_secs(5), || {
        let pins = pins_to(redis, "gpu0") + pins_to(redis, "gpu1");
        pins > 0 && pins as f64 == lb.metric("inferlb_affinity_entries")
    });
    assert!(written, "{}", lb.metrics());
    turns
}

/// How many times `lb` adopted what Redis holds (once a session, when it (re)connects).
fn bootstraps(lb: &Lb) -> usize {
    lb.proc
        .log_text()
        .matches(" pins adopted from redis")
        .count()
}

/// `lb` says, within 10 s, that it deleted what Redis kept of `replica`, restarted.
fn assert_deleted(lb: &Lb, replica: &str) {
    let said = format!("cluster: deleted from redis what it kept of restarted replica {replica}: ");
    let deleted = wait_until(Duration::from_secs(10), || {
        lb.proc.log_text().contains(&said)
    });
    assert!(deleted, "{}", lb.proc.log_text());
}

/// A replica that restarted lost its cache, and Redis forgets it too: its pins and saved
/// index are deleted (the other replica's pins stay), so an instance that starts later sends
/// its conversations where they spread, not back to it as if it held them.
#[test]
fn a_restarted_replicas_pins_and_saved_index_leave_redis() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (mut a, mut b) = two_sims(root.path(), &[]);
    let one = costed(root.path(), "one", &[&a, &b], &redis, None);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)));
    let turns = first_turns(&one, &redis, 6);
    let home = turns[0].1.clone();
    let other = if home == "gpu0" { "gpu1" } else { "gpu0" };
    let other_pins = pins_to(&redis, other);
    assert!(pins_to(&redis, &home) > 0 && other_pins > 0);
    // Rank 0 saves each index every 10 s.
    let index = format!("inferlb:v2:index:{home}");
    let saved = wait_until(Duration::from_secs(15), || redis.exists(&index));
    assert!(saved, "{}", one.proc.log_text());

    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    assert_deleted(&one, &home);
    assert_eq!(
        (pins_to(&redis, &home), pins_to(&redis, other)),
        (0, other_pins)
    );
    // Gone, or saved again since the restart: empty.
    assert_eq!(redis.cli(&["STRLEN", &index]).as_deref(), Some("0\n"));
    // Settled in Redis: the restart seen is the one whose records went.
    let state =
        |field: &str| redis.cli(&["HGET", "inferlb:restarted:v1", &format!("{field}:{home}")]);
    assert!(state("seen").is_some_and(|s| s.trim().parse::<u64>().is_ok()));
    assert_eq!(state("seen"), state("deleted"));

    let two = costed(root.path(), "two", &[&a, &b], &redis, None);
    assert!(wait_until(Duration::from_secs(10), || bootstraps(&two) == 1));
    let (_, route) = turn(&two, &turns[0].0, 1);
    assert_eq!(route, "spread");
    let (text, _) = turns
        .iter()
        .find(|(_, r)| r == other)
        .expect("one went to the other");
    let (replica, route) = turn(&two, text, 1);
    assert_eq!((replica.as_str(), route.as_str()), (other, "pinned"));
}

/// A replica that restarted while an instance was cut off from Redis: when it is back, that
/// instance adopts neither the replica's old pins nor its saved index, though Redis still holds
/// them (no other instance deleted them), then deletes them.
#[test]
fn an_instance_back_from_an_outage_adopts_no_pins_to_a_replica_that_restarted_meanwhile() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let relay = Relay::start(redis.port);
    let (mut a, mut b) = two_sims(root.path(), &[]);
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let one = costed(root.path(), "one", &[&a, &b], &redis, Some(url));
    assert!(wait_until(Duration::from_secs(10), || connected(&one)));
    let turns = first_turns(&one, &redis, 2);
    let home = turns[0].1.clone();
    let index = format!("inferlb:v2:index:{home}");
    let saved = wait_until(Duration::from_secs(15), || redis.exists(&index));
    assert!(saved, "{}", one.proc.log_text());
    let home_pins = pins_to(&redis, &home);

    relay.cut();
    assert!(wait_until(Duration::from_secs(10), || !connected(&one)));
    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let said = format!("replica {home}: restarted");
    let seen = wait_until(Duration::from_secs(5), || {
        one.proc.log_text().contains(&said)
    });
    assert!(seen, "{}", one.proc.log_text());
    assert_eq!(pins_to(&redis, &home), home_pins, "Redis still holds them");

    let before = bootstraps(&one);
    relay.reopen();
    assert!(wait_until(Duration::from_secs(15), || bootstraps(&one) > before));
    // At once, before rank 0's first look: neither the old pin nor the old index is adopted.
    let (_, route) = turn(&one, &turns[0].0, 1);
    assert_eq!(route, "spread");
    assert_deleted(&one, &home);
}

/// A replica that restarted while no instance ran (the only one was stopped, no other read the
/// restart): Redis keeps the start the instances read, so an instance started afterwards finds
/// the restart all the same. It adopts none of the replica's old pins (or drops them at its
/// first read) and deletes them from Redis, and the conversation's next turn spreads.
#[test]
fn a_replica_restarted_while_no_instance_ran_loses_its_pins_all_the_same() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (mut a, mut b) = two_sims(root.path(), &[]);
    let mut one = costed(root.path(), "one", &[&a, &b], &redis, None);
    assert!(wait_until(Duration::from_secs(10), || connected(&one)));
    let turns = first_turns(&one, &redis, 2);
    let home = turns[0].1.clone();
    let start = format!("inferlb:started:v1:{home}");
    let kept = wait_until(Duration::from_secs(5), || redis.exists(&start));
    assert!(kept, "{}", one.proc.log_text());
    one.proc.stop();
    let home_pins = pins_to(&redis, &home);
    assert!(home_pins > 0);

    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    let two = costed(root.path(), "two", &[&a, &b], &redis, None);
    assert_deleted(&two, &home);
    assert_eq!(pins_to(&redis, &home), 0);
    let (_, route) = turn(&two, &turns[0].0, 1);
    assert_eq!(route, "spread");
}

/// Pins an instance queued while cut off from Redis, to a replica that restarted meanwhile,
/// are not written when it is back, though another instance already deleted what Redis kept
/// of that replica: they would name its lost cache for every instance that adopts them.
#[test]
fn pins_queued_in_an_outage_to_a_replica_that_restarted_meanwhile_are_not_written() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let relay = Relay::start(redis.port);
    let (mut a, mut b) = two_sims(root.path(), &[]);
    let first = costed(root.path(), "a-first", &[&a, &b], &redis, None);
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let cut = costed(root.path(), "b-cut", &[&a, &b], &redis, Some(url));
    assert!(wait_until(Duration::from_secs(10), || bootstraps(&first)
        == 1
        && bootstraps(&cut) == 1));
    let text = text_of("queued", 1500);
    let (home, _) = turn(&cut, &text, 0);
    assert!(wait_until(Duration::from_secs(5), || pins_to(
        &redis, &home
    ) > 0));

    relay.cut();
    assert!(wait_until(Duration::from_secs(10), || !connected(&cut)));
    // Its next turn goes home, pinned: the pins it makes wait for Redis.
    let (replica, route) = turn(&cut, &text, 1);
    assert_eq!(
        (replica.as_str(), route.as_str()),
        (home.as_str(), "pinned")
    );
    let sim = if a.id == home { &mut a } else { &mut b };
    sim.restart(&[]);
    sim.assert_healthy();
    assert_deleted(&first, &home);
    assert_eq!(pins_to(&redis, &home), 0);
    let said = format!("replica {home}: restarted");
    let seen = wait_until(Duration::from_secs(5), || {
        cut.proc.log_text().contains(&said)
    });
    assert!(seen, "{}", cut.proc.log_text());

    relay.reopen();
    assert!(wait_until(Duration::from_secs(15), || bootstraps(&cut) == 2));
    assert_eq!(pins_to(&redis, &home), 0);
}

/// Rank 0 settles every restart Redis holds, of replicas it does not know too: their pins go
/// (and no other), and a state settled longer ago than `pin_ttl_seconds` is forgotten, an
/// orphan field among them.
#[test]
fn rank_0_settles_restarts_of_replicas_it_does_not_know_and_forgets_old_states() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    let dir = root.path().join("alone");
    std::fs::create_dir_all(&dir).expect("dir");
    let conf = LbConf {
        extra: format!(
            "  cluster: {{redis_url: \"{}\", instance_id: \"alone\", pin_ttl_seconds: 30}}\n",
            redis.url()
        ),
        ..test_conf()
    };
    let states = "inferlb:restarted:v1";
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (recent, old) = (now_ms.to_string(), (now_ms - 60_000).to_string());
    let set = |args: &[&str]| assert!(redis.cli(args).is_some(), "{args:?}");
    set(&[
        "HSET",
        states,
        "seen:elsewhere",
        &recent,
        "deleted:elsewhere",
        &old,
    ]);
    set(&[
        "HSET",
        states,
        "seen:settled",
        &old,
        "deleted:settled",
        &old,
    ]);
    set(&["HSET", states, "deleted:orphan", &old]);
    set(&["SET", "inferlb:v2:a:00000000000000e1", "elsewhere"]);
    set(&["SET", "inferlb:v2:a:00000000000000a0", "gpu0"]);
    let lb = Lb::start(&dir, &[&a, &b], conf);
    assert_deleted(&lb, "elsewhere");
    let field = |f: &str| redis.cli(&["HGET", states, f]).unwrap_or_default();
    let forgotten = wait_until(Duration::from_secs(5), || {
        field("seen:settled").trim().is_empty() && field("deleted:orphan").trim().is_empty()
    });
    assert!(forgotten, "{:?}", redis.cli(&["HGETALL", states]));
    assert_eq!(field("deleted:elsewhere").trim(), recent, "settled, kept");
    assert_eq!(
        (pins_to(&redis, "elsewhere"), pins_to(&redis, "gpu0")),
        (0, 1)
    );
}
