//! `poolpilot-bench compare`: two or more gateway builds in alternating part-1 runs at one load
//! (a fresh process each, pinned and checked for disturbance as part 1 is), reported as medians
//! with their ranges and the ratio of medians to the first build: how a change to the gateway
//! or to its build is measured before a whole `make bench`.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::parts::{Plan, Row, Sample, cell};
use crate::peers::Target;
use crate::stage::{Pinning, Stage};
use crate::stats::num;

/// `poolpilot-bench compare`'s arguments.
#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// A gateway binary to compare (give two or more; the first is the reference).
    #[arg(long = "gateway-bin", required = true)]
    pub gateway_bins: Vec<PathBuf>,
    /// Closed-loop connections (`wrk -cN`).
    #[arg(long, default_value_t = 64)]
    pub concurrency: u32,
    /// Rounds: every build runs once per round, in an order reversed every round.
    #[arg(long, default_value_t = 6)]
    pub rounds: usize,
    /// Seconds per measured run (after 1 s of warm-up).
    #[arg(long, default_value_t = 5.0)]
    pub secs: f64,
    /// Scratch directory for configs and logs.
    #[arg(long)]
    pub run_dir: PathBuf,
}

/// Runs the comparison; returns its table (Markdown).
pub async fn run(args: &CompareArgs, pinning: Pinning) -> anyhow::Result<String> {
    anyhow::ensure!(
        args.gateway_bins.len() >= 2,
        "compare needs two gateway binaries or more"
    );
    anyhow::ensure!(args.rounds >= 1, "compare needs a round at least");
    let stage = Stage::start(&args.run_dir, pinning).await?;
    let plan = Plan {
        secs: args.secs,
        ..Plan::new(false, 0)
    };
    let benches = args
        .gateway_bins
        .iter()
        .map(|bin| stage.bench(plan.clone(), bin))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let row = Row::Concurrency(args.concurrency);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); benches.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..benches.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            eprintln!("compare: {}", args.gateway_bins[i].display());
            samples[i].push(
                benches[i]
                    .part1_sample(row, Target::Poolpilot, round)
                    .await?,
            );
        }
    }
    stage.upstream.stop().await;
    Ok(table(args, &samples))
}

fn table(args: &CompareArgs, samples: &[Vec<Sample>]) -> String {
    let mut w = String::new();
    let _ = writeln!(
        w,
        "`wrk -t1 -c{}`, {} round(s) of {} s per build (median, lowest–highest; ratios are of \
         medians, to the first build)\n",
        args.concurrency, args.rounds, args.secs
    );
    let _ = writeln!(
        w,
        "| build | req/s | ÷ first | CPU µs / req | ÷ first | user µs | system µs | redone |\n\
         |---|---|---:|---|---:|---:|---:|---:|"
    );
    // Every run of a build is one row and target: its cell holds the medians and ranges.
    let row = Row::Concurrency(args.concurrency);
    let cells: Vec<_> = samples
        .iter()
        .map(|runs| cell(runs, row, Target::Poolpilot))
        .collect();
    // CPU in µs per request (a cell holds seconds per 10k requests).
    let us = |s_per_10k: f64| s_per_10k * 100.0;
    for (bin, c) in args.gateway_bins.iter().zip(&cells) {
        let _ = writeln!(
            w,
            "| {} | {} ({}–{}) | {} | {} ({}–{}) | {} | {} | {} | {} |",
            bin.display(),
            num(c.rps, 0),
            num(c.rps_range.0, 0),
            num(c.rps_range.1, 0),
            num(c.rps / cells[0].rps, 2),
            num(us(c.cpu), 1),
            num(us(c.cpu_range.0), 1),
            num(us(c.cpu_range.1), 1),
            num(c.cpu / cells[0].cpu, 2),
            num(c.user_us, 1),
            num(c.system_us, 1),
            c.redone,
        );
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadResult;

    fn run(rps: f64, cpu_per_10k: f64) -> Sample {
        let load = LoadResult {
            requests: 1000,
            errors: 0,
            rps,
            p50_us: 100.0,
            p99_us: 200.0,
            p999_us: 300.0,
        };
        Sample::from_table(
            Row::Concurrency(64),
            Target::Poolpilot,
            load,
            cpu_per_10k,
            0.0,
        )
    }

    #[test]
    fn the_table_gives_each_build_its_median_range_and_ratio_to_the_first() {
        let args = CompareArgs {
            gateway_bins: vec!["a".into(), "b".into()],
            concurrency: 64,
            rounds: 3,
            secs: 5.0,
            run_dir: "/tmp".into(),
        };
        let samples = vec![
            vec![run(100.0, 0.30), run(90.0, 0.32), run(110.0, 0.28)],
            vec![run(120.0, 0.25), run(130.0, 0.24), run(115.0, 0.27)],
        ];
        let text = table(&args, &samples);
        assert!(
            text.contains("| a | 100 (90–110) | 1.00 | 30.0 (28.0–32.0) | 1.00 |"),
            "{text}"
        );
        assert!(
            text.contains("| b | 120 (115–130) | 1.20 | 25.0 (24.0–27.0) | 0.83 |"),
            "{text}"
        );
    }
}
