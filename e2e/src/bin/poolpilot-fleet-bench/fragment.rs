//! Writes the fleet benchmark's markdown fragment (included in `BENCHMARKS.md` by
//! `poolpilot-bench --include`): each target met or not with its numbers, the run's details,
//! the method and how to run it again.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use poolpilot_e2e::fleet_bench::{FleetPlan, FleetResult};

/// Cold start to every policy settled, seconds.
pub const SETTLE_TARGET: f64 = 60.0;
/// Reconcile p99, seconds.
pub const RECONCILE_P99_TARGET: f64 = 1.0;
/// Queries per metric per round.
pub const QUERIES_TARGET: f64 = 1.0;
/// The rollout of an edit to every pod, seconds.
pub const ROLLOUT_TARGET: f64 = 10.0;

/// The run around the measurement.
#[derive(Clone, Debug)]
pub struct Run {
    /// A quick run.
    pub quick: bool,
    /// `date -u` at the start.
    pub started: String,
    /// `/proc/loadavg` at the start and the end.
    pub load: (String, String),
    /// Wall time in all.
    pub wall: Duration,
    /// The operator binary.
    pub operator_bin: PathBuf,
}

/// One target: what it asks, what was measured, whether it was met.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// What it asks.
    pub what: String,
    /// The numbers.
    pub measured: String,
    /// Met.
    pub met: bool,
}

fn secs(s: Option<f64>) -> String {
    match s {
        Some(s) if s < 1.0 => format!("{:.0} ms", s * 1000.0),
        Some(s) => format!("{s:.1} s"),
        None => "–".to_owned(),
    }
}

