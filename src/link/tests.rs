//! The link against a real `redis-server` (the harness's): lanes keep a large write from
//! holding back a small one, and an outage is one transition down and one up.

use std::time::{Duration, Instant};

use inferlb_harness::Redis;

use super::*;

fn conf(redis: &Redis) -> ClusterConf {
    ClusterConf {
        redis_url: redis.url(),
        redis_password: None,
        redis_ca: None,
        instance_id: "link-test".into(),
        pin_ttl: Duration::from_secs(60),
    }
}

/// A link to `redis`, its keeper running until the returned sender is dropped.
async fn connected(redis: &Redis) -> (Arc<Link>, watch::Sender<bool>) {
    let link = Link::new(conf(redis));
    let (stop, shutdown) = watch::channel(false);
    let keeper = link.keeper();
    tokio::spawn(async move { keeper.run(shutdown).await });
    let came_up = tokio::time::timeout(Duration::from_secs(10), up(&mut link.status())).await;
    assert!(came_up.is_ok(), "the link did not come up");
    (link, stop)
}

/// A pin as the cluster writes one: its key, and its announcement.
fn pin(n: u64) -> Pipeline {
    let mut p = redis::pipe();
    p.cmd("SET")
        .arg(format!("inferlb:test:pin:{n}"))
        .arg("gpu0")
        .arg("EX")
        .arg(60)
        .ignore();
    p.cmd("PUBLISH")
        .arg(Channel::Pins.name())
        .arg(format!("link-test|pin|a|{n:016x}|gpu0"))
        .ignore();
    p
}

/// A 20 MB value, as the Responses store will write chains of megabytes.
fn bulk() -> Cmd {
    let mut set = redis::cmd("SET");
    set.arg("inferlb:test:bulk").arg(vec![b'x'; 20 << 20]);
    set
}

/// The bulk write and the pin are sent together, the bulk first; which answer comes first is
/// what is compared, not how long either took, so a slow machine cannot make it pass or fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_write_on_the_bulk_lane_does_not_hold_back_a_pin_on_the_control_lane() {
    let dir = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(dir.path());
    let (link, _stop) = connected(&redis).await;
    let big = bulk();

    for round in 0..3 {
        let start = Instant::now();
        let (bulk_done, pin_done) = tokio::join!(
            async {
                let r = link.query::<()>(Lane::Bulk, &big).await;
                (r, Instant::now())
            },
            async {
                let r = link.pipe::<()>(Lane::Control, &pin(round)).await;
                (r, Instant::now())
            },
        );
        assert_eq!(bulk_done.0, Ok(()));
        assert_eq!(pin_done.0, Ok(()));
        let (bulk_took, pin_took) = (bulk_done.1 - start, pin_done.1 - start);
        eprintln!("round {round}: bulk {bulk_took:?}, pin {pin_took:?}");
        assert!(
            pin_done.1 < bulk_done.1,
            "the pin waited for the bulk write: pin {pin_took:?}, bulk {bulk_took:?}"
        );
    }

    // The control: on one lane, the pin waits behind the bulk write (which is why they have
    // a connection each).
    let (bulk_done, pin_done) = tokio::join!(
        async {
            let r = link.query::<()>(Lane::Bulk, &big).await;
            (r, Instant::now())
        },
        async {
            // Sent once the bulk write is queued on the connection (join polls it first, but
            // it may yield before it is queued): a connection answers in the order it is sent.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let r = link.pipe::<()>(Lane::Bulk, &pin(9)).await;
            (r, Instant::now())
        },
    );
    assert_eq!((bulk_done.0, pin_done.0), (Ok(()), Ok(())));
    assert!(pin_done.1 >= bulk_done.1, "one connection answers in order");
    assert!(link.is_up());
}

/// Redis killed: the first call that fails takes the link down, the calls after fail at once
/// without waiting; restarted, the keeper connects again; one transition each way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_one_transition_each_way_and_calls_fail_at_once_meanwhile() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut redis = Redis::start(dir.path());
    let (link, _stop) = connected(&redis).await;
    let mut status = link.status();
    let first = up(&mut status).await;
    let ping = redis::cmd("PING");
    assert_eq!(
        link.query::<String>(Lane::Control, &ping).await,
        Ok("PONG".into())
    );
    // Other tests of this process count transitions too: at least these.
    let downs = METRICS.transitions.with_label_values(&["down"]).get();

    redis.kill();
    let failed = link.query::<String>(Lane::Budgets, &ping).await;
    assert!(failed.as_ref().is_err_and(Failed::is_outage), "{failed:?}");
    assert!(!link.is_up());
    for lane in Lane::ALL {
        let started = Instant::now();
        assert_eq!(
            link.query::<String>(lane, &ping).await,
            Err(Failed::Down),
            "{lane:?}"
        );
        assert!(started.elapsed() < lane.bound(), "failed at once");
    }
    assert!(METRICS.transitions.with_label_values(&["down"]).get() > downs);

    redis.restart();
    let back = tokio::time::timeout(Duration::from_secs(10), up(&mut status)).await;
    assert!(back.is_ok_and(|g| g > first), "a new generation");
    assert_eq!(
        link.query::<String>(Lane::Bulk, &ping).await,
        Ok("PONG".into())
    );
}

#[test]
fn channel_names_are_versioned_and_read_back() {
    assert_eq!(
        Channel::Pins.name(),
        format!("inferlb:v{HASH_VERSION}:pins")
    );
    let names: Vec<&str> = Channel::ALL.iter().map(|c| c.name()).collect();
    for (c, n) in Channel::ALL.iter().zip(&names) {
        assert_eq!(Channel::from_name(n), Some(*c));
        assert!(n.contains(":v"), "{n} carries a version");
        assert_ne!(*n, "inferlb:drains", "the old channel is not reused");
    }
    assert_eq!(Channel::from_name("inferlb:drains"), None);
    let lanes: Vec<usize> = Lane::ALL.iter().map(|l| l.index()).collect();
    assert_eq!(lanes, (0..Lane::ALL.len()).collect::<Vec<_>>());
}

/// Only the control lane's silence is an outage: a slow budget exchange or a slow large write
/// fails that call alone, and a refusal is never one.
#[test]
fn which_failures_take_the_link_down() {
    let table = [
        (Failed::Down, true),
        (Failed::Broken("reset".into()), true),
        (Failed::Slow(Lane::Control), true),
        (Failed::Slow(Lane::Budgets), false),
        (Failed::Slow(Lane::Bulk), false),
        (Failed::Refused("WRONGTYPE".into()), false),
    ];
    for (failed, outage) in table {
        assert_eq!(failed.is_outage(), outage, "{failed:?}");
    }
}
