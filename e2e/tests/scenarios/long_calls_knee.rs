//! Scenario 12, long calls and a knee: two backends whose calls take 4–10 s (a few completions
//! per instance per interval, as LLM calls on a small fleet). model-a's batch thrashes as it
//! fills (modelsim `--saturation-slowdown=6` over 12 slots: its throughput peaks at about 5
//! calls in flight per instance and falls beyond, and calls beyond 12 queue inside it); model-b
//! batches without thrashing (its throughput keeps rising with in-flight). A crowd arrives at
//! both. model-b gets its pool in ONE decision and keeps it; model-a's first step goes past its
//! knee, and within 4 intervals a decision names the knee evidence or the backend's own queue
//! (the sample's saturation query on `vllm:num_requests_waiting`), after which the target
//! settles near the knee: at the end within ±25% of it, and the calls it completes per second
//! over the last 60 s (each counted over the seconds it was open) at least 90% of the best 60 s
//! seen.
//!
//! ```text
//!  per backend: 2 instances, 100 tokens × 40 ms (4 s alone); policy min 2, max 25, every 10 s
//!  light load (2 callers each) ─► both targets at min
//!  crowd: model-a 40 callers (4 × its knee of ~5 per instance), model-b 24
//!      model-b: 2 → ⌈24 × 1.2 ÷ 2⌉ = 15 in one decision, held there
//!      model-a: 2 → 24, its instances queue and thrash ─► the next decision steps back to
//!               what they serve at once (their queue: 20 in flight less 8 waiting = 12),
//!               remembered; once the calls started before a change are done, the levels
//!               below it are measured and probed, and the target ends near the knee
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::policy::DecisionAction;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{BackendSpec, StackSpec, WAIT, quick_policy, set, with_stack};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "long-calls-knee";
/// The autoscale interval.
const INTERVAL: Duration = Duration::from_secs(10);
/// Lower bound of the targets, where the crowd finds them.
const MIN: u32 = 2;
/// Upper bound: model-b's capacity 32 × (1 − 0.2).
const MAX: u32 = 25;
/// Instances of each backend.
const ENDPOINTS: u32 = 2;
/// model-a's batch slots per instance.
const SLOTS: u32 = 12;
/// modelsim's thrashing term for model-a: with `u` of the slots busy a token takes
/// `1 + 0.3·u + 6·u²` as long, so throughput per instance, `c / (1 + 0.3·c/12 + 6·(c/12)²)`,
/// peaks at `c = 12/√6 ≈ 4.9`.
const SATURATION_SLOWDOWN: f64 = 6.0;
/// model-a's knee: in flight per instance with the most throughput (see above).
const KNEE: f64 = 4.9;
/// Output tokens per call, and the time of one.
const TOKENS: u32 = 100;
/// See [`TOKENS`].
const PER_TOKEN_MS: u32 = 40;
/// Callers before the crowd, per backend.
const LIGHT: usize = 2;
/// model-a's crowd: 4 × its knee over both instances.
const CROWD_A: usize = 40;
/// model-b's crowd.
const CROWD_B: usize = 24;
/// How long the crowd lasts.
const CROWD_FOR: Duration = Duration::from_secs(240);
/// Every call open when the crowd ends has ended this long after: its lease timeout (30 s) and
/// the call itself.
const CALLS_END_WITHIN: Duration = Duration::from_secs(60);
/// Decisions after model-a's first growth within which one must name the knee or the queue.
const KNEE_WITHIN: usize = 4;

/// One backend as one decision left it.
#[derive(Clone, Debug)]
struct Seen {
    at: f64,
    target: u32,
    action: DecisionAction,
    reason: String,
}

