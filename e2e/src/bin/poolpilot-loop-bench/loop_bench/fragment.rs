//! Writes the loop benchmark's markdown fragment (included in `BENCHMARKS.md` by
//! `poolpilot-bench --include`): the targets met or not, the flash crowd's tables, the rollout
//! times, the operator at scale, the method and how to reproduce one row.

use std::fmt::Write as _;

use super::control::{
    BUCKET, CROWD, ControlResult, CrowdRun, INTERVAL, LIGHT, MAX, MIN, Mode, SERVICE_MS,
};
use super::rollout::{self, DefaultRolloutRow, RolloutRow, RolloutTimes};
use super::scale::{self, ScaleRow};
use super::{Plan, Results};

/// The rollout target: every pod within this many milliseconds of the apply.
const ROLLOUT_TARGET_MS: f64 = 2000.0;
/// The default rollout's target: the last pod within this long after its verification period.
const DEFAULT_ROLLOUT_SLACK_MS: f64 = 2000.0;

/// Renders the fragment.
pub fn render(plan: &Plan, r: &Results) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(
        w,
        "## Control loop and operator scale (parts 5–6)\n\n\
         Written by `poolpilot-loop-bench` ({}) on {}, on the embedded cluster \
         (`make cluster-up`: real etcd, kube-apiserver and controller-manager, the kubelet with \
         containerd and runc running every pod from its image: operator, gateways and modelsim \
         of the {} build; Prometheus scraping every 2 s, the operator querying it every 2 s). \
         Load average \
         {} at the start, {} at the end; {:.0} s in all. Every number comes from that run; do not \
         edit by hand.\n",
        if plan.quick {
            "**quick mode**: short runs to validate the harness, not for conclusions"
        } else {
            "full mode"
        },
        r.started,
        if plan.image_profile == "release" {
            "release".to_owned()
        } else {
            format!("**{}**", plan.image_profile)
        },
        r.load.0,
        r.load.1,
        r.wall.as_secs_f64()
    );
    render_targets(w, plan, r);
    match &r.control {
        Some(Ok(c)) => render_control(w, c),
        Some(Err(e)) => failed(w, "Flash crowd three ways", e),
        None => {}
    }
    match &r.rollout {
        Some(Ok(times)) => render_rollout(w, times),
        Some(Err(e)) => failed(w, "Rollout time of a limit edit", e),
        None => {}
    }
    match &r.scale {
        Some(Ok(rows)) => render_scale(w, plan, rows),
        Some(Err(e)) => failed(w, "Operator scale", e),
        None => {}
    }
    render_reproduce(w);
    md
}

fn failed(w: &mut String, what: &str, e: &anyhow::Error) {
    let _ = writeln!(
        w,
        "### {what}\n\n**Not measured: the run failed.** `{}`\n",
        format!("{e:#}").replace('`', "'")
    );
}

fn pct(rate: f64) -> String {
    format!("{:.2}%", rate * 100.0)
}

