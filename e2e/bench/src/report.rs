//! Writes `BENCHMARKS.md`: machine, targets met or not, the tables of parts 1–4 and 4b, the included fragments
//! of parts 5–7, the profile's hot spots, the exact peer configs and how to reproduce one row.

use std::fmt::Write as _;

use poolpilot_bench::machine::{loadavg, utc_now};

use crate::parts::{
    ATTEMPTS, Bench, Cell, ContentionRun, DISTURBED, IdleRun, Plan, Profile, Row, Sample, SseRun,
    cell, rows,
};
use crate::peers::{self, Target};
use crate::procs::first_line;
use crate::stats::{median, ms, ms_signed, num, pct, ratio};
use crate::tls_upstream::{TLS_REQUESTS_PER_CONNECTION, TlsRun};

/// What the run saw of the machine.
#[derive(Clone, Debug, Default)]
pub struct Machine {
    /// `date -u` at the start.
    pub started: String,
    /// `/proc/loadavg` at the start and the end.
    pub load_start: String,
    /// At the end.
    pub load_end: String,
    /// Wall time of parts 1–4, seconds.
    pub wall_secs: f64,
}

impl Machine {
    /// Reads the start time and load.
    pub fn at_start() -> Self {
        Self {
            started: utc_now(),
            load_start: loadavg(),
            ..Self::default()
        }
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn mem_total() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0))
        .unwrap_or_else(|| "unknown".into())
}

/// Everything the report is made of.
#[derive(Debug)]
pub struct Results<'a> {
    /// The run.
    pub bench: &'a Bench,
    /// Machine facts.
    pub machine: Machine,
    /// Part 1.
    pub samples: Vec<Sample>,
    /// Part 2.
    pub contention: Vec<ContentionRun>,
    /// Part 3.
    pub sse: Vec<SseRun>,
    /// Part 4.
    pub idle: Vec<IdleRun>,
    /// Part 4b.
    pub tls: Vec<TlsRun>,
    /// The profile.
    pub profile: Profile,
    /// The profile's file name, beside the report.
    pub profile_file: String,
    /// Hand-written analysis to include verbatim.
    pub analysis: Option<String>,
    /// Fragments of other harnesses (parts 5–7), included verbatim after part 4.
    pub includes: Vec<String>,
    /// Part 1's ratios drawn as SVG, relative to the report (when part 1 ran).
    pub part1_plot: Option<String>,
    /// Part 1 against the report this run replaces.
    pub regression: crate::regression::Outcome,
}

const PROXIES: [Target; 3] = [Target::Poolpilot, Target::Haproxy, Target::Nginx];
const ALL: [Target; 4] = [
    Target::Direct,
    Target::Poolpilot,
    Target::Haproxy,
    Target::Nginx,
];

fn mib(kib: f64) -> String {
    num(kib / 1024.0, 1)
}

/// Renders the whole document.
pub fn render(r: &Results<'_>) -> String {
    let b = r.bench;
    let plan = &b.plan;
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(
        w,
        "# Benchmarks: poolpilot-gateway beside HAProxy and nginx\n"
    );
    let _ = writeln!(
        w,
        "Written by `make bench` ({}) on {}: every number below comes from that run of the \
         committed harness (`e2e/bench`, binary `poolpilot-bench`); do not edit by hand. {}\n",
        if plan.quick {
            "**quick mode** (`BENCH_QUICK=1`: short runs to validate the harness, not for \
             conclusions)"
        } else {
            "full mode"
        },
        r.machine.started,
        if r.includes.is_empty() {
            "Parts 5–7 (control loop and operator scale, on the embedded cluster) are \
             not measured in this run."
        } else {
            "Parts 5–7 (control loop and operator scale, on the embedded cluster) come \
             from `poolpilot-loop-bench` and `poolpilot-fleet-bench`, included below as they \
             last wrote them (`make bench` runs them first; each part says when it was \
             measured)."
        }
    );

    // Machine.
    let _ = writeln!(w, "## Machine\n");
    let _ = writeln!(w, "| what | value |\n|---|---|");
    let _ = writeln!(w, "| CPU | {} × {} |", num_cpus(), cpu_model());
    let _ = writeln!(w, "| memory | {} |", mem_total());
    let _ = writeln!(
        w,
        "| OS | Debian {}, Linux {} |",
        first_line("cat", &["/etc/debian_version"]),
        first_line("uname", &["-r"])
    );
    let _ = writeln!(
        w,
        "| load average (1/5/15 min) | start {} · end {} (other builds shared the machine when it was high) |",
        r.machine.load_start, r.machine.load_end
    );
    let _ = writeln!(
        w,
        "| wall time of parts 1–4, 4b and the profile | {:.0} s |",
        r.machine.wall_secs
    );
    let _ = writeln!(w, "| rustc | {} |", first_line("rustc", &["--version"]));
    let _ = writeln!(w, "| HAProxy | {} |", first_line("haproxy", &["-v"]));
    let _ = writeln!(w, "| nginx | {} |", first_line("nginx", &["-v"]));
    let _ = writeln!(w, "| wrk | {} |", first_line("wrk", &["-v"]));
    let _ = writeln!(
        w,
        "| pinning | proxy on CPU {}; upstream, load generator and driver on CPU {} (`taskset`); \
         the 2-worker rows' proxy on CPUs {} beside them |",
        b.env.proxy_cpu, b.load_cpu, b.env.all_cpus
    );
    let _ = writeln!(
        w,
        "| workers | 1 for every proxy: gateway `POOLPILOT_WORKER_THREADS=1` (tokio's \
         single-threaded scheduler), HAProxy `nbthread 1`, nginx one process; 2 in the \
         2-worker rows (gateway 2 threads, HAProxy `nbthread 2`, nginx a master and 2 workers) |"
    );
    let _ = writeln!(
        w,
        "| limits of the machine | {} |\n",
        if num_cpus() <= 2 {
            "2 cores: a 2-worker proxy shares both with the upstream and the load generator, so \
             those rows show how each proxy copes with contended cores, not what two free cores \
             give; no CPU is kept for the proxy alone there"
        } else {
            "the 2-worker rows' proxy shares its cores with the upstream and the load generator"
        }
    );

    render_targets(w, &r.samples, &r.idle);
    crate::regression::render(w, &r.regression);
    render_part1(w, r);
    render_part2(w, r);
    render_part3(w, r);
    render_part4(w, r);
    render_part4b(w, r);
    for fragment in &r.includes {
        let _ = writeln!(w, "{}\n", fragment.trim_end());
    }
    render_profile(w, r);
    if let Some(analysis) = &r.analysis {
        let _ = writeln!(w, "{}\n", analysis.trim_end());
    }
    render_configs(w, r);
    md
}

