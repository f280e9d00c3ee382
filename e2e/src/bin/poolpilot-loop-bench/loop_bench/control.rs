//! Part 5a: the flash-crowd scenario (`e2e/tests/scenarios/flash_crowd.rs`) played three ways on
//! one stack with the same load — poolpilot autoscaling from its minimum, a static target at that
//! minimum (autoscale off, max = min), a static target at the maximum — and measured from the
//! client side (error rate per 15 s bucket, time to recover below 0.5%) and the backend side
//! (modelsim's peak counters, reset when each crowd starts).
//!
//! ```text
//!  light load (3 workers) ─► target at the mode's starting value, on every gateway
//!  crowd: 42 workers (1 s calls, 300 ms lease timeout) against a fleet pool of 9 × 3 endpoints
//!  ─► buckets of 15 s, recovery second, decision and rollout (autoscale), backend peaks
//! ```

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec, Tally};
use poolpilot_e2e::stack::{Stack, WAIT, one_backend_policy, set, share};
use serde_json::{Value, json};

use super::Plan;

/// Service time of one call (the flash-crowd scenario's).
pub const SERVICE_MS: u32 = 1000;
/// Autoscale interval.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// The starting target: 3 per pod per endpoint.
pub const MIN: u32 = 9;
/// The maximum: model-a's capacity 64 × (1 − 0.2).
pub const MAX: u32 = 51;
/// Workers before and after a crowd.
pub const LIGHT: usize = 3;
/// Workers of the crowd: 42 in flight against a fleet pool of 27 (+56%).
pub const CROWD: usize = 42;
/// The error rate under which the load has recovered.
pub const RECOVERED: f64 = 0.005;
/// Width of a reported bucket.
pub const BUCKET: u64 = 15;
/// Width of the windows that must all stay below [`RECOVERED`] from the recovery second on.
const RECOVERY_WINDOW: u64 = 5;
const GATEWAYS: usize = 3;

/// How the target is managed during a crowd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Autoscale off, target fixed at [`MIN`].
    StaticStart,
    /// Autoscale off, target fixed at [`MAX`].
    StaticMax,
    /// poolpilot's loop, starting from [`MIN`].
    Autoscale,
}

impl Mode {
    /// The row label.
    pub fn label(self) -> &'static str {
        match self {
            Mode::StaticStart => "static at start (target 9)",
            Mode::StaticMax => "static at max (target 51)",
            Mode::Autoscale => "poolpilot autoscale (9 → ?)",
        }
    }
}

/// The operator's decision during an autoscaled crowd.
#[derive(Clone, Debug)]
pub struct Decision {
    /// `from → to`.
    pub from: u32,
    /// See `from`.
    pub to: u32,
    /// The reason in the status.
    pub reason: String,
    /// Seconds from the crowd's start until the status showed it.
    pub seen_after: u64,
    /// Seconds from the crowd's start until every gateway ran the new shares.
    pub rolled_after: Option<u64>,
}

/// modelsim's counters over one crowd, across the backend's instances.
#[derive(Clone, Debug, Default)]
pub struct Peaks {
    /// Highest in-flight requests of any one instance.
    pub in_flight_max: u64,
    /// Sum of the instances' in-flight peaks (an upper bound of the fleet's simultaneous peak).
    pub in_flight_sum: u64,
    /// Highest open connections of any one instance.
    pub connections_max: u64,
    /// Sum of the instances' connection peaks.
    pub connections_sum: u64,
    /// Instances read.
    pub instances: usize,
}

/// One crowd.
#[derive(Clone, Debug)]
pub struct CrowdRun {
    /// How the target was managed.
    pub mode: Mode,
    /// The fleet target when the crowd started, and when it ended.
    pub target: (u32, u32),
    /// Outcomes per 15 s bucket from the crowd's start.
    pub buckets: Vec<Tally>,
    /// Outcomes over the whole crowd.
    pub total: Tally,
    /// Seconds from the crowd's start to the first second from which every 5 s window stays
    /// below 0.5%; `None`: never within the crowd.
    pub recovered_after: Option<u64>,
    /// The decision (autoscale only).
    pub decision: Option<Decision>,
    /// Backend peaks.
    pub peaks: Peaks,
}

