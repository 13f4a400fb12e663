//! The same multi-turn agent loop through every agent API: chat completions, the Responses
//! API with the full input each turn (`store: false`), the Responses API chained with
//! `previous_response_id`, and Anthropic's Messages API. All render into the same prompt text
//! on the replica, so routing, cache hits and TTFT should come out alike; the cached share is
//! read from each API's own usage.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{filler, pct, stream_api, Api, ApiOutcome};
use crate::cluster::{Cluster, ClusterSpec, Front};
use crate::{Args, Sizes};

/// How a conversation reaches the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentApi {
    Chat,
    /// `/v1/responses`, the whole conversation as `input` every turn, `store: false`.
    ResponsesFull,
    /// `/v1/responses`, each turn only its new input and `previous_response_id`; the replicas
    /// keep the store (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`).
    ResponsesChained,
    /// The same, with inferlb keeping the store (`responses.store: balancer`) in front of
    /// replicas without one.
    ResponsesBalancerStore,
    /// Anthropic `/v1/messages`.
    Messages,
}

impl AgentApi {
    pub const ALL: [AgentApi; 5] = [
        AgentApi::Chat,
        AgentApi::ResponsesFull,
        AgentApi::ResponsesChained,
        AgentApi::ResponsesBalancerStore,
        AgentApi::Messages,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AgentApi::Chat => "chat",
            AgentApi::ResponsesFull => "responses (full input, store: false)",
            AgentApi::ResponsesChained => "responses (previous_response_id, replica store)",
            AgentApi::ResponsesBalancerStore => "responses (previous_response_id, balancer store)",
            AgentApi::Messages => "messages (Anthropic)",
        }
    }

    /// For file names.
    fn slug(self) -> &'static str {
        match self {
            AgentApi::Chat => "chat",
            AgentApi::ResponsesFull => "responses-full",
            AgentApi::ResponsesChained => "responses-chained",
            AgentApi::ResponsesBalancerStore => "responses-balancer-store",
            AgentApi::Messages => "messages",
        }
    }

    /// Each turn sends only its new input and the previous response's id.
    fn chained(self) -> bool {
        matches!(
            self,
            AgentApi::ResponsesChained | AgentApi::ResponsesBalancerStore
        )
    }

    /// What the front's conf and the replicas' flags add for this API.
    fn store_in_balancer(self) -> (&'static str, &'static [&'static str]) {
        match self {
            AgentApi::ResponsesBalancerStore => {
                ("  responses: {store: balancer}\n", &["--no-response-store"])
            }
            _ => ("", &[]),
        }
    }

    fn api(self) -> Api {
        match self {
            AgentApi::Chat => Api::Chat,
            AgentApi::ResponsesFull
            | AgentApi::ResponsesChained
            | AgentApi::ResponsesBalancerStore => Api::Responses,
            AgentApi::Messages => Api::Messages,
        }
    }
}