/// Processors of the machine (not of this process, which is pinned to one).
fn num_cpus() -> usize {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count()
}

fn idle_median(idle: &[IdleRun], t: Target, pooled: bool) -> f64 {
    median(
        &idle
            .iter()
            .filter(|i| i.target == t && i.pooled == pooled)
            .map(IdleRun::bytes_per_conn)
            .collect::<Vec<_>>(),
    )
}

/// The targets table, judged on part 1's one-worker closed-loop rows and part 4; a target whose
/// figures are missing is "not measured", never met.
fn render_targets(w: &mut String, samples: &[Sample], idle_runs: &[IdleRun]) {
    let _ = writeln!(w, "## Targets\n");
    let _ = writeln!(w, "| target | met? | detail |\n|---|---|---|");
    let mut thr_fail = Vec::new();
    let mut p99_fail = Vec::new();
    let mut cpu_fail = Vec::new();
    // Rows without every figure: nothing is judged on them (a comparison with a missing figure
    // would pass without having measured anything).
    let mut unmeasured = Vec::new();
    let mut judged = 0;
    for row in rows(samples)
        .into_iter()
        .filter(|row| row.is_judged_closed_loop())
    {
        let d = cell(samples, row, Target::Direct);
        let p = cell(samples, row, Target::Poolpilot);
        let h = cell(samples, row, Target::Haproxy);
        let n = cell(samples, row, Target::Nginx);
        let figures = [d.p99, p.rps, p.p99, p.cpu, h.rps, h.p99, h.cpu, n.rps];
        if figures.iter().any(|f| !f.is_finite()) {
            unmeasured.push(row.label());
            continue;
        }
        judged += 1;
        if p.cpu > h.cpu {
            cpu_fail.push(format!(
                "{}: {} µs vs {} µs",
                row.label(),
                num(p.cpu * 100.0, 1),
                num(h.cpu * 100.0, 1)
            ));
        }
        if p.rps < h.rps || p.rps < n.rps {
            thr_fail.push(format!(
                "{}: {} × HAProxy, {} × nginx",
                row.label(),
                ratio(p.rps, h.rps),
                ratio(p.rps, n.rps)
            ));
        }
        if p.p99 - d.p99 > h.p99 - d.p99 {
            p99_fail.push(format!(
                "{}: {} ms vs {} ms",
                row.label(),
                ms_signed(p.p99 - d.p99),
                ms_signed(h.p99 - d.p99)
            ));
        }
    }
    let verdict = |fails: &Vec<String>| {
        if judged == 0 || !unmeasured.is_empty() {
            let missing = if judged == 0 {
                "part 1 was not run".to_string()
            } else {
                format!("no figures for {}", unmeasured.join(", "))
            };
            ("**not measured**".to_string(), missing)
        } else if fails.is_empty() {
            ("yes".to_string(), "every row".to_string())
        } else {
            ("**no**".to_string(), fails.join("; "))
        }
    };
    let (m, d) = verdict(&thr_fail);
    let _ = writeln!(
        w,
        "| throughput ≥ 1.0× HAProxy and ≥ 1.0× nginx at every concurrency (one worker) | {m} | {d} |"
    );
    let (m, d) = verdict(&p99_fail);
    let _ = writeln!(
        w,
        "| added p99 latency ≤ HAProxy's at every closed-loop row (one worker) | {m} | {d} |"
    );
    let (m, d) = verdict(&cpu_fail);
    let _ = writeln!(
        w,
        "| CPU per request ≤ HAProxy's at every closed-loop row (one worker) | {m} | {d} |"
    );
    let mut idle_met = true;
    let mut idle_measured = true;
    let idle = [true, false].map(|pooled| {
        let [p, h, n] = PROXIES.map(|t| idle_median(idle_runs, t, pooled));
        idle_measured &= p.is_finite() && n.is_finite();
        idle_met &= p <= n;
        format!(
            "{}: poolpilot {} B, HAProxy {} B, nginx {} B",
            if pooled {
                "upstream connections pooled"
            } else {
                "none pooled"
            },
            num(p, 0),
            num(h, 0),
            num(n, 0)
        )
    });
    let _ = writeln!(
        w,
        "| RSS per idle client connection ≤ nginx's | {} | {} |\n",
        match (idle_measured, idle_met) {
            (false, _) => "**not measured**",
            (true, true) => "yes",
            (true, false) => "**no**",
        },
        idle.join("; ")
    );
}

