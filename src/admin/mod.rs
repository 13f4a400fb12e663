//! The admin listener (127.0.0.1 by default): Prometheus metrics and replica drain.
//!
//! - `GET /metrics`: the Prometheus text format.
//! - `GET /admin/replicas`: each replica's state, as JSON.
//! - `GET /ready`: 200 when at least one replica is live and, with a cluster, the shared state
//!   was adopted; 503 otherwise (for load balancers and Kubernetes readiness probes).
//! - `POST /admin/replicas/{id}/drain` and `.../undrain`: take a replica out of rotation
//!   (in-flight requests finish, pinned conversations move on their next turn) and back.
//! - `POST /admin/replicas` with `{"id", "address", "api_key_env"? or "api_key_file"?,
//!   "models"?, "cache_tokens"?, "role"?, "bootstrap_port"?}`: adds a replica at runtime (it joins after a passing health
//!   check); each instance reads its key from its own environment or file;
//!   `DELETE /admin/replicas/{id}` removes one (in-flight requests finish).
//!
//! With a cluster, a drain, add or remove is answered once it is written to Redis (200, or 201
//! for an add, with `"applied": "cluster"`). When Redis cannot take it within a second, the
//! answer is 202 with `"applied": "local"`: the change holds here and is written when Redis is
//! back.
//!
//! With `admin.token_file` or `token_env` set, every path needs `Authorization: Bearer <token>`
//! (401 otherwise), except `/metrics` and `/ready`, which need `admin.metrics_token_file`'s
//! when it is set. Every change is logged with the caller's address; so is every refusal.

use std::sync::Arc;

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;

pub mod auth;

use crate::cluster::Applied;
use crate::conf::netpolicy::Networks;
use crate::conf::{check_replica, ReplicaConf};
use crate::fleet::registry::Registry;
use auth::Auth;

pub struct Admin {
    pub registry: Arc<Registry>,
    /// Drains are shared with the other instances of a cluster.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Who may call.
    pub auth: Arc<Auth>,
    /// Where an added replica may be.
    pub networks: Networks,
}

fn reply(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .unwrap_or_default()
}

fn json(status: StatusCode, v: serde_json::Value) -> Response<Vec<u8>> {
    reply(status, "application/json", v.to_string().into_bytes())
}

fn unauthorized() -> Response<Vec<u8>> {
    let mut r = json(
        StatusCode::UNAUTHORIZED,
        serde_json::json!({"error": "this needs `Authorization: Bearer <token>` with the admin token (inferlb.admin)"}),
    );
    r.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    r
}

/// The request body, up to 64 KiB (an admin call is small).
async fn read_body(session: &mut ServerSession) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = session.read_request_body().await {
        body.extend_from_slice(&chunk);
        if body.len() > 64 * 1024 {
            break;
        }
    }
    body
}

impl Admin {
    /// Adds the replica described by `body`, checked as a conf entry is: what was added and,
    /// with a cluster, where the addition stands.
    async fn add(&self, body: &[u8]) -> Result<(ReplicaConf, Option<Applied>), String> {
        let mut conf: ReplicaConf = serde_json::from_slice(body)
            .map_err(|e| format!("expected {{\"id\", \"address\", ...}}: {e}"))?;
        if conf.discover.is_some() {
            return Err("discover: dns belongs in the conf file".into());
        }
        if conf.data_parallel_size.is_some_and(|n| n > 1) {
            return Err(
                "data_parallel_size belongs in the conf file; add each rank here with data_parallel_rank (and its own id)"
                    .into(),
            );
        }
        // A key sent here would travel in requests and, in a cluster, to every instance.
        if conf.api_key.is_some() {
            return Err(
                "api_key: a key is never sent to the admin API; name where each \
                        instance reads it: api_key_env (an environment variable) or \
                        api_key_file (a file)"
                    .into(),
            );
        }
        let checked =
            tokio::task::spawn_blocking(move || check_replica(&mut conf, "replica").map(|()| conf))
                .await
                .map_err(|e| e.to_string())??;
        if let Some(socket) = checked.socket {
            self.networks
                .check(socket.ip())
                .map_err(|e| format!("replica.address: {:?}: {e}", checked.address))?;
        }
        self.registry.add(&checked, None)?;
        let applied = match &self.cluster {
            Some(c) => Some(c.replica(&checked.id, Some(&checked)).await),
            None => None,
        };
        Ok((checked, applied))
    }