// Its first run on the embedded cluster with this guard (2026-12-03): model-a 2 → 24 → 13 →
// 11 → 7 with a backend-queue reason from the second decision, then held at 7 ("the most
// throughput is at 8") to the end: outside ±25% of its knee of 4.9 (3.7–6.1). Run again on
// 2026-12-07: 2 → 24 → 12 → 9 by the backend's queue ("it serves about 9 at once"), then held
// at 9 to the end while the guard named 17 its best level: one interval at 17, measured as the
// queued calls drained after the step back, outranked 9 on 60 calls, and nothing below 9 was
// ever probed. With levels above the queue's reading left out and one probe below it (two
// runs, 2026-12-07 later): 2 → 24 → 12 → 9 → 5 → 7 → 3 → 4, ending at 4 (within the bound)
// but with its last 60 s at 1.07 calls/s against the best 1.30 (82%); and 2 → 24 → 12 → 8 →
// 4 → 6 → 5 → 3, ending while it measured 3 to locate the peak. The probes are judged on 2–10
// calls an interval (counted noise 30–70%), so the bracket wanders over a curve that differs by
// 10% between 3 and 5. With each call counted over the seconds it was open (the drain after a
// step back no longer counts as a rate), two runs on a fresh cluster after a cold build
// (2026-12-07): 2 → 24 → 12 → … → 6 at the end, its last 60 s at 1.13 calls/s against the best
// 1.15 (98%): passed; and 2 → 24 → 13 → 11 → 9 by the queue, a probe to 5 judged "more at 9"
// (response bytes 431 B/s at 5 against 1.08 kB/s at 9, ×2.5 on 8 and 10 completed calls), back
// to 9 to the end: failed (9 against 4.9). The answers are not streamed, so the calls in flight
// at a level receive no bytes until they end, yet they count as evidence of its byte rate: the
// noise is taken for far less than it is. With only the calls past their first byte counted as
// byte-rate evidence (none, for these whole answers), two runs on 2026-12-07: 2 → 24 → 12 → 8
// by the queue, a probe to 4, then 6 and 5 (within the bounds from 171 s to 221 s), and at
// 231 s a probe to 2, where it ended (failed); and 2 → 24 → 13 → 10 by the queue, a probe to 5
// judged worse (395 B/s at 5 against 1.19 kB/s at 10 on 22 and 22 calls: the level 10 was
// measured while the queue the step back left drained into it), back to 10 to the end (failed).
// Counting completions, these levels are 1–2 calls a second apart on 10–30 calls each: what
// would separate them is a throughput whose noise is the spread of the call times rather than
// 1/√calls (Little's law: in flight over the mean call time). With Little's law and the settle
// wait after a load's own start (2026-12-07, a cluster just started on new images): 2 → 24 → 12
// → 8 by the queue, a probe to 4, then 6 and 5 (the levels 4, 5 and 6 compared by Little's law
// within 2%: 0.57 and 0.56 calls/s per endpoint), and at 231 s a probe below the lowest of that
// flat top, to 2, where the crowd ended (failed: the probe is judged after the run's end). With
// a curve's fall measured from its most throughput and probes below bounded by Little's law
// (2026-12-07, a cluster just started): 2 → 24 → 13 → 9 by the queue, held at 9 until that
// level had settled evidence (110 s), a probe to 5 judged on the bytes of 4–8 whole answers and
// left at 161 s as "9 gives more" (×2.06, noise ±68%), then, the levels timed, Little's law
// found 5 better than 9 (0.59 against 0.48 calls/s per endpoint, ×0.82, noise ±10%) and probed
// 7 at 221 s, where the crowd ended (failed: 7). Each move waits out calls of 8–20 s, and a
// crowd of 240 s holds about five of them. Run 2 (a cluster just started, 21:15): 2 → 24 → 13 →
// 11 → 9 → 11 → 8 by the queue, a probe to 4 left as "8 gives more" on 16 and 18 calls counted
// (4 read at half its rate while its calls turned over): 8 at the end (failed). Run 3 (21:39):
// passed, 6 at the end, its last 60 s at 1.10 calls/s against the best 1.15 (96%). Run 4
// (22:42): 2 → 24 → 12 → 8 by the queue, held there to 131 s, a probe to 4, then 6 from 191 s
// to the end: passed, its last 60 s at 1.11 against 1.13 (98%). With a target within the
// deadband above the queue's level stepped back to it and the queue's level measured before
// anything below it is probed (2026-12-08, each on a cluster just started): 2 → 24 → 13 (its
// queue) → 11 → 9 → 10 → 9 → 7, then 4 from 171 s to the end: passed, 1.11 against 1.18 (94%);
// and 2 → 24 → 13 (its queue) → 11 → 7, held there to 191 s, then 4, and 5 at the end: passed,
// 1.13 against 1.13 (100%). It runs on demand until the guard settles within the bounds in
// (nearly) every run, a fresh clone's first among them.
#[tokio::test]
#[ignore = "model-a ended at 7, 9, 3, 9, 2, 10, 2, 7 and 8 per endpoint against a knee of 4.9 (±25%), at 4 with its last minute at 82% of its best, three times at 6 with 98%, 96% and 98%, and at 4 and 5 with 94% and 100% (passed); run with --ignored"]
async fn long_calls_settle_near_the_knee_and_a_rising_backend_grows_in_one_step()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let long = |b: BackendSpec| {
        b.arg(format!("--per-token-ms={PER_TOKEN_MS}"))
            .arg("--base-latency-ms=50")
            .arg("--jitter-sigma=0.1")
            .arg("--batch-slowdown=0.3")
            .arg("--max-queue=256")
    };
    let spec = StackSpec {
        gateways: 2,
        backends: vec![
            long(BackendSpec::new("model-a", ENDPOINTS, SLOTS))
                .arg(format!("--saturation-slowdown={SATURATION_SLOWDOWN}")),
            long(BackendSpec::new("model-b", ENDPOINTS, 32)).arg("--saturation-slowdown=0"),
        ],
        ..StackSpec::default()
    };
    with_stack("longcalls", spec, async |stack| {
        let mut policy = quick_policy()?;
        set(&mut policy, "/spec/autoscale/interval", json!("10s"))?;
        set(&mut policy, "/spec/autoscale/min", json!(MIN))?;
        set(&mut policy, "/spec/autoscale/max", json!(MAX))?;
        set(
            &mut policy,
            "/spec/autoscale/scaleDown",
            json!({"stabilizationWindow": "30s", "maxStepPercent": 50}),
        )?;
        // Long calls: the per-client limits and the lease timeout are not what this is about.
        set(&mut policy, "/spec/clients/maxConcurrency", json!(64))?;
        set(
            &mut policy,
            "/spec/backends/0/pool/leaseTimeout",
            json!("30s"),
        )?;
        set(
            &mut policy,
            "/spec/backends/1/pool/leaseTimeout",
            json!("30s"),
        )?;
        set(&mut policy, "/spec/backends/0/pool/maxPending", json!(256))?;
        set(&mut policy, "/spec/backends/1/pool/maxPending", json!(256))?;
        for i in 0..2 {
            set(
                &mut policy,
                &format!("/spec/backends/{i}/timeouts"),
                json!({"firstByte": "60s", "total": "120s", "streamIdle": "30s"}),
            )?;
        }
        stack.apply_starting_at_min(&policy).await?;
        let gateways = stack.wait_gateways(2).await?;
        let proxies: Vec<_> = gateways.iter().map(|g| g.proxy()).collect();
        let load = |model: &str, workers: usize| {
            let spec = LoadSpec::one_client_per_worker(
                proxies.clone(),
                model,
                TOKENS,
                workers,
                Duration::from_secs(120),
            );
            Load::start_as(spec, LIGHT, &format!("long-{model}"), None)
        };
        let load_a = load("model-a", CROWD_A)?;
        let load_b = load("model-b", CROWD_B)?;
        for b in ["model-a", "model-b"] {
            eventually("the target at min under light load", WAIT, || async {
                let s = stack.backend_status(b).await?;
                anyhow::ensure!(s.target == MIN, "{b}: target {}", s.target);
                Ok(())
            })
            .await?;
        }

        // The crowd, right after a decision.
        stack.wait_next_decision(INTERVAL * 3).await?;
        load_a.set_workers(CROWD_A);
        load_b.set_workers(CROWD_B);
        let crowd = Instant::now();
        let crowd_second = load_a.now();
        let mut seen: BTreeMap<&str, Vec<Seen>> = BTreeMap::new();
        let mut last = BTreeMap::new();
        while crowd.elapsed() < CROWD_FOR {
            for b in ["model-a", "model-b"] {
                let s = stack.backend_status(b).await?;
                let Some(d) = s.last_decision.clone() else {
                    continue;
                };
                if last.get(b) == Some(&d.time) {
                    continue;
                }
                last.insert(b, d.time.clone());
                seen.entry(b).or_default().push(Seen {
                    at: crowd.elapsed().as_secs_f64(),
                    target: s.target,
                    action: d.action,
                    reason: d.reason,
                });
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let end_second = load_a.now();
        let table = seen
            .iter()
            .flat_map(|(b, v)| {
                v.iter().map(move |s| {
                    format!(
                        "\n  {b} {:>5.1}s {:>2} {:?}: {}",
                        s.at, s.target, s.action, s.reason
                    )
                })
            })
            .collect::<String>();

        // model-b: ONE decision grows it to the crowd's demand, and it keeps its pool.
        let b = seen.get("model-b").context("model-b decisions")?;
        let wanted_b = (CROWD_B as f64 * 1.2 / f64::from(ENDPOINTS)).ceil() as u32;
        let first_up = b
            .iter()
            .find(|s| s.action == DecisionAction::ScaleUp)
            .with_context(|| format!("model-b never grew{table}"))?;
        assert!(
            first_up.target >= wanted_b * 9 / 10 && first_up.at <= INTERVAL.as_secs_f64() * 2.5,
            "model-b grows to ~{wanted_b} in one decision{table}"
        );
        assert!(
            b.iter()
                .skip_while(|s| s.at < first_up.at)
                .all(|s| s.target >= first_up.target * 9 / 10 && !s.reason.contains("knee")),
            "model-b keeps its pool and is never held at a knee{table}"
        );

        // model-a: its first step goes past the knee; within a few decisions one names the
        // knee evidence or the backend's queue.
        let a = seen.get("model-a").context("model-a decisions")?;
        let grew = a
            .iter()
            .position(|s| s.action == DecisionAction::ScaleUp)
            .with_context(|| format!("model-a never grew{table}"))?;
        let named = a[grew + 1..]
            .iter()
            .take(KNEE_WITHIN)
            .find(|s| {
                s.reason.contains("knee")
                    || s.reason.contains("the backend reports saturation")
                    || s.reason.contains("stepped back")
            })
            .with_context(|| format!("no knee reason within {KNEE_WITHIN} decisions{table}"))?;
        figure(SCENARIO, "model-a knee reason", &named.reason);
        figure(
            SCENARIO,
            "model-a targets (seconds into the crowd: target)",
            a.iter()
                .map(|s| format!("{:.0}: {}", s.at, s.target))
                .collect::<Vec<_>>()
                .join(", "),
        );
        let end = a.last().context("a model-a decision")?;
        let knee = KNEE;
        assert!(
            (f64::from(end.target) - knee).abs() <= 0.25 * knee + 0.5,
            "model-a settles within ±25% of its knee ({knee:.1} per endpoint): {}{table}",
            end.target
        );

        // model-a's completed calls per second at the end: at least 90% of the best 60 s seen.
        // Each call counts over the seconds it was open, not all in the second it ended: a step
        // back releases the calls queued in the backend together, a burst of completions that
        // no level sustains (served at the rate of the level before, and counted there). The
        // calls open at the end are waited for (the longest waits 30 s for its lease, then
        // runs), and the rates are read over 60 s windows (six to ten call durations).
        tokio::time::sleep(CALLS_END_WITHIN).await;
        let per_second = load_a.served_per_second(crowd_second, end_second);
        let windows: Vec<f64> = per_second
            .windows(60)
            .map(|w| w.iter().sum::<f64>() / 60.0)
            .collect();
        let best = windows.iter().copied().fold(0.0, f64::max);
        let last_window = windows.last().copied().unwrap_or_default();
        figure(
            SCENARIO,
            "model-a completed calls/s, best 60 s / last 60 s",
            format!("{best:.2} / {last_window:.2}"),
        );
        figure(
            SCENARIO,
            "targets at the end (model-a / model-b)",
            format!("{} / {}", end.target, b.last().map_or(0, |s| s.target)),
        );
        assert!(
            last_window >= 0.9 * best,
            "model-a ends at {last_window:.2} calls/s, under 90% of the best {best:.2}{table}"
        );
        load_a.stop().await;
        load_b.stop().await;
        Ok(())
    })
    .await
}
