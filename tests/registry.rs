//! Replica identity: health and demotion belong to each configured replica, never to an address.

mod common;

use std::time::Duration;

use common::*;

/// Two replicas configured with one address (two names for one server, as DNS can also make):
/// when the server goes away both are demoted, and when it comes back both are re-admitted.
#[test]
fn two_replicas_on_one_address_are_both_readmitted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut shared = Sim::start(dir.path(), "gpu0", &[]);
    let other = Sim::start(dir.path(), "gpu1", &[]);
    // A second replica entry on gpu0's address.
    let options = LbConf {
        replicas: vec![Replica::new("gpu0b", &shared.addr())],
        ..test_conf()
    };
    let lb = Lb::start(dir.path(), &[&shared, &other], options);
    let live = |id: &str| lb.replica_state(id)["live"] == true;
    let client = http();
    let body = chat_body(&[("user", "hi")], false, 2);

    shared.stop();
    // Fresh requests spread over all three: both names of the stopped server fail and are demoted.
    let both_down = wait_until(Duration::from_secs(10), || {
        let r = client
            .post(lb.url("/v1/chat/completions"))
            .json(&body)
            .send();
        assert_eq!(r.expect("send").status(), 200, "a live replica serves it");
        !live("gpu0") && !live("gpu0b")
    });
    assert!(both_down, "both names of the stopped server are demoted");

    shared.restart(&[]);
    assert!(shared.wait_healthy(Duration::from_secs(10)));
    let both_up = wait_until(Duration::from_secs(10), || live("gpu0") && live("gpu0b"));
    assert!(
        both_up,
        "both re-admitted after a passing health check: {}",
        lb.admin("GET", "/admin/replicas")
    );
    // And both serve again.
    let mut seen = std::collections::HashSet::new();
    for _ in 0..12 {
        let r = client
            .post(lb.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .expect("send");
        assert_eq!(r.status(), 200);
        let replica = r.headers()["x-inferlb-replica"].to_str().expect("header");
        seen.insert(replica.to_string());
    }
    assert!(seen.contains("gpu0") && seen.contains("gpu0b"), "{seen:?}");
}

/// A replica removed through the admin API takes every series that names it off the scrape:
/// before, it stayed `inferlb_replica_up 1` with its counters for as long as inferlb ran.
#[test]
fn a_removed_replica_leaves_no_series_on_the_scrape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = two_sims(dir.path(), &[]);
    let lb = Lb::start(dir.path(), &[&a], test_conf());
    let added = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&serde_json::json!({"id": "gpu1", "address": b.addr()}))
        .send()
        .expect("add");
    assert_eq!(added.status(), 201);
    assert!(
        wait_until(Duration::from_secs(10), || lb.replica_state("gpu1")["live"]
            == true),
        "gpu1 joins after a passing check"
    );
    // Fresh conversations until gpu1 served one, so that its counters have series too.
    let mut i = 0;
    let served = wait_until(Duration::from_secs(10), || {
        i += 1;
        routed_chat(&lb, &[("user", &format!("conversation {i}"))]).0 == "gpu1"
    });
    assert!(served, "gpu1 served a request");
    let label = r#"replica="gpu1""#;
    let naming = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && l.contains(label))
            .map(str::to_owned)
            .collect()
    };
    let before = naming(&lb.metrics());
    for family in ["inferlb_replica_up{", "inferlb_requests_total{"] {
        assert!(
            before.iter().any(|l| l.starts_with(family)),
            "{family}: {before:?}"
        );
    }
    assert_eq!(lb.metric(r#"inferlb_replica_up{replica="gpu1"}"#), 1.0);

    let removed = http()
        .delete(lb.admin_url("/admin/replicas/gpu1"))
        .send()
        .expect("delete");
    assert_eq!(removed.status(), 200);
    let text = lb.metrics();
    assert_eq!(naming(&text), Vec::<String>::new(), "{text}");
    assert_eq!(lb.metric(r#"inferlb_replica_up{replica="gpu0"}"#), 1.0);
    // And it stays off while the balancer serves on.
    routed_chat(&lb, &[("user", "after the removal")]);
    assert_eq!(naming(&lb.metrics()), Vec::<String>::new());
}
