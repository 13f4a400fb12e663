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
