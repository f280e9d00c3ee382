//! The loop benchmark's run: the order of the parts on the embedded cluster and the results
//! they hand to the fragment writer (the plan is in plan.rs).
//!
//! ```text
//!  stack "loopb" (3 gateways, 3 × model-a) ── control: flash crowd × {autoscale, static start, static max}
//!                                          └─ rollout: maxConcurrency edit at 3 → 10 → 30 gateways
//!  stack "scaleb" (5 gateways, no backends) ── scale: 1 → 20 → 50 → 200 policies, operator metrics
//! ```

pub mod control;
pub mod fragment;
mod plan;
pub mod rollout;
pub mod scale;

pub use plan::{Part, Plan, median};

use std::time::Duration;

use poolpilot_bench::machine::{loadavg, utc_now};
use poolpilot_e2e::stack::{BackendSpec, StackSpec, with_stack};
use tokio::time::Instant;

/// What the run measured; a part that failed keeps its error.
#[derive(Debug, Default)]
pub struct Results {
    /// Part 5, the flash crowd.
    pub control: Option<anyhow::Result<control::ControlResult>>,
    /// Part 5, rollout times.
    pub rollout: Option<anyhow::Result<rollout::RolloutTimes>>,
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
/// model-a instances with 64 slots and a 1 s service time). The rollout part scales the gateways
/// to 30, which the node's 2 CPUs hold only at a small CPU request (the scheduler counts requests;
/// the pods share the CPUs as before).
fn crowd_stack() -> StackSpec {
    StackSpec {
        gateways: 3,
        gateway_cpu_request: Some("10m"),
        backends: vec![BackendSpec::new("model-a", 3, 64).service_ms(control::SERVICE_MS)],
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
        let outcome = with_stack("loopb", crowd_stack(), async |stack| {
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
        let outcome = with_stack("scaleb", scale::stack(), async |stack| {
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
