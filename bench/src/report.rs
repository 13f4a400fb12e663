//! What a run writes: the markdown tables (results.md), the raw numbers (results.json) and the
//! TTFT plot.

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::client::pct;
use crate::scenarios::deploy::DeployResult;
use crate::scenarios::overhead::Latency;
use crate::scenarios::soak::SoakResult;
use crate::{Args, Sizes, TargetResult};

/// Everything a run measured.
pub struct Report<'a> {
    pub args: &'a Args,
    pub sizes: &'a Sizes,
    pub targets: &'a [TargetResult],
    pub overhead: &'a [Latency],
    pub deploys: &'a [DeployResult],
    pub soak: Option<&'a SoakResult>,
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
        md.push_str(&deploy_table(self.deploys, self.sizes));
        if let Some(k) = self.soak {
            md.push_str(&soak_line(k));
        }
        format!("Command: `{}`\n\n{md}", Report::command())
    }

    /// Writes results.md, results.json and the plot into `out`; returns the markdown.
    pub fn write(&self, out: &Path) -> String {
        let report = self.markdown();
        std::fs::write(out.join("results.md"), &report).expect("write results.md");
        let raw = json!({"command": Report::command(), "sizes": self.sizes, "targets": self.targets, "overhead": self.overhead, "deploy": self.deploys, "soak": self.soak});
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

fn table(results: &[TargetResult], lat: &[Latency], s: &Sizes, a: &Args) -> String {
    let mut md = String::new();
    if !results.is_empty() {
        md.push_str(&format!(
            "Simulated replicas: 2; context {} tokens; {} conversations x {} turns (+{} tokens a turn); burst {}; cache {} tokens a replica; speed x{}.\n\n",
            s.context_tokens, s.conversations, s.turns, s.turn_tokens, s.burst, s.cache_tokens, a.speed
        ));
        md.push_str(&targets_table(results));
    }
    md.push_str(&overhead_table(lat));
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
    md
}

fn overhead_table(lat: &[Latency]) -> String {
    let mut md = String::new();
    if !lat.is_empty() {
        md.push_str("\nProxy overhead (replicas answer at once; 200 req/s open loop, then 32 closed-loop clients; SSE at a 5 ms token interval):\n\n");
        md.push_str("| target | p50 at 200 rps (ms) | p99 at 200 rps (ms) | saturation (req/s) | p50 at saturation (ms) | p99 at saturation (ms) | errors | SSE gap p50 (ms) | SSE gap p99 (ms) |\n|---|---|---|---|---|---|---|---|---|\n");
        for l in lat {
            md.push_str(&format!(
                "| {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {:.2} |\n",
                l.target,
                l.fixed_p50_ms,
                l.fixed_p99_ms,
                l.saturation_rps,
                l.saturation_p50_ms,
                l.saturation_p99_ms,
                l.errors,
                l.sse_gap_p50_ms,
                l.sse_gap_p99_ms
            ));
        }
        if let (Some(d), Some(i)) = (
            lat.iter().find(|l| l.target == "direct"),
            lat.iter().find(|l| l.target == "inferlb"),
        ) {
            md.push_str(&format!(
                "\ninferlb adds {:.2} ms at p50 and {:.2} ms at p99 at 200 rps; saturation throughput inferlb/direct = {:.2}.\n",
                i.fixed_p50_ms - d.fixed_p50_ms, i.fixed_p99_ms - d.fixed_p99_ms, i.saturation_rps / d.saturation_rps
            ));
        }
    }
    md
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
    format!(
        "\nSoak: {} concurrent connections for {:.0} s (half streams of 25 tokens, half small requests): {} requests, {} errors; inferlb RSS {} KiB after warm-up, {} KiB at the end (every tenth of the run: {:?}); file descriptors {} after warm-up, {} under load, {} once the clients left.\n",
        k.connections, k.seconds, k.requests, k.errors, k.rss_start_kib, k.rss_end_kib, k.rss_series_kib, k.fds_start, k.fds_under_load, k.fds_after
    )
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
