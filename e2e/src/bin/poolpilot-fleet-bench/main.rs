//! `poolpilot-fleet-bench`: part 7 of BENCHMARKS.md on the embedded cluster — the operator at
//! 2,000 ConnectionPolicies × 1,000 simulated gateway pods (`poolpilot_e2e::fleet_bench`): cold
//! start to every policy settled, reconcile latency, PromQL queries per metric per round, a
//! rollout to every pod with `verifyIntervals: 0`, the operator's memory and CPU — written as a
//! markdown fragment that `poolpilot-bench --include` puts into `BENCHMARKS.md`.
//!
//! ```sh
//! make cluster-up        # `make bench` starts its own
//! cargo build --workspace --bins
//! $CARGO_TARGET_DIR/debug/poolpilot-fleet-bench --out e2e/bench/operator-fleet.md [--quick] [--operator-bin PATH]
//! ```

mod fragment;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use poolpilot_bench::machine::{loadavg, utc_now};
use poolpilot_e2e::fleet_bench::{self, FleetPlan};
use poolpilot_e2e::scenario::serial;
use tokio::time::Instant;

/// The operator at 2,000 policies × 1,000 simulated gateway pods (part 7 of BENCHMARKS.md).
#[derive(Debug, Parser)]
#[command(version = poolpilot_telemetry::LONG_VERSION)]
struct Args {
    /// The markdown fragment to write.
    #[arg(long, default_value = "e2e/bench/operator-fleet.md")]
    out: PathBuf,
    /// A short run (200 policies × 100 pods) that validates the harness.
    #[arg(long, env = "BENCH_QUICK", value_parser = clap::builder::FalseyValueParser::new())]
    quick: bool,
    /// The operator binary to run as a process of this machine (`make bench`: the release
    /// build); default: the one beside this binary.
    #[arg(long)]
    operator_bin: Option<PathBuf>,
    /// The operator's `--rollout-concurrency` (its default when not given).
    #[arg(long)]
    rollout_concurrency: Option<u16>,
    /// The operator's `--concurrent-reconciles` (its default when not given).
    #[arg(long)]
    concurrent_reconciles: Option<u16>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    poolpilot_e2e::install_crypto_provider();
    let args = Args::parse();
    let mut plan = if args.quick {
        FleetPlan::quick()
    } else {
        FleetPlan::full()
    };
    plan.rollout_concurrency = args.rollout_concurrency;
    plan.concurrent_reconciles = args.concurrent_reconciles;
    let operator_bin = args
        .operator_bin
        .clone()
        .unwrap_or_else(|| poolpilot_e2e::paths::workspace_bin_dir().join("poolpilot-operator"));
    eprintln!("poolpilot-fleet-bench: waiting for the scenario lock");
    let _serial = serial().await?;
    eprintln!(
        "poolpilot-fleet-bench: {} policies × {} pods ({}), operator {}",
        plan.policies,
        plan.pods,
        if args.quick { "quick" } else { "full" },
        operator_bin.display()
    );
    let run = fragment::Run {
        quick: args.quick,
        started: utc_now(),
        load: (loadavg(), String::new()),
        wall: std::time::Duration::ZERO,
        operator_bin: operator_bin.clone(),
    };
    let start = Instant::now();
    let mut result = None;
    let outcome = poolpilot_e2e::with_namespace("fleetb", async |ns| {
        let r = fleet_bench::run(ns, &plan, &operator_bin, &|m| {
            eprintln!("poolpilot-fleet-bench: {m}")
        })
        .await;
        let failed = r.as_ref().err().map(|e| format!("{e:#}"));
        result = Some(r);
        // A failed run fails the namespace too, so that it is dumped.
        match failed {
            Some(e) => anyhow::bail!("{e}"),
            None => Ok(()),
        }
    })
    .await;
    let result = match (result, outcome) {
        (Some(r), _) => r,
        (None, Err(e)) => Err(e),
        (None, Ok(())) => Err(anyhow::anyhow!("the run returned nothing")),
    };
    let run = fragment::Run {
        load: (run.load.0, loadavg()),
        wall: start.elapsed(),
        ..run
    };
    let text = fragment::render(&plan, &run, &result);
    std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "poolpilot-fleet-bench: wrote {} in {:.0} s",
        args.out.display(),
        run.wall.as_secs_f64()
    );
    result.map(|_| ())
}
