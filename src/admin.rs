//! The admin listener (127.0.0.1 by default): Prometheus metrics and replica drain.
//!
//! - `GET /metrics`: the Prometheus text format.
//! - `GET /admin/replicas`: each replica's state, as JSON.
//! - `POST /admin/replicas/{id}/drain` and `.../undrain`: take a replica out of rotation
//!   (in-flight requests finish, pinned conversations move on their next turn) and back.

use std::sync::Arc;

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;

use crate::registry::Registry;

pub struct Admin {
    pub registry: Arc<Registry>,
    /// Drains are shared with the other instances of a cluster.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
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

impl Admin {
    fn state(&self) -> serde_json::Value {
        let list: Vec<_> = self
            .registry
            .all()
            .iter()
            .map(|r| {
                serde_json::json!({
                    "id": &*r.id,
                    "address": r.address,
                    "healthy": r.is_healthy(),
                    "demoted": r.is_demoted(),
                    "draining": r.is_draining(),
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
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method.as_str(), parts.as_slice()) {
            ("GET", ["metrics"]) => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                crate::metrics::render(),
            ),
            ("GET", ["admin", "replicas"]) => json(StatusCode::OK, self.state()),
            ("POST", ["admin", "replicas", id, action @ ("drain" | "undrain")]) => {
                match self.registry.get(id) {
                    Some(r) => {
                        let draining = *action == "drain";
                        r.set_draining(draining);
                        if let Some(c) = &self.cluster {
                            c.drain(&r.id, draining);
                        }
                        json(StatusCode::OK, self.state())
                    }
                    None => json(
                        StatusCode::NOT_FOUND,
                        serde_json::json!({"error": format!("no replica with id {id:?}")}),
                    ),
                }
            }
            _ => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"error": "try GET /metrics, GET /admin/replicas, POST /admin/replicas/{id}/drain|undrain"}),
            ),
        }
    }
}
