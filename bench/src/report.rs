//! What a run writes: the markdown tables (results.md), the raw numbers (results.json) and the
//! TTFT plot.

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::client::pct;
use crate::scenarios::agent_apis::{AgentApi, AgentApisResult};
use crate::scenarios::deploy::DeployResult;
use crate::scenarios::fork::ForkResult;
use crate::scenarios::overhead::OverheadResult;
use crate::scenarios::soak::SoakResult;
use crate::scenarios::trace::{TraceResult, TraceRow};
use crate::{Args, Sizes, TargetResult, Timings};

/// Everything a run measured.
pub struct Report<'a> {
    pub args: &'a Args,
    pub sizes: &'a Sizes,
    pub targets: &'a [TargetResult],
    pub overhead: Option<&'a OverheadResult>,
    pub overhead_tls: Option<&'a crate::scenarios::overhead_tls::TlsOverheadResult>,
    pub deploys: &'a [DeployResult],
    pub soak: Option<&'a SoakResult>,
    pub apis: Option<&'a AgentApisResult>,
    pub fork: Option<&'a ForkResult>,
    pub trace: Option<&'a TraceResult>,
    pub overload: Option<&'a crate::scenarios::overload::OverloadResult>,
    pub pd: Option<&'a crate::scenarios::pd::PdResult>,
    pub timings: &'a Timings,
}

impl Report<'_> {
    /// The command line, for the report's first line.
    fn command() -> String {
        let command = format!(
            "inferlb-bench {}",
            std::env::args().skip(1).collect::<Vec<_>>().join(" ")
        );
        command.trim().to_string()
    }

    /// results.md's text.
    pub fn markdown(&self) -> String {
        let mut md = table(self.targets, self.overhead, self.sizes, self.args);
        if let Some(t) = self.overhead_tls {
            md.push_str(&crate::scenarios::overhead_tls::table(t));
        }
        if let Some(x) = self.apis {
            md.push_str(&apis_table(x, self.args));
        }
        if let Some(f) = self.fork {
            md.push_str(&fork_table(f, self.args));
        }
        if let Some(t) = self.trace {
            md.push_str(&trace_tables(t));
        }
        if let Some(o) = self.overload {
            md.push_str(&crate::scenarios::overload::table(o));
        }
        if let Some(p) = self.pd {
            md.push_str(&crate::scenarios::pd::table(p));
        }
        md.push_str(&deploy_table(self.deploys, self.sizes));
        if let Some(k) = self.soak {
            md.push_str(&soak_line(k));
        }
        md.push_str(&timings_line(self.timings));
        format!("Command: `{}`\n\n{md}", Report::command())
    }

    /// Writes results.md, results.json and the plot into `out`; returns the markdown.
    pub fn write(&self, out: &Path) -> String {
        let report = self.markdown();
        std::fs::write(out.join("results.md"), &report).expect("write results.md");
        let raw = json!({"command": Report::command(), "sizes": self.sizes, "targets": self.targets, "agent_apis": self.apis, "fork": self.fork, "trace": self.trace, "overload": self.overload, "pd": self.pd, "overhead": self.overhead, "overhead_tls": self.overhead_tls, "deploy": self.deploys, "soak": self.soak, "timings_s": self.timings});
        std::fs::write(
            out.join("results.json"),
            serde_json::to_vec_pretty(&raw).unwrap_or_default(),
        )
        .expect("write results.json");
        if let Err(e) = plot(self.targets, out) {
            eprintln!("plot failed: {e}");
        }
        report
    }
}

fn table(results: &[TargetResult], lat: Option<&OverheadResult>, s: &Sizes, a: &Args) -> String {
    let mut md = String::new();
    if !results.is_empty() {
        md.push_str(&format!(
            "Simulated replicas: 2; context {} tokens; {} conversations x {} turns (+{} tokens a turn); burst {}; cache {} tokens a replica; speed x{}.\n\n",
            s.context_tokens, s.conversations, s.turns, s.turn_tokens, s.burst, s.cache_tokens, a.speed
        ));
        md.push_str(&targets_table(results));
    }
    md.push_str(
        &lat.map(crate::scenarios::overhead::table)
            .unwrap_or_default(),
    );
    md
}