/// A part of the report: its `## ` heading, the paragraph that says how it was measured, and
/// its table's header and alignment rows.
fn part_head(w: &mut String, title: &str, description: &str, header: &str, align: &str) {
    let _ = writeln!(w, "## {title}\n");
    let _ = writeln!(w, "{description}");
    table_head(w, header, align);
}

/// A Markdown table's header row and its alignment row.
fn table_head(w: &mut String, header: &str, align: &str) {
    let _ = writeln!(w, "{header}\n{align}");
}

fn render_part1(w: &mut String, r: &Results<'_>) {
    let Plan {
        rate,
        rate_conns,
        warmup_secs,
        secs,
        rounds,
        spread_rounds,
        spread_concurrency,
        ..
    } = &r.bench.plan;
    let spread_rows = spread_concurrency
        .iter()
        .map(|c| Row::Concurrency(*c).label())
        .collect::<Vec<_>>()
        .join(" and ");
    part_head(
        w,
        "1. Proxy overhead and throughput",
        &format!(
            "One upstream (`poolpilot-bench upstream`: hyper HTTP/1.1 on one thread, 64-byte JSON \
             body, no service time), `GET /v1/fast`. Connection cap 256 for every proxy (no row \
             queues). Closed loop rows: `wrk -t1 -cN`; the fixed-rate row: {rate} req/s open loop over {rate_conns} \
             keep-alive connections from the driver's own generator (`load::fixed_rate`: latency \
             counted from a request's due time whenever its connection was still busy then, so \
             stalls are not hidden by coordinated omission). Each run: a fresh \
             proxy, {warmup_secs} s warm-up, {secs} s measured; {rounds} round(s), {spread_rounds} for \
             {spread_rows} (their spread below), proxies in alternating order (reversed every \
             round); medians over rounds. A run in which other tasks or the hypervisor (steal) took \
             more than {disturbed}% of the proxy's CPU (`/proc/stat` less the proxy's own time) is \
             measured again, up to {ATTEMPTS} times, keeping the least disturbed. Every proxy adds \
             `X-Forwarded-For` and `Via` towards the upstream and `Via` to the response, checked \
             at its start. *Added* = the proxy's percentile minus direct-to-upstream's in the same \
             row. CPU = the proxy's user + system time (`/proc/<pid>/stat`, every process of the \
             proxy) over the measured run, per 10,000 completed requests (split below). Peak RSS \
             = `VmHWM` at the end of the run (summed over nginx's processes with 2 workers). \
             Latencies in ms. Direct-to-upstream runs on one core (load generator and upstream \
             share CPU 1), so at `c=1` it has no cross-core wake-up at all; every proxy adds two \
             (to CPU 0 and back), which is most of their `c=1` cost.\n",
            disturbed = DISTURBED * 100.0,
        ),
        "| load | target | req/s | p50 | p99 | p99.9 | added p50 | added p99 | CPU s / 10k req | peak RSS MiB | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    );
    for row in rows(&r.samples) {
        let d = cell(&r.samples, row, Target::Direct);
        for t in ALL {
            let c = cell(&r.samples, row, t);
            let (a50, a99) = if t == Target::Direct {
                ("–".to_string(), "–".to_string())
            } else {
                (ms_signed(c.p50 - d.p50), ms_signed(c.p99 - d.p99))
            };
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                row.label(),
                t.name(),
                num(c.rps, 0),
                ms(c.p50),
                ms(c.p99),
                ms(c.p999),
                a50,
                a99,
                num(c.cpu, 3),
                mib(c.rss_kib),
                c.errors
            );
        }
    }
    let _ = writeln!(
        w,
        "\nRatios per row (poolpilot ÷ peer; req/s above 1 is better, latency and CPU below 1 \
         are better):\n"
    );
    table_head(
        w,
        "| load | req/s ÷ HAProxy | req/s ÷ nginx | p99 ÷ HAProxy | p99 ÷ nginx | CPU ÷ HAProxy | CPU ÷ nginx |",
        "|---|---:|---:|---:|---:|---:|---:|",
    );
    for row in rows(&r.samples) {
        let p = cell(&r.samples, row, Target::Poolpilot);
        let h = cell(&r.samples, row, Target::Haproxy);
        let n = cell(&r.samples, row, Target::Nginx);
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.label(),
            ratio(p.rps, h.rps),
            ratio(p.rps, n.rps),
            ratio(p.p99, h.p99),
            ratio(p.p99, n.p99),
            ratio(p.cpu, h.cpu),
            ratio(p.cpu, n.cpu)
        );
    }
    let _ = writeln!(w);
    if let Some(plot) = &r.part1_plot {
        let _ = writeln!(w, "{}\n", part1_plot_line(plot));
    }
    render_part1_cpu(w, r);
    render_part1_spread(w, r);
}

