//! Health checks: Pingora's `HttpHealthCheck` (GET /health) run by Pingora's background
//! service, wrapped so that a passing check also re-admits a replica the data path demoted,
//! and so that each up/down transition is logged once.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use pingora_core::Result;
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::Backend;

use crate::config::HealthConf;
use crate::replicas::Replicas;

pub struct ReplicaHealthCheck {
    http: HttpHealthCheck,
    /// Set once the replica set exists (it needs the load balancer this check belongs to).
    replicas: Arc<OnceLock<Arc<Replicas>>>,
}

impl ReplicaHealthCheck {
    pub fn new(conf: &HealthConf, replicas: Arc<OnceLock<Arc<Replicas>>>) -> Self {
        let mut http = HttpHealthCheck::new("localhost", false);
        if let Ok(mut req) = RequestHeader::build("GET", conf.path.as_bytes(), None) {
            let _ = req.append_header("Host", "localhost");
            http.req = req;
        }
        http.consecutive_failure = conf.failures;
        http.consecutive_success = conf.successes;
        http.peer_template.options.connection_timeout = Some(conf.timeout);
        http.peer_template.options.read_timeout = Some(conf.timeout);
        ReplicaHealthCheck { http, replicas }
    }
}

#[async_trait]
impl HealthCheck for ReplicaHealthCheck {
    async fn check(&self, target: &Backend) -> Result<()> {
        let found = self
            .replicas
            .get()
            .and_then(|rs| rs.by_backend(target).map(|r| (rs, r, rs.demotions(r))));
        self.http.check(target).await?;
        if let Some((rs, r, before)) = found {
            rs.check_passed(r, before);
        }
        Ok(())
    }

    async fn health_status_change(&self, target: &Backend, healthy: bool) {
        let Some(rs) = self.replicas.get() else {
            return;
        };
        let Some(r) = rs.by_backend(target) else {
            return;
        };
        if healthy {
            log::warn!(
                "replica {} ({}) is up: health check passed",
                r.id,
                r.address
            );
        } else {
            log::warn!(
                "replica {} ({}) is down: health check failed",
                r.id,
                r.address
            );
        }
        crate::metrics::METRICS
            .up
            .with_label_values(&[&r.id])
            .set((healthy && !r.is_demoted()) as i64);
    }

    fn health_threshold(&self, success: bool) -> usize {
        self.http.health_threshold(success)
    }
}
