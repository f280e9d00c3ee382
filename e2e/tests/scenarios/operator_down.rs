//! Scenario 7, operator down, restarted, and leader handover (2 replicas): the targets are first
//! tuned away from their upper bound (light load, short stabilization window: down to
//! `autoscale.min`). (a) With the operator scaled to 0 the gateways keep their limits and serve;
//! (b) a gateway pod deleted meanwhile is replaced by one that starts from the durable ConfigMap
//! `models-limits` (its revision, generation and tuned shares, not defaults) and turns Ready
//! without the operator (once its `awaitOperator` wait is over: 5 s here, 15 s as shipped); (c)
//! back at 2 replicas, deleting the leader hands the Lease to the standby, which resumes without
//! resetting the targets.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt as _;
use kube::api::Api;
use poolpilot_api::{ConnectionPolicyStatus, GatewayLimits};
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, OPERATOR_DEPLOYMENT, OPERATOR_LABELS, POLICY, Stack, StackSpec, WAIT,
    metric_sum, pod_ip, quick_policy, set, with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "operator-down";
/// The policy's decision interval.
const INTERVAL: Duration = Duration::from_secs(5);
/// The policy's bounds: a new policy starts at `MAX`, light load tunes it down to `MIN`.
const MIN: u32 = 6;
const MAX: u32 = 25;
const GATEWAYS: usize = 3;
/// The gateways' `awaitOperator`: how long a started pod waits for the operator's share before
/// it serves the ConfigMap's limits alone (shortened from the shipped 15 s).
const AWAIT_OPERATOR: Duration = Duration::from_secs(5);
/// The leader-election Lease (`--lease-name`, in the operator's namespace).
const LEASE: &str = "poolpilot-operator";
/// The operator's own metrics port (`--listen=$(POD_IP):8080` in the overlay).
const OPERATOR_METRICS_PORT: u16 = 8080;