/// Part 1's CPU per request in user mode and in the kernel, the interrupts, and how disturbed
/// the runs were.
fn render_part1_cpu(w: &mut String, r: &Results<'_>) {
    let _ = writeln!(
        w,
        "CPU per request, split (medians over rounds): user and system µs of the proxy's \
         processes; interrupts (device and inter-processor, `/proc/interrupts`) delivered to the \
         proxy's CPUs per request; *others* = the largest share of the proxy's CPU that other \
         tasks or the hypervisor took in a kept run (not known with 2 workers, which share every \
         CPU); *redone* = runs measured again for that.\n"
    );
    table_head(
        w,
        "| load | target | user µs / req | system µs / req | interrupts / req | others, max | redone |",
        "|---|---|---:|---:|---:|---:|---:|",
    );
    for row in rows(&r.samples) {
        for t in ALL {
            let c = cell(&r.samples, row, t);
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} | {} | {} | {} |",
                row.label(),
                t.name(),
                num(c.user_us, 2),
                num(c.system_us, 2),
                num(c.interrupts_per_req, 3),
                if c.others_max.is_nan() {
                    "–".to_string()
                } else {
                    format!("{}%", num(c.others_max * 100.0, 1))
                },
                c.redone
            );
        }
    }
    let _ = writeln!(w);
}

/// The spread of the rows run more often: lowest, median and highest over the rounds.
fn render_part1_spread(w: &mut String, r: &Results<'_>) {
    let spread: Vec<Row> = rows(&r.samples)
        .into_iter()
        .filter(|&row| cell(&r.samples, row, Target::Poolpilot).runs > r.bench.plan.rounds)
        .collect();
    if spread.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "Spread over the rounds of the rows run more often (lowest · median · highest; p99 in ms):\n"
    );
    table_head(
        w,
        "| load | target | rounds | req/s | p99 |",
        "|---|---|---:|---|---|",
    );
    for row in spread {
        for t in ALL {
            let c = cell(&r.samples, row, t);
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} · {} · {} | {} · {} · {} |",
                row.label(),
                t.name(),
                c.runs,
                num(c.rps_range.0, 0),
                num(c.rps, 0),
                num(c.rps_range.1, 0),
                ms(c.p99_range.0),
                ms(c.p99),
                ms(c.p99_range.1),
            );
        }
    }
    let _ = writeln!(w);
}

/// Part 1's samples as a report wrote them (one median per row and target), so that its picture
/// can be drawn again from the committed report: `poolpilot-bench plot`.
pub fn samples_from_report(markdown: &str) -> anyhow::Result<Vec<Sample>> {
    let start = markdown
        .find("## 1. ")
        .ok_or_else(|| anyhow::anyhow!("no part 1 in the report"))?;
    let part = &markdown[start..];
    let part = &part[..part[3..].find("\n## ").map_or(part.len(), |end| end + 3)];
    let mut samples = Vec::new();
    for line in part.lines() {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() != 11 || cells[0] == "load" || cells[0].starts_with("---") {
            continue;
        }
        let row = Row::parse(cells[0])?;
        let target = [
            Target::Direct,
            Target::Poolpilot,
            Target::Haproxy,
            Target::Nginx,
        ]
        .into_iter()
        .find(|t| t.name() == cells[1])
        .ok_or_else(|| anyhow::anyhow!("unknown target {:?}", cells[1]))?;
        let number = |i: usize| -> f64 { cells[i].parse().unwrap_or(f64::NAN) };
        let load = crate::load::LoadResult {
            requests: 0,
            errors: cells[10].parse().unwrap_or(0),
            rps: number(2),
            p50_us: number(3) * 1000.0,
            p99_us: number(4) * 1000.0,
            p999_us: number(5) * 1000.0,
        };
        samples.push(Sample::from_table(
            row,
            target,
            load,
            number(8),
            number(9) * 1024.0,
        ));
    }
    anyhow::ensure!(!samples.is_empty(), "part 1 has no rows");
    Ok(samples)
}

/// The committed report's part 1, or why there is none to compare with.
pub fn committed_part1(committed: Option<&str>) -> Result<Vec<Sample>, String> {
    let markdown = committed.ok_or("there is no committed report to compare with")?;
    if markdown.contains("**quick mode**") {
        return Err("the committed report is from a quick run".into());
    }
    samples_from_report(markdown)
        .map_err(|e| format!("the committed report's part 1 cannot be read ({e})"))
}

/// The line that shows part 1's picture, after its ratio table.
pub fn part1_plot_line(plot: &str) -> String {
    format!("![poolpilot ÷ HAProxy and ÷ nginx per load: req/s, p99, CPU]({plot})")
}

/// One figure of a [`Cell`].
type CellValue = fn(&Cell) -> f64;

