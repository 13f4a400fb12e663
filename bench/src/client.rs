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

/// The endpoint families a request can go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Responses,
    /// Anthropic Messages.
    Messages,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }
}

/// One streamed request of any API, as the client saw it.
#[derive(Debug, Default, Clone)]
pub struct ApiOutcome {
    /// Time to the first non-empty content event (chat `delta.content`, completions `text`,
    /// Responses `response.output_text.delta`, Anthropic `text_delta`).
    pub ttft: Option<Duration>,
    pub total: Duration,
    /// The generated text (only when asked for).
    pub reply: String,
    /// 0: no response at all.
    pub status: u16,
    /// No 200, or the stream did not end the way its API ends a complete answer.
    pub failed: bool,
    /// Prompt tokens and how many of them were cached, from the API's own usage: chat and
    /// completions `prompt_tokens` / `prompt_tokens_details.cached_tokens` (needs
    /// `stream_options.include_usage`), Responses `input_tokens` /
    /// `input_tokens_details.cached_tokens`, Anthropic `input_tokens` (uncached only) +
    /// `cache_read_input_tokens` (+ `cache_creation_input_tokens`).
    pub usage: Option<(u64, u64)>,
    /// The Responses API's response id.
    pub response_id: Option<String>,
    /// `x-inferlb-route`, when inferlb answered.
    pub route: Option<String>,
    /// `x-sim-replica`: the simulated replica that served it, whatever proxied it.
    pub replica: Option<String>,
}

/// Usage in chat / completions shape.
fn openai_usage(u: &Value) -> Option<(u64, u64)> {
    let prompt = u["prompt_tokens"].as_u64()?;
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Some((prompt, cached))
}

/// Usage in the Responses API's shape.
fn responses_usage(u: &Value) -> Option<(u64, u64)> {
    let prompt = u["input_tokens"].as_u64()?;
    let cached = u["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Some((prompt, cached))
}

/// Usage in Anthropic's shape: `input_tokens` counts only what was not read from the cache.
fn anthropic_usage(u: &Value) -> Option<(u64, u64)> {
    let uncached = u["input_tokens"].as_u64()?;
    let read = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
    let created = u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
    Some((uncached + read + created, read))
}

/// What one server-sent event carried.
struct Event<'a> {
    name: Option<&'a str>,
    data: Option<&'a str>,
}

