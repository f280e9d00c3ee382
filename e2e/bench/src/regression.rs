//! The part-1 regression check: this run's standing against the peers, row by row, compared
//! with the committed report's, so that a change that slows the gateway's hot path fails
//! `make bench` on the day it lands.
//!
//! It compares ratios, never raw figures: both runs measured HAProxy and nginx beside the
//! gateway, on the same machine and in alternating order, so a slower or busier machine moves
//! the peers' numbers with the gateway's and leaves the ratio. Gated per row: req/s ÷ HAProxy
//! and req/s ÷ nginx (higher is better), CPU per request ÷ HAProxy and ÷ nginx (lower is
//! better). The gateway's *standing* on a metric is the ratio where higher is better and its
//! inverse where lower is; a row regresses when its standing falls below
//! `1 − TOLERANCE` of the committed one. Tail latency is reported in the tables but not gated:
//! how far a short run's p99 ratio moves between identical runs is not measured yet, and a
//! gate tighter than that spread would fail at random.
//!
//! Quick runs (`BENCH_QUICK=1`) are too short to compare and skip the check, as does a run
//! whose committed report has no part 1 or was itself a quick run; the report says which.

use std::fmt::Write as _;

use crate::parts::{Row, Sample, cell, rows};
use crate::peers::Target;

/// How far the gateway's standing on a gated ratio may fall below the committed report's.
pub const TOLERANCE: f64 = 0.10;

/// A gated ratio of one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// req/s ÷ the peer's req/s (higher is better).
    Throughput(Target),
    /// CPU per request ÷ the peer's (lower is better).
    Cpu(Target),
}

impl Metric {
    /// Every gated ratio.
    pub const ALL: [Self; 4] = [
        Self::Throughput(Target::Haproxy),
        Self::Throughput(Target::Nginx),
        Self::Cpu(Target::Haproxy),
        Self::Cpu(Target::Nginx),
    ];

    fn label(self) -> String {
        match self {
            Self::Throughput(peer) => format!("req/s ÷ {}", peer_name(peer)),
            Self::Cpu(peer) => format!("CPU ÷ {}", peer_name(peer)),
        }
    }

    /// The ratio in `samples` (NaN when a side is missing).
    fn ratio(self, samples: &[Sample], row: Row) -> f64 {
        let ours = cell(samples, row, Target::Poolpilot);
        match self {
            Self::Throughput(peer) => ours.rps / cell(samples, row, peer).rps,
            Self::Cpu(peer) => ours.cpu / cell(samples, row, peer).cpu,
        }
    }

    /// The gateway's standing for a ratio: higher is better.
    fn standing(self, ratio: f64) -> f64 {
        match self {
            Self::Throughput(_) => ratio,
            Self::Cpu(_) => 1.0 / ratio,
        }
    }
}

fn peer_name(peer: Target) -> &'static str {
    match peer {
        Target::Haproxy => "HAProxy",
        Target::Nginx => "nginx",
        Target::Poolpilot | Target::Direct => unreachable!("only peers are compared with"),
    }
}

/// One gated ratio of one row in both runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// The row.
    pub row: Row,
    /// The ratio.
    pub metric: Metric,
    /// In the committed report.
    pub committed: f64,
    /// In this run.
    pub now: f64,
}

impl Comparison {
    /// This run's standing relative to the committed one (1 = unchanged, below 1 = worse).
    pub fn relative(&self) -> f64 {
        self.metric.standing(self.now) / self.metric.standing(self.committed)
    }

    /// Whether the standing fell by more than [`TOLERANCE`].
    pub fn regressed(&self) -> bool {
        self.relative() < 1.0 - TOLERANCE
    }
}

/// What the check found.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Not checked, and why.
    Skipped(String),
    /// Every gated ratio of the rows both runs have.
    Checked(Vec<Comparison>),
}

impl Outcome {
    /// The comparisons that regressed.
    pub fn regressions(&self) -> Vec<&Comparison> {
        match self {
            Self::Skipped(_) => Vec::new(),
            Self::Checked(all) => all.iter().filter(|c| c.regressed()).collect(),
        }
    }
}

/// Compares this run's part 1 with the committed report's: every gated ratio of every row that
/// both have, with both sides measured.
pub fn check(quick: bool, committed: Result<Vec<Sample>, String>, now: &[Sample]) -> Outcome {
    if quick {
        return Outcome::Skipped("quick runs are too short to compare".into());
    }
    if now.is_empty() {
        return Outcome::Skipped("part 1 did not run".into());
    }
    let committed = match committed {
        Ok(samples) => samples,
        Err(why) => return Outcome::Skipped(why),
    };
    let committed_rows = rows(&committed);
    let mut all = Vec::new();
    for row in rows(now).into_iter().filter(|r| committed_rows.contains(r)) {
        for metric in Metric::ALL {
            let (committed, now) = (metric.ratio(&committed, row), metric.ratio(now, row));
            if committed.is_finite() && now.is_finite() && committed > 0.0 && now > 0.0 {
                all.push(Comparison {
                    row,
                    metric,
                    committed,
                    now,
                });
            }
        }
    }
    if all.is_empty() {
        return Outcome::Skipped("no row of this run is in the committed report".into());
    }
    Outcome::Checked(all)
}

