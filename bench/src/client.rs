//! The load generator's requests, and the few calls it makes to inferlb's admin port.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

/// Text of about `tokens` simulator tokens (4 bytes each), distinct per `seed`.
pub fn filler(seed: &str, tokens: usize) -> String {
    let mut s = format!("[{seed}] ");
    let words = ["alpha ", "beta ", "gamma ", "delta ", "omega "];
    let mut i = 0;
    while s.len() < tokens * 4 {
        s.push_str(words[i % words.len()]);
        s.push_str(&format!("{i} "));
        i += 1;
    }
    s
}

/// One streamed chat request, as the client saw it.
pub struct Outcome {
    /// Time to the first non-empty content token.
    pub ttft: Option<Duration>,
    pub total: Duration,
    pub reply: String,
    /// 0: no response at all.
    pub status: u16,
    /// Bytes of a 200 response arrived, then the stream broke.
    pub cut_after_start: bool,
    /// The stream did not end with `[DONE]` (or there was no 200).
    pub failed: bool,
    /// The `x-inferlb-replica` header, when there is one.
    pub replica: Option<String>,
}

pub async fn stream_chat(
    client: &reqwest::Client,
    base: &str,
    messages: &[Value],
    max_tokens: usize,
) -> Outcome {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": max_tokens});
    let mut out = Outcome {
        ttft: None,
        total: Duration::ZERO,
        reply: String::new(),
        status: 0,
        cut_after_start: false,
        failed: true,
        replica: None,
    };
    let resp = match client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => {
            out.total = started.elapsed();
            return out;
        }
    };
    out.status = resp.status().as_u16();
    out.replica = resp
        .headers()
        .get("x-inferlb-replica")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if out.status != 200 {
        out.total = started.elapsed();
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                continue;
            }
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if !c.is_empty() && out.ttft.is_none() {
                    out.ttft = Some(started.elapsed());
                }
                out.reply.push_str(c);
            }
        }
    }
    out.total = started.elapsed();
    out.failed = !done;
    out.cut_after_start = !done;
    out
}

/// A one-token, non-streamed request: its latency in ms, None when it failed.
pub async fn small_request(client: &reqwest::Client, base: &str) -> Option<f64> {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1});
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    r.bytes().await.ok()?;
    Some(started.elapsed().as_secs_f64() * 1e3)
}

/// The `p` quantile (0..=1) of `v`, NaN when empty.
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let idx = ((s.len() - 1) as f64 * p).round() as usize;
    s[idx]
}

/// The sum of every sample of metric `name` in inferlb's scrape (0 when it cannot be read).
pub async fn scrape_sum(client: &reqwest::Client, admin: u16, name: &str) -> f64 {
    let Ok(r) = client
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
    else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `POST /admin/replicas/<id>/<action>` (drain, undrain); errors are ignored.
pub async fn admin_post(client: &reqwest::Client, admin: u16, id: &str, action: &str) {
    let _ = client
        .post(format!(
            "http://127.0.0.1:{admin}/admin/replicas/{id}/{action}"
        ))
        .send()
        .await;
}

/// Polls inferlb's admin state (at most 10 s) until replica `id` satisfies `ready`.
pub async fn wait_replica(
    client: &reqwest::Client,
    admin: u16,
    id: &str,
    ready: impl Fn(&Value) -> bool,
) {
    for _ in 0..200 {
        let state: Value = match client
            .get(format!("http://127.0.0.1:{admin}/admin/replicas"))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Value::Null,
        };
        let replicas = state["replicas"].as_array().cloned().unwrap_or_default();
        if replicas.iter().any(|r| r["id"] == id && ready(r)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