fn targets_table(results: &[TargetResult]) -> String {
    let mut md = String::new();
    md.push_str("| target | warm-turn TTFT p50 (ms) | p90 (ms) | prefix-cache hit rate | burst makespan (s) | mixed: warm TTFT p50 (ms) | mixed: burst makespan (s) | failover: requests | errors before streaming | streams cut | failovers counted |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        md.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.1}% | {:.2} | {:.0} | {:.2} | {} | {} | {} | {} |\n",
            r.target,
            pct(&r.agent.warm_ttft_ms, 0.5),
            pct(&r.agent.warm_ttft_ms, 0.9),
            r.agent_hit_rate * 100.0,
            r.burst_makespan_s,
            pct(&r.mixed_agent.warm_ttft_ms, 0.5),
            r.mixed_burst_makespan_s,
            r.failover.requests,
            r.failover.errors_before_streaming,
            r.failover.streams_cut,
            r.failover.failovers,
        ));
    }
    let get = |t: &str| results.iter().find(|r| r.target == t);
    if let (Some(ad), Some(af), Some(rr)) = (get("adaptive"), get("affinity"), get("roundrobin")) {
        let (a50, f50, r50) = (
            pct(&ad.agent.warm_ttft_ms, 0.5),
            pct(&af.agent.warm_ttft_ms, 0.5),
            pct(&rr.agent.warm_ttft_ms, 0.5),
        );
        md.push_str(&format!(
            "\nRatios (same run): adaptive/affinity warm TTFT = {:.3} (target <= 1.05); adaptive/roundrobin warm TTFT = {:.3} (target < 0.5); adaptive/roundrobin burst makespan = {:.3} (target <= 1.03); adaptive/affinity burst makespan = {:.3}.\n",
            a50 / f50, a50 / r50, ad.burst_makespan_s / rr.burst_makespan_s, ad.burst_makespan_s / af.burst_makespan_s
        ));
    }
    let split = |m: &std::collections::BTreeMap<String, usize>| -> String {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let splits: Vec<String> = results
        .iter()
        .filter(|r| r.target != "direct")
        .map(|r| {
            format!(
                "{} {} (mixed: {})",
                r.target,
                split(&r.burst_split),
                split(&r.mixed_burst_split)
            )
        })
        .collect();
    if !splits.is_empty() {
        md.push_str(&format!(
            "Burst requests per replica, alone and mixed with the agent loops: {}.\n",
            splits.join("; ")
        ));
    }
    if let (Some(pc), Some(ad)) = (get("prefill_cost"), get("adaptive")) {
        md.push_str(&format!(
            "prefill_cost/adaptive (same run): warm TTFT p50 = {:.3}, hit rate {:.1}% vs {:.1}%, burst makespan = {:.3}, mixed warm TTFT p50 = {:.3}.\n",
            pct(&pc.agent.warm_ttft_ms, 0.5) / pct(&ad.agent.warm_ttft_ms, 0.5),
            pc.agent_hit_rate * 100.0,
            ad.agent_hit_rate * 100.0,
            pc.burst_makespan_s / ad.burst_makespan_s,
            pct(&pc.mixed_agent.warm_ttft_ms, 0.5) / pct(&ad.mixed_agent.warm_ttft_ms, 0.5),
        ));
    }
    md
}