/// Draws part 1's ratios (poolpilot ÷ each peer: req/s, p99, CPU per 10k requests) per load as
/// grouped bars at `path`, with the line of parity at 1. `false` when part 1 did not run.
pub fn plot_part1(samples: &[Sample], path: &std::path::Path) -> anyhow::Result<bool> {
    let rows = rows(samples);
    if rows.is_empty() {
        return Ok(false);
    }
    let mut groups: Vec<(String, Vec<f64>)> = Vec::new();
    let metrics: [(&str, CellValue); 3] =
        [("req/s", |c| c.rps), ("p99", |c| c.p99), ("CPU", |c| c.cpu)];
    for (what, pick) in metrics {
        for peer in [Target::Haproxy, Target::Nginx] {
            let values = rows
                .iter()
                .map(|row| {
                    let p = pick(&cell(samples, *row, Target::Poolpilot));
                    let q = pick(&cell(samples, *row, peer));
                    if q > 0.0 { p / q } else { f64::NAN }
                })
                .collect();
            groups.push((format!("{what} ÷ {}", peer.name()), values));
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    poolpilot_plot::grouped_bars(
        path,
        &poolpilot_plot::BarChart {
            title:
                "poolpilot-gateway ÷ peer (req/s: above 1 is better; p99, CPU: below 1 is better)"
                    .into(),
            category_label: "load".into(),
            value_label: "ratio".into(),
            categories: rows.iter().map(|r| r.label()).collect(),
            groups,
            reference: Some(1.0),
        },
    )?;
    Ok(true)
}

fn render_part2(w: &mut String, r: &Results<'_>) {
    let Plan {
        contention_secs,
        contention_rounds,
        ..
    } = &r.bench.plan;
    part_head(
        w,
        "2. Pool under contention",
        &format!(
            "Upstream service time 50 ms (`GET /v1/slow?ms=50`), connection cap 32 (poolpilot \
             `maxConnectionsPerEndpoint: 32`, `leaseTimeout: 5s`; HAProxy `server ... maxconn 32`, \
             `timeout queue 5s`), offered concurrency 128: 4 clients × 32 keep-alive connections, \
             closed loop, {contention_secs} s per run, {contention_rounds} round(s), medians. The ceiling is 32 / 50 ms = \
             640 completed/s. *Queue wait* = from the client sending a request to the upstream \
             receiving it (both read `CLOCK_MONOTONIC`; the upstream returns its time in \
             `x-recv-us`). *Share deviation* = the largest |client share − 1/4| ÷ 1/4. nginx is \
             left out: open-source nginx has no upstream queue (a request over `max_conns` gets \
             502 at once).\n",
        ),
        "| proxy | completed/s | queue wait p50 ms | queue wait p99 ms | latency p99 ms | error rate | share deviation | per-client completions (last round) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    );
    for t in [Target::Poolpilot, Target::Haproxy] {
        let runs: Vec<&ContentionRun> = r.contention.iter().filter(|c| c.target == t).collect();
        let m = |f: &dyn Fn(&ContentionRun) -> f64| {
            median(&runs.iter().map(|c| f(c)).collect::<Vec<_>>())
        };
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {}% | {}% | {:?} |",
            t.name(),
            num(m(&|c| c.completed_per_s), 1),
            ms(m(&|c| c.queue_p50_us)),
            ms(m(&|c| c.queue_p99_us)),
            ms(m(&|c| c.latency_p99_us)),
            num(m(&|c| c.error_rate * 100.0), 3),
            num(m(&|c| c.share_deviation_pct), 1),
            runs.last()
                .map(|c| c.per_client.clone())
                .unwrap_or_default()
        );
    }
    let _ = writeln!(w);
}

fn render_part3(w: &mut String, r: &Results<'_>) {
    let Plan {
        sse_streams,
        sse_events,
        sse_every_ms,
        sse_rounds,
        ..
    } = &r.bench.plan;
    part_head(
        w,
        "3. Streaming (SSE)",
        &format!(
            "{sse_streams} concurrent streams of {sse_events} events, one every {sse_every_ms} ms \
             (`GET /v1/sse?n={sse_events}&ms={sse_every_ms}`), connection cap 64, {sse_rounds} round(s), medians. \
             *Transit* = when the client read an event minus when the upstream wrote it (the event \
             carries its `CLOCK_MONOTONIC` write time), over every event of every stream; *added* = \
             minus direct's. TTFB = from sending the request to the first complete event. As one \
             configures them for SSE, nginx has `proxy_buffering off` for `/v1/sse` and HAProxy \
             routes it to a backend with `option http-no-delay` (without it HAProxy sends with \
             `MSG_MORE` and events wait in the kernel for tens of milliseconds). \
             Latencies in ms.\n",
        ),
        "| target | TTFB p50 | TTFB max | added TTFB p50 | transit p50 | transit p99 | transit p99.9 | added transit p50 | added transit p99 | complete streams |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    );
    let med = |t: Target, f: &dyn Fn(&SseRun) -> f64| {
        median(
            &r.sse
                .iter()
                .filter(|s| s.target == t)
                .map(f)
                .collect::<Vec<_>>(),
        )
    };
    let d_ttfb = med(Target::Direct, &|s| s.ttfb_p50_us);
    let d50 = med(Target::Direct, &|s| s.transit_p50_us);
    let d99 = med(Target::Direct, &|s| s.transit_p99_us);
    for t in ALL {
        let ttfb = med(t, &|s| s.ttfb_p50_us);
        let t50 = med(t, &|s| s.transit_p50_us);
        let t99 = med(t, &|s| s.transit_p99_us);
        let (complete, started) = r
            .sse
            .iter()
            .filter(|s| s.target == t)
            .fold((0, 0), |(c, n), s| (c + s.complete, n + s.streams));
        let added = |x: f64, base: f64| {
            if t == Target::Direct {
                "–".to_string()
            } else {
                ms_signed(x - base)
            }
        };
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {complete}/{started} |",
            t.name(),
            ms(ttfb),
            ms(med(t, &|s| s.ttfb_max_us)),
            added(ttfb, d_ttfb),
            ms(t50),
            ms(t99),
            ms(med(t, &|s| s.transit_p999_us)),
            added(t50, d50),
            added(t99, d99),
        );
    }
    let _ = writeln!(w);
}

fn render_part4(w: &mut String, r: &Results<'_>) {
    let plan = &r.bench.plan;
    let (idle_conns, idle_rounds) = (plan.idle_conns, plan.idle_rounds);
    let haproxy_conns = plan.idle_conns_of(Target::Haproxy);
    part_head(
        w,
        "4. Idle client connections",
        &format!(
            "A fresh proxy serves one request, then {idle_conns} client connections are opened \
             (128 at a time, from their own loopback source address), each sends one keep-alive \
             request, reads the response and stays open; 2 s later the proxy's `VmRSS` is read. \
             Per connection = (RSS with them − RSS before) ÷ connections. Twice per proxy: with \
             the upstream connections the calls used kept in the proxy's pool (up to the cap of \
             256: `GET /v1/fast`), and with none kept (`GET /v1/close`: the upstream answers \
             `Connection: close`), so that the client connections' own cost shows apart. \
             {idle_rounds} round(s), medians. Soft fd limits are raised to the hard limit \
             (20,000 here) for every process. HAProxy holds {haproxy_conns}: it reserves two fds \
             per connection under its global `maxconn` and refuses to start when they do not fit \
             the hard limit, so 9,990 is the most it can hold here.\n",
        ),
        "| proxy | upstream connections | idle client connections | RSS before MiB | RSS with them MiB | bytes per idle connection | still open when read |",
        "|---|---|---:|---:|---:|---:|---:|",
    );
    for (t, pooled) in PROXIES.into_iter().flat_map(|t| [(t, true), (t, false)]) {
        let runs: Vec<&IdleRun> = r
            .idle
            .iter()
            .filter(|i| i.target == t && i.pooled == pooled)
            .collect();
        let m =
            |f: &dyn Fn(&IdleRun) -> f64| median(&runs.iter().map(|i| f(i)).collect::<Vec<_>>());
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} |",
            t.name(),
            if pooled { "pooled" } else { "closed" },
            num(m(&|i| i.opened as f64), 0),
            mib(m(&|i| i.base_kib as f64)),
            mib(m(&|i| i.loaded_kib as f64)),
            num(m(&IdleRun::bytes_per_conn), 0),
            num(m(&|i| i.still_open as f64), 0),
        );
    }
    let _ = writeln!(w);
}

