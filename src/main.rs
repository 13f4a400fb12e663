//! `inferlb -c conf/inferlb.yaml [-d] [-u] [-t]`: assembles the services and runs them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pingora_core::apps::http_app::HttpServer;
use pingora_core::listeners::{L4BufferSettings, ListenerConfig};
use pingora_core::server::configuration::Opt;
use pingora_core::server::{ExecutionPhase, Server};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;

use inferlb::admin::Admin;
use inferlb::fleet::affinity::AffinityTable;
use inferlb::fleet::health::HealthChecker;
use inferlb::fleet::pins_file::StateKeeper;
use inferlb::fleet::registry::Registry;
use inferlb::proxy::Balancer;

// glibc's malloc showed up as a tenth of the proxy's CPU under load (perf), and its per-thread
// arenas let RSS creep; mimalloc does better on both for this allocation pattern.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut opt = Opt::parse_args();
    let path = opt
        .conf
        .take()
        .unwrap_or_else(|| "conf/inferlb.yaml".into());
    let routing_env = std::env::var("ROUTING").ok();
    let loaded = match inferlb::conf::load(&path, routing_env.as_deref()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("inferlb: invalid configuration: {e}");
            std::process::exit(2);
        }
    };
    for warning in loaded.inferlb.warnings() {
        eprintln!("inferlb: warning: {warning}");
    }
    if opt.test {
        println!("inferlb: configuration {path} is valid");
    }
    let conf = Arc::new(loaded.inferlb);

    let max_attempts = loaded.server.max_retries;
    // An upgrade takes its listeners over from the old process instead of binding them.
    let upgrading = opt.upgrade;
    let mut server = Server::new_with_opt_and_conf(opt, loaded.server);
    server.bootstrap();
    if !upgrading {
        if let Err(e) = wait_for_addresses(&conf, BIND_WAIT) {
            eprintln!("inferlb: {e}");
            std::process::exit(1);
        }
    }

    // Set when this process starts handing over (SIGQUIT) or stopping (SIGTERM): responses then
    // close their connections, so clients move to the new process instead of racing the
    // old one's shutdown on an idle keep-alive connection.
    let leaving = Arc::new(AtomicBool::new(false));
    let mut phases = server.watch_execution_phase();
    let flag = leaving.clone();
    std::thread::spawn(move || {
        while let Ok(phase) = phases.blocking_recv() {
            if matches!(
                phase,
                ExecutionPhase::GracefulUpgradeTransferringFds | ExecutionPhase::GracefulTerminate
            ) {
                flag.store(true, Ordering::Relaxed);
            }
        }
    });

    inferlb::fleet::probe::init();
    let registry = Arc::new(Registry::new(&conf.replicas, &conf.upstream));
    let metrics = &inferlb::telemetry::metrics::METRICS;
    let affinity = Arc::new(AffinityTable::new(
        conf.affinity_capacity,
        Some(metrics.affinity_entries.clone()),
    ));
    let stored = Arc::new(AffinityTable::new(
        conf.stored_responses_capacity,
        Some(metrics.stored_responses.clone()),
    ));
    let health = background_service("health", HealthChecker::new(&conf.health, registry.clone()));
    let registry_for_load = registry.clone();
    let registry_for_kv_events = registry.clone();
    let registry_for_discovery = registry.clone();

    // One link to the cluster's Redis, for its state and the shared budgets alike.
    let link = conf.cluster.clone().map(inferlb::link::Link::new);
    let link_service = link
        .as_ref()
        .map(|l| background_service("redis link", l.keeper()));
    let cluster = conf.cluster.as_ref().zip(link.clone()).map(|(c, link)| {
        let (handle, changes) =
            inferlb::cluster::Cluster::new(c.instance_id.clone(), Some(link.clone()));
        let sync = inferlb::cluster::ClusterSync {
            cluster: handle.clone(),
            changes: std::sync::Mutex::new(Some(changes)),
            link,
            registry: registry.clone(),
            affinity: affinity.clone(),
            stored: stored.clone(),
            pin_ttl: c.pin_ttl,
            networks: conf.admin.allowed_networks.clone(),
            restarts: Default::default(),
        };
        (handle, background_service("cluster", sync))
    });
    let (cluster, cluster_service) = match cluster {
        Some((h, s)) => (Some(h), Some(s)),
        None => (None, None),
    };

    let keeper = StateKeeper {
        affinity: affinity.clone(),
        stored: stored.clone(),
        registry: registry.clone(),
        path: conf.state_file.clone(),
        interval: std::time::Duration::from_secs(2),
        leaving: leaving.clone(),
        other_version_seen: Default::default(),
    };
    let learnt = keeper.load();
    if learnt > 0 {
        log::info!(
            "{learnt} affinity pins loaded from {}",
            conf.state_file.display()
        );
    }
    let state = background_service("affinity state", keeper);

    // The Responses store, when the balancer keeps it; shared through the cluster's Redis.
    let history = conf
        .responses
        .in_balancer()
        .then(|| inferlb::history::Store::new(conf.responses.clone(), link.clone()));
    let resender = history.as_ref().filter(|_| link.is_some()).map(|store| {
        background_service(
            "responses store",
            inferlb::history::Resender {
                store: store.clone(),
            },
        )
    });

    let tokenizers = match inferlb::protocol::tokens::Tokenizers::load(&conf.tokenizers) {
        Ok(t) => Arc::new(t),
        Err(e) => {
            eprintln!("inferlb: {e}");
            std::process::exit(2);
        }
    };
    let mut proxy = pingora_proxy::http_proxy_service_with_name(
        &server.configuration,
        Balancer::new(
            registry.clone(),
            affinity.clone(),
            stored,
            cluster.clone(),
            conf.clone(),
            max_attempts,
            leaving,
        )
        .with_history(history)
        .with_tokenizers(tokenizers),
        "inferlb",
    );
    // A plain listener reads the socket straight into Pingora's HTTP buffers: its default
    // 64 KiB read buffer per connection (zeroed when made, there for TLS's small reads) only
    // added a copy, and was most of inferlb's memory per open stream.
    let plain = |addr: &str| {
        ListenerConfig::tcp(addr).l4_buffer(L4BufferSettings {
            read: Some(0),
            write: None,
        })
    };
    let reloader = match &conf.tls {
        None => {
            proxy.add_listener(plain(&conf.listen));
            None
        }
        Some(tls) => {
            let served = inferlb::conf::tls::ServedCertificate::new(tls)
                .and_then(|served| Ok((served.listener_settings()?, served)));
            let (settings, served) = match served {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("inferlb: {e}");
                    std::process::exit(2);
                }
            };
            proxy.add_tls_with_settings(&conf.listen, None, settings);
            if let Some(addr) = &conf.plain_listen {
                proxy.add_listener(plain(addr));
            }
            Some(background_service(
                "certificate reload",
                inferlb::conf::tls::CertificateReloader { served },
            ))
        }
    };
    if conf.h2c {
        // On TLS connections ALPN decides; this lets a plain connection open with h2's preface.
        if let Some(app) = proxy.app_logic_mut() {
            let mut options = pingora_core::apps::HttpServerOptions::default();
            options.h2c = true;
            app.server_options = Some(options);
        }
    }

    let auth = Arc::new(inferlb::admin::auth::Auth::new(&conf.admin));
    if auth.has_files() {
        server.add_service(background_service(
            "admin token reload",
            inferlb::admin::auth::TokenReloader {
                auth: auth.clone(),
                interval: conf.admin.reload_interval,
            },
        ));
    }
    let mut admin = Service::new(
        "admin".to_string(),
        HttpServer::new_app(Admin {
            registry,
            cluster,
            auth,
            networks: conf.admin.allowed_networks.clone(),
        }),
    );
    admin.add_tcp(&conf.admin_listen);

    log::info!(
        "inferlb listening on {}{}{} (admin and metrics on {}), routing {:?}, {} replicas",
        conf.listen,
        if conf.tls.is_some() {
            " (TLS: h2, http/1.1)"
        } else {
            ""
        },
        conf.plain_listen
            .as_ref()
            .map_or(String::new(), |p| format!(" and {p} (plain)")),
        conf.admin_listen,
        conf.routing,
        conf.replicas.len()
    );
    // Overload protection reads the replicas' own queues too, whatever the policy.
    if inferlb::routing::Router::new(conf.routing, None).weighs_prefill() || conf.overload.is_some()
    {
        let load = inferlb::fleet::poll::LoadReader {
            registry: registry_for_load,
            affinity,
            interval: conf.load_poll_interval,
        };
        server.add_service(background_service("replica load", load));
    }
    // The replicas' own KV events, for those whose entry names a publisher (or that come to).
    let kv_events = inferlb::fleet::kv_events::KvEventWatcher {
        registry: registry_for_kv_events,
    };
    server.add_service(background_service("replica KV events", kv_events));
    let found_by_dns: Vec<_> = conf
        .replicas
        .iter()
        .filter(|r| r.discover.is_some())
        .cloned()
        .collect();
    if !found_by_dns.is_empty() {
        let discovery = inferlb::fleet::discovery::Discovery {
            entries: found_by_dns,
            conf: conf.discovery.clone(),
            registry: registry_for_discovery,
            networks: conf.admin.allowed_networks.clone(),
            refused: Default::default(),
        };
        server.add_service(background_service("discovery", discovery));
    }
    if let Some(s) = reloader {
        server.add_service(s);
    }
    // Every secret read from a file (client keys, replica keys, tokens, the Redis password).
    server.add_service(background_service(
        "secrets reload",
        inferlb::conf::secrets::SecretsReloader {
            interval: conf.secrets_reload_interval,
        },
    ));
    if let Some(s) = link_service {
        server.add_service(s);
    }
    if let Some(s) = cluster_service {
        server.add_service(s);
    }
    if let Some(s) = resender {
        server.add_service(s);
    }
    server.add_service(health);
    server.add_service(state);
    server.add_service(proxy);
    server.add_service(admin);
    server.run_forever();
}