/// Part 5a's result.
#[derive(Clone, Debug)]
pub struct ControlResult {
    /// One run per mode, in the order static start, static max, autoscale.
    pub runs: Vec<CrowdRun>,
    /// The crowd's length.
    pub crowd: Duration,
}

/// The policy of one mode: the quick sample with model-a only, decisions every 10 s, shrinking
/// in one step after 10 s (the flash-crowd scenario's), or autoscale off at a fixed target.
pub fn policy(mode: Mode) -> anyhow::Result<Value> {
    let (enabled, min, max) = match mode {
        Mode::Autoscale => (true, MIN, MAX),
        Mode::StaticStart => (false, MIN, MIN),
        Mode::StaticMax => (false, MIN, MAX),
    };
    let mut p = one_backend_policy("model-a", INTERVAL, min, max)?;
    set(&mut p, "/spec/autoscale/enabled", json!(enabled))?;
    Ok(p)
}

/// Runs the three crowds on `stack` (autoscale first, from a fresh policy, as the scenario does).
pub async fn run(stack: &Stack<'_>, plan: &Plan) -> anyhow::Result<ControlResult> {
    stack.apply(&policy(Mode::Autoscale)?).await?;
    let gateways = stack.wait_gateways(GATEWAYS).await?;
    let load = Load::start(
        LoadSpec::one_client_per_worker(
            gateways.iter().map(|g| g.proxy()).collect(),
            "model-a",
            4,
            CROWD,
            Duration::from_secs(30),
        ),
        LIGHT,
    )?;
    let mut runs = Vec::new();
    for mode in [Mode::Autoscale, Mode::StaticStart, Mode::StaticMax] {
        eprintln!("poolpilot-loop-bench:   crowd, {}", mode.label());
        let run = crowd(stack, &load, mode, plan.crowd)
            .await
            .with_context(|| format!("crowd {}", mode.label()))?;
        eprintln!(
            "poolpilot-loop-bench:   {}: {} · recovered {:?}",
            mode.label(),
            run.total,
            run.recovered_after
        );
        runs.push(run);
    }
    load.stop().await;
    runs.sort_by_key(|r| match r.mode {
        Mode::StaticStart => 0,
        Mode::StaticMax => 1,
        Mode::Autoscale => 2,
    });
    Ok(ControlResult {
        runs,
        crowd: plan.crowd,
    })
}

