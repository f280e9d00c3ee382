//! `poolpilot-bench`: the gateway side by side with HAProxy and nginx on one machine (
//! parts 1–4 and 4b), writing `BENCHMARKS.md` and the gateway's profile, with the fragments of other
//! harnesses (parts 5–7, `--include`).
//!
//! `poolpilot-bench run` drives everything; `poolpilot-bench compare` measures gateway builds
//! against each other (`compare.rs`); `poolpilot-bench upstream ADDR` is the upstream they
//! start (the same binary, so every proxy fronts the same server).

mod clock;
mod compare;
mod cpus;
mod load;
mod parts;
mod peers;
mod pki;
mod procs;
mod regression;
mod report;
mod stage;
mod stats;
mod tls_upstream;
mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::parts::Plan;
use crate::stage::{Pinning, Stage, pinned_runtime};

#[derive(Debug, Parser)]
#[command(about = "poolpilot's proxy benchmarks", version = poolpilot_telemetry::LONG_VERSION)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run parts 1–4, 4b and the profile, and write the report.
    Run(RunArgs),
    /// Compare gateway builds: alternating part-1 runs of each at one load, printed as a
    /// table of medians and ranges.
    Compare(compare::CompareArgs),
    /// Draw part 1's picture again from a written report (its tables), and link it there.
    Plot {
        /// The report to read and link the picture from.
        #[arg(long, default_value = "BENCHMARKS.md")]
        report: PathBuf,
    },
    /// Serve the benchmark upstream on ADDR (single thread), and over TLS on `--tls`.
    Upstream {
        /// Listen address.
        addr: SocketAddr,
        /// Also serve over TLS here (with `--cert` and `--key`).
        #[arg(long, requires_all = ["cert", "key"])]
        tls: Option<SocketAddr>,
        /// The TLS listener's certificate chain (PEM).
        #[arg(long)]
        cert: Option<PathBuf>,
        /// Its private key (PEM).
        #[arg(long)]
        key: Option<PathBuf>,
        /// Requests a TLS connection serves before the upstream closes it.
        #[arg(long, default_value_t = tls_upstream::TLS_REQUESTS_PER_CONNECTION)]
        tls_requests_per_connection: u64,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Short runs that validate the harness (numbers not for conclusions).
    #[arg(long, env = "BENCH_QUICK", value_parser = clap::builder::FalseyValueParser::new())]
    quick: bool,
    /// The report to write.
    #[arg(long, default_value = "BENCHMARKS.md")]
    out: PathBuf,
    /// The release gateway binary.
    #[arg(long)]
    gateway_bin: PathBuf,
    /// Scratch directory for configs, logs and perf data.
    #[arg(long)]
    run_dir: PathBuf,
    /// The fixed request rate of part 1 (requests/s; keep it below every proxy's saturation).
    #[arg(long, env = "BENCH_RATE", default_value_t = 3000)]
    rate: u32,
    /// Hand-written analysis included verbatim in the report, when the file exists.
    #[arg(long)]
    analysis: Option<PathBuf>,
    /// Markdown fragments written by other harnesses (`poolpilot-loop-bench`'s parts 5–6,
    /// `poolpilot-fleet-bench`'s part 7), included verbatim after part 4; a missing file is an
    /// error.
    #[arg(long)]
    include: Vec<PathBuf>,
    /// The report part 1 is checked against (`regression`: the run fails when the gateway's
    /// standing against a peer falls more than 10%); by default the report `--out` replaces.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Only these parts (comma-separated from 1,2,3,4,4b,profile); all when empty.
    #[arg(long, env = "BENCH_PARTS", default_value = "")]
    parts: String,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Upstream {
            addr,
            tls,
            cert,
            key,
            tls_requests_per_connection,
        } => {
            let tls = match (tls, cert, key) {
                (Some(addr), Some(cert_file), Some(key_file)) => Some(upstream::TlsListener {
                    addr,
                    cert_file,
                    key_file,
                    requests_per_connection: tls_requests_per_connection.max(1),
                }),
                _ => None,
            };
            upstream::serve(addr, tls)
        }
        Command::Plot { report } => plot_from_report(&report),
        Command::Run(args) => {
            let (rt, pinning) = pinned_runtime()?;
            rt.block_on(run(args, pinning))
        }
        Command::Compare(args) => {
            let (rt, pinning) = pinned_runtime()?;
            let table = rt.block_on(compare::run(&args, pinning))?;
            println!("{table}");
            Ok(())
        }
    }
}