fn render_part4b(w: &mut String, r: &Results<'_>) {
    let plan = &r.bench.plan;
    let levels = plan
        .tls_concurrency
        .iter()
        .map(|c| format!("c={c}"))
        .collect::<Vec<_>>()
        .join(" and ");
    part_head(
        w,
        "4b. TLS to the upstream",
        &format!(
            "The same upstream over TLS (rustls; TLS 1.3 and 1.2; a certificate for `{name}` \
             signed by a CA made for the run), which closes every connection after \
             {per_conn} requests (`connection: close` on the last), as providers' front ends \
             do: a proxy that pools perfectly still opens {floor} connections per 1,000 calls, \
             and what each one costs shows. Every proxy verifies the certificate against the \
             run's CA for that name and sends it as SNI, and keeps sessions to resume (the \
             gateway's per-endpoint session store, HAProxy's per-server cache, nginx's \
             `proxy_ssl_session_reuse on`); the upstream issues stateless tickets (TLS 1.3 and \
             1.2) and caches TLS 1.2 session IDs. `wrk` at {levels} against `/v1/fast`, \
             {secs} s after a {warm} s warm-up (the pool and the session cache filled), \
             {rounds} round(s), medians. New connections and handshakes are counted by the \
             upstream (`GET /v1/tls-stats`) over the measured run; per 1,000 calls the \
             upstream answered. *Reuse* = calls on a connection that had served one before \
             (`1 − new connections ÷ calls`); *resumed* = resumed ÷ all handshakes. The \
             upstream encrypts on the load generator's CPU, so calls/s here is not the \
             proxies' peak (part 1 is); CPU per call is the proxy's, user + system. *Failed* \
             handshakes are ones the upstream saw broken off (a proxy that drops a connect when \
             its client goes away, as `wrk` stopping at the end of a run makes them do).\n",
            name = crate::pki::SERVER_NAME,
            per_conn = TLS_REQUESTS_PER_CONNECTION,
            floor = 1000 / TLS_REQUESTS_PER_CONNECTION,
            secs = plan.tls_secs,
            warm = plan.warmup_secs,
            rounds = plan.tls_rounds,
        ),
        "| proxy | load | calls/s | new connections per 1,000 calls | full handshakes per 1,000 calls | resumed per 1,000 calls | reuse | resumed | failed handshakes | errors | proxy CPU µs per call |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    );
    for &conns in &plan.tls_concurrency {
        for t in PROXIES {
            let runs: Vec<&TlsRun> = r
                .tls
                .iter()
                .filter(|x| x.target == t && x.conns == conns)
                .collect();
            if runs.is_empty() {
                continue;
            }
            let m =
                |f: &dyn Fn(&TlsRun) -> f64| median(&runs.iter().map(|x| f(x)).collect::<Vec<_>>());
            let _ = writeln!(
                w,
                "| {} | c={conns} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name(),
                num(m(&|x| x.load.rps), 0),
                num(m(&|x| x.per_1000(x.seen.connections)), 1),
                num(m(&|x| x.per_1000(x.seen.full)), 2),
                num(m(&|x| x.per_1000(x.seen.resumed)), 1),
                pct(m(&TlsRun::reuse_rate)),
                pct(m(&TlsRun::resumption_rate)),
                runs.iter().map(|x| x.seen.failed).sum::<u64>(),
                runs.iter().map(|x| x.load.errors).sum::<u64>(),
                num(m(&|x| x.cpu_us_per_call), 1),
            );
        }
    }
    let _ = writeln!(w);
}

/// The lines part 4b's configs have that part 1's do not: TLS towards the upstream.
fn render_tls_lines(w: &mut String, r: &Results<'_>) {
    let b = r.bench;
    let (plain, tls) = (b.part1_settings(), b.tls_settings());
    let admin = std::net::SocketAddr::new(plain.listen.ip(), plain.listen.port() + 1000);
    let dir = std::path::Path::new("<dir>");
    let _ = writeln!(
        w,
        "Part 4b runs the same files towards the upstream's TLS address ({}), with these lines \
         instead (the CA file is the run's):\n",
        tls.upstream
    );
    for (name, lang, plain, tls) in [
        (
            "bench-limits.yaml",
            "yaml",
            peers::poolpilot_configs(&plain, admin).1,
            peers::poolpilot_configs(&tls, admin).1,
        ),
        (
            "haproxy.cfg",
            "text",
            peers::haproxy_config(&plain),
            peers::haproxy_config(&tls),
        ),
        (
            "nginx.conf",
            "nginx",
            peers::nginx_config(&plain, dir),
            peers::nginx_config(&tls, dir),
        ),
    ] {
        let mut changed: Vec<&str> = tls.lines().filter(|l| !plain.contains(l)).collect();
        changed.dedup();
        let _ = writeln!(w, "```{lang}\n# {name}\n{}\n```\n", changed.join("\n"));
    }
}

fn render_profile(w: &mut String, r: &Results<'_>) {
    let p = &r.profile;
    let _ = writeln!(w, "## Profile of the gateway at peak throughput\n");
    match &p.load {
        Some(load) => {
            let _ = writeln!(
                w,
                "`perf record -e cpu-clock -F 999 -g -p <gateway>` for {} s under `wrk -c{}` \
                 ({} req/s during the profile; sampling costs some throughput). Flat profiles (self \
                 time) by shared object, then by shared object and symbol, from [`{}`]({}) (`perf report --stdio \
                 --no-children --sort dso,symbol`). The top entries:\n",
                r.bench.plan.profile_secs,
                p.conns,
                num(load.rps, 0),
                r.profile_file,
                r.profile_file
            );
            let _ = writeln!(w, "```text");
            for line in &p.top {
                let _ = writeln!(w, "{line}");
            }
            let _ = writeln!(w, "```\n");
        }
        None => {
            let _ = writeln!(w, "{}", p.text);
        }
    }
}

fn render_configs(w: &mut String, r: &Results<'_>) {
    let b = r.bench;
    let s = b.part1_settings();
    let _ = writeln!(w, "## Peer configs (exactly as run in part 1)\n");
    let _ = writeln!(
        w,
        "Part 2 uses the same files with the cap at 32 (`maxconn 32`, `max_conns=32` / \
         `keepalive 32`, `maxConnectionsPerEndpoint: 32`); part 3 with the cap at 64, part 4 \
         at 256. \
         The proxy listens on {}, the upstream on {}.\n",
        s.listen, s.upstream
    );
    let admin = std::net::SocketAddr::new(s.listen.ip(), s.listen.port() + 1000);
    let (gateway, limits) = peers::poolpilot_configs(&s, admin);
    let _ = writeln!(
        w,
        "poolpilot-gateway (`POOLPILOT_WORKER_THREADS=1 RUST_LOG=warn poolpilot-gateway --config bench-gateway.yaml`):\n"
    );
    let _ = writeln!(w, "```yaml\n# bench-gateway.yaml\n{gateway}```\n");
    let _ = writeln!(w, "```yaml\n# bench-limits.yaml\n{limits}```\n");
    let _ = writeln!(
        w,
        "The 2-worker rows run the same files with `POOLPILOT_WORKER_THREADS=2`, `nbthread 2` \
         and, for nginx, `master_process on; worker_processes 2;`.\n"
    );
    let _ = writeln!(w, "HAProxy (`haproxy -db -f haproxy.cfg`):\n");
    let _ = writeln!(w, "```text\n{}```\n", peers::haproxy_config(&s));
    let _ = writeln!(w, "nginx (`nginx -p <dir> -c nginx.conf`):\n");
    let _ = writeln!(
        w,
        "```nginx\n{}```\n",
        peers::nginx_config(&s, std::path::Path::new("<dir>"))
    );
    render_tls_lines(w, r);
    let _ = writeln!(w, "## Reproduce one row\n");
    let _ = writeln!(
        w,
        "Part 1, `c=64`, HAProxy (the other proxies: start them with the configs above instead):\n"
    );
    let _ = writeln!(
        w,
        "```sh\n\
         export CARGO_TARGET_DIR=$HOME/.cache/poolpilot/target-bench\n\
         cargo build --release -p poolpilot-gateway -p poolpilot-bench\n\
         taskset -c {l} $CARGO_TARGET_DIR/release/poolpilot-bench upstream {up} &\n\
         taskset -c {p} haproxy -db -f haproxy.cfg &      # the config above\n\
         taskset -c {l} wrk -t1 -c64 -d{d}s --timeout 5s http://{listen}/v1/fast\n\
         ```\n\n\
         The harness does the same with a summary script (`-s`, printing p50/p99/p99.9 as JSON), \
         a fresh proxy per run, and reads the proxy's `/proc/<pid>/stat` before and after. \
         `make bench` runs everything (`BENCH_QUICK=1 make bench` for a short validation run); \
         `poolpilot-bench run --help` lists the knobs.\n",
        l = b.load_cpu,
        p = b.env.proxy_cpu,
        up = b.upstream,
        listen = s.listen,
        d = b.plan.secs,
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn targets_without_their_figures_are_not_measured_never_met() {
        let mut w = String::new();
        super::render_targets(&mut w, &[], &[]);
        let verdicts: Vec<&str> = w
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| target"))
            .map(|l| l.split(" | ").nth(1).unwrap_or_default())
            .collect();
        assert_eq!(verdicts.len(), 4, "{w}");
        assert!(
            verdicts.iter().all(|v| *v == "**not measured**"),
            "a run without parts 1 and 4 meets no target: {w}"
        );
    }

    use super::*;
    use crate::load::LoadResult;

    fn sample(row: Row, target: Target, rps: f64, p99_us: f64, cpu: f64) -> Sample {
        let load = LoadResult {
            requests: 1000,
            errors: 0,
            rps,
            p50_us: p99_us / 2.0,
            p99_us,
            p999_us: p99_us * 2.0,
        };
        Sample::from_table(row, target, load, cpu, 4096.0)
    }

    #[test]
    fn part_one_is_drawn_as_ratios_per_load() {
        let mut samples = Vec::new();
        for row in [
            Row::Concurrency(1),
            Row::Concurrency(64),
            Row::TwoWorkers(64),
        ] {
            samples.push(sample(row, Target::Direct, 20_000.0, 100.0, f64::NAN));
            samples.push(sample(row, Target::Poolpilot, 9_000.0, 300.0, 1.0));
            samples.push(sample(row, Target::Haproxy, 10_000.0, 250.0, 0.8));
            samples.push(sample(row, Target::Nginx, 9_000.0, 320.0, 1.2));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs/plots/ratios.svg");
        assert!(plot_part1(&samples, &path).unwrap());
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "c=1",
            "c=64",
            "req/s ÷ haproxy",
            "p99 ÷ nginx",
            "CPU ÷ haproxy",
        ] {
            assert!(svg.contains(text), "no {text:?} in the picture");
        }
        assert!(!plot_part1(&[], &dir.path().join("none.svg")).unwrap());
        // Drawn again from what a report wrote, the ratios are the same.
        let mut md = String::from("# x\n\n");
        for row in [
            Row::Concurrency(1),
            Row::Concurrency(64),
            Row::TwoWorkers(64),
        ] {
            for t in ALL {
                let c = cell(&samples, row, t);
                md.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | x | x | {} | {} | 0 |\n",
                    row.label(),
                    t.name(),
                    c.rps,
                    c.p50 / 1000.0,
                    c.p99 / 1000.0,
                    c.p999 / 1000.0,
                    c.cpu,
                    c.rss_kib / 1024.0
                ));
            }
        }
        let md = format!("## 1. Proxy overhead\n\n{md}\n## 2. Next\n| a | b |\n");
        let read = samples_from_report(&md).unwrap();
        assert_eq!(read.len(), 12);
        for row in [Row::Concurrency(64), Row::TwoWorkers(64)] {
            let (a, b) = (
                cell(&read, row, Target::Haproxy),
                cell(&samples, row, Target::Haproxy),
            );
            assert_eq!((a.rps, a.p99, a.cpu), (b.rps, b.p99, b.cpu));
        }
        assert!(samples_from_report("## 2. only\n").is_err());
        assert!(!dir.path().join("none.svg").exists());
    }

    #[test]
    fn missing_quick_or_unreadable_committed_reports_skip_the_regression_check() {
        use crate::regression::{Outcome, check};
        let now = vec![sample(
            Row::Concurrency(16),
            Target::Poolpilot,
            10.0,
            1000.0,
            9.0,
        )];
        assert!(matches!(
            check(false, committed_part1(None), &now),
            Outcome::Skipped(_)
        ));
        assert!(matches!(
            check(
                false,
                committed_part1(Some("Written by `make bench` (**quick mode** …)")),
                &now
            ),
            Outcome::Skipped(_)
        ));
        assert!(matches!(
            check(false, committed_part1(Some("# no part 1 here")), &now),
            Outcome::Skipped(_)
        ));
    }

    /// The committed report is read back from its own table: the check sees what a report
    /// written by this harness says.
    #[test]
    fn the_committed_reports_part_1_is_read_back_for_the_regression_check() {
        use crate::regression::{Outcome, check, render};
        let committed =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../BENCHMARKS.md"))
                .unwrap();
        let samples = committed_part1(Some(&committed)).unwrap();
        let outcome = check(false, Ok(samples.clone()), &samples);
        let Outcome::Checked(all) = &outcome else {
            panic!("{outcome:?}")
        };
        assert!(
            all.len() >= 4 * crate::regression::Metric::ALL.len(),
            "{all:?}"
        );
        assert!(all.iter().all(|c| (c.relative() - 1.0).abs() < 1e-12));
        let mut text = String::new();
        render(&mut text, &outcome);
        assert!(text.contains("**None regressed**"), "{text}");
    }
}
