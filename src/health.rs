//! Health checks: every replica probed with Pingora's `HttpHealthCheck` (GET /health) on an
//! interval, all in parallel. The result is recorded on the replica itself (`replica.rs`): a
//! passing check re-admits a replica the data path demoted, and each up/down transition is
//! logged once. Probes go by replica, never by address, so two replicas that share an address
//! are each checked and re-admitted.

use std::sync::Arc;

use async_trait::async_trait;
use futures::future::join_all;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};

use crate::config::HealthConf;
use crate::registry::Registry;
use crate::replica::Replica;

pub struct HealthChecker {
    http: HttpHealthCheck,
    conf: HealthConf,
    registry: Arc<Registry>,
}

impl HealthChecker {
    pub fn new(conf: &HealthConf, registry: Arc<Registry>) -> Self {
        let mut http = HttpHealthCheck::new("localhost", false);
        if let Ok(mut req) = RequestHeader::build("GET", conf.path.as_bytes(), None) {
            let _ = req.append_header("Host", "localhost");
            http.req = req;
        }
        http.peer_template.options.connection_timeout = Some(conf.timeout);
        http.peer_template.options.read_timeout = Some(conf.timeout);
        HealthChecker {
            http,
            conf: conf.clone(),
            registry,
        }
    }

    async fn check(&self, r: &Replica) {
        let before = r.demotions();
        let ok = self.http.check(&r.backend).await.is_ok();
        let (flipped, passed) =
            r.observe_check(ok, before, self.conf.failures, self.conf.successes);
        match flipped {
            Some(true) => log::warn!(
                "replica {} ({}) is up: health check passed",
                r.id,
                r.address
            ),
            Some(false) => log::warn!(
                "replica {} ({}) is down: health check failed",
                r.id,
                r.address
            ),
            None => {}
        }
        // Learn what it serves when it comes up, then now and then (a redeploy may change it).
        if ok && !r.models_configured && (r.models().is_empty() || passed % 60 == 0) {
            if let Some(models) = crate::probe::models(r, self.conf.timeout).await {
                r.set_models(models);
            }
        }
    }
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.conf.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            join_all(self.registry.all().iter().map(|r| self.check(r))).await;
        }
    }
}
