//! Scenario canary rollback: a policy edit points model-a at instances that answer every call
//! with 500. Under the Progressive rollout the canary pod gets the new document first; at the
//! end of its verification its upstream 5xx share is far above the other pods', so the rollout
//! halts, the canary is rolled back to its previous document, the condition names the signal
//! with both numbers, and the other pods never get the new document. Then a good edit rolls out
//! in waves: the canary, its verification, the rest; drawn into
//! `<cache>/plots/e2e-rollout-waves.svg`.

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, StackSpec, WAIT, one_backend_policy, set, with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "canary-rollback";
const INTERVAL: Duration = Duration::from_secs(5);
/// Verification of the canary: two intervals.
const VERIFY_INTERVALS: u32 = 2;

#[tokio::test]
async fn a_canary_answering_5xx_is_rolled_back_and_the_rest_never_get_its_document()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        operators: 1,
        backends: vec![
            BackendSpec::new("model-a", 1, 64).service_ms(100),
            // Serves model-a's name too, and fails every call.
            BackendSpec::new("model-b", 1, 64)
                .service_ms(100)
                .arg("--model=model-a,model-b")
                .arg("--fault-error-ratio=1"),
        ],
        ..StackSpec::default()
    };
    with_stack("canary", spec, async |stack| {
        // Static targets (no autoscale), so that only the edit makes a new revision.
        let mut policy = one_backend_policy("model-a", INTERVAL, 4, 24)?;
        set(&mut policy, "/spec/autoscale/enabled", json!(false))?;
        // One failing call must not eject the endpoint: the canary keeps calling it.
        if let Some(b) = policy.pointer_mut("/spec/backends/0") {
            b.as_object_mut().map(|o| o.remove("outlierDetection"));
            b.as_object_mut().map(|o| o.remove("healthCheck"));
        }
        // The first document reaches every pod at once (the quick policy's rollout verifies
        // nothing); then the rollout verifies, which leaves the document as it is.
        stack.apply(&policy).await?;
        let mut gateways = stack.wait_gateways(3).await?;
        gateways.sort_by(|a, b| a.name.cmp(&b.name));
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        set(
            &mut policy,
            "/spec/rollout",
            json!({"strategy": "Progressive", "canaryPods": 1, "verifyIntervals": VERIFY_INTERVALS}),
        )?;
        stack.apply(&policy).await?;
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        let before: Vec<String> = {
            let mut v = Vec::new();
            for g in &gateways {
                v.push(g.limits().await?.revision);
            }
            v
        };
        let load = Load::start(
            LoadSpec::one_client_per_worker(
                gateways.iter().map(|g| g.proxy()).collect(),
                "model-a",
                8,
                6,
                Duration::from_secs(10),
            ),
            6,
        )?;
        // Calls of every pod in Prometheus before the edit.
        tokio::time::sleep(INTERVAL).await;

        // === the regressing edit ===
        set(
            &mut policy,
            "/spec/backends/0/endpoints/service/name",
            json!("model-b"),
        )?;
        stack.apply(&policy).await?;
        let applied = Instant::now();
        let canary = gateways.first().context("a gateway")?.clone();
        let mut canary_got_it = None;
        let mut checks = 0u32;
        let halted = loop {
            anyhow::ensure!(
                applied.elapsed() < WAIT,
                "no halt within {WAIT:?} of the edit"
            );
            // The other pods never run the new document.
            for (g, rev) in gateways.iter().zip(&before).skip(1) {
                let now = g.limits().await?.revision;
                assert_eq!(
                    &now,
                    rev,
                    "{} got a new document {:.1}s after the edit",
                    g.name,
                    applied.elapsed().as_secs_f64()
                );
            }
            let on_canary = canary.limits().await?;
            if canary_got_it.is_none() && on_canary.revision != before[0] {
                canary_got_it = Some(applied.elapsed());
            }
            checks += 1;
            if let Some(c) = stack.condition(POLICY, "RolledOut").await?
                && c.reason == "Halted"
            {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let halted_after = applied.elapsed();
        let canary_after = canary_got_it.context("the canary never got the new document")?;
        assert!(
            halted.message.contains("upstream 5xx on")
                && halted.message.contains("of the canaries' calls vs")
                && halted.message.contains("rolled back to their previous document"),
            "the condition names the signal, both numbers and the rollback: {halted:?}"
        );
        // The canary runs its previous content again (a later generation).
        let back = eventually("the canary back on its previous document", WAIT, || async {
            let l = canary.limits().await?;
            anyhow::ensure!(l.revision == before[0], "revision {}", l.revision);
            Ok(l)
        })
        .await?;
        let rolled_back_after = applied.elapsed();
        let event = stack.wait_event(POLICY, "RolloutHalted", "upstream 5xx").await?;
        // It stays halted: nothing is pushed again.
        tokio::time::sleep(INTERVAL * 2).await;
        for (g, rev) in gateways.iter().zip(&before) {
            assert_eq!(&g.limits().await?.revision, rev, "{} after the halt", g.name);
        }
        figure(
            SCENARIO,
            "edit → canary runs it seconds",
            format!("{:.1}", canary_after.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "edit → halted seconds",
            format!(
                "{:.1} (verification {VERIFY_INTERVALS} × {}s): {}",
                halted_after.as_secs_f64(),
                INTERVAL.as_secs(),
                halted.message
            ),
        );
        figure(
            SCENARIO,
            "edit → canary back on its previous document seconds",
            format!(
                "{:.1} (generation {}; {checks} checks of the other pods: never on the new document)",
                rolled_back_after.as_secs_f64(),
                back.generation
            ),
        );
        figure(
            SCENARIO,
            "RolloutHalted Event",
            event.message.unwrap_or_default(),
        );

        // === a good edit rolls out in waves: the canary, its verification, then the rest ===
        set(
            &mut policy,
            "/spec/backends/0/endpoints/service/name",
            json!("model-a"),
        )?;
        set(&mut policy, "/spec/backends/0/pool/maxPending", json!(200))?;
        stack.apply(&policy).await?;
        let edited = Instant::now();
        let mut took: Vec<Option<f64>> = vec![None; gateways.len()];
        let mut timeline: Vec<(f64, f64)> = vec![(0.0, 0.0)];
        while took.iter().any(Option::is_none) {
            anyhow::ensure!(
                edited.elapsed() < WAIT,
                "the good edit did not reach every pod within {WAIT:?}: {took:?}"
            );
            for (i, g) in gateways.iter().enumerate() {
                if took[i].is_none() {
                    let l = g.limits().await?;
                    if l.revision != before[i] && l.backends.first().is_some_and(|b| b.pool.max_pending == 200) {
                        took[i] = Some(edited.elapsed().as_secs_f64());
                    }
                }
            }
            let at = edited.elapsed().as_secs_f64();
            let on = took.iter().flatten().count() as f64;
            if timeline.last().is_some_and(|(_, n)| *n != on) {
                timeline.push((at, timeline.last().map_or(0.0, |p| p.1)));
            }
            timeline.push((at, on));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took: Vec<f64> = took.into_iter().flatten().collect();
        // The picture goes on a little past the last pod.
        let last = timeline.last().copied().unwrap_or_default();
        timeline.push((last.0 + 1.0, last.1));
        let canary_at = took[0];
        let rest_at = took[1..].iter().copied().fold(f64::INFINITY, f64::min);
        let verify = (INTERVAL * VERIFY_INTERVALS).as_secs_f64();
        assert!(
            rest_at >= canary_at + verify - 1.0,
            "the other pods wait for the canary's verification ({verify}s): canary {canary_at:.1}s, rest {took:?}"
        );
        stack.wait_condition(POLICY, "RolledOut", "True", WAIT).await?;
        figure(
            SCENARIO,
            "good edit: canary / rest seconds",
            format!(
                "{canary_at:.1} / {} (verification {verify}s)",
                took[1..]
                    .iter()
                    .map(|t| format!("{t:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
        let picture = poolpilot_e2e::pool_view::plot_path("e2e-rollout-waves");
        if let Some(dir) = picture.parent() {
            std::fs::create_dir_all(dir)?;
        }
        poolpilot_plot::time_chart(
            &picture,
            &poolpilot_plot::TimeChart {
                title: format!(
                    "a Progressive rollout to {} gateways: 1 canary, verified for {VERIFY_INTERVALS} × {}s",
                    gateways.len(),
                    INTERVAL.as_secs()
                ),
                left_label: "pods running the new document".into(),
                left: vec![poolpilot_plot::Series {
                    name: "pods on the new document".into(),
                    points: timeline,
                }],
                markers: vec![
                    poolpilot_plot::Marker {
                        x: canary_at,
                        label: "canary".into(),
                    },
                    poolpilot_plot::Marker {
                        x: rest_at,
                        label: "verified: the rest".into(),
                    },
                ],
                ..poolpilot_plot::TimeChart::default()
            },
        )?;
        figure(SCENARIO, "picture", picture.display());
        load.stop().await;
        Ok(())
    })
    .await
}