/// How long a listener's address may stay in use at start (an old process still stopping)
/// before inferlb gives up: as long as Pingora's own listener keeps trying.
const BIND_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Waits, at most `limit`, until every address inferlb listens on can be bound, and names the
/// one that cannot. Pingora's listener retries an address in use just as long, but then gives
/// up on that listener alone and leaves the process running without it (no proxy port, or no
/// metrics and admin): inferlb exits instead, saying why.
fn wait_for_addresses(
    conf: &inferlb::conf::Config,
    limit: std::time::Duration,
) -> Result<(), String> {
    let start = std::time::Instant::now();
    let listeners = [
        ("listen", Some(&conf.listen)),
        ("admin_listen", Some(&conf.admin_listen)),
        ("plain_listen", conf.plain_listen.as_ref()),
    ];
    for (key, addr) in listeners {
        let Some(addr) = addr else { continue };
        let mut warned = false;
        loop {
            match std::net::TcpListener::bind(addr.as_str()) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && start.elapsed() < limit => {
                    if !warned {
                        log::warn!("inferlb.{key} {addr} is in use: waiting up to {limit:?}");
                        warned = true;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(e) => return Err(format!("inferlb.{key}: cannot listen on {addr}: {e}")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn conf_listening_on(admin: u16) -> inferlb::conf::Config {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let listen = free.local_addr().expect("its address").port();
        drop(free);
        let text = format!(
            "inferlb:\n  listen: 127.0.0.1:{listen}\n  admin_listen: 127.0.0.1:{admin}\n  \
             replicas:\n    - {{id: a, address: \"127.0.0.1:9\"}}\n"
        );
        inferlb::conf::parse(&text, None).expect("conf").inferlb
    }

    #[test]
    fn an_address_in_use_is_waited_for_then_named_when_it_stays_taken() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = held.local_addr().expect("address").port();
        let conf = conf_listening_on(port);
        let start = Instant::now();
        let e = wait_for_addresses(&conf, Duration::from_millis(400)).expect_err("in use");
        assert!(start.elapsed() >= Duration::from_millis(400), "waited");
        assert!(
            e.starts_with(&format!(
                "inferlb.admin_listen: cannot listen on 127.0.0.1:{port}"
            )),
            "{e}"
        );
        // Released while waiting: the wait ends then, well before its limit.
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let start = Instant::now();
        wait_for_addresses(&conf, Duration::from_secs(20)).expect("released");
        assert!(start.elapsed() >= Duration::from_millis(300));
        release.join().expect("release");
    }
}
