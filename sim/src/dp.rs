//! A data-parallel server (`--data-parallel-size`, vLLM's internal load balancing): one
//! address in front of several engines, each a whole [`Sim`] with its own prefix cache, batch
//! and KV event publisher. A request's `X-data-parallel-rank` header names its engine, as
//! vLLM reads it (any case; a value that is not a rank of this server is refused with 400);
//! without one, the least loaded engine takes it (waiting counted four times over running, as
//! vLLM's client weighs them). `/metrics` is the server's, every engine's samples labelled
//! `engine="k"`; `/reset_prefix_cache` resets every engine; every other path is rank 0's
//! unless the header names another.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower::ServiceExt;

use crate::endpoints::metrics_of;
use crate::{error, router as rank_router, App};

/// The header naming the engine (vLLM's name; header names are case-insensitive).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

struct Server {
    ranks: Vec<App>,
    routers: Vec<Router>,
    /// Where the search for the least loaded engine starts: ties go round.
    next: AtomicUsize,
}

/// The server's routes: each request dispatched to its engine's.
pub fn router(ranks: Vec<App>) -> Router {
    let routers = ranks.iter().map(rank_router).collect();
    let server = Arc::new(Server {
        ranks,
        routers,
        next: AtomicUsize::new(0),
    });
    Router::new().fallback(dispatch).with_state(server)
}

/// The engine `header` names: `Ok(None)` without one, `Err` for a value that is not one of
/// `n` ranks.
fn named_rank(header: Option<&axum::http::HeaderValue>, n: usize) -> Result<Option<usize>, String> {
    let Some(v) = header else {
        return Ok(None);
    };
    let k = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .ok_or_else(|| format!("Invalid X-data-parallel-rank header value: {v:?}"))?;
    if k >= n {
        return Err(format!("data_parallel_rank {k} is out of range [0, {n})."));
    }
    Ok(Some(k))
}

impl Server {
    /// The engine with the fewest requests, waiting weighed four times running; ties go to
    /// the next in turn.
    fn least_loaded(&self) -> usize {
        let n = self.ranks.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&k| {
                let c = &self.ranks[k].engine.counters;
                c.waiting.load(Ordering::Relaxed) * 4 + c.running.load(Ordering::Relaxed)
            })
            .unwrap_or(0)
    }
}

async fn dispatch(State(server): State<Arc<Server>>, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    if path == "/metrics" {
        return metrics_of(&server.ranks);
    }
    let named = match named_rank(req.headers().get(RANK_HEADER), server.ranks.len()) {
        Ok(k) => k,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    if named.is_none() && req.method() == Method::POST && path == "/reset_prefix_cache" {
        for sim in &server.ranks {
            sim.engine.reset_prefix_cache();
        }
        return StatusCode::OK.into_response();
    }
    let rank = named.unwrap_or_else(|| {
        if req.method() == Method::POST && path.starts_with("/v1/") {
            server.least_loaded()
        } else {
            0
        }
    });
    match server.routers[rank].clone().oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_header_names_one_of_the_engines() {
        let v = |s: &'static str| axum::http::HeaderValue::from_static(s);
        assert_eq!(named_rank(None, 2), Ok(None));
        assert_eq!(named_rank(Some(&v("1")), 2), Ok(Some(1)));
        assert_eq!(named_rank(Some(&v(" 0 ")), 2), Ok(Some(0)));
        for bad in ["2", "-1", "one", ""] {
            assert!(named_rank(Some(&v(bad)), 2).is_err(), "{bad:?}");
        }
    }
}
