//! Two inferlb instances sharing one view through a real Redis: a conversation's turns go to
//! the same replica whichever instance they reach, drains are everyone's, and Redis going away
//! costs no request; when it is back, what was pinned meanwhile is shared.

mod common;

use std::path::Path;
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
