//! deploy/k8s: every manifest parses and is named, the kustomization lists them all, the
//! ConfigMap's conf passes the real `inferlb -t`, and the Deployment, Services and conf agree
//! on ports, probe paths, names and the grace period.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s")
}

/// One YAML document of one file in deploy/k8s.
struct Doc {
    file: String,
    value: Value,
}

/// Every document of every deploy/k8s/*.yaml, in file order; empty documents are skipped.
fn docs() -> Vec<Doc> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(k8s_dir())
        .expect("deploy/k8s exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no YAML file in deploy/k8s");
    let mut out = vec![];
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("read manifest");
        for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let value = Value::deserialize(de)
                .unwrap_or_else(|e| panic!("{file}: document {i} does not parse: {e}"));
            if !value.is_null() {
                out.push(Doc {
                    file: file.clone(),
                    value,
                });
            }
        }
    }
    out
}

/// The value at a dotted path (`spec.template.spec.containers.0`); numbers index sequences.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, key| match key.parse::<usize>() {
            Ok(i) if v.is_sequence() => v.get(i),
            _ => v.get(key),
        })
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{path}: missing or not a string"))
}

fn u64_at(v: &Value, path: &str) -> u64 {
    at(v, path)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{path}: missing or not a number"))
}

/// The only object of this kind and name.
fn object<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Doc> = docs
        .iter()
        .filter(|d| {
            at(&d.value, "kind").and_then(Value::as_str) == Some(kind)
                && at(&d.value, "metadata.name").and_then(Value::as_str) == Some(name)
        })
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}/{name} in deploy/k8s");
    &found[0].value
}

/// The port number of `host:port`.
fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{addr:?} is not host:port"))
}

/// The ConfigMap's `inferlb.yaml`, as text.
fn conf_text(docs: &[Doc]) -> String {
    let cm = object(docs, "ConfigMap", "inferlb");
    at(cm, "data")
        .and_then(|d| d.get("inferlb.yaml"))
        .and_then(Value::as_str)
        .expect("ConfigMap inferlb has data.\"inferlb.yaml\"")
        .to_owned()
}

fn conf(docs: &[Doc]) -> Value {
    serde_yaml::from_str(&conf_text(docs)).expect("inferlb.yaml parses")
}

/// The inferlb container of the inferlb Deployment.
fn container(deployment: &Value) -> &Value {
    let containers = at(deployment, "spec.template.spec.containers")
        .and_then(Value::as_sequence)
        .expect("containers");
    containers
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some("inferlb"))
        .expect("a container named inferlb")
}

/// A port as a container names it (`http`) or as a number, resolved to its number.
fn resolve_port(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("a port is a number or a name");
    at(container, "ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
        .map(|p| u64_at(p, "containerPort"))
        .unwrap_or_else(|| panic!("no container port named {name:?}"))
}

/// Runs the real binary with `-t -c` on `text`, its /tmp paths moved into a temporary dir.
fn check_conf(text: &str) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = text.replace("/tmp/", &format!("{}/", dir.path().display()));
    let file = dir.path().join("inferlb.yaml");
    std::fs::write(&file, text).expect("write conf");
    Command::new(env!("CARGO_BIN_EXE_inferlb"))
        .arg("-t")
        .arg("-c")
        .arg(&file)
        .env_remove("ROUTING")
        .output()
        .expect("run inferlb -t")
}

#[test]
fn every_manifest_parses_and_is_listed() {
    let docs = docs();
    for d in &docs {
        for key in ["apiVersion", "kind", "metadata.name"] {
            let v = at(&d.value, key).and_then(Value::as_str);
            assert!(
                v.is_some_and(|s| !s.is_empty()),
                "{}: a document has no {key}",
                d.file
            );
        }
    }
    let kustomization = object(&docs, "Kustomization", "inferlb");
    let listed: Vec<&str> = at(kustomization, "resources")
        .and_then(Value::as_sequence)
        .expect("kustomization resources")
        .iter()
        .map(|r| r.as_str().expect("a resource is a file name"))
        .collect();
    let mut files: Vec<&str> = docs
        .iter()
        .map(|d| d.file.as_str())
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    files.dedup();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(
        sorted, files,
        "kustomization.yaml lists every other manifest, once"
    );
    for kind in [
        "Namespace",
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
    ] {
        assert!(
            docs.iter().any(|d| str_at(&d.value, "kind") == kind),
            "a {kind} in deploy/k8s"
        );
    }
}

