//! The loop benchmark's plan (how long and how big each part runs, quick or full), the order of
//! the parts on the embedded cluster, and the results they hand to the fragment writer.
//!
//! ```text
//!  stack "loopb" (3 gateways, 3 × model-a) ── control: flash crowd × {autoscale, static start, static max}
//!                                          └─ rollout: maxConcurrency edit at 3 → 10 → 30 gateways
//!  stack "scaleb" (5 gateways, no backends) ── scale: 1 → 20 → 50 → 200 policies, operator metrics
//! ```

pub mod control;
pub mod fragment;
pub mod rollout;
pub mod scale;

use std::path::PathBuf;
use std::time::Duration;

use poolpilot_bench::machine::{loadavg, utc_now};
use poolpilot_e2e::stack::{BackendSpec, StackSpec, with_stack};
use tokio::time::Instant;

/// One part of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The flash crowd three ways.
    Control,
    /// Rollout time of a limit edit.
    Rollout,
    /// The operator at many policies.
    Scale,
}

impl Part {
    const ALL: [Part; 3] = [Part::Control, Part::Rollout, Part::Scale];

    /// Parses `control,rollout,scale` (all when empty).
    pub fn parse_list(list: &str) -> anyhow::Result<Vec<Part>> {
        if list.trim().is_empty() {
            return Ok(Self::ALL.to_vec());
        }
        list.split(',')
            .map(|p| match p.trim() {
                "control" => Ok(Part::Control),
                "rollout" => Ok(Part::Rollout),
                "scale" => Ok(Part::Scale),
                other => anyhow::bail!("unknown part {other:?} (control, rollout, scale)"),
            })
            .collect()
    }
}

/// How long and how big each part runs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Short runs that validate the harness.
    pub quick: bool,
    /// How long each flash crowd lasts (a whole number of 15 s buckets).
    pub crowd: Duration,
    /// Gateway counts of the rollout part.
    pub rollout_pods: Vec<u32>,
    /// Edits per gateway count.
    pub rollout_reps: usize,
    /// Policy counts of the scale part.
    pub policy_levels: Vec<usize>,
    /// How long the operator is measured at each policy count.
    pub scale_window: Duration,
    /// Where the operator and gateway binaries the pods run come from (`None`: the images',
    /// the workspace's debug build).
    pub binaries: Option<PathBuf>,
}

impl Plan {
    /// The quick or the full plan, its pods running the binaries in `binaries`.
    pub fn new(quick: bool, binaries: Option<PathBuf>) -> Self {
        if quick {
            Self {
                quick,
                crowd: Duration::from_secs(30),
                rollout_pods: vec![3, 10],
                rollout_reps: 2,
                policy_levels: vec![1, 20],
                scale_window: Duration::from_secs(15),
                binaries,
            }
        } else {
            Self {
                quick,
                crowd: Duration::from_secs(60),
                rollout_pods: vec![3, 10, 30],
                rollout_reps: 5,
                policy_levels: vec![1, 20, 50, 200],
                scale_window: Duration::from_secs(30),
                binaries,
            }
        }
    }
}

/// What the run measured; a part that failed keeps its error.
#[derive(Debug, Default)]
pub struct Results {
    /// Part 5, the flash crowd.
    pub control: Option<anyhow::Result<control::ControlResult>>,
    /// Part 5, rollout times.
    pub rollout: Option<anyhow::Result<Vec<rollout::RolloutRow>>>,
    /// Part 6.
    pub scale: Option<anyhow::Result<Vec<scale::ScaleRow>>>,
    /// `date -u` at the start.
    pub started: String,
    /// `/proc/loadavg` at the start and the end.
    pub load: (String, String),
    /// Wall time of the whole run.
    pub wall: Duration,
}

impl Results {
    /// An error naming every part that failed, if any did.
    pub fn failures(&self) -> anyhow::Result<()> {
        let mut failed = Vec::new();
        if let Some(Err(e)) = &self.control {
            failed.push(format!("control: {e:#}"));
        }
        if let Some(Err(e)) = &self.rollout {
            failed.push(format!("rollout: {e:#}"));
        }
        if let Some(Err(e)) = &self.scale {
            failed.push(format!("scale: {e:#}"));
        }
        anyhow::ensure!(failed.is_empty(), "{}", failed.join("\n"));
        Ok(())
    }
}

/// The stack of the control and rollout parts: the flash-crowd scenario's (3 gateways, three
/// model-a instances with 64 slots and a 1 s service time).
fn crowd_stack(plan: &Plan) -> StackSpec {
    StackSpec {
        gateways: 3,
        backends: vec![BackendSpec::new("model-a", 3, 64).service_ms(control::SERVICE_MS)],
        binaries: plan.binaries.clone(),
        ..StackSpec::default()
    }
}

/// Runs the parts, each to its end or its first error.
pub async fn run(plan: &Plan, parts: &[Part]) -> Results {
    let start = Instant::now();
    let mut results = Results {
        started: utc_now(),
        load: (loadavg(), String::new()),
        ..Results::default()
    };
    let want = |p: Part| parts.contains(&p);
    if want(Part::Control) || want(Part::Rollout) {
        let mut control = None;
        let mut rollout = None;
        let outcome = with_stack("loopb", crowd_stack(plan), async |stack| {
            if want(Part::Control) {
                eprintln!("poolpilot-loop-bench: part 5, flash crowd three ways");
                control = Some(control::run(stack, plan).await);
            }
            if want(Part::Rollout) {
                eprintln!("poolpilot-loop-bench: part 5, rollout times");
                rollout = Some(rollout::run(stack, plan).await);
            }
            // A failed part fails the stack too, so that its namespace is dumped.
            match (&control, &rollout) {
                (Some(Err(_)), _) | (_, Some(Err(_))) => anyhow::bail!("a part failed"),
                _ => Ok(()),
            }
        })
        .await;
        if let Err(e) = outcome {
            // The stack failed to deploy: every part it was to run failed with it.
            let why = format!("{e:#}");
            control =
                control.or_else(|| want(Part::Control).then(|| Err(anyhow::anyhow!("{why}"))));
            rollout =
                rollout.or_else(|| want(Part::Rollout).then(|| Err(anyhow::anyhow!("{why}"))));
        }
        results.control = control;
        results.rollout = rollout;
    }
    if want(Part::Scale) {
        eprintln!("poolpilot-loop-bench: part 6, operator scale");
        let mut scale = None;
        let outcome = with_stack("scaleb", scale::stack(plan), async |stack| {
            let rows = scale::run(stack, plan).await?;
            scale = Some(Ok(rows));
            Ok(())
        })
        .await;
        if let Err(e) = outcome {
            scale = Some(Err(e));
        }
        results.scale = scale;
    }
    results.load.1 = loadavg();
    results.wall = start.elapsed();
    results
}

/// The median of `values` (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_default_to_all() {
        assert_eq!(Part::parse_list("").unwrap(), Part::ALL.to_vec());
        assert_eq!(
            Part::parse_list("scale, control").unwrap(),
            vec![Part::Scale, Part::Control]
        );
        assert!(Part::parse_list("proxy").is_err());
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