/// The report's section on the check.
pub fn render(w: &mut String, outcome: &Outcome) {
    let _ = writeln!(w, "## Regression check\n");
    match outcome {
        Outcome::Skipped(why) => {
            let _ = writeln!(w, "Not checked: {why}.\n");
        }
        Outcome::Checked(all) => {
            let regressions = outcome.regressions().len();
            let _ = writeln!(
                w,
                "Part 1's ratios against the report this run replaced (`make bench` fails when the \
                 gateway's standing on one falls more than {:.0}%: req/s ÷ peer below {:.0}% of \
                 the committed ratio, CPU ÷ peer above {:.0}% of it). {}\n",
                TOLERANCE * 100.0,
                (1.0 - TOLERANCE) * 100.0,
                100.0 / (1.0 - TOLERANCE),
                if regressions == 0 {
                    format!("**None regressed** ({} compared).", all.len())
                } else {
                    format!("**{regressions} of {} regressed.**", all.len())
                }
            );
            let _ = writeln!(
                w,
                "| load | ratio | committed | this run | standing | |\n|---|---|---:|---:|---:|---|"
            );
            for c in all {
                let _ = writeln!(
                    w,
                    "| {} | {} | {:.2} | {:.2} | {:+.0}% | {} |",
                    c.row.label(),
                    c.metric.label(),
                    c.committed,
                    c.now,
                    (c.relative() - 1.0) * 100.0,
                    if c.regressed() { "**regressed**" } else { "" }
                );
            }
            let _ = writeln!(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadResult;

    fn sample(row: Row, target: Target, rps: f64, cpu: f64) -> Sample {
        let load = LoadResult {
            requests: 0,
            errors: 0,
            rps,
            p50_us: 100.0,
            p99_us: 1000.0,
            p999_us: 2000.0,
        };
        Sample::from_table(row, target, load, cpu, 10_000.0)
    }

    /// One row with the gateway at `ours` req/s and `cpu` CPU beside peers at 100 req/s and 1.0.
    fn run(row: Row, ours: f64, cpu: f64) -> Vec<Sample> {
        vec![
            sample(row, Target::Direct, 200.0, f64::NAN),
            sample(row, Target::Poolpilot, ours, cpu),
            sample(row, Target::Haproxy, 100.0, 1.0),
            sample(row, Target::Nginx, 100.0, 1.0),
        ]
    }

    const C16: Row = Row::Concurrency(16);

    #[test]
    fn a_throughput_ratio_that_falls_more_than_ten_percent_regresses() {
        let outcome = check(false, Ok(run(C16, 90.0, 1.0)), &run(C16, 80.0, 1.0));
        let regressed = outcome.regressions();
        assert_eq!(regressed.len(), 2, "{outcome:?}");
        assert!(
            regressed
                .iter()
                .all(|c| matches!(c.metric, Metric::Throughput(_)))
        );
        assert!((regressed[0].relative() - 80.0 / 90.0).abs() < 1e-9);
    }

    #[test]
    fn a_fall_within_the_tolerance_and_an_improvement_pass() {
        assert!(
            check(false, Ok(run(C16, 90.0, 1.0)), &run(C16, 82.0, 1.05))
                .regressions()
                .is_empty()
        );
        assert!(
            check(false, Ok(run(C16, 90.0, 1.0)), &run(C16, 120.0, 0.5))
                .regressions()
                .is_empty()
        );
    }

    #[test]
    fn more_cpu_per_request_beyond_the_tolerance_regresses() {
        let outcome = check(false, Ok(run(C16, 90.0, 1.0)), &run(C16, 90.0, 1.2));
        let regressed = outcome.regressions();
        assert_eq!(regressed.len(), 2, "{outcome:?}");
        assert!(regressed.iter().all(|c| matches!(c.metric, Metric::Cpu(_))));
    }

    #[test]
    fn a_slower_machine_that_slows_every_proxy_alike_is_no_regression() {
        let mut slower = run(C16, 45.0, 2.0);
        for s in &mut slower {
            if matches!(s.target, Target::Haproxy | Target::Nginx) {
                s.load.rps = 50.0;
                s.cpu_per_10k = 2.0;
            }
        }
        let outcome = check(false, Ok(run(C16, 90.0, 1.0)), &slower);
        assert!(outcome.regressions().is_empty(), "{outcome:?}");
    }

    #[test]
    fn only_rows_both_runs_have_are_compared() {
        let mut committed = run(C16, 90.0, 1.0);
        committed.extend(run(Row::Concurrency(64), 90.0, 1.0));
        let outcome = check(false, Ok(committed), &run(C16, 90.0, 1.0));
        let Outcome::Checked(all) = &outcome else {
            panic!("{outcome:?}")
        };
        assert_eq!(all.len(), Metric::ALL.len());
        assert!(all.iter().all(|c| c.row == C16));
        let disjoint = check(
            false,
            Ok(run(Row::Rate(3000), 90.0, 1.0)),
            &run(C16, 10.0, 9.0),
        );
        assert!(matches!(disjoint, Outcome::Skipped(_)), "{disjoint:?}");
    }

    #[test]
    fn quick_runs_skip_the_check() {
        assert!(matches!(
            check(true, Ok(run(C16, 90.0, 1.0)), &run(C16, 10.0, 9.0)),
            Outcome::Skipped(_)
        ));
    }
}