fn event_of(text: &str) -> Event<'_> {
    let mut e = Event {
        name: None,
        data: None,
    };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            e.name = Some(v.trim());
        } else if let Some(v) = line.strip_prefix("data:") {
            e.data = Some(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    e
}

/// The state of one stream being read.
struct StreamRead {
    api: Api,
    keep_reply: bool,
    started: Instant,
    out: ApiOutcome,
    done: bool,
}

impl StreamRead {
    fn content(&mut self, text: &str) {
        if !text.is_empty() && self.out.ttft.is_none() {
            self.out.ttft = Some(self.started.elapsed());
        }
        if self.keep_reply {
            self.out.reply.push_str(text);
        }
    }

    /// Handles one event. Once the first token is in, events that can only carry more text
    /// are not parsed unless the reply is kept: a long replay stays cheap for the client.
    fn event(&mut self, e: Event<'_>) {
        let Some(data) = e.data else { return };
        let quiet = self.out.ttft.is_some() && !self.keep_reply;
        match self.api {
            Api::Chat | Api::Completions => {
                if data == "[DONE]" {
                    self.done = true;
                    return;
                }
                if quiet && !data.contains("\"usage\"") && !data.contains("\"error\"") {
                    return;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    return;
                };
                if v.get("error").is_some() {
                    self.out.failed = true;
                    return;
                }
                let text = if self.api == Api::Chat {
                    v["choices"][0]["delta"]["content"].as_str()
                } else {
                    v["choices"][0]["text"].as_str()
                };
                if let Some(t) = text {
                    self.content(t);
                }
                if v["usage"].is_object() {
                    self.out.usage = openai_usage(&v["usage"]).or(self.out.usage);
                }
            }
            Api::Responses => {
                let name = e.name.unwrap_or("");
                if name == "response.output_text.delta" && quiet {
                    return;
                }
                if !matches!(
                    name,
                    "response.output_text.delta"
                        | "response.created"
                        | "response.completed"
                        | "response.failed"
                        | "response.incomplete"
                        | "error"
                ) {
                    return;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    return;
                };
                match name {
                    "response.output_text.delta" => {
                        if let Some(t) = v["delta"].as_str() {
                            self.content(t);
                        }
                    }
                    "response.created" => {
                        self.out.response_id = v["response"]["id"].as_str().map(str::to_owned);
                    }
                    "response.completed" => {
                        self.out.usage = responses_usage(&v["response"]["usage"]);
                        if let Some(id) = v["response"]["id"].as_str() {
                            self.out.response_id = Some(id.to_owned());
                        }
                        self.done = true;
                    }
                    _ => self.out.failed = true,
                }
            }
            Api::Messages => {
                let name = e.name.unwrap_or("");
                match name {
                    "message_stop" => self.done = true,
                    "content_block_delta" if quiet => {}
                    "content_block_delta" | "message_start" | "error" => {
                        let Ok(v) = serde_json::from_str::<Value>(data) else {
                            return;
                        };
                        match name {
                            "content_block_delta" => {
                                if let Some(t) = v["delta"]["text"].as_str() {
                                    self.content(t);
                                }
                            }
                            "message_start" => {
                                self.out.usage = anthropic_usage(&v["message"]["usage"]);
                            }
                            _ => self.out.failed = true,
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Sends `body` (which must ask for a stream) to `api`'s endpoint on `base` and reads the
/// stream to its end. `keep_reply`: collect the generated text (else, after the first token,
/// only the end of the stream and the usage are looked for).
pub async fn stream_api(
    client: &reqwest::Client,
    base: &str,
    api: Api,
    body: &Value,
    keep_reply: bool,
) -> ApiOutcome {
    let started = Instant::now();
    let mut read = StreamRead {
        api,
        keep_reply,
        started,
        out: ApiOutcome {
            failed: true,
            ..ApiOutcome::default()
        },
        done: false,
    };
    let mut req = client.post(format!("{base}{}", api.path())).json(body);
    if api == Api::Messages {
        req = req.header("anthropic-version", "2023-06-01");
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(_) => {
            read.out.total = started.elapsed();
            return read.out;
        }
    };
    read.out.status = resp.status().as_u16();
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    read.out.route = header("x-inferlb-route");
    read.out.replica = header("x-sim-replica");
    if read.out.status != 200 {
        read.out.total = started.elapsed();
        return read.out;
    }
    read.out.failed = false;
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    // Where the search for the next event's end resumes.
    let mut scanned = 0;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        buf.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(pos) = buf[scanned.max(start)..]
            .windows(2)
            .position(|w| w == b"\n\n")
        {
            let end = scanned.max(start) + pos;
            if let Ok(text) = std::str::from_utf8(&buf[start..end]) {
                read.event(event_of(text));
            }
            start = end + 2;
            scanned = start;
        }
        buf.drain(..start);
        scanned = buf.len().saturating_sub(1);
    }
    read.out.total = started.elapsed();
    read.out.failed |= !read.done;
    read.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(api: Api, stream: &str) -> ApiOutcome {
        let mut r = StreamRead {
            api,
            keep_reply: true,
            started: Instant::now(),
            out: ApiOutcome::default(),
            done: false,
        };
        for e in stream.split("\n\n").filter(|e| !e.trim().is_empty()) {
            r.event(event_of(e));
        }
        r.out.failed |= !r.done;
        r.out
    }

    #[test]
    fn each_apis_stream_gives_first_token_reply_and_usage() {
        let chat = read(
            Api::Chat,
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"content\":\"hi \"}}]}\n\n\
             data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n\
             data: [DONE]\n\n",
        );
        assert!(!chat.failed && chat.ttft.is_some());
        assert_eq!((chat.reply.as_str(), chat.usage), ("hi ", Some((100, 64))));

        let completion = read(
            Api::Completions,
            "data: {\"choices\":[{\"text\":\"a \"}]}\n\ndata: [DONE]\n\n",
        );
        assert_eq!(
            (completion.failed, completion.reply.as_str()),
            (false, "a ")
        );

        let responses = read(
            Api::Responses,
            "event: response.created\ndata: {\"response\":{\"id\":\"resp_1\"}}\n\n\
             event: response.output_text.delta\ndata: {\"delta\":\"x\"}\n\n\
             event: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":50,\"input_tokens_details\":{\"cached_tokens\":32}}}}\n\n",
        );
        assert!(!responses.failed);
        assert_eq!(responses.response_id.as_deref(), Some("resp_1"));
        assert_eq!(responses.usage, Some((50, 32)));

        let messages = read(
            Api::Messages,
            "event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":18,\"cache_read_input_tokens\":32,\"cache_creation_input_tokens\":0}}}\n\n\
             event: content_block_delta\ndata: {\"delta\":{\"type\":\"text_delta\",\"text\":\"y\"}}\n\n\
             event: message_stop\ndata: {}\n\n",
        );
        assert!(!messages.failed);
        assert_eq!(messages.usage, Some((50, 32)), "uncached + cache read");
        assert_eq!(messages.reply, "y");
    }

    #[test]
    fn a_stream_without_its_end_or_with_an_error_failed() {
        assert!(
            read(
                Api::Chat,
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"
            )
            .failed
        );
        assert!(
            read(
                Api::Chat,
                "data: {\"error\":{\"message\":\"cut\"}}\n\ndata: [DONE]\n\n"
            )
            .failed
        );
        assert!(
            read(
                Api::Messages,
                "event: error\ndata: {\"error\":{}}\n\nevent: message_stop\ndata: {}\n\n"
            )
            .failed
        );
        assert!(read(Api::Responses, "event: response.failed\ndata: {}\n\n").failed);
    }
}