/// The pipeline's steps over a stretch: runs, p50 · p99 of each.
fn steps(times: &[poolpilot_e2e::fleet_bench::StepTimes]) -> String {
    times
        .iter()
        .map(|t| {
            format!(
                "{} {:.0}, {} · {}",
                t.step,
                t.count,
                secs(t.p50_p99.0),
                secs(t.p50_p99.1)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn rates(by_verb: &BTreeMap<String, f64>) -> String {
    let total: f64 = by_verb.values().sum();
    let parts: Vec<String> = by_verb.iter().map(|(v, n)| format!("{v} {n:.1}")).collect();
    if parts.is_empty() {
        "0".to_owned()
    } else {
        format!("{total:.1} ({})", parts.join(", "))
    }
}

/// The acceptance's targets against `r`.
pub fn targets(plan: &FleetPlan, r: &FleetResult) -> Vec<Target> {
    let size = format!("{} policies × {} pods", plan.policies, plan.pods);
    let settle = Target {
        what: format!(
            "{size} settled from a cold start in < {SETTLE_TARGET:.0} s (operator start → every policy \
             Accepted and RolledOut on its generation with every selected pod updated, every pod running \
             its group's backends)"
        ),
        measured: match r.settle {
            Some(s) => format!("{s:.1} s"),
            None => format!(
                "not within {:.0} s: {} of {} policies settled, {} pods not on their document",
                plan.settle_timeout.as_secs_f64(),
                r.settled,
                plan.policies,
                r.pods_wrong.0
            ),
        },
        met: r.settle.is_some_and(|s| s < SETTLE_TARGET),
    };
    let p99 = Target {
        what: format!(
            "p99 reconcile < {RECONCILE_P99_TARGET:.0} s (`poolpilot_operator_reconcile_duration_seconds`, \
             the operator's whole run)"
        ),
        measured: format!(
            "{} over the whole run (cold start {}, steady window {}, change of every group policy {})",
            secs(r.run_p99),
            secs(r.cold_reconcile.1),
            secs(r.steady_reconcile.1),
            secs(r.change_reconcile.1)
        ),
        met: r.run_p99.is_some_and(|p| p < RECONCILE_P99_TARGET),
    };
    let served = r.served_per_metric_round();
    let queries = Target {
        what: "≤ one PromQL query per metric per round".to_owned(),
        measured: format!(
            "operator's counters: at most {:.2} per metric per round ({} metrics, {:.0} rounds in the \
             steady window); Prometheus served {:.0} instant queries in {:.0} rounds: {} per metric per round",
            r.max_queries_per_metric(),
            r.queries_per_round.len(),
            r.rounds,
            r.served.0,
            r.served.1,
            served.map_or("–".to_owned(), |s| format!("{s:.2}"))
        ),
        met: r.rounds > 0.0
            && r.max_queries_per_metric() <= QUERIES_TARGET
            && served.is_some_and(|s| s <= QUERIES_TARGET),
    };
    let rollout = Target {
        what: format!(
            "rollout of an edit to all {} pods with `verifyIntervals: 0` in < {ROLLOUT_TARGET:.0} s",
            plan.pods
        ),
        measured: match r.rollout {
            Some(s) => format!("{s:.2} s ({:.0} PUTs)", r.rollout_puts),
            None => format!(
                "not within {:.0} s: {} of {} pods",
                plan.rollout_timeout.as_secs_f64(),
                r.rollout_reached,
                plan.pods
            ),
        },
        met: r.rollout.is_some_and(|s| s < ROLLOUT_TARGET),
    };
    let rss = Target {
        what: "operator RSS reported".to_owned(),
        measured: format!(
            "highest sample {}, peak (VmHWM) {}",
            mib(r.rss.0),
            r.rss.1.map_or("–".to_owned(), mib)
        ),
        met: r.rss.0 > 0,
    };
    vec![settle, p99, queries, rollout, rss]
}

/// Renders the fragment.
pub fn render(plan: &FleetPlan, run: &Run, result: &anyhow::Result<FleetResult>) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(
        w,
        "## Operator at {} policies × {} pods (part 7)\n\n\
         Written by `poolpilot-fleet-bench` ({}) on {}, against the embedded cluster's API server, with \
         the operator `{}` as a process of this machine. Load average {} at the start, {} at the end; \
         {:.0} s in all. Every number comes from that run; do not edit by hand.\n",
        plan.policies,
        plan.pods,
        if run.quick {
            "**quick mode**: a smaller fleet to validate the harness, not for conclusions; the targets are the full size's"
        } else {
            "full mode"
        },
        run.started,
        run.operator_bin.display(),
        run.load.0,
        run.load.1,
        run.wall.as_secs_f64()
    );
    match result {
        Ok(r) => {
            render_targets(w, plan, r);
            render_details(w, plan, r);
        }
        Err(e) => {
            let _ = writeln!(
                w,
                "**Not measured: the run failed.** `{}`\n",
                format!("{e:#}").replace('`', "'")
            );
        }
    }
    render_method(w, plan);
    md
}

fn render_targets(w: &mut String, plan: &FleetPlan, r: &FleetResult) {
    let _ = writeln!(
        w,
        "### Targets\n\n| target | measured | met |\n|---|---|---|"
    );
    for t in targets(plan, r) {
        let _ = writeln!(
            w,
            "| {} | {} | {} |",
            t.what,
            t.measured,
            if t.met { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(w);
}

fn render_details(w: &mut String, plan: &FleetPlan, r: &FleetResult) {
    let intervals = plan.interval.as_secs();
    let queries: Vec<String> = r
        .queries_per_round
        .iter()
        .map(|(q, n)| format!("{q} {n:.2}"))
        .collect();
    let rows = [
        (
            "pods and policies created (before the operator)".to_owned(),
            format!("{:.1} s", r.setup),
        ),
        (
            "cold start: settled".to_owned(),
            r.settle.map_or("no".to_owned(), |s| format!("{s:.1} s")),
        ),
        (
            "cold start: reconciles".to_owned(),
            format!("{:.0}", r.cold_reconciles),
        ),
        (
            "cold start: reconcile p50 · p99".to_owned(),
            format!(
                "{} · {}",
                secs(r.cold_reconcile.0),
                secs(r.cold_reconcile.1)
            ),
        ),
        (
            "cold start: API requests/s (by verb)".to_owned(),
            rates(&r.cold_api),
        ),
        (
            "cold start: steps (runs, p50 · p99)".to_owned(),
            steps(&r.cold_steps),
        ),
        (
            "cold start: namespace passes (by outcome)".to_owned(),
            r.cold_passes
                .iter()
                .map(|(o, n)| format!("{o} {n:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        (
            "cold start: operator CPU".to_owned(),
            r.cpu
                .0
                .map_or("–".to_owned(), |c| format!("{c:.1} CPU-seconds")),
        ),
        (
            format!(
                "steady window ({:.0} s): reconciles per {intervals} s interval",
                r.window.as_secs_f64()
            ),
            format!("{:.1}", r.steady_reconciles_per_interval),
        ),
        (
            "steady window: reconcile p50 · p99".to_owned(),
            format!(
                "{} · {}",
                secs(r.steady_reconcile.0),
                secs(r.steady_reconcile.1)
            ),
        ),
        (
            "steady window: PromQL queries per round, by metric".to_owned(),
            queries.join(", "),
        ),
        (
            "steady window: API requests/s (by verb)".to_owned(),
            rates(&r.steady_api),
        ),
        (
            "rollout of the fleet-wide edit".to_owned(),
            r.rollout.map_or(
                format!("{} of {} pods", r.rollout_reached, plan.pods),
                |s| format!("{s:.2} s, {:.0} PUTs", r.rollout_puts),
            ),
        ),
        (
            "a change of every group policy: written · settled".to_owned(),
            format!(
                "{:.1} s · {}",
                r.change_all.0,
                r.change_all.1.map_or(
                    format!(
                        "{} of {} policies within the timeout",
                        r.change_settled, plan.policies
                    ),
                    |s| format!("{s:.1} s from the first write")
                )
            ),
        ),
        (
            "a change of every group policy: reconcile p50 · p99".to_owned(),
            format!(
                "{} · {}",
                secs(r.change_reconcile.0),
                secs(r.change_reconcile.1)
            ),
        ),
        (
            "a change of every group policy: steps (runs, p50 · p99)".to_owned(),
            steps(&r.change_steps),
        ),
        (
            "operator RSS: highest sample · VmHWM".to_owned(),
            format!("{} · {}", mib(r.rss.0), r.rss.1.map_or("–".to_owned(), mib)),
        ),
        (
            "operator CPU, whole run".to_owned(),
            r.cpu
                .1
                .map_or("–".to_owned(), |c| format!("{c:.1} CPU-seconds")),
        ),
    ];
    let _ = writeln!(w, "### The run\n\n| | |\n|---|---|");
    for (k, v) in rows {
        let _ = writeln!(w, "| {k} | {v} |");
    }
    let _ = writeln!(w);
}

fn render_method(w: &mut String, plan: &FleetPlan) {
    let _ = writeln!(
        w,
        "### Method\n\n\
         {pods} simulated gateway pods (`poolpilot-fleet-sim`'s fleet, in the bench's process): each an \
         HTTPS admin endpoint on its own 127/8 address with the install's bearer token, answering PUTs \
         after {lat} ms; in the API server each is a Pod object with a scheduling gate (no scheduler \
         binds it, no kubelet runs it) whose status the bench writes as a kubelet would (`Running`, \
         `Ready`, `podIP` the simulated address). The pods make {groups} groups of {per} \
         (label `{group}`, each group's limits ConfigMap named by the `poolpilot.io/limits-configmap` \
         annotation, as the chart sets it); {gp} group policies go round the groups, each with one \
         backend on its group's pods, and one policy `fleet-wide` selects every pod, so each pod runs \
         the backends of about {bpp} policies. Every policy: autoscale on, bounds pinned (a decision \
         every {iv} s, no change), rollout Progressive with 1 canary pod and `verifyIntervals: 0`. \
         A private Prometheus scrapes the fleet's one target every {iv} s with `honor_labels` \
         ({series} series once every pod runs its document). The operator runs as a process of this \
         machine with the admin kubeconfig (`--namespace`, `--prometheus-url` that Prometheus, \
         `--gateway-ca-file` the fleet's CA, `--metrics-interval` and `--scrape-interval` {iv}s): the \
         node runs its pods in network namespaces of their own, where 127/8 is the pod's own loopback, \
         so an operator pod could not reach the simulated pods.\n\n\
         The cold start is timed from the operator's start to the first check (every second: the \
         policies' status from the API, each pod's document from the fleet) at which everything has \
         settled. Reconcile latencies are interpolated in the operator's histogram \
         (`poolpilot_operator_reconcile_duration_seconds`, buckets 1.5× apart). Queries per metric per \
         round: the operator's `poolpilot_operator_prometheus_queries_total{{query}}` ÷ `_rounds_total` in \
         the steady window, and Prometheus' own `prometheus_http_requests_total{{handler=\"/api/v1/query\"}}` \
         (no one else queries it) ÷ the operator's rounds ÷ its metrics over the whole run. The rollout \
         edits `fleet-wide`'s `pool.maxPending` and is timed from the API write's return to the last \
         pod running it, read from the fleet every 10 ms. Then every group policy is changed at once (its \
         backend's `pool.maxPending`, {gp} merge patches 16 at a time) and timed from the first write until \
         every policy has settled on its new generation and every pod runs the change; its reconcile \
         latencies and steps are the histograms' growth from the operator's metrics read just before \
         the first write to those read at the end. RSS is `/proc/<pid>/status`' `VmRSS` every \
         500 ms and `VmHWM` at the end; CPU `/proc/<pid>/stat`.\n\n\
         ```sh\n\
         make cluster-up\n\
         cargo build --workspace --bins\n\
         CARGO_TARGET_DIR=$HOME/.cache/poolpilot/target-bench cargo build --release -p poolpilot-operator\n\
         $CARGO_TARGET_DIR/debug/poolpilot-fleet-bench --out /tmp/operator-fleet.md \\\n  \
         --operator-bin $HOME/.cache/poolpilot/target-bench/release/poolpilot-operator   # --quick: 200 × 100\n\
         ```\n\n\
         The binary takes the scenario lock, so it never overlaps a scenario run; the harness is \
         `e2e/src/fleet_bench.rs` and `e2e/src/bin/poolpilot-fleet-bench/`.\n",
        pods = plan.pods,
        lat = plan.put_latency.as_millis(),
        groups = plan.groups(),
        per = plan.pods_per_group,
        group = poolpilot_e2e::fleet_bench::GROUP_LABEL,
        gp = plan.group_policies(),
        bpp = plan.expected_backends(0).len(),
        iv = plan.interval.as_secs(),
        series = plan.series(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(plan: &FleetPlan) -> FleetResult {
        FleetResult {
            plan: plan.clone(),
            operator_bin: PathBuf::new(),
            setup: 20.0,
            settle: Some(42.0),
            settled: plan.policies,
            pods_wrong: (0, Vec::new()),
            cold_reconcile: (Some(0.01), Some(0.4)),
            cold_reconciles: 4100.0,
            cold_api: [("patch".to_owned(), 50.0), ("create".to_owned(), 10.0)].into(),
            cold_steps: vec![poolpilot_e2e::fleet_bench::StepTimes {
                step: "plan".into(),
                count: 4000.0,
                p50_p99: (Some(0.004), Some(0.6)),
            }],
            cold_passes: [("planned".to_owned(), 300.0), ("reused".to_owned(), 3700.0)].into(),
            steady_reconcile: (Some(0.005), Some(0.05)),
            run_p99: Some(0.5),
            steady_reconciles_per_interval: 2000.0,
            steady_api: [("patch".to_owned(), 1.0)].into(),
            window: Duration::from_secs(60),
            queries_per_round: [("leased".to_owned(), 1.0), ("pending".to_owned(), 1.0)].into(),
            rounds: 4.0,
            served: (40.0, 20.0),
            rollout: Some(3.2),
            rollout_reached: plan.pods,
            rollout_puts: 1000.0,
            change_all: (12.0, Some(45.0)),
            change_reconcile: (Some(0.01), Some(0.4)),
            change_steps: Vec::new(),
            change_settled: 0,
            rss: (300 << 20, Some(310 << 20)),
            cpu: (Some(30.0), Some(50.0)),
        }
    }

    #[test]
    fn targets_are_met_by_numbers_under_them_and_not_over() {
        let plan = FleetPlan::full();
        let good = result(&plan);
        assert!(targets(&plan, &good).iter().all(|t| t.met));
        let mut slow = good.clone();
        slow.settle = Some(61.0);
        slow.run_p99 = Some(1.2);
        slow.rollout = None;
        slow.rollout_reached = 800;
        slow.served = (41.0, 20.0);
        let t = targets(&plan, &slow);
        assert_eq!(
            t.iter().map(|t| t.met).collect::<Vec<_>>(),
            [false, false, false, false, true]
        );
        assert!(
            t[3].measured.contains("800 of 1000 pods"),
            "{}",
            t[3].measured
        );
        assert!(
            t[2].measured.contains("1.02 per metric per round"),
            "{}",
            t[2].measured
        );
        let mut unsettled = good.clone();
        unsettled.settle = None;
        unsettled.settled = 1500;
        unsettled.pods_wrong = (7, vec!["gw-sim-3".into()]);
        let t = targets(&plan, &unsettled);
        assert!(!t[0].met);
        assert!(
            t[0].measured
                .contains("1500 of 2000 policies settled, 7 pods")
        );
        let mut twice = good;
        twice.queries_per_round.insert("leased".into(), 2.0);
        assert!(!targets(&plan, &twice)[2].met);
    }

    #[test]
    fn the_fragment_states_each_target_and_a_failure() {
        let plan = FleetPlan::full();
        let run = Run {
            quick: false,
            started: "2026-12-03 18:00 UTC".into(),
            load: ("1.0".into(), "2.0".into()),
            wall: Duration::from_secs(300),
            operator_bin: PathBuf::from("/x/release/poolpilot-operator"),
        };
        let md = render(&plan, &run, &Ok(result(&plan)));
        assert!(md.starts_with("## Operator at 2000 policies × 1000 pods (part 7)"));
        assert_eq!(md.matches("| yes |").count(), 5, "{md}");
        assert!(md.contains("| 42.0 s | yes |"));
        assert!(md.contains("100 groups of 10"));
        assert!(md.contains("| a change of every group policy: written · settled | 12.0 s · 45.0 s from the first write |"), "{md}");
        assert!(md.contains(&format!("{} series", plan.series())));
        assert!(
            md.contains("| cold start: steps (runs, p50 · p99) | plan 4000, 4 ms · 600 ms |"),
            "{md}"
        );
        assert!(
            md.contains("| cold start: namespace passes (by outcome) | planned 300, reused 3700 |")
        );
        let failed = render(&plan, &run, &Err(anyhow::anyhow!("no `Prometheus`")));
        assert!(failed.contains("**Not measured: the run failed.** `no 'Prometheus'`"));
        assert!(!failed.contains("### Targets"));
    }
}