/// One API under one routing policy.
#[derive(Debug, Default, Clone, Serialize)]
pub struct AgentApiRow {
    pub api: String,
    pub policy: String,
    pub warm_turns: usize,
    pub warm_ttft_ms: Vec<f64>,
    pub warm_ttft_p50_ms: f64,
    pub warm_ttft_p90_ms: f64,
    /// Prompt tokens of the warm turns, and the cached part, as the API's usage reported them.
    pub warm_prompt_tokens: u64,
    pub warm_cached_tokens: u64,
    pub warm_cached_share: f64,
    /// Turns without a usage report (counted nowhere in the share).
    pub missing_usage: usize,
    pub errors: usize,
    /// `x-inferlb-route` of every turn.
    pub routes: BTreeMap<String, usize>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct AgentApisResult {
    pub loops: usize,
    pub turns: usize,
    pub context_tokens: usize,
    pub turn_tokens: usize,
    pub cache_tokens: usize,
    pub rows: Vec<AgentApiRow>,
}

impl AgentApisResult {
    pub fn row(&self, api: AgentApi, policy: &str) -> Option<&AgentApiRow> {
        self.rows
            .iter()
            .find(|r| r.api == api.name() && r.policy == policy)
    }
}

/// What one conversation's turns gave.
#[derive(Default)]
struct LoopTally {
    warm_ttft_ms: Vec<f64>,
    prompt: u64,
    cached: u64,
    missing_usage: usize,
    errors: usize,
    routes: BTreeMap<String, usize>,
}

/// The request body of one turn. `history` is the conversation so far as (role, text), the
/// new user message last.
fn body(
    api: AgentApi,
    context: &str,
    history: &[(&str, String)],
    previous: Option<&str>,
    reply_tokens: usize,
) -> Value {
    let items = |h: &[(&str, String)]| -> Vec<Value> {
        h.iter()
            .map(|(role, text)| json!({"role": role, "content": text}))
            .collect()
    };
    match api {
        AgentApi::Chat => {
            let mut messages = vec![json!({"role": "system", "content": context})];
            messages.extend(items(history));
            json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": reply_tokens, "stream_options": {"include_usage": true}})
        }
        AgentApi::ResponsesFull => {
            json!({"model": "sim-model", "instructions": context, "input": items(history), "store": false, "stream": true, "max_output_tokens": reply_tokens})
        }
        AgentApi::ResponsesChained | AgentApi::ResponsesBalancerStore => match previous {
            // Only the new input, and the instructions again: OpenAI does not carry them over
            // from the previous response (the Agents SDK sends them every turn).
            Some(id) => {
                json!({"model": "sim-model", "instructions": context, "previous_response_id": id, "input": items(&history[history.len() - 1..]), "stream": true, "max_output_tokens": reply_tokens})
            }
            None => {
                json!({"model": "sim-model", "instructions": context, "input": items(history), "stream": true, "max_output_tokens": reply_tokens})
            }
        },
        AgentApi::Messages => {
            json!({"model": "sim-model", "system": context, "messages": items(history), "stream": true, "max_tokens": reply_tokens})
        }
    }
}

/// `s.api_loops` conversations at once through `api`, each `s.api_turns` turns over its own
/// context, with jittered tool time between turns.
async fn loops(
    client: &reqwest::Client,
    base: &str,
    api: AgentApi,
    s: &Sizes,
    speed: f64,
) -> LoopTally {
    let tasks: Vec<_> = (0..s.api_loops)
        .map(|c| {
            let (client, base, s) = (client.clone(), base.to_string(), s.clone());
            tokio::spawn(async move {
                let mut t = LoopTally::default();
                // The same text whatever the API, so the rows compare like with like.
                let context = filler(
                    &format!("api conversation {c} context"),
                    s.api_context_tokens,
                );
                let mut history: Vec<(&str, String)> = vec![];
                let mut previous: Option<String> = None;
                for turn in 0..s.api_turns {
                    let think = (c as u64 * 7919 + turn as u64 * 104_729) % 1000;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1000.0 / speed))
                        .await;
                    history.push((
                        "user",
                        filler(&format!("c{c} tool output {turn}"), s.api_turn_tokens),
                    ));
                    let b = body(api, &context, &history, previous.as_deref(), s.reply_tokens);
                    let keep = !api.chained();
                    let o: ApiOutcome = stream_api(&client, &base, api.api(), &b, keep).await;
                    *t.routes
                        .entry(o.route.clone().unwrap_or_else(|| "-".into()))
                        .or_insert(0) += 1;
                    if o.failed {
                        t.errors += 1;
                        history.pop();
                        continue;
                    }
                    if turn > 0 {
                        let ms = o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3;
                        t.warm_ttft_ms.push(ms);
                        match o.usage {
                            Some((prompt, cached)) => {
                                t.prompt += prompt;
                                t.cached += cached;
                            }
                            None => t.missing_usage += 1,
                        }
                    }
                    if api.chained() {
                        previous = o.response_id.clone();
                        // The store holds the history; the client keeps only what it sends.
                        history.push(("assistant", String::new()));
                    } else {
                        history.push(("assistant", o.reply));
                    }
                }
                t
            })
        })
        .collect();
    let mut all = LoopTally::default();
    for task in tasks {
        if let Ok(t) = task.await {
            all.warm_ttft_ms.extend(t.warm_ttft_ms);
            all.prompt += t.prompt;
            all.cached += t.cached;
            all.missing_usage += t.missing_usage;
            all.errors += t.errors;
            for (k, v) in t.routes {
                *all.routes.entry(k).or_insert(0) += v;
            }
        } else {
            all.errors += 1;
        }
    }
    all
}

/// Every API under every policy, each on a fresh pair of replicas.
pub async fn agent_apis(
    client: &reqwest::Client,
    a: &Args,
    s: &Sizes,
    policies: &[&str],
) -> AgentApisResult {
    let mut result = AgentApisResult {
        loops: s.api_loops,
        turns: s.api_turns,
        context_tokens: s.api_context_tokens,
        turn_tokens: s.api_turn_tokens,
        cache_tokens: s.api_cache_tokens,
        rows: vec![],
    };
    for api in AgentApi::ALL {
        for policy in policies {
            eprintln!("[agent apis] {} via {policy}", api.name());
            let (lb_extra, sim_flags) = api.store_in_balancer();
            let c = Cluster::start(&ClusterSpec {
                lb_extra,
                sim_flags,
                log: Some(
                    a.out
                        .join("logs")
                        .join(format!("apis-{policy}-{}.log", api.slug())),
                ),
                ..ClusterSpec::pair(Front::Inferlb(policy), a.speed, s.api_cache_tokens)
            });
            let t = loops(client, &c.target(), api, s, a.speed).await;
            drop(c);
            result.rows.push(AgentApiRow {
                api: api.name().into(),
                policy: policy.to_string(),
                warm_turns: t.warm_ttft_ms.len(),
                warm_ttft_p50_ms: pct(&t.warm_ttft_ms, 0.5),
                warm_ttft_p90_ms: pct(&t.warm_ttft_ms, 0.9),
                warm_ttft_ms: t.warm_ttft_ms,
                warm_prompt_tokens: t.prompt,
                warm_cached_tokens: t.cached,
                warm_cached_share: t.cached as f64 / t.prompt.max(1) as f64,
                missing_usage: t.missing_usage,
                errors: t.errors,
                routes: t.routes,
            });
        }
    }
    result
}