#[tokio::test]
async fn operator_down_restart_and_handover_keep_the_tuned_limits() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: GATEWAYS as u32,
        operators: 2,
        backends: vec![BackendSpec::new("model-a", 2, 64).service_ms(100)],
        gateway_settings: vec![("awaitOperator", format!("{}s", AWAIT_OPERATOR.as_secs()))],
        ..StackSpec::default()
    };
    with_stack("opdown", spec, async |stack| {
        // model-a only; shrink in one step once a 10 s window has passed.
        let mut policy = quick_policy()?;
        policy
            .pointer_mut("/spec/backends")
            .and_then(|b| b.as_array_mut())
            .context("backends")?
            .retain(|b| b["name"] == "model-a");
        set(&mut policy, "/spec/autoscale/min", json!(MIN))?;
        set(&mut policy, "/spec/autoscale/max", json!(MAX))?;
        // Every pod's document is then the ConfigMap's (the checks below compare revisions):
        // fleet-wide client limits would give the first pods one call more.
        set(&mut policy, "/spec/clients/scope", json!("PerPod"))?;
        set(
            &mut policy,
            "/spec/autoscale/scaleDown",
            json!({"stabilizationWindow": "10s", "maxStepPercent": 100}),
        )?;
        stack.apply(&policy).await?;
        let gateways = stack.wait_gateways(GATEWAYS).await?;
        stack.wait_ready(OPERATOR_LABELS, 2).await?;
        let load = light_load(&gateways.iter().map(|g| g.proxy()).collect::<Vec<_>>())?;

        // === tuned: the target shrinks from the upper bound to the minimum ===
        let tuning = Instant::now();
        let tuned = eventually("the target tuned down to autoscale.min", WAIT, || async {
            let s = status(stack).await?;
            let b = s.backends.first().context("model-a")?;
            anyhow::ensure!(b.target == MIN, "target {}", b.target);
            Ok(s)
        })
        .await?;
        let scale = tuned.backends[0]
            .last_scale
            .clone()
            .context("a last scale")?;
        assert_eq!(
            (scale.from, scale.to),
            (MAX, MIN),
            "one step from the upper bound to the minimum: {scale:?}"
        );
        // Every pod runs its document of the tuned target (each its own share of it: the
        // division follows each pod's demand), as status.pods says.
        let before = eventually("the tuned shares on every gateway", WAIT, || async {
            let s = status(stack).await?;
            let items = s.pods.context("status.pods")?.items;
            let docs = stack
                .wait_limits("every gateway", GATEWAYS, Duration::from_secs(1), |_| Ok(()))
                .await?;
            for (g, l) in &docs {
                let item = items.iter().find(|i| i.name == g.name).context("a pod item")?;
                anyhow::ensure!(
                    item.current && item.revision.as_deref() == Some(l.revision.as_str()),
                    "{} serves {} ({item:?})",
                    g.name,
                    l.revision
                );
            }
            anyhow::ensure!(
                docs.iter().map(|(_, l)| share(l)).sum::<u32>() == MIN,
                "shares {:?}",
                docs.iter().map(|(_, l)| share(l)).collect::<Vec<_>>()
            );
            Ok(docs)
        })
        .await?;
        let shares = |docs: &[(poolpilot_e2e::stack::GatewayPod, GatewayLimits)]| -> Vec<u32> {
            docs.iter().map(|(_, l)| share(l)).collect()
        };
        assert_eq!(shares(&before).iter().sum::<u32>(), MIN);
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        figure(
            SCENARIO,
            "tuned before the outage",
            format!(
                "target {MAX} → {MIN} in {:.1}s, shares {:?} (upper bound would give {}/pod)",
                tuning.elapsed().as_secs_f64(),
                shares(&before),
                MAX / GATEWAYS as u32
            ),
        );
        let held = Held::of(&tuned);
        let configmap = limits_configmap(stack).await?;
        assert_eq!(
            Some(configmap.generation),
            tuned.limits_generation,
            "the ConfigMap holds the tuned document"
        );

        // === (a) no operator at all ===
        stack.scale(OPERATOR_DEPLOYMENT, 0).await?;
        stack.wait_ready(OPERATOR_LABELS, 0).await?;
        let down = Instant::now();
        let down_from = load.now();
        let mut checks = 0;
        while down.elapsed() < INTERVAL * 3 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for (g, l) in &before {
                let now = g.limits().await?;
                assert_eq!(
                    (&now.revision, now.generation, share(&now)),
                    (&l.revision, l.generation, share(l)),
                    "{} keeps its limits without the operator",
                    g.name
                );
            }
            checks += 1;
        }
        let served = load.window(down_from, load.now());
        load.stop().await;
        assert!(served.ok > 0, "no call served without the operator");
        assert!(
            served.error_rate() < 0.01,
            "calls failed without the operator: {served:?}"
        );
        figure(
            SCENARIO,
            "operator at 0: served",
            format!(
                "{} calls in {:.0}s, error rate {:.2}%, limits unchanged on {GATEWAYS} gateways over {checks} checks",
                served.calls,
                down.elapsed().as_secs_f64(),
                served.error_rate() * 100.0
            ),
        );

        // === (b) a gateway pod restarted while no operator runs ===
        let victim = before[0].0.name.clone();
        let deleted = Instant::now();
        run(stack
            .kubectl()
            .args(["delete", "pod", "-n", stack.name(), &victim, "--wait=false"]))
        .await?;
        let fresh = eventually(
            "a replacement gateway Ready without the operator",
            WAIT,
            || async {
                let gws = stack.gateways().await?;
                let names: Vec<&str> = gws.iter().map(|g| g.name.as_str()).collect();
                anyhow::ensure!(
                    gws.len() == GATEWAYS && !names.contains(&victim.as_str()),
                    "ready gateways {names:?}"
                );
                gws.into_iter()
                    .find(|g| !before.iter().any(|(b, _)| b.name == g.name))
                    .context("no new pod")
            },
        )
        .await?;
        let replaced_after = deleted.elapsed();
        assert!(
            replaced_after >= AWAIT_OPERATOR,
            "the replacement waits {AWAIT_OPERATOR:?} for the operator before it serves alone: Ready after {replaced_after:?}"
        );
        anyhow::ensure!(
            stack.ready_pods(OPERATOR_LABELS).await?.is_empty(),
            "the operator is still down"
        );
        let restarted = fresh.limits().await?;
        assert_eq!(
            (&restarted.revision, restarted.generation),
            (&configmap.revision, configmap.generation),
            "the replacement runs the ConfigMap's document"
        );
        assert_eq!(
            share(&restarted),
            share(&configmap),
            "the replacement's share is the ConfigMap's"
        );
        assert!(
            share(&restarted) < MAX / GATEWAYS as u32,
            "the replacement runs the tuned share {}, not the upper bound's {}",
            share(&restarted),
            MAX / GATEWAYS as u32
        );
        figure(
            SCENARIO,
            "gateway restarted without the operator",
            format!(
                "{} → {} Ready in {:.1}s, runs the ConfigMap's revision {} generation {}, share {} per endpoint",
                victim,
                fresh.name,
                replaced_after.as_secs_f64(),
                restarted.revision,
                restarted.generation,
                share(&restarted)
            ),
        );
        // It serves, like the others.
        let gateways = stack.wait_gateways(GATEWAYS).await?;
        let load = light_load(&gateways.iter().map(|g| g.proxy()).collect::<Vec<_>>())?;
        let from = load.now();
        eventually("calls through every gateway, the new one too", WAIT, || async {
            let t = load.window(from, load.now());
            anyhow::ensure!(t.ok >= 30, "{t:?}");
            Ok(())
        })
        .await?;
        let t = load.window(from, load.now());
        assert!(t.error_rate() < 0.01, "{t:?}");

        // === (c) the operator back, then the leader deleted ===
        let up = Instant::now();
        stack.scale(OPERATOR_DEPLOYMENT, 2).await?;
        let operators = stack.wait_ready(OPERATOR_LABELS, 2).await?;
        let names: Vec<String> = operators.iter().map(|p| p.name_any()).collect();
        let leader = eventually("one of the new replicas leads", WAIT, || async {
            let holder = holder(stack).await?;
            anyhow::ensure!(names.contains(&holder), "the Lease is held by {holder:?}");
            Ok(holder)
        })
        .await?;
        let led_after = up.elapsed();
        let after_restart = stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        let s = status(stack).await?;
        assert_eq!(
            Held::of(&s).targets,
            held.targets,
            "the restarted operator keeps the tuned targets"
        );
        figure(
            SCENARIO,
            "operator back at 2 replicas",
            format!(
                "{leader} leads {:.1}s after the scale-up; Ready again ({}), targets {}",
                led_after.as_secs_f64(),
                after_restart.message,
                s.targets.clone().unwrap_or_default()
            ),
        );
        let limits_before_handover = stack
            .wait_limits("every gateway runs the policy's revision", GATEWAYS, WAIT, |l| {
                anyhow::ensure!(share(l) <= MIN / GATEWAYS as u32 + 1, "share {}", share(l));
                Ok(())
            })
            .await?;
        let revision_before = s.revision.clone();
        let pool_before: u32 = limits_before_handover.iter().map(|(_, l)| share(l)).sum();

        let standby = operators
            .iter()
            .find(|p| p.name_any() != leader)
            .context("a standby")?;
        let standby_name = standby.name_any();
        let standby_metrics = format!(
            "http://{}:{OPERATOR_METRICS_PORT}/metrics",
            pod_ip(standby)?
        );
        let idle = operator_metrics(&standby_metrics).await?;
        assert_eq!(
            metric_sum(&idle, "poolpilot_operator_reconciles_total", &[]),
            0.0,
            "the standby does not reconcile"
        );

        let handover = Instant::now();
        run(stack
            .kubectl()
            .args(["delete", "pod", "-n", stack.name(), &leader, "--wait=false"]))
        .await?;
        // Targets never move while the Lease changes hands. The deleted leader releases it on
        // SIGTERM; the standby, or the replacement the Deployment starts meanwhile, takes it.
        let pods: Api<Pod> = stack.ns().api();
        let mut new_leader: Option<(String, String)> = None;
        let mut taken_after = None;
        let first_reconcile_after;
        let deadline = Instant::now() + WAIT;
        loop {
            anyhow::ensure!(
                Instant::now() < deadline,
                "no new leader reconciled within {WAIT:?} (Lease holder {new_leader:?})"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
            let s = status(stack).await?;
            assert_eq!(
                Held::of(&s).targets,
                held.targets,
                "targets during the handover"
            );
            if new_leader.is_none()
                && let Ok(h) = holder(stack).await
                && h != leader
                && let Some(ip) = pods.get_opt(&h).await?.and_then(|p| pod_ip(&p).ok())
            {
                taken_after = Some(handover.elapsed());
                let url = format!("http://{ip}:{OPERATOR_METRICS_PORT}/metrics");
                new_leader = Some((h, url));
            }
            if let Some((_, url)) = &new_leader
                && let Ok(text) = operator_metrics(url).await
                && metric_sum(&text, "poolpilot_operator_reconciles_total", &[]) > 0.0
            {
                first_reconcile_after = handover.elapsed();
                break;
            }
        }
        let taken_after = taken_after.context("lease")?;
        let (new_leader, new_leader_metrics) = new_leader.context("a new leader")?;
        let which = if new_leader == standby_name {
            "the standby"
        } else {
            "the replacement replica"
        };

        // The new leader decides for three intervals: never back to the upper bound.
        let resumed = Instant::now();
        let mut decisions = 0.0;
        while resumed.elapsed() < INTERVAL * 3 || decisions < 2.0 {
            anyhow::ensure!(
                resumed.elapsed() < WAIT,
                "the new leader made no decision: {decisions}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = status(stack).await?;
            assert_eq!(Held::of(&s).targets, held.targets, "targets after the handover");
            // A re-division by the new leader goes to the pods it lowers first: the fleet
            // never holds more than the pool.
            let gateways = limits_before_handover.iter().map(|(g, _)| g);
            if let Some(shares) = shares_at_once(gateways).await? {
                anyhow::ensure!(
                    shares.iter().sum::<u32>() <= pool_before,
                    "the gateways hold {shares:?} at once, more than the pool of {pool_before}"
                );
            }
            let text = operator_metrics(&new_leader_metrics).await?;
            decisions = metric_sum(&text, "poolpilot_operator_decisions_total", &[]);
            assert_eq!(
                metric_sum(
                    &text,
                    "poolpilot_operator_decisions_total",
                    &["kind=\"scale_up\""]
                ),
                0.0,
                "the new leader scaled up: {text}"
            );
        }
        let s = status(stack).await?;
        assert_eq!(
            s.backends[0].last_scale.as_ref().map(|l| (l.from, l.to)),
            Some((MAX, MIN)),
            "the last scale is still the tuning before the handover"
        );
        // Each gateway keeps its document, unless the new leader re-divided the same target over
        // the pods by their demand (a rebalance, which any decision may make: a new revision
        // of the documents): then the shares still add up to the pool they added up to before.
        let rebalances = metric_sum(
            &operator_metrics(&new_leader_metrics).await?,
            "poolpilot_operator_decisions_total",
            &["kind=\"rebalance\""],
        );
        if rebalances == 0.0 {
            assert_eq!(s.revision, revision_before, "no new revision after the handover");
        }
        // A rebalance reaches the pods in two PUT waves (the pods it lowers, then the others):
        // the sum is read once the pods run it, a reconcile or two.
        eventually("the same pool after the handover", INTERVAL * 3, || async {
            let mut pool_now = 0;
            for (g, l) in &limits_before_handover {
                let now = g.limits().await?;
                pool_now += share(&now);
                if rebalances == 0.0 {
                    assert_eq!(
                        (&now.revision, share(&now)),
                        (&l.revision, share(l)),
                        "{} keeps its limits across the handover (no rebalance)",
                        g.name
                    );
                }
            }
            anyhow::ensure!(
                pool_now == pool_before,
                "the shares the gateways run add up to {pool_now}, not the pool of {pool_before} \
                 they added up to before the handover ({rebalances} rebalances)"
            );
            Ok(())
        })
        .await?;
        let kinds: Vec<String> = operator_metrics(&new_leader_metrics)
            .await?
            .lines()
            .filter(|l| l.starts_with("poolpilot_operator_decisions_total{"))
            .map(str::to_owned)
            .collect();
        let t = load.window(from, load.now());
        load.stop().await;
        figure(
            SCENARIO,
            "leader handover seconds",
            format!(
                "{:.1} ({leader} deleted → {new_leader}, {which}, holds the Lease)",
                taken_after.as_secs_f64()
            ),
        );
        figure(
            SCENARIO,
            "leader deleted → new leader's first reconcile seconds",
            format!("{:.1}", first_reconcile_after.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "new leader's decisions",
            format!("{kinds:?}; targets {} unchanged", held.targets),
        );
        figure(
            SCENARIO,
            "load through restart and handover",
            format!(
                "{} calls, error rate {:.2}%",
                t.calls,
                t.error_rate() * 100.0
            ),
        );
        assert!(t.error_rate() < 0.01, "{t:?}");
        Ok(())
    })
    .await
}

/// What a reset would change.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    targets: String,
}

