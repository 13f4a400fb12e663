//! `inferlb -c conf/inferlb.yaml [-d] [-u] [-t]`: assembles the services and runs them.

use std::sync::{Arc, OnceLock};

use pingora_core::apps::http_app::HttpServer;
use pingora_core::server::configuration::Opt;
use pingora_core::server::Server;
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::{Backends, LoadBalancer};

use inferlb::admin::Admin;
use inferlb::config;
use inferlb::health::ReplicaHealthCheck;
use inferlb::proxy::Balancer;
use inferlb::replicas::{backend_for, Replicas};

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

    let mut proxy = pingora_proxy::http_proxy_service_with_name(
        &server.configuration,
        Balancer::new(replicas.clone(), conf.clone()),
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
    server.add_service(proxy);
    server.add_service(admin);
    server.run_forever();
}