/// Where part 1's picture goes, relative to the report.
const PART1_PLOT: &str = "docs/plots/bench-proxy-ratios.svg";

/// `poolpilot-bench plot`: part 1's picture from the report's own table, linked after its ratio
/// table (where a run's report puts it).
fn plot_from_report(report: &std::path::Path) -> anyhow::Result<()> {
    let markdown =
        std::fs::read_to_string(report).with_context(|| format!("reading {}", report.display()))?;
    let samples = report::samples_from_report(&markdown)?;
    let dir = report.parent().unwrap_or(std::path::Path::new("."));
    report::plot_part1(&samples, &dir.join(PART1_PLOT))?;
    let line = report::part1_plot_line(PART1_PLOT);
    if !markdown.contains(&line) {
        let ratios = markdown
            .find("| load | req/s ÷ HAProxy")
            .context("no ratio table in the report")?;
        let end = markdown[ratios..]
            .find("\n\n")
            .map_or(markdown.len(), |e| ratios + e + 2);
        let linked = format!("{}{line}\n\n{}", &markdown[..end], &markdown[end..]);
        std::fs::write(report, linked)?;
    }
    eprintln!("poolpilot-bench: drew {}", dir.join(PART1_PLOT).display());
    Ok(())
}

async fn run(args: RunArgs, pinning: Pinning) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    // Read first: a missing fragment must not cost a whole run.
    let includes = args
        .include
        .iter()
        .map(|p| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The committed report, read before this run replaces it.
    let committed = std::fs::read_to_string(args.baseline.as_ref().unwrap_or(&args.out)).ok();
    let machine = report::Machine::at_start();
    eprintln!(
        "poolpilot-bench: {} mode",
        if args.quick { "quick" } else { "full" }
    );
    let stage = Stage::start(&args.run_dir, pinning).await?;
    let bench = stage.bench(Plan::new(args.quick, args.rate), &args.gateway_bin)?;
    let want = |part: &str| args.parts.is_empty() || args.parts.split(',').any(|p| p == part);

    let samples = if want("1") {
        bench.part1().await.context("part 1")?
    } else {
        Vec::new()
    };
    let contention = if want("2") {
        bench.part2().await.context("part 2")?
    } else {
        Vec::new()
    };
    let sse = if want("3") {
        bench.part3().await.context("part 3")?
    } else {
        Vec::new()
    };
    let idle = if want("4") {
        // Let the previous parts' sockets leave TIME_WAIT accounting behind.
        tokio::time::sleep(Duration::from_secs(1)).await;
        bench.part4().await.context("part 4")?
    } else {
        Vec::new()
    };
    let tls = if want("4b") {
        bench.part4b().await.context("part 4b")?
    } else {
        Vec::new()
    };
    let profile = if want("profile") {
        bench.profile(64).await.context("profile")?
    } else {
        parts::Profile::default()
    };
    stage.upstream.stop().await;

    let profile_file = format!(
        "{}-profile.txt",
        args.out
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("BENCHMARKS")
    );
    let out_dir = args
        .out
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    if !profile.text.is_empty() {
        std::fs::write(out_dir.join(&profile_file), &profile.text)?;
    }
    let analysis = match &args.analysis {
        Some(path) if path.exists() => Some(std::fs::read_to_string(path)?),
        _ => None,
    };
    // The picture of part 1 beside the docs' other plots, linked from the report.
    let part1_plot = report::plot_part1(&samples, &out_dir.join(PART1_PLOT))
        .context("drawing part 1")?
        .then(|| PART1_PLOT.to_owned());
    let regression = regression::check(
        args.quick,
        report::committed_part1(committed.as_deref()),
        &samples,
    );
    let mut machine = machine;
    machine.load_end = poolpilot_bench::machine::loadavg();
    machine.wall_secs = started.elapsed().as_secs_f64();
    let results = report::Results {
        bench: &bench,
        machine,
        samples,
        contention,
        sse,
        idle,
        tls,
        profile,
        profile_file,
        analysis,
        includes,
        part1_plot,
        regression,
    };
    std::fs::write(&args.out, report::render(&results))
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "poolpilot-bench: wrote {} in {:.0} s",
        args.out.display(),
        results.machine.wall_secs
    );
    let regressed = results.regression.regressions();
    anyhow::ensure!(
        regressed.is_empty(),
        "part 1 regressed against the committed report (see its \"Regression check\"): {}",
        regressed
            .iter()
            .map(|c| format!(
                "{} {:?}: {:.2} → {:.2}",
                c.row.label(),
                c.metric,
                c.committed,
                c.now
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok(())
}
