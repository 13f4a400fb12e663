//! Fitting the tools users already run: several models behind one address, Prometheus for real,
//! the Grafana dashboard's queries, the access log.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn post(lb: &Lb, body: &Value) -> reqwest::blocking::Response {
    http()
        .post(lb.url("/v1/chat/completions"))
        .json(body)
        .send()
        .expect("request")
}

fn chat_for(model: &str, text: &str) -> Value {
    let mut b = chat_body(&[("user", text)], false, 2);
    b["model"] = json!(model);
    b
}

#[test]
fn several_models_behind_one_address() {
    let dir = tempfile::tempdir().unwrap();
    let a = Sim::start(dir.path(), "gpu0", &["--model", "alpha"]);
    let b = Sim::start(dir.path(), "gpu1", &["--model", "beta,alpha"]);
    // A third replica whose models come from the conf, not from its /v1/models.
    let c = Sim::start(dir.path(), "gpu2", &["--model", "gamma"]);
    let lb = Lb::start(
        dir.path(),
        &[&a, &b],
        LbConf {
            health_interval_seconds: Some(0.3),
            replicas: vec![Replica {
                models: vec!["gamma".into()],
                ..Replica::of(&c)
            }],
            ..test_conf()
        },
    );
    let models = || -> BTreeSet<String> {
        let v: Value = http()
            .get(lb.url("/v1/models"))
            .send()
            .unwrap()
            .json()
            .unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(5), || models().len() == 3),
        "{:?}",
        models()
    );
    assert_eq!(
        models(),
        ["alpha", "beta", "gamma"].map(String::from).into()
    );

    for i in 0..4 {
        let r = post(&lb, &chat_for("beta", &format!("b{i}")));
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-inferlb-replica"], "gpu1");
        let r = post(&lb, &chat_for("gamma", &format!("g{i}")));
        assert_eq!(r.headers()["x-inferlb-replica"], "gpu2");
    }
    let alpha: BTreeSet<String> = (0..6)
        .map(|i| {
            post(&lb, &chat_for("alpha", &format!("a{i}"))).headers()["x-inferlb-replica"]
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        alpha,
        ["gpu0", "gpu1"].map(String::from).into(),
        "alpha spreads over its pool"
    );

    // Adaptive routing inside the pool: a continuation stays on its replica.
    let mut body = chat_body(
        &[("user", "q"), ("assistant", "x"), ("user", "more")],
        false,
        2,
    );
    body["model"] = json!("alpha");
    let first = post(&lb, &chat_for("alpha", "q"));
    let home = first.headers()["x-inferlb-replica"]
        .to_str()
        .unwrap()
        .to_string();
    let r = post(&lb, &body);
    assert_eq!(
        (
            r.headers()["x-inferlb-replica"].to_str().unwrap(),
            r.headers()["x-inferlb-route"].to_str().unwrap()
        ),
        (home.as_str(), "pinned")
    );

    // An unknown model: 404 in OpenAI's format, no replica touched.
    let served_before: u64 = [&a, &b, &c]
        .iter()
        .map(|s| s.stats()["requests"].as_u64().unwrap())
        .sum();
    let r = post(&lb, &chat_for("nope", "x"));
    assert_eq!(r.status(), 404);
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
    let served_after: u64 = [&a, &b, &c]
        .iter()
        .map(|s| s.stats()["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(served_before, served_after);

    // A model whose replicas are all down: 503.
    let mut b = b;
    b.stop();
    let r = post(&lb, &chat_for("beta", "x"));
    assert_eq!(r.status(), 503);
    let r = post(&lb, &chat_for("alpha", "still served"));
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-inferlb-replica"], "gpu0");
}

/// Traffic that makes every series the dashboard shows exist: answers, a rejection, usage,
/// a cut stream, a failover.
fn exercise(lb: &Lb, a: &mut Sim, b: &Sim) {
    for i in 0..4 {
        let mut body = chat_body(&[("user", &format!("m{i}"))], i % 2 == 0, 2);
        body["stream_options"] = json!({"include_usage": true});
        let r = post(lb, &body);
        assert_eq!(r.status(), 200);
        let _ = r.bytes();
    }
    let r = http()
        .post(lb.url("/v1/completions"))
        .body(vec![b'x'; 3_000_000])
        .send()
        .unwrap();
    assert_eq!(r.status(), 413);
    b.fault(json!({"fault": "cut_stream", "count": 1}));
    a.fault(json!({"fault": "cut_stream", "count": 1}));
    let r = post(lb, &chat_body(&[("user", "cut")], true, 20));
    let _ = r.bytes();
    a.stop();
    for i in 0..3 {
        let r = post(lb, &chat_body(&[("user", &format!("f{i}"))], false, 1));
        assert_eq!(r.status(), 200);
    }
}

#[test]
fn every_metric_the_grafana_dashboard_queries_exists_in_a_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            health_interval_seconds: Some(2.0),
            max_body_bytes: Some(1_000_000),
            ..test_conf()
        },
    );
    exercise(&lb, &mut a, &b);
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/conf/grafana/inferlb-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut queried = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("inferlb_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                queried.insert(name);
            }
        }
    }
    assert!(queried.len() >= 10, "{queried:?}");
    // The P/D panels' counters have series once a disaggregated pool served something:
    // tests/pd.rs checks those.
    queried.retain(|n| !n.starts_with("inferlb_pd_"));
    let scrape = lb.metrics();
    let present: BTreeSet<String> = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_owned))
        .collect();
    for name in &queried {
        assert!(
            present.contains(name),
            "the dashboard queries {name}, which the scrape lacks:\n{scrape}"
        );
    }
    // The prefix-cache hit rate comes from the replicas' own usage reports.
    let cached: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("inferlb_prompt_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(cached > 0.0);
}