fn apis_table(x: &AgentApisResult, a: &Args) -> String {
    let mut md = format!(
        "\nAgent APIs: the same agent loop ({} conversations x {} turns, {}-token contexts, +{} tokens a turn, jittered tool time) through each API; 2 replicas with {} tokens of cache each; speed x{}. TTFT: streamed, to the first content event. Cached share: cached prompt tokens over prompt tokens of the warm turns (every turn after the first), as each API's own usage reports them.\n\n",
        x.loops, x.turns, x.context_tokens, x.turn_tokens, x.cache_tokens, a.speed
    );
    md.push_str("| API | policy | warm turns | warm TTFT p50 (ms) | p90 (ms) | cached share | errors | routes |\n|---|---|---|---|---|---|---|---|\n");
    for r in &x.rows {
        let routes: Vec<String> = r.routes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.1}% | {} | {} |\n",
            r.api,
            r.policy,
            r.warm_turns,
            r.warm_ttft_p50_ms,
            r.warm_ttft_p90_ms,
            r.warm_cached_share * 100.0,
            r.errors,
            routes.join(", ")
        ));
    }
    let policies: Vec<&str> = {
        let mut p: Vec<&str> = vec![];
        for r in &x.rows {
            if !p.contains(&r.policy.as_str()) {
                p.push(&r.policy);
            }
        }
        p
    };
    for policy in policies {
        let Some(chat) = x.row(AgentApi::Chat, policy) else {
            continue;
        };
        let ratios: Vec<String> = AgentApi::ALL[1..]
            .iter()
            .filter_map(|api| {
                let r = x.row(*api, policy)?;
                Some(format!(
                    "{} {:.3}",
                    api.name(),
                    r.warm_cached_share / chat.warm_cached_share.max(1e-9)
                ))
            })
            .collect();
        let target = if policy == "adaptive" {
            " (target >= 0.95)"
        } else {
            ""
        };
        md.push_str(&format!(
            "\nCached share relative to chat under {policy}{target}: {}.",
            ratios.join("; ")
        ));
    }
    md.push('\n');
    md
}

fn fork_table(f: &ForkResult, a: &Args) -> String {
    let mut md = format!(
        "\nFork: one {}-token history (a system prompt and 10 turns) served once, then {} siblings, {} ms of model time apart, each the history and a different last message; 2 replicas with {} tokens of cache each; speed x{}. 'at home': served by the replica that served the history. Hit rate: cached over prompt tokens of the siblings, from the replicas' counters.\n\n",
        f.history_tokens, f.siblings, f.stagger_ms, f.cache_tokens, a.speed
    );
    md.push_str("| target | siblings | at home | TTFT p50 (ms) | p90 (ms) | hit rate | errors |\n|---|---|---|---|---|---|---|\n");
    for r in &f.rows {
        match &r.skipped {
            Some(why) => md.push_str(&format!(
                "| {} | skipped: {} | | | | | |\n",
                r.target,
                why.replace('|', "/")
            )),
            None => md.push_str(&format!(
                "| {} | {} | {} | {:.0} | {:.0} | {:.1}% | {} |\n",
                r.target,
                r.siblings,
                r.siblings_at_home,
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.hit_rate * 100.0,
                r.errors
            )),
        }
    }
    md
}

/// The rows of one cell of the replay matrix (shape, load, cache, scheduler), in order.
fn cells(t: &TraceResult) -> Vec<Vec<&TraceRow>> {
    let mut out: Vec<Vec<&TraceRow>> = vec![];
    for r in &t.rows {
        let same = |x: &TraceRow| {
            x.shape == r.shape
                && x.load_pct == r.load_pct
                && x.cache_tokens == r.cache_tokens
                && x.scheduler == r.scheduler
        };
        match out.iter_mut().find(|c| same(c[0])) {
            Some(c) => c.push(r),
            None => out.push(vec![r]),
        }
    }
    out
}

