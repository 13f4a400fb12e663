//! `inferlb -c conf/inferlb.yaml [-d] [-u] [-t]`: assembles the services and runs them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use pingora_core::apps::http_app::HttpServer;
use pingora_core::server::configuration::Opt;
use pingora_core::server::{ExecutionPhase, Server};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::{Backends, LoadBalancer};

use inferlb::admin::Admin;
use inferlb::config;
use inferlb::health::ReplicaHealthCheck;
use inferlb::proxy::Balancer;
use inferlb::replicas::{backend_for, Replicas};
use inferlb::state::StateKeeper;

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
    let loaded = match config::load(&path, routing_env.as_deref()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("inferlb: invalid configuration: {e}");
            std::process::exit(2);
        }
    };
    if opt.test {
        println!("inferlb: configuration {path} is valid");
    }
    let conf = Arc::new(loaded.inferlb);

    let mut server = Server::new_with_opt_and_conf(opt, loaded.server);
    server.bootstrap();

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

    // Pingora's load balancer holds the replicas' health; the routing policy does the choosing.
    let backends: std::collections::BTreeSet<_> = conf.replicas.iter().map(backend_for).collect();
    let mut lb = LoadBalancer::from_backends(Backends::new(Static::new(backends)));
    // Fill the membership now, so the first request does not find an empty set.
    let filled = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map(|rt| rt.block_on(lb.update()));
    if !matches!(filled, Ok(Ok(()))) {
        eprintln!("inferlb: cannot initialise the replica set");
        std::process::exit(2);
    }
    let replicas_cell = Arc::new(OnceLock::new());
    lb.set_health_check(Box::new(ReplicaHealthCheck::new(
        &conf.health,
        replicas_cell.clone(),
    )));
    lb.health_check_frequency = Some(conf.health.interval);
    lb.parallel_health_check = true;
    let health = background_service("health", lb);
    let replicas = Arc::new(Replicas::new(
        &conf.replicas,
        health.task(),
        conf.affinity_capacity,
    ));
    let _ = replicas_cell.set(replicas.clone());

    let keeper = StateKeeper {
        replicas: replicas.clone(),
        path: conf.state_file.clone(),
        interval: std::time::Duration::from_secs(2),
        leaving: leaving.clone(),
    };
    let learnt = keeper.load();
    if learnt > 0 {
        log::info!(
            "{learnt} affinity pins loaded from {}",
            conf.state_file.display()
        );
    }
    let state = background_service("affinity state", keeper);

    let mut proxy = pingora_proxy::http_proxy_service_with_name(
        &server.configuration,
        Balancer::new(replicas.clone(), conf.clone(), leaving),
        "inferlb",
    );
    proxy.add_tcp(&conf.listen);

    let mut admin = Service::new("admin".to_string(), HttpServer::new_app(Admin { replicas }));
    admin.add_tcp(&conf.admin_listen);

    log::info!(
        "inferlb listening on {} (admin and metrics on {}), routing {:?}, {} replicas",
        conf.listen,
        conf.admin_listen,
        conf.routing,
        conf.replicas.len()
    );
    server.add_service(health);
    server.add_service(state);
    server.add_service(proxy);
    server.add_service(admin);
    server.run_forever();
}