fn render_targets(w: &mut String, plan: &Plan, r: &Results) {
    let _ = writeln!(w, "### Targets\n");
    let _ = writeln!(w, "| target | measured | met |\n|---|---|---|");
    if let Some(Ok(c)) = &r.control {
        let find = |m: Mode| c.runs.iter().find(|run| run.mode == m);
        if let (Some(auto), Some(start)) = (find(Mode::Autoscale), find(Mode::StaticStart)) {
            // Within 2 intervals of the rollout (the flash-crowd scenario's bound), and never
            // for the static pool at the starting value.
            let bound = auto
                .decision
                .as_ref()
                .and_then(|d| d.rolled_after)
                .map(|s| s + 2 * INTERVAL.as_secs());
            let auto_ok = matches!((auto.recovered_after, bound), (Some(a), Some(b)) if a <= b);
            let start_ok = start.recovered_after.is_none();
            let _ = writeln!(
                w,
                "| control loop recovers below 0.5% errors within 2 intervals (of its rollout), static-at-start does not | autoscale: {}; static at start: {} | {} |",
                recovered_text(auto),
                recovered_text(start),
                yes_no(auto_ok && start_ok)
            );
        }
    }
    if let Some(Ok(times)) = &r.rollout {
        if let Some(row) = times.fast.iter().max_by_key(|row| row.pods) {
            let (med, max) = RolloutRow::median_max_ms(&row.from_return);
            let _ = writeln!(
                w,
                "| fast path (`verifyIntervals: 0`): rollout to {} pods under 2 s (from `kubectl apply` returning) | median {med:.0} ms, max {max:.0} ms | {} |",
                row.pods,
                yes_no(max < ROLLOUT_TARGET_MS)
            );
        }
        let row = &times.default;
        let verify_ms = default_verify_ms();
        let (_, canary_max) = RolloutRow::median_max_ms(&row.canary);
        let (med, max) = RolloutRow::median_max_ms(&row.last);
        let min = row
            .last
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .fold(f64::INFINITY, f64::min);
        let _ = writeln!(
            w,
            "| default rollout: the canary at once (under 2 s), the other {} pods after its verification ({:.0} s), within 2 s of its end | canary max {canary_max:.0} ms; last pod min {:.1} s, median {:.1} s, max {:.1} s | {} |",
            row.pods.saturating_sub(1),
            verify_ms / 1e3,
            min / 1e3,
            med / 1e3,
            max / 1e3,
            yes_no(
                !row.last.is_empty()
                    && canary_max < ROLLOUT_TARGET_MS
                    && min >= verify_ms
                    && max < verify_ms + DEFAULT_ROLLOUT_SLACK_MS
            )
        );
    }
    if let Some(Ok(rows)) = &r.scale {
        // Only windows without an operator restart have meaningful counters.
        let valid: Vec<&ScaleRow> = rows.iter().filter(|row| row.valid()).collect();
        let largest = plan.policy_levels.iter().max().copied().unwrap_or_default();
        let measured = valid
            .iter()
            .map(|row| format!("{:.1} per round at {}", row.queries_per_round, row.policies))
            .collect::<Vec<_>>()
            .join(", ");
        let flat = valid
            .windows(2)
            .all(|p| p[1].queries_per_round <= p[0].queries_per_round + 1e-9);
        let reached = valid.iter().any(|row| row.policies == largest);
        let _ = writeln!(
            w,
            "| PromQL queries per interval do not grow with policies (up to {largest}) | {measured}{} | {} |",
            if reached {
                String::new()
            } else {
                format!("; **not measurable at {largest}**: see the operator restarts below")
            },
            if reached {
                yes_no(flat)
            } else {
                "**not shown**"
            }
        );
        let stable = rows
            .iter()
            .all(|row| row.valid() && row.settle.is_some() && row.restarts.1 == 0);
        let _ = writeln!(
            w,
            "| the operator holds {largest} policies × {} pods (settles, no restart) | {} | {} |",
            scale::PODS,
            rows.iter()
                .map(|row| format!(
                    "{}: {}, {} restarts{}",
                    row.policies,
                    row.settle
                        .map_or("not settled".to_owned(), |s| format!("settled in {s:.0} s")),
                    row.restarts.1,
                    row.last_exit
                        .as_ref()
                        .map_or(String::new(), |e| format!(" (last: {e})"))
                ))
                .collect::<Vec<_>>()
                .join("; "),
            yes_no(stable && rows.iter().any(|row| row.policies == largest))
        );
    }
    let _ = writeln!(w);
}

fn yes_no(ok: bool) -> &'static str {
    if ok { "yes" } else { "**no**" }
}

fn recovered_text(run: &CrowdRun) -> String {
    match run.recovered_after {
        Some(0) => "no errors to recover from".to_owned(),
        Some(s) => format!("below 0.5% from +{s} s"),
        None => "never within the crowd".to_owned(),
    }
}