    /// The state after a change: `ok` when the change is everyone's (or there is no cluster),
    /// 202 when it is applied here only, for now.
    fn changed(&self, ok: StatusCode, applied: Option<Applied>) -> Response<Vec<u8>> {
        let mut state = self.state();
        let status = match applied {
            None => ok,
            Some(Applied::Cluster) => {
                state["applied"] = "cluster".into();
                ok
            }
            Some(Applied::Local) => {
                state["applied"] = "local".into();
                StatusCode::ACCEPTED
            }
        };
        json(status, state)
    }

    fn state(&self) -> serde_json::Value {
        let list: Vec<_> = self
            .registry
            .all()
            .iter()
            .map(|r| {
                serde_json::json!({
                    "id": &*r.id,
                    "address": r.endpoint.address,
                    "role": r.role.name(),
                    "healthy": r.health.is_healthy(),
                    "demoted": r.health.is_demoted(),
                    "draining": r.health.is_draining(),
                    "live": r.is_live(),
                    "in_flight": r.in_flight(),
                })
            })
            .collect();
        serde_json::json!({ "replicas": list })
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let method = session.req_header().method.as_str().to_owned();
        let path = session.req_header().uri.path().to_owned();
        // The peer's address: who made a change, or was refused.
        let caller = session
            .client_addr()
            .map_or_else(|| "-".to_string(), |a| a.to_string());
        let authorization = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION);
        if !self.auth.admits(&path, authorization.map(|v| v.as_bytes())) {
            let why = if authorization.is_some() {
                "wrong"
            } else {
                "no"
            };
            log::warn!("admin: {method} {path} from {caller} refused: {why} bearer token");
            return unauthorized();
        }
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method.as_str(), parts.as_slice()) {
            ("GET", ["metrics"]) => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                crate::telemetry::metrics::render(),
            ),
            ("GET", ["admin", "replicas"]) => json(StatusCode::OK, self.state()),
            ("GET", ["ready"]) => {
                let live = self.registry.all().iter().filter(|r| r.is_live()).count();
                let shared = self.cluster.as_ref().is_none_or(|c| c.is_bootstrapped());
                let status = if live > 0 && shared {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(
                    status,
                    serde_json::json!({"live_replicas": live, "cluster_state": shared}),
                )
            }
            ("POST", ["admin", "replicas"]) => {
                let body = read_body(session).await;
                match self.add(&body).await {
                    Ok((r, applied)) => {
                        log::info!("admin: {caller} added replica {} at {}", r.id, r.address);
                        self.changed(StatusCode::CREATED, applied)
                    }
                    Err(e) => {
                        log::warn!("admin: {caller} could not add a replica: {e}");
                        json(StatusCode::BAD_REQUEST, serde_json::json!({"error": e}))
                    }
                }
            }
            ("DELETE", ["admin", "replicas", id]) => match self.registry.remove(id) {
                Some(gone) => {
                    log::info!(
                        "admin: {caller} removed replica {} at {}",
                        gone.id,
                        gone.endpoint.address
                    );
                    let applied = match &self.cluster {
                        Some(c) => Some(c.replica(id, None).await),
                        None => None,
                    };
                    self.changed(StatusCode::OK, applied)
                }
                None => json(
                    StatusCode::NOT_FOUND,
                    serde_json::json!({"error": format!("no replica with id {id:?}")}),
                ),
            },
            ("POST", ["admin", "replicas", id, action @ ("drain" | "undrain")]) => {
                match self.registry.get(id) {
                    Some(r) => {
                        let draining = *action == "drain";
                        log::info!(
                            "admin: {caller} {action}ed replica {} at {}",
                            r.id,
                            r.endpoint.address
                        );
                        r.set_draining(draining);
                        let applied = match &self.cluster {
                            Some(c) => Some(c.drain(&r.id, draining).await),
                            None => None,
                        };
                        self.changed(StatusCode::OK, applied)
                    }
                    None => json(
                        StatusCode::NOT_FOUND,
                        serde_json::json!({"error": format!("no replica with id {id:?}")}),
                    ),
                }
            }
            _ => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"error": "try GET /metrics, GET /admin/replicas, POST /admin/replicas, POST /admin/replicas/{id}/drain|undrain, DELETE /admin/replicas/{id}"}),
            ),
        }
    }
}