impl Held {
    fn of(s: &ConnectionPolicyStatus) -> Self {
        Self {
            targets: s.targets.clone().unwrap_or_default(),
        }
    }
}

/// Three closed-loop clients: enough for fresh latency samples, far below the minimum target.
fn light_load(gateways: &[std::net::SocketAddr]) -> anyhow::Result<Load> {
    Load::start(
        LoadSpec::one_client_per_worker(
            gateways.to_vec(),
            "model-a",
            8,
            GATEWAYS,
            Duration::from_secs(10),
        ),
        GATEWAYS,
    )
}

async fn status(stack: &Stack<'_>) -> anyhow::Result<ConnectionPolicyStatus> {
    stack.policy(POLICY).await?.status.context("no status yet")
}

/// model-a's share on each gateway at one moment: read twice over, and `None` when a document
/// moved between the two reads (a PUT landing in the middle of one read would mix two
/// divisions).
async fn shares_at_once<'a>(
    gateways: impl Iterator<Item = &'a GatewayPod> + Clone,
) -> anyhow::Result<Option<Vec<u32>>> {
    let mut reads = Vec::new();
    for _ in 0..2 {
        let mut read = Vec::new();
        for g in gateways.clone() {
            let l = g.limits().await?;
            let share = share(&l);
            read.push((l.revision, share));
        }
        reads.push(read);
    }
    Ok((reads[0] == reads[1]).then(|| reads[0].iter().map(|(_, s)| *s).collect()))
}

/// model-a's per-pod share in a limits document.
fn share(l: &GatewayLimits) -> u32 {
    l.backends
        .iter()
        .find(|b| b.name == "model-a")
        .map_or(0, |b| b.pool.max_connections_per_endpoint)
}

/// The document of the durable ConfigMap `models-limits`.
async fn limits_configmap(stack: &Stack<'_>) -> anyhow::Result<GatewayLimits> {
    let api: Api<ConfigMap> = stack.ns().api();
    let cm = api.get(&format!("{POLICY}-limits")).await?;
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get("limits.json"))
        .context("limits.json")?;
    Ok(serde_json::from_str(text)?)
}

/// The Lease's holder.
async fn holder(stack: &Stack<'_>) -> anyhow::Result<String> {
    let api: Api<Lease> = stack.ns().api();
    api.get(LEASE)
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .context("the Lease has no holder")
}

async fn operator_metrics(url: &str) -> anyhow::Result<String> {
    Ok(reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?)
}