#[test]
fn prometheus_scrapes_inferlb_and_reads_back_the_failover() {
    let Some(prometheus) = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        panic!("prometheus is not installed: `make deps` installs Debian's prometheus package");
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut a, _b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            health_interval_seconds: Some(2.0),
            ..test_conf()
        },
    );
    let port = free_port();
    let conf = dir.path().join("prometheus.yml");
    std::fs::write(
        &conf,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: inferlb\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            lb.admin_port
        ),
    )
    .unwrap();
    let mut cmd = Command::new(prometheus);
    cmd.arg(format!("--config.file={}", conf.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"));
    // Prometheus shuts down cleanly on SIGTERM.
    let _prometheus = Proc::spawn(
        "prometheus",
        cmd,
        Some(&dir.path().join("prometheus.log")),
        Signal::SIGTERM,
    )
    .unwrap();
    // Cause one failover: a stopped replica, traffic.
    a.stop();
    for i in 0..4 {
        let r = post(&lb, &chat_body(&[("user", &format!("p{i}"))], false, 1));
        assert_eq!(r.status(), 200);
    }
    assert_eq!(
        lb.metric(r#"inferlb_failovers_total{reason="connect_refused",replica="gpu0"}"#),
        1.0
    );
    let query = format!("http://127.0.0.1:{port}/api/v1/query?query=sum(inferlb_failovers_total)");
    let mut last = Value::Null;
    let seen = wait_until(Duration::from_secs(30), || {
        last = http()
            .get(&query)
            .send()
            .and_then(|r| r.json())
            .unwrap_or(Value::Null);
        last["data"]["result"][0]["value"][1] == "1"
    });
    assert!(seen, "Prometheus answered {last}");
}

#[test]
fn the_access_log_is_one_json_line_per_request_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, lb) = cluster(
        dir.path(),
        &[],
        LbConf {
            access_log: Some("json".into()),
            ..test_conf()
        },
    );
    let r = http()
        .post(lb.url("/v1/chat/completions"))
        .header("x-request-id", "req-42")
        .json(&chat_body(&[("user", "log me")], false, 2))
        .send()
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "req-42");
    let replica = r.headers()["x-inferlb-replica"]
        .to_str()
        .unwrap()
        .to_string();
    let usage: Value = r.json().unwrap();
    assert!(wait_until(Duration::from_secs(3), || lb
        .proc
        .log_text()
        .contains("req-42")));
    let line = lb
        .proc
        .log_text()
        .lines()
        .find(|l| l.contains("req-42"))
        .unwrap()
        .to_string();
    let v: Value = serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap();
    assert_eq!(v["replica"], replica.as_str());
    assert_eq!(v["route"], "spread");
    assert_eq!(v["status"], 200);
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["attempts"], 1);
    assert_eq!(v["prompt_tokens"], usage["usage"]["prompt_tokens"]);
    assert_eq!(
        v["cached_tokens"],
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    assert!(v["ttfb_ms"].as_f64().unwrap() >= 0.0 && v["duration_ms"].as_f64().unwrap() >= 0.0);
}