fn trace_tables(t: &TraceResult) -> String {
    let mut md = format!(
        "\nTrace replay: the first {} requests of `{}` ({:.0} s of trace, {} input tokens, mean {:.0} a request); each 512-token hash block a fixed text of 512 simulated tokens, distinct per block id; chat shape: one `user` message per block; completions shape: the whole prompt as one string; max_tokens = the trace's output_length{}. {} replicas at {} prefill tokens/s, speed x{}. Load: arrival times scaled so that the fleet's prefill with no cache hit would be busy that share of the time. Hit rate: cached over prompt tokens from the replicas' own counters, summed. Reference: the same replay against one replica caching the whole fleet's capacity, whose prefill never queues. TTFT in ms of the modelled engine (wall time x speed). Every duration is compressed alike: inferlb reads each replica's /metrics every 250 ms / speed, the peer routers evict their cache trees every 60 s (SGLang) or 120 s (vLLM) / speed; otherwise the peers run with their defaults and `--policy cache_aware`.\n",
        t.requests,
        t.trace,
        t.span_s,
        t.input_tokens,
        t.input_tokens as f64 / t.requests.max(1) as f64,
        if t.capped_requests > 0 {
            format!(
                " capped at {} ({} requests above it; with the full lengths the 2-core machine's CPU, relaying one event per token, rather than the replicas set the TTFT at this speed)",
                t.max_tokens_cap, t.capped_requests
            )
        } else {
            format!(" (none above the cap of {})", t.max_tokens_cap)
        },
        t.replicas,
        t.prefill_tokens_per_s,
        t.speed
    );
    for n in &t.notes {
        md.push_str(&format!("\n- {n}"));
    }
    md.push_str("\n\n| shape | load | cache a replica | scheduler | router | hit rate | reference | ratio | TTFT p50 (ms) | p90 (ms) | p99 (ms) | busiest replica | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &t.rows {
        let head = format!(
            "| {} | {:.0}% | {} | {} | {} |",
            r.shape, r.load_pct, r.cache_tokens, r.scheduler, r.policy
        );
        match &r.skipped {
            Some(why) => md.push_str(&format!(
                "{head} skipped: {} | | | | | | | |\n",
                why.replace('|', "/")
            )),
            None => md.push_str(&format!(
                "{head} {:.2}% | {:.2}% | {} | {:.0} | {:.0} | {:.0} | {:.0}% | {} |\n",
                r.hit_rate * 100.0,
                r.reference_hit_rate * 100.0,
                ratio(r.ratio_to_reference),
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.ttft_p99_ms,
                r.max_replica_share * 100.0,
                r.errors
            )),
        }
    }
    // prefill_cost against every other router, cell by cell.
    let mut lines = vec![];
    for cell in cells(t) {
        let Some(pc) = cell
            .iter()
            .find(|r| r.policy == "prefill_cost" && r.skipped.is_none())
        else {
            continue;
        };
        let others: Vec<String> = cell
            .iter()
            .filter(|r| r.policy != "prefill_cost" && r.skipped.is_none())
            .map(|r| {
                format!(
                    "{}: hit rate x{}, TTFT p50 x{:.2}, p90 x{:.2}",
                    r.policy,
                    ratio(if r.hit_rate > 0.0 {
                        pc.hit_rate / r.hit_rate
                    } else {
                        f64::NAN
                    }),
                    pc.ttft_p50_ms / r.ttft_p50_ms,
                    pc.ttft_p90_ms / r.ttft_p90_ms
                )
            })
            .collect();
        lines.push(format!(
            "- {} shape, load {:.0}%, cache {}, {}: {}",
            pc.shape,
            pc.load_pct,
            pc.cache_tokens,
            pc.scheduler,
            others.join("; ")
        ));
    }
    if !lines.is_empty() {
        md.push_str("\nprefill_cost relative to each router in the same cell (below 1 is better for TTFT, above 1 for the hit rate):\n\n");
        md.push_str(&lines.join("\n"));
        md.push('\n');
    }
    md
}

/// A ratio with two decimals, "-" when there is none.
fn ratio(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "-".into()
    }
}

fn timings_line(t: &Timings) -> String {
    let parts: Vec<String> =
        t.0.iter()
            .filter(|(_, s)| *s >= 0.05)
            .map(|(p, s)| format!("{p} {s:.0} s"))
            .collect();
    format!("\nRun time: {}.\n", parts.join(", "))
}

