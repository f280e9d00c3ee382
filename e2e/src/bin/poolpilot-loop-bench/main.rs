//! `poolpilot-loop-bench`: parts 5 and 6 of BENCHMARKS.md on the embedded cluster — the flash crowd three
//! ways (static at the start, static at the maximum, autoscaling), the rollout time of a limit
//! edit to 3/10/30 gateway pods, and the operator at 1/50/200 policies × 5 pods — written as a
//! markdown fragment that `poolpilot-bench --include` puts into `BENCHMARKS.md`.
//!
//! ```sh
//! make cluster-up        # `make bench` starts it on release images: IMAGE_PROFILE=release
//! cargo build --workspace --bins
//! $CARGO_TARGET_DIR/debug/poolpilot-loop-bench --out e2e/bench/control-loop.md [--quick] [--parts control,rollout,scale] [--image-profile release]
//! ```

mod loop_bench;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use poolpilot_e2e::scenario::serial;

use crate::loop_bench::{Part, Plan};

/// Control-loop and operator-scale benchmarks on the embedded cluster (parts 5–6 of
/// BENCHMARKS.md).
#[derive(Debug, Parser)]
#[command(version = poolpilot_telemetry::LONG_VERSION)]
struct Args {
    /// The markdown fragment to write.
    #[arg(long, default_value = "e2e/bench/control-loop.md")]
    out: PathBuf,
    /// Short runs that validate the harness (numbers not for conclusions).
    #[arg(long, env = "BENCH_QUICK", value_parser = clap::builder::FalseyValueParser::new())]
    quick: bool,
    /// Only these parts (comma-separated from control, rollout, scale); all when empty.
    #[arg(long, env = "LOOP_BENCH_PARTS", default_value = "")]
    parts: String,
    /// The build profile of the images the node runs, as `make cluster-up IMAGE_PROFILE=…` built
    /// them (`make bench` starts its cluster on release images); the report states it.
    #[arg(long, default_value = "debug", value_parser = ["debug", "release"])]
    image_profile: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    poolpilot_e2e::install_crypto_provider();
    let args = Args::parse();
    let parts = Part::parse_list(&args.parts)?;
    let plan = Plan::new(args.quick, args.image_profile.clone());
    eprintln!("poolpilot-loop-bench: waiting for the scenario lock");
    let _serial = serial().await?;
    eprintln!(
        "poolpilot-loop-bench: {} mode, parts {parts:?}",
        if plan.quick { "quick" } else { "full" }
    );
    let results = loop_bench::run(&plan, &parts).await;
    let fragment = loop_bench::fragment::render(&plan, &results);
    std::fs::write(&args.out, fragment)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "poolpilot-loop-bench: wrote {} in {:.0} s",
        args.out.display(),
        results.wall.as_secs_f64()
    );
    results.failures()
}