/// Brings the stack to the mode's starting target under light load, then plays one crowd.
async fn crowd(
    stack: &Stack<'_>,
    load: &Load,
    mode: Mode,
    length: Duration,
) -> anyhow::Result<CrowdRun> {
    load.set_workers(LIGHT);
    let start_target = if mode == Mode::StaticMax { MAX } else { MIN };
    if mode != Mode::Autoscale {
        stack.apply(&policy(mode)?).await?;
    }
    // A new autoscaled policy starts at its upper bound and shrinks to min under light load.
    eventually("the target at the mode's start", WAIT, || async {
        let b = stack.backend_status("model-a").await?;
        anyhow::ensure!(
            b.target == start_target,
            "target {} (want {start_target})",
            b.target
        );
        Ok(())
    })
    .await?;
    let expected = shares_of(start_target);
    stack
        .wait_limits(
            "every gateway runs the starting shares",
            GATEWAYS,
            WAIT,
            |l| {
                let s = share(l, "model-a")?;
                anyhow::ensure!(
                    expected.contains(&s),
                    "share {s} (want one of {expected:?})"
                );
                Ok(())
            },
        )
        .await?;
    if mode == Mode::Autoscale {
        // Start right after a decision, so that the next one sees the crowd only.
        stack.wait_next_decision(INTERVAL * 3).await?;
    } else {
        // A few seconds of light load on the new shares, as before the autoscaled crowd.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let backends = stack.backends("model-a").await?;
    for b in &backends {
        b.reset_peaks().await?;
    }
    load.set_workers(CROWD);
    let first = load.now();
    let end = first + length.as_secs();
    let mut decision: Option<Decision> = None;
    while load.now() < end {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if mode != Mode::Autoscale {
            continue;
        }
        match &mut decision {
            None => {
                let b = stack.backend_status("model-a").await?;
                if let Some(last) = b.last_scale.filter(|l| l.from == MIN && l.to > MIN) {
                    decision = Some(Decision {
                        from: last.from,
                        to: last.to,
                        reason: last.reason,
                        seen_after: load.now() - first,
                        rolled_after: None,
                    });
                }
            }
            Some(d) if d.rolled_after.is_none() => {
                let want = shares_of(d.to);
                let mut all = true;
                for g in stack.gateways().await? {
                    let s = g
                        .limits()
                        .await
                        .ok()
                        .and_then(|l| share(&l, "model-a").ok());
                    all &= s.is_some_and(|s| want.contains(&s));
                }
                if all {
                    d.rolled_after = Some(load.now() - first);
                }
            }
            Some(_) => {}
        }
    }
    load.set_workers(LIGHT);
    let mut peaks = Peaks::default();
    for b in &backends {
        let s = b.stats().await?;
        peaks.in_flight_max = peaks.in_flight_max.max(s.in_flight_peak);
        peaks.in_flight_sum += s.in_flight_peak;
        peaks.connections_max = peaks.connections_max.max(s.connections_peak);
        peaks.connections_sum += s.connections_peak;
        peaks.instances += 1;
    }
    let end_target = stack.backend_status("model-a").await?.target;
    let buckets = (first..end)
        .step_by(BUCKET as usize)
        .map(|s| load.window(s, (s + BUCKET).min(end)))
        .collect();
    let windows: Vec<f64> = (first..end.saturating_sub(RECOVERY_WINDOW - 1))
        .map(|w| load.window(w, w + RECOVERY_WINDOW).error_rate())
        .collect();
    Ok(CrowdRun {
        mode,
        target: (start_target, end_target),
        buckets,
        total: load.window(first, end),
        recovered_after: recovery(&windows),
        decision,
        peaks,
    })
}

/// The per-pod shares a fleet target splits into over the gateways (the remainder goes one each
/// to some pods).
fn shares_of(target: u32) -> Vec<u32> {
    let base = target / GATEWAYS as u32;
    if target.is_multiple_of(GATEWAYS as u32) {
        vec![base]
    } else {
        vec![base, base + 1]
    }
}

/// The first index from which every window's error rate stays below [`RECOVERED`]; `None` when
/// the last window does not.
pub fn recovery(windows: &[f64]) -> Option<u64> {
    let mut from = None;
    for (i, rate) in windows.iter().enumerate().rev() {
        if *rate >= RECOVERED {
            break;
        }
        from = Some(i as u64);
    }
    from
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_is_the_start_of_the_final_clean_run() {
        assert_eq!(recovery(&[0.5, 0.2, 0.0, 0.01, 0.0, 0.0]), Some(4));
        assert_eq!(recovery(&[0.0, 0.0]), Some(0));
        assert_eq!(recovery(&[0.0, 0.3]), None);
        assert_eq!(recovery(&[]), None);
    }

    #[test]
    fn shares_split_the_target() {
        assert_eq!(shares_of(9), vec![3]);
        assert_eq!(shares_of(17), vec![5, 6]);
    }

    #[test]
    fn modes_set_the_bounds() {
        let p = policy(Mode::StaticStart).unwrap();
        assert_eq!(p["spec"]["autoscale"]["enabled"], false);
        assert_eq!(p["spec"]["autoscale"]["max"], MIN);
        let p = policy(Mode::Autoscale).unwrap();
        assert_eq!(p["spec"]["autoscale"]["enabled"], true);
        assert_eq!(
            (
                p["spec"]["autoscale"]["min"].clone(),
                p["spec"]["autoscale"]["max"].clone()
            ),
            (json!(MIN), json!(MAX))
        );
        assert_eq!(p["spec"]["backends"].as_array().unwrap().len(), 1);
    }
}