fn deploy_table(deploys: &[DeployResult], s: &Sizes) -> String {
    if deploys.is_empty() {
        return String::new();
    }
    let mut md = format!(
        "\nRolling deploy ({} agent loops on {}-token contexts; gpu0 then gpu1 drained, restarted with a slow start, undrained; 'after' is the second half of the period after the deploy):\n\n",
        s.conversations * 3,
        s.context_tokens / 4
    );
    md.push_str("| variant | phase | turns | gpu0 share | gpu1 share | warm TTFT p50 (ms) | p90 (ms) | errors |\n|---|---|---|---|---|---|---|---|\n");
    for d in deploys {
        for p in &d.phases {
            md.push_str(&format!(
                "| {} | {} | {} | {:.0}% | {:.0}% | {:.0} | {:.0} | {} |\n",
                d.variant,
                p.phase,
                p.turns,
                p.share[0] * 100.0,
                p.share[1] * 100.0,
                p.warm_ttft_p50_ms,
                p.warm_ttft_p90_ms,
                p.errors
            ));
        }
    }
    md
}

fn soak_line(k: &SoakResult) -> String {
    let mut md = format!(
        "\nSoak: {} concurrent connections for {:.0} s (half streams of 25 tokens, half small requests): {} requests, {} errors; inferlb RSS {} KiB after warm-up, {} KiB at the end (every tenth of the run: {:?}); file descriptors {} after warm-up, {} under load, {} once the clients left.\n",
        k.connections, k.seconds, k.requests, k.errors, k.rss_start_kib, k.rss_end_kib, k.rss_series_kib, k.fds_start, k.fds_under_load, k.fds_after
    );
    if !k.open_streams.is_empty() {
        md.push_str(&format!("\nStreams open at once (one connection each, a token a second; fresh inferlb and replicas for each count; descriptor limit {}):\n\n| streams | open | errors | seconds to open | inferlb RSS idle (KiB) | with the streams open (KiB) | per stream (KiB) | descriptors open | RSS after (KiB) | descriptors after |\n|---|---|---|---|---|---|---|---|---|---|\n", k.nofile_limit));
        for s in &k.open_streams {
            let per = (s.rss_open_kib as f64 - s.rss_idle_kib as f64) / s.streams.max(1) as f64;
            md.push_str(&format!(
                "| {} | {} | {} | {:.1} | {} | {} | {:.1} | {} | {} | {} |\n",
                s.streams,
                s.open,
                s.errors,
                s.open_seconds,
                s.rss_idle_kib,
                s.rss_open_kib,
                per,
                s.fds_open,
                s.rss_after_kib,
                s.fds_after
            ));
        }
    }
    md
}

/// TTFT distributions per target as an SVG (and a PNG when rsvg-convert is installed).
fn plot(results: &[TargetResult], out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let svg = out.join("ttft.svg");
    {
        let root = SVGBackend::new(&svg, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let max = results
            .iter()
            .flat_map(|r| r.agent.warm_ttft_ms.iter().copied())
            .fold(1.0f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Warm-turn time to first token, CDF per routing target",
                ("sans-serif", 22),
            )
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..max, 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms)")
            .y_desc("fraction of turns")
            .draw()?;
        let colors = [RED, BLUE, GREEN, BLACK, MAGENTA];
        for (i, r) in results.iter().enumerate() {
            let mut v = r.agent.warm_ttft_ms.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len().max(1) as f64;
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(k, x)| (*x, (k + 1) as f64 / n)),
                    color.stroke_width(2),
                ))?
                .label(r.target.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
    }
    let png = out.join("ttft.png");
    let converted = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(&svg)
        .status();
    if !converted.is_ok_and(|s| s.success()) {
        eprintln!("rsvg-convert not available: the plot is {}", svg.display());
    }
    Ok(())
}