#[test]
fn configmap_conf_passes_inferlb_t() {
    let docs = docs();
    let text = conf_text(&docs);
    let out = check_conf(&text);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "inferlb -t refused the ConfigMap's conf: {stdout}{stderr}"
    );
    assert!(
        stdout.contains("configuration") && stdout.contains("is valid"),
        "{stdout}"
    );
    assert!(!stderr.contains("warning"), "warnings: {stderr}");

    // The check is not vacuous: the same conf with a broken key is refused.
    let broken = text.replace("admin_listen: 0.0.0.0:7771", "admin_listen: nowhere");
    assert_ne!(broken, text);
    let out = check_conf(&broken);
    assert!(!out.status.success(), "a broken admin_listen passed -t");
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin_listen"));
}

#[test]
fn deployment_agrees_with_the_conf() {
    let docs = docs();
    let conf = conf(&docs);
    let listen = str_at(&conf, "inferlb.listen");
    let admin = str_at(&conf, "inferlb.admin_listen");
    assert!(
        admin.starts_with("0.0.0.0:"),
        "admin_listen must be reachable from the kubelet's probes: {admin}"
    );
    let deployment = object(&docs, "Deployment", "inferlb");
    assert!(
        u64_at(deployment, "spec.replicas") >= 2,
        "several instances"
    );
    let c = container(deployment);

    let ports: Vec<u64> = at(c, "ports")
        .and_then(Value::as_sequence)
        .expect("container ports")
        .iter()
        .map(|p| u64_at(p, "containerPort"))
        .collect();
    assert!(
        ports.contains(&port_of(listen)),
        "container port for {listen}"
    );
    assert!(
        ports.contains(&port_of(admin)),
        "container port for {admin}"
    );

    for (probe, path) in [("readinessProbe", "/ready"), ("livenessProbe", "/metrics")] {
        let get = at(c, &format!("{probe}.httpGet")).unwrap_or_else(|| panic!("{probe}.httpGet"));
        assert_eq!(str_at(get, "path"), path, "{probe} path");
        let port = resolve_port(c, get.get("port").expect("probe port"));
        assert_eq!(port, port_of(admin), "{probe} on the admin port");
    }

    // The conf is read where the command says, from the ConfigMap.
    let command: Vec<&str> = at(c, "command")
        .and_then(Value::as_sequence)
        .expect("command")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let conf_path = command
        .windows(2)
        .find(|w| w[0] == "-c")
        .map(|w| w[1])
        .expect("command has -c FILE");
    assert!(!command.contains(&"-d"), "runs in the foreground");
    let pod = at(deployment, "spec.template.spec").expect("pod spec");
    let mounts = at(c, "volumeMounts")
        .and_then(Value::as_sequence)
        .expect("volumeMounts");
    let volumes = at(pod, "volumes")
        .and_then(Value::as_sequence)
        .expect("volumes");
    let volume_of = |dir: &str| -> &Value {
        let mount = mounts
            .iter()
            .find(|m| str_at(m, "mountPath") == dir)
            .unwrap_or_else(|| panic!("nothing mounted at {dir}"));
        let name = str_at(mount, "name");
        volumes
            .iter()
            .find(|v| str_at(v, "name") == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    let (conf_dir, conf_file) = conf_path.rsplit_once('/').expect("an absolute path");
    assert_eq!(conf_file, "inferlb.yaml");
    assert_eq!(str_at(volume_of(conf_dir), "configMap.name"), "inferlb");

    // A read-only root: every file inferlb writes is under a writable emptyDir.
    assert_eq!(
        at(c, "securityContext.readOnlyRootFilesystem").and_then(Value::as_bool),
        Some(true)
    );
    let non_root = at(pod, "securityContext.runAsNonRoot")
        .or_else(|| at(c, "securityContext.runAsNonRoot"))
        .and_then(Value::as_bool);
    assert_eq!(non_root, Some(true), "runAsNonRoot");
    for key in ["pid_file", "upgrade_sock"] {
        let path = str_at(&conf, key);
        let dir = Path::new(path).parent().unwrap().to_str().unwrap();
        assert!(
            at(volume_of(dir), "emptyDir").is_some(),
            "{key} {path} is on an emptyDir"
        );
    }
    if let Some(state) = at(&conf, "inferlb.state_file").and_then(Value::as_str) {
        let dir = Path::new(state).parent().unwrap().to_str().unwrap();
        assert!(
            at(volume_of(dir), "emptyDir").is_some(),
            "state_file {state}"
        );
    }

    // SIGTERM: streams get grace_period_seconds, the runtime graceful_shutdown_timeout_seconds
    // more, after the preStop hook; the kubelet must not SIGKILL before.
    let grace = u64_at(&conf, "grace_period_seconds");
    let shutdown = u64_at(&conf, "graceful_shutdown_timeout_seconds");
    let pre_stop = at(c, "lifecycle.preStop.sleep.seconds")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let pod_grace = u64_at(pod, "terminationGracePeriodSeconds");
    assert!(
        pod_grace >= grace,
        "{pod_grace} s < grace_period_seconds {grace}"
    );
    assert!(
        pod_grace >= pre_stop + grace + shutdown,
        "terminationGracePeriodSeconds {pod_grace} < preStop {pre_stop} + grace {grace} + shutdown {shutdown}"
    );
}

#[test]
fn services_reach_what_the_conf_names() {
    let docs = docs();
    let conf = conf(&docs);
    let deployment = object(&docs, "Deployment", "inferlb");
    let c = container(deployment);
    let pod_labels = at(deployment, "spec.template.metadata.labels").expect("pod labels");
    let selects_pods = |selector: &Value| {
        let m = selector.as_mapping().expect("selector is a mapping");
        !m.is_empty() && m.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
    };

    // The clients' Service and the admin one reach the conf's two listeners.
    for (name, key) in [
        ("inferlb", "inferlb.listen"),
        ("inferlb-admin", "inferlb.admin_listen"),
    ] {
        let svc = object(&docs, "Service", name);
        assert!(
            selects_pods(at(svc, "spec.selector").expect("selector")),
            "Service {name} selects the inferlb pods"
        );
        let target = at(svc, "spec.ports.0.targetPort").expect("targetPort");
        assert_eq!(
            resolve_port(c, target),
            port_of(str_at(&conf, key)),
            "Service {name} targets {key}"
        );
    }
    let admin = object(&docs, "Service", "inferlb-admin");
    let spec_type = at(admin, "spec.type").and_then(Value::as_str);
    assert!(
        matches!(spec_type, None | Some("ClusterIP")),
        "the admin Service stays cluster-internal"
    );
    let annotations = at(admin, "metadata.annotations").expect("annotations");
    assert_eq!(
        annotations
            .get("prometheus.io/scrape")
            .and_then(Value::as_str),
        Some("true")
    );
    assert_eq!(
        annotations
            .get("prometheus.io/port")
            .and_then(Value::as_str),
        Some(
            port_of(str_at(&conf, "inferlb.admin_listen"))
                .to_string()
                .as_str()
        )
    );

    let pdb = object(&docs, "PodDisruptionBudget", "inferlb");
    assert!(selects_pods(
        at(pdb, "spec.selector.matchLabels").expect("pdb selector")
    ));
    assert_eq!(u64_at(pdb, "spec.minAvailable"), 1);

    // cluster.redis_url names the Valkey Service and its port.
    let url = str_at(&conf, "inferlb.cluster.redis_url");
    let host_port = url.strip_prefix("redis://").expect("a redis:// URL");
    let (host, port) = host_port.rsplit_once(':').expect("host:port");
    let valkey = object(&docs, "Service", host);
    assert_eq!(
        u64_at(valkey, "spec.ports.0.port"),
        port.parse::<u64>().unwrap()
    );
    object(&docs, "Deployment", host);

    // The DNS-discovered replica is the headless Service, in the kustomization's namespace.
    let replicas = at(&conf, "inferlb.replicas")
        .and_then(Value::as_sequence)
        .expect("replicas");
    assert_eq!(replicas.len(), 1);
    assert_eq!(str_at(&replicas[0], "discover"), "dns");
    let address = str_at(&replicas[0], "address");
    let host = address.rsplit_once(':').unwrap().0;
    let mut labels = host.split('.');
    let (service, namespace) = (labels.next().unwrap(), labels.next().expect("a namespace"));
    assert_eq!(
        labels.collect::<Vec<_>>(),
        ["svc", "cluster", "local"],
        "{address}"
    );
    let kustomization = object(&docs, "Kustomization", "inferlb");
    assert_eq!(str_at(kustomization, "namespace"), namespace);
    let headless = object(&docs, "Service", service);
    assert_eq!(str_at(headless, "spec.clusterIP"), "None");
    assert_eq!(u64_at(headless, "spec.ports.0.port"), port_of(address));
}