fn render_control(w: &mut String, c: &ControlResult) {
    let buckets = c.crowd.as_secs().div_ceil(BUCKET);
    let _ = writeln!(
        w,
        "### Flash crowd three ways\n\n\
         The flash-crowd scenario (`e2e/tests/scenarios/flash_crowd.rs`, the lease-timeout incident scaled to this \
         machine) on one stack: 3 gateway pods, 3 model-a instances (modelsim, 64 slots, {SERVICE_MS} ms \
         per call), lease timeout 300 ms. {LIGHT} closed-loop workers, then a crowd of {CROWD} for \
         {} s against a fleet pool of {MIN} × 3 endpoints = {} (+56%), then {LIGHT} again. The same \
         load in each mode; modes in the order autoscale, static at start, static at max. \
         Autoscale: interval {} s, bounds [{MIN}, {MAX}], the crowd starts right after a decision. \
         Error rate per {BUCKET} s bucket from the crowd's start:\n",
        c.crowd.as_secs(),
        MIN * 3,
        INTERVAL.as_secs()
    );
    let _ = write!(w, "| mode |");
    for b in 0..buckets {
        let _ = write!(w, " {}–{} s |", b * BUCKET, (b + 1) * BUCKET);
    }
    let _ = writeln!(
        w,
        " whole crowd | calls | recovered below 0.5% | target start → end |"
    );
    let _ = write!(w, "|---|");
    for _ in 0..buckets {
        let _ = write!(w, "---:|");
    }
    let _ = writeln!(w, "---:|---:|---|---|");
    for run in &c.runs {
        let _ = write!(w, "| {} |", label(run));
        for b in &run.buckets {
            let _ = write!(w, " {} |", pct(b.error_rate()));
        }
        let _ = writeln!(
            w,
            " {} | {} | {} | {} → {} |",
            pct(run.total.error_rate()),
            run.total.calls,
            recovered_text(run),
            run.target.0,
            run.target.1
        );
    }
    let _ = writeln!(
        w,
        "\n\"Recovered\": the first second from which every 5-second window of the crowd stays \
         below 0.5% errors (\"never\": the last window does not). Errors are the gateways' \
         `lease_timeout` 503s unless the table below says otherwise.\n"
    );
    let _ = writeln!(
        w,
        "| mode | errors by reason | decision (status `lastScale`) | seen / rolled out | backend in-flight peak: max instance · sum of instances | backend connections peak: max · sum |\n|---|---|---|---|---:|---:|"
    );
    for run in &c.runs {
        let errors = if run.total.errors.is_empty() {
            "none".to_owned()
        } else {
            run.total
                .errors
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (decision, timing) = match &run.decision {
            Some(d) => (
                format!("{} → {}: {}", d.from, d.to, d.reason),
                format!(
                    "+{} s / {}",
                    d.seen_after,
                    d.rolled_after
                        .map_or("not rolled out".to_owned(), |s| format!("+{s} s"))
                ),
            ),
            None if run.mode == Mode::Autoscale => ("none".to_owned(), "–".to_owned()),
            None => ("autoscale off".to_owned(), "–".to_owned()),
        };
        let _ = writeln!(
            w,
            "| {} | {errors} | {decision} | {timing} | {} · {} | {} · {} |",
            label(run),
            run.peaks.in_flight_max,
            run.peaks.in_flight_sum,
            run.peaks.connections_max,
            run.peaks.connections_sum
        );
    }
    let _ = writeln!(
        w,
        "\nBackend peaks are modelsim's own counters (`/admin/stats`, reset as each crowd starts) \
         over {} instances; the sum of per-instance peaks bounds the fleet's simultaneous peak \
         from above. The target's bound for autoscale: recovered no later than 2 intervals ({} s) \
         after the second every gateway ran the raised shares (scenario 2's bound).\n",
        c.runs.first().map_or(0, |r| r.peaks.instances),
        2 * INTERVAL.as_secs()
    );
}

fn label(run: &CrowdRun) -> String {
    match (run.mode, &run.decision) {
        (Mode::Autoscale, Some(d)) => format!("poolpilot autoscale ({} → {})", d.from, d.to),
        (mode, _) => mode.label().to_owned(),
    }
}

/// The default rollout's verification period, in milliseconds.
fn default_verify_ms() -> f64 {
    rollout::DEFAULT_INTERVAL.as_secs_f64() * 1e3 * f64::from(rollout::DEFAULT_VERIFY_INTERVALS)
}

fn render_rollout(w: &mut String, times: &RolloutTimes) {
    let rows = &times.fast;
    let _ = writeln!(
        w,
        "### Rollout time of a limit edit\n\n\
         `kubectl apply` of the policy with `clients.maxConcurrency` changed (5 ↔ 6), then every \
         gateway pod's `GET /v1/limits` polled every {} ms until it shows the new value. Policy: \
         autoscale off, rollout Progressive with 1 canary pod and `verifyIntervals: 0` (the \
         scenarios' quick policy). \"From return\" starts when `kubectl apply` returned (the \
         object is stored by then); \"from start\" includes the kubectl process.\n",
        rollout::POLL.as_millis()
    );
    let _ = writeln!(
        w,
        "| gateway pods | edits | last pod, from return: median | max | from start: median | max | kubectl apply: median |\n|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in rows {
        let (rm, rx) = RolloutRow::median_max_ms(&row.from_return);
        let (sm, sx) = RolloutRow::median_max_ms(&row.from_start);
        let (km, _) = RolloutRow::median_max_ms(&row.kubectl);
        let _ = writeln!(
            w,
            "| {} | {} | {rm:.0} ms | {rx:.0} ms | {sm:.0} ms | {sx:.0} ms | {km:.0} ms |",
            row.pods,
            row.from_return.len()
        );
    }
    let _ = writeln!(w);
    render_default_rollout(w, &times.default);
}

fn render_default_rollout(w: &mut String, row: &DefaultRolloutRow) {
    let _ = writeln!(
        w,
        "The same edits at {} pods under the **default** rollout (Progressive, 1 canary pod, \
         `verifyIntervals: {}` at the default {} s interval): the canary takes the edit at once, \
         the other pods once it has run it for the verification period ({:.0} s) and been judged \
         no worse than the rest.\n",
        row.pods,
        rollout::DEFAULT_VERIFY_INTERVALS,
        rollout::DEFAULT_INTERVAL.as_secs(),
        default_verify_ms() / 1e3
    );
    let _ = writeln!(
        w,
        "| gateway pods | edits | canary, from return: median | max | last pod, from return: median | max |\n|---:|---:|---:|---:|---:|---:|"
    );
    let (cm, cx) = RolloutRow::median_max_ms(&row.canary);
    let (lm, lx) = RolloutRow::median_max_ms(&row.last);
    let _ = writeln!(
        w,
        "| {} | {} | {cm:.0} ms | {cx:.0} ms | {:.1} s | {:.1} s |\n",
        row.pods,
        row.last.len(),
        lm / 1e3,
        lx / 1e3
    );
}

fn render_scale(w: &mut String, plan: &Plan, rows: &[ScaleRow]) {
    let _ = writeln!(
        w,
        "### Operator scale\n\n\
         {} gateway pods; policies `scale-NNN`, each with one backend `b-NNN` at a static address \
         (distinct names: none is Conflicted), all selecting the same pods, autoscale on with \
         bounds pinned at {} (decisions every {} s), applied in one `kubectl apply` per step. \
         After every policy is Accepted and RolledOut (their status conditions), the operator's own metrics are read across a window: \
         `poolpilot_operator_reconcile_duration_seconds` (p50/p99 interpolated in buckets 1.5× \
         apart), `_prometheus_queries_total` / `_prometheus_rounds_total`, \
         `_kube_requests_total{{verb}}` (every request of its client, watches counted when opened), \
         `_gateway_puts_total`, and `process_resident_memory_bytes` (highest of samples every 5 s). \"Per \
         interval\" is per {} s.\n",
        scale::PODS,
        scale::PODS,
        scale::INTERVAL.as_secs(),
        scale::INTERVAL.as_secs()
    );
    let _ = writeln!(
        w,
        "| policies | settled (Accepted + RolledOut) | operator restarts | window | reconciles / interval | reconcile p50 | p99 | PromQL queries / round | / interval | API requests / interval (by verb) | PUTs / interval | operator RSS |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
    );
    for r in rows {
        let settled = match r.settle {
            Some(s) => format!("{s:.1} s"),
            None => format!(
                "**not within {} s** ({} Accepted, {} RolledOut at the end)",
                scale::SETTLE.as_secs(),
                r.accepted,
                r.rolled_out
            ),
        };
        let restarts = if r.valid() {
            r.restarts.1.to_string()
        } else {
            format!(
                "**{} → {} during the window** ({})",
                r.restarts.0,
                r.restarts.1,
                r.last_exit.as_deref().unwrap_or("reason unknown")
            )
        };
        if !r.valid() {
            // The counters started again inside the window: no delta means anything.
            let _ = writeln!(
                w,
                "| {} | {settled} | {restarts} | {:.0} s | – | – | – | – | – | – | – | {:.1} MiB |",
                r.policies,
                r.window.as_secs_f64(),
                r.rss_max / 1048576.0
            );
            continue;
        }
        let verbs = r
            .api_by_verb
            .iter()
            .map(|(k, v)| format!("{k} {v:.1}"))
            .collect::<Vec<_>>()
            .join(", ");
        let ms = |v: Option<f64>| v.map_or("–".to_owned(), |s| format!("{:.1} ms", s * 1e3));
        let _ = writeln!(
            w,
            "| {} | {settled} | {restarts} | {:.0} s | {:.1} | {} | {} | {:.1} | {:.1} | {:.1} ({verbs}) | {:.1} | {:.1} MiB |",
            r.policies,
            r.window.as_secs_f64(),
            r.reconciles_per_interval,
            ms(r.reconcile_p50),
            ms(r.reconcile_p99),
            r.queries_per_round,
            r.queries_per_interval,
            r.api_per_interval,
            r.puts_per_interval,
            r.rss_max / 1048576.0
        );
    }
    for n in plan
        .policy_levels
        .iter()
        .filter(|n| !rows.iter().any(|r| r.policies == **n))
    {
        let _ = writeln!(
            w,
            "| {n} | not attempted: a smaller count did not settle | | | | | | | | | | |"
        );
    }
    let _ = writeln!(
        w,
        "\nWhere a reconcile's time goes (mean per pipeline step in the window, \
         `poolpilot_operator_step_duration_seconds`):\n"
    );
    let _ = writeln!(
        w,
        "| policies | observe | validate | plan | rollout | status |\n|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let _ = write!(w, "| {} |", r.policies);
        for step in ["observe", "validate", "plan", "rollout", "status"] {
            let cell = r
                .step_means
                .get(step)
                .map_or("–".to_owned(), |s| format!("{:.1} ms", s * 1e3));
            let _ = write!(w, " {cell} |");
        }
        let _ = writeln!(w);
    }
    let _ = writeln!(w);
}

fn render_reproduce(w: &mut String) {
    let _ = writeln!(
        w,
        "### How to reproduce one row\n\n\
         ```sh\n\
         make cluster-up IMAGE_PROFILE=release IMAGE_TARGET_DIR=$HOME/.cache/poolpilot/target-bench\n\
         # part 5 flash crowd (three rows), or rollout, or scale (part 6); --quick for short runs\n\
         $HOME/.cache/poolpilot/target/debug/poolpilot-loop-bench --parts control --out /tmp/control-loop.md \\\n\
         \x20 --image-profile release\n\
         ```\n\n\
         The binary takes the scenario lock (`$POOLPILOT_CLUSTER_DIR/scenario.lock`), so it never \
         overlaps a scenario run; the harness is `e2e/src/bin/poolpilot-loop-bench/`.\n"
    );
}
