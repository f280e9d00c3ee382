//! `make demo`: poolpilot's main job on the embedded cluster, live. Makes the admin credentials
//! an install makes (unless an earlier run did: a random token, a CA and the gateways'
//! certificate), deploys the product from `manifests/overlays/local` (CRD, operator, gateways,
//! modelsim backends, the sample policy),
//! waits for every gateway replica, lets the pool shrink while idle, plays a flash crowd (demand
//! 50% over the pool, as in the incident the product comes from), and shows once a second what the
//! gateways (their shares and bursts) and the operator do until the error rate is back under
//! 0.5%; then a before/after summary and a picture of the crowd (`--plot`); then a skew (most
//! callers on one gateway) and each pod's share following it, leaving everything running.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Write as _};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_api::policy::DecisionRecord;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::credentials::{self, AdminCredentials};
use poolpilot_e2e::load::{Load, LoadSpec, Tally, skewed};
use poolpilot_e2e::paths::workspace_root;
use poolpilot_e2e::pool_view::{PoolRecorder, PoolView, plot_path, pool_view};
use poolpilot_e2e::stack::{ADMIN_PORT, GATEWAY_DEPLOYMENT, GATEWAY_LABELS, GatewayPod, is_ready};
use poolpilot_e2e::{Cluster, eventually};
use tokio::time::Instant;

/// Plays poolpilot's flash-crowd demo on the embedded cluster (`make demo`).
#[derive(Debug, Parser)]
#[command(version = poolpilot_telemetry::LONG_VERSION)]
struct Args {
    /// The sample's namespace (manifests/overlays/local).
    #[arg(long, default_value = "poolpilot")]
    namespace: String,
    /// The operator's namespace (manifests/overlays/local), where its CA bundle goes.
    #[arg(long, default_value = "poolpilot-system")]
    operator_namespace: String,
    /// The sample policy.
    #[arg(long, default_value = "models")]
    policy: String,
    /// The backend the flash crowd calls.
    #[arg(long, default_value = "model-a")]
    backend: String,
    /// Demand of the flash crowd over the pool in force (1.5: 50% over).
    #[arg(long, default_value_t = 1.5)]
    overload: f64,
    /// Callers of the skew phase (after the crowd) on the last gateway, in percent.
    #[arg(long, default_value_t = 80)]
    skew_percent: u32,
    /// Longest time the flash crowd runs.
    #[arg(long, default_value = "150s", value_parser = humantime_secs)]
    max_crowd: Duration,
    /// Where to draw the crowd (pool, errors, decisions) as SVG; default
    /// `<cache>/plots/flash-crowd.svg`.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

fn humantime_secs(s: &str) -> Result<Duration, String> {
    s.parse::<poolpilot_api::Duration>()
        .map(|d| d.get())
        .map_err(|e| e.to_string())
}

/// The demo's autoscale interval, in seconds (`DEMO_PACE`).
const DEMO_INTERVAL: u64 = 10;
/// The pace of the demo's control loop (the shipped sample decides every 15 s and shrinks over
/// 5 min, which is right for production and slow for a demo).
const DEMO_PACE: &str = r#"{"spec": {"autoscale": {"interval": "10s", "scaleDown": {"stabilizationWindow": "10s", "maxStepPercent": 100}}, "rollout": {"strategy": "Progressive", "canaryPods": 1, "verifyIntervals": 0}}}"#;
/// Callers of the light load that keeps latency samples coming while the pool shrinks (an idle
/// backend has no latency, which the operator counts as missing data).
const TRICKLE: usize = 3;
/// `max_tokens` of the demo's calls: modelsim takes 20 ms + 10 ms per token, so about 1 s, long
/// enough against the 300 ms lease timeout for a 50% overload to show as lease timeouts.
const TOKENS: u32 = 100;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    poolpilot_e2e::install_crypto_provider();
    let args = Args::parse();
    let cluster = Cluster::shared().await?;
    let client = cluster.client().await?;
    let policies: Api<ConnectionPolicy> = Api::namespaced(client.clone(), &args.namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.namespace);
    let root = workspace_root();

    step("installing the ConnectionPolicy CRD (kubectl apply -k manifests/crds)");
    cluster.install_crd().await?;
    step(
        "creating the admin credentials (a random token, a CA, the gateways' certificate) unless they exist",
    );
    for ns in [&args.namespace, &args.operator_namespace] {
        eventually("the namespace exists", Duration::from_secs(60), || async {
            let object = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            let file = tempfile::NamedTempFile::new()?;
            std::fs::write(file.path(), serde_json::to_vec(&object)?)?;
            run(cluster.kubectl().args(["apply", "-f"]).arg(file.path())).await
        })
        .await?;
    }
    let credentials = Arc::new(
        AdminCredentials::ensure(&client, &args.namespace, &args.operator_namespace).await?,
    );
    step("deploying poolpilot (kubectl apply -k manifests/overlays/local)");
    let overlay = root.join("manifests/overlays/local");
    eventually("the overlay applies", Duration::from_secs(60), || async {
        run(cluster.kubectl().arg("apply").arg("-k").arg(&overlay)).await
    })
    .await?;

    step("waiting for the operator, the gateways and the backends to be Ready");
    let policy = eventually(
        "the sample policy is Ready",
        Duration::from_secs(240),
        || async {
            let p = policies.get(&args.policy).await?;
            let ready = condition(&p, "Ready").is_some_and(|(s, _)| s == "True");
            anyhow::ensure!(ready, "Ready: {:?}", condition(&p, "Ready"));
            Ok(p)
        },
    )
    .await?;
    // Every replica, not the first to turn Ready: a crowd aimed at the pods Ready at that
    // moment would leave the others idle and say nothing about how the fleet divides its load.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &args.namespace);
    let gateways = eventually(
        "every gateway replica is Ready",
        Duration::from_secs(240),
        || async {
            let replicas = deployments
                .get(GATEWAY_DEPLOYMENT)
                .await?
                .spec
                .replicas
                .unwrap_or(1);
            let ready = ready_gateways(&pods, &credentials).await?;
            anyhow::ensure!(
                ready.len() >= usize::try_from(replicas).unwrap_or(0),
                "{} of {replicas} gateway replicas Ready",
                ready.len()
            );
            Ok(ready)
        },
    )
    .await?;
    println!(
        "   policy {} Ready, {} gateway pods: {}",
        args.policy,
        gateways.len(),
        gateways
            .iter()
            .map(|g| g.proxy().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );

    step("pacing the control loop for a demo (decide every 10s, shrink after 10s)");
    policies
        .patch(
            &args.policy,
            &PatchParams::default(),
            &Patch::Merge(serde_json::from_str::<serde_json::Value>(DEMO_PACE)?),
        )
        .await?;
    let min = policy.spec.autoscale.min;
    step(&format!(
        "light load ({TRICKLE} callers): letting {}'s target shrink to autoscale.min = {min}",
        args.backend
    ));
    // The load is aimed at the gateways it is given: the list read just before each phase.
    let spec = |gateways: &[GatewayPod], workers: usize| {
        LoadSpec::one_client_per_worker(
            gateways.iter().map(GatewayPod::proxy).collect(),
            args.backend.clone(),
            TOKENS,
            workers,
            Duration::from_secs(30),
        )
    };
    let trickle = Load::start_as(spec(&gateways, TRICKLE), TRICKLE, "demo-light", None)?;
    // On a terminal one line counts down; in a log, a line per change of the target.
    let shown = parking_lot::Mutex::new(None::<u32>);
    let endpoints = eventually(
        "the target shrinks to min",
        Duration::from_secs(180),
        || async {
            let p = policies.get(&args.policy).await?;
            let b = backend_status(&p, &args.backend).context("no backend status yet")?;
            if std::io::stdout().is_terminal() {
                print!("\r   target {:>3} → {min} ", b.target);
                let _ = std::io::stdout().flush();
            } else if shown.lock().replace(b.target) != Some(b.target) {
                println!("   target {:>3} → {min}", b.target);
            }
            anyhow::ensure!(b.target == min && rolled_out(&p), "target {}", b.target);
            Ok(b.endpoints)
        },
    )
    .await?;
    println!();
    trickle.stop().await;

    let pool = u32::try_from(min as usize * endpoints as usize).unwrap_or(u32::MAX);
    let workers = (f64::from(pool) * args.overload).round() as usize;
    step(&format!(
        "flash crowd: {workers} callers at once against a pool of {pool} connections \
         ({min} per endpoint × {endpoints} endpoints), lease timeout 300ms"
    ));
    let gateways = ready_gateways(&pods, &credentials).await?;
    let before_crowd = backend_status(&policies.get(&args.policy).await?, &args.backend)
        .and_then(|b| b.last_scale);
    let load = Load::start_as(spec(&gateways, workers), workers, "demo", None)?;
    let crowd = Instant::now();
    let mut decision: Option<(u64, String)> = None;
    let mut recovered: Option<u64> = None;
    let live = std::io::stdout().is_terminal();
    let mut told = b_decision(&policies.get(&args.policy).await?, &args.backend);
    let mut recorder = PoolRecorder::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let p = policies.get(&args.policy).await?;
        let now = load.now();
        let b = backend_status(&p, &args.backend);
        // Every decision of the operator, with why, as status tells it.
        let last = b_decision(&p, &args.backend);
        if last != told
            && let Some(d) = &last
        {
            if !live {
                println!("   operator at t={now:>3}s: {:?}: {}", d.action, d.reason);
            }
            told = last.clone();
        }
        if decision.is_none()
            && let Some(scale) = b.as_ref().and_then(|b| b.last_scale.clone())
            && scale.to > scale.from
            && before_crowd.as_ref() != Some(&scale)
        {
            decision = Some((
                now,
                format!("{} → {}: {}", scale.from, scale.to, scale.reason),
            ));
            recorder.decision(
                crowd.elapsed().as_secs_f64(),
                format!("{} → {} per endpoint", scale.from, scale.to),
            );
        }
        let gateway_view = pool_view(&gateways, &args.backend).await;
        if let Some(view) = gateway_view {
            recorder.record(crowd.elapsed().as_secs_f64(), view);
        }
        let last = load.last(3);
        // Recovered: three seconds in a row under 0.5% errors. With each pod's burst allowance
        // that may come before the operator's decision, which then sizes the shares to the
        // demand it sees.
        if recovered.is_none() && now >= 3 && last.calls > 0 && last.error_rate() < 0.005 {
            recovered = Some(now);
        }
        render(
            live,
            &p,
            &args.backend,
            &gateway_view,
            &load,
            workers,
            decision.as_ref(),
            told.as_ref(),
        );
        let done = match (recovered, &decision) {
            (Some(r), Some((at, _))) => now >= r.max(*at) + 10,
            _ => false,
        };
        if done || crowd.elapsed() >= args.max_crowd {
            break;
        }
    }
    let seconds = load.seconds();
    let total = load.window(0, load.now());
    load.stop().await;
    let picture = args
        .plot
        .clone()
        .unwrap_or_else(|| plot_path("flash-crowd"));
    recorder
        .draw(
            &picture,
            &format!(
                "make demo: flash crowd on {}, {workers} callers against a pool of {pool}",
                args.backend
            ),
            &seconds,
        )
        .with_context(|| format!("drawing {}", picture.display()))?;

    println!();
    step("summary");
    let (before, after) = match (&decision, recovered) {
        (Some((at, _)), Some(r)) => (window(&seconds, 0, *at), window(&seconds, r, u64::MAX)),
        (Some((at, _)), None) => (
            window(&seconds, 0, *at),
            window(&seconds, *at + 10, u64::MAX),
        ),
        (None, _) => (total.clone(), Tally::default()),
    };
    let causes = if before.errors.is_empty() {
        String::new()
    } else {
        format!("; {:?}", before.errors)
    };
    println!(
        "   before the operator acted: {:>5.1}% errors ({} of {} calls{causes})",
        before.error_rate() * 100.0,
        before.failed(),
        before.calls,
    );
    match &decision {
        Some((at, what)) => println!(
            "   decision at t={at}s ({:.1} intervals of {}s into the crowd): {what}",
            *at as f64 / DEMO_INTERVAL as f64,
            DEMO_INTERVAL
        ),
        None => println!(
            "   the operator made no decision within {:?}",
            args.max_crowd
        ),
    }
    match recovered {
        // The first three seconds already under 0.5%: each pod's burst allowance took the
        // crowd beyond its share until the decision resized the shares.
        Some(r) if r <= 3 && before.error_rate() < 0.005 => println!(
            "   under 0.5% errors from the start: the pods' burst allowance held the crowd until the decision"
        ),
        Some(r) => println!("   back under 0.5% errors at t={r}s"),
        None => {}
    }
    println!(
        "   after:                      {:>5.1}% errors ({} of {} calls)",
        after.error_rate() * 100.0,
        after.failed(),
        after.calls
    );
    println!("   the crowd, drawn: {}", picture.display());
    println!();
    let recovery = if decision.is_some() && recovered.is_some() {
        Ok(())
    } else {
        Err(anyhow::anyhow!(
            "the demo did not show a recovery: decision {decision:?}, recovered {recovered:?}"
        ))
    };

    // The skew: most callers on one pod, as a load balancer leaves a few clients with long-lived
    // connections. The operator divides the target by where the demand is.
    let gateways = ready_gateways(&pods, &credentials).await?;
    let followed = if recovery.is_ok() && gateways.len() >= 2 {
        println!();
        skew(
            &policies,
            (&args.policy, &args.backend),
            &gateways,
            workers,
            args.skew_percent,
        )
        .await
    } else {
        Ok(())
    };
    println!();
    keep_running(&args, cluster, &gateways);
    recovery.and(followed)
}

/// How to reach what the demo leaves running.
fn keep_running(args: &Args, cluster: &Cluster, gateways: &[GatewayPod]) {
    println!("poolpilot keeps running on the embedded cluster:");
    println!(
        "   export KUBECONFIG={} PATH={}:$PATH",
        cluster.kubeconfig().display(),
        poolpilot_e2e::paths::cache_dir().join("bin").display()
    );
    println!(
        "   kubectl get cpol -n {}                # targets, rollout, conditions",
        args.namespace
    );
    println!(
        "   kubectl describe cpol {} -n {}    # decisions and events",
        args.policy, args.namespace
    );
    println!(
        "   Prometheus:  {}",
        cluster.prometheus_url().unwrap_or("(none)")
    );
    if let Some(g) = gateways.first() {
        println!(
            "   send a call: curl -s http://{}/v1/chat/completions -H 'authorization: Bearer me' -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
            g.proxy(),
            args.backend
        );
        let name = credentials::server_name(&args.namespace);
        let secret = |key: &str| {
            format!(
                "kubectl -n {} get secret {} -o jsonpath='{{.data.{}}}' | base64 -d",
                args.namespace,
                if key == "token" {
                    credentials::TOKEN_SECRET
                } else {
                    credentials::TLS_SECRET
                },
                key.replace('.', "\\.")
            )
        };
        println!(
            "   limits in force: curl -s --cacert <({}) --resolve {name}:{ADMIN_PORT}:{} -H \"authorization: Bearer $({})\" https://{name}:{ADMIN_PORT}/v1/limits",
            secret("ca.crt"),
            g.ip,
            secret("token")
        );
    }
    println!("   stop it all: make demo-down");
}

/// Runs `workers` callers with `percent`% of them on the last gateway for up to four intervals,
/// printing each pod's share once a second, until that pod's share covers its callers and the
/// errors of the last 5 s are under 0.5%.
async fn skew(
    policies: &Api<ConnectionPolicy>,
    (policy, backend): (&str, &str),
    gateways: &[GatewayPod],
    workers: usize,
    percent: u32,
) -> anyhow::Result<()> {
    let proxies: Vec<_> = gateways.iter().map(GatewayPod::proxy).collect();
    let onto = gateways.len() - 1;
    let busy = &gateways[onto].name;
    step(&format!(
        "skew: {workers} callers, {percent}% of them on {busy} (an L4 load balancer's uneven spread)"
    ));
    let spec = LoadSpec::one_client_per_worker(
        skewed(&proxies, onto, percent),
        backend.to_owned(),
        TOKENS,
        workers,
        Duration::from_secs(30),
    );
    let load = Load::start_as(spec, workers, "demo-skew", None)?;
    let on_busy = (workers * percent as usize).div_ceil(100);
    let started = Instant::now();
    let mut followed = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while started.elapsed() < Duration::from_secs(4 * DEMO_INTERVAL) {
        tick.tick().await;
        let p = policies.get(policy).await.ok();
        let Some(b) = p.as_ref().and_then(|p| backend_status(p, backend)) else {
            continue;
        };
        let shares: Vec<String> = b
            .shares
            .iter()
            .map(|s| format!("{} {}", s.pod, s.share))
            .collect();
        let last = load.last(5);
        println!(
            "   t={:>3}s  shares per endpoint: {}  burst {}  errors (5 s) {:.1}%",
            load.now(),
            shares.join(", "),
            b.burst,
            last.error_rate() * 100.0
        );
        let on = b
            .shares
            .iter()
            .find(|s| &s.pod == busy)
            .map_or(0, |s| s.share);
        let covers = on as usize * b.endpoints as usize >= on_busy;
        if followed.is_none() && covers {
            followed = Some(load.now());
        }
        if followed.is_some_and(|f| load.now() >= f + 5)
            && last.calls > 0
            && last.error_rate() < 0.005
        {
            break;
        }
    }
    let last = load.last(5);
    load.stop().await;
    match followed {
        Some(at) => println!(
            "   the shares followed the skew at t={at}s; last 5 s: {:.1}% errors",
            last.error_rate() * 100.0
        ),
        None => println!(
            "   the shares did not follow the skew within {} s",
            4 * DEMO_INTERVAL
        ),
    }
    anyhow::ensure!(
        followed.is_some() && last.error_rate() < 0.005,
        "the demo did not show the shares following the skew: followed {followed:?}, last 5 s {last}"
    );
    Ok(())
}

fn step(what: &str) {
    println!(">> {what}");
}

fn condition(p: &ConnectionPolicy, kind: &str) -> Option<(String, String)> {
    p.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == kind)
            .map(|c| (c.status.clone(), c.reason.clone()))
    })
}

/// The backend's last decision in the policy's status.
fn b_decision(p: &ConnectionPolicy, name: &str) -> Option<DecisionRecord> {
    backend_status(p, name).and_then(|b| b.last_decision)
}

fn rolled_out(p: &ConnectionPolicy) -> bool {
    condition(p, "RolledOut").is_some_and(|(s, _)| s == "True")
}

fn backend_status(
    p: &ConnectionPolicy,
    name: &str,
) -> Option<poolpilot_api::policy::BackendStatus> {
    p.status
        .as_ref()
        .and_then(|s| s.backends.iter().find(|b| b.name == name).cloned())
}

async fn ready_gateways(
    pods: &Api<Pod>,
    credentials: &Arc<AdminCredentials>,
) -> anyhow::Result<Vec<GatewayPod>> {
    let list = pods
        .list(&ListParams::default().labels(GATEWAY_LABELS))
        .await?;
    let out = list
        .items
        .iter()
        .filter(|p| is_ready(p))
        .map(|p| GatewayPod::of(p, credentials))
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(!out.is_empty(), "no Ready gateway pod");
    Ok(out)
}

fn window(seconds: &[(u64, Tally)], from: u64, to: u64) -> Tally {
    let mut total = Tally::default();
    for (_, t) in seconds.iter().filter(|(s, _)| *s >= from && *s < to) {
        total.calls += t.calls;
        total.ok += t.ok;
        for (k, v) in &t.errors {
            *total.errors.entry(k.clone()).or_default() += v;
        }
    }
    total
}

#[allow(clippy::too_many_arguments)]
fn render(
    live: bool,
    p: &ConnectionPolicy,
    backend: &str,
    gateways: &Option<PoolView>,
    load: &Load,
    workers: usize,
    decision: Option<&(u64, String)>,
    latest: Option<&DecisionRecord>,
) {
    let now = load.now();
    let last = load.last(1);
    let status = p.status.clone().unwrap_or_default();
    let b = status.backends.iter().find(|b| b.name == backend);
    let PoolView {
        leased,
        pending,
        pooled,
        bursting,
    } = gateways.unwrap_or_default();
    let conditions: BTreeMap<&str, &str> = status
        .conditions
        .iter()
        .map(|c| (c.type_.as_str(), c.status.as_str()))
        .collect();
    let line = format!(
        "t={now:>3}s  {backend}: target {:>3}/endpoint  pooled {pooled:>3.0}  burst {bursting:>3.0}  leased {leased:>3.0}  pending {pending:>3.0}  util {:>4}  callers {workers}  errors {:>5.1}% ({} calls/s)",
        b.map_or(0, |b| b.target),
        b.and_then(|b| b.utilization)
            .map_or("-".to_owned(), |u| format!("{:.0}%", u * 100.0)),
        last.error_rate() * 100.0,
        last.calls
    );
    if live {
        print!("\x1b[H\x1b[2J");
        println!("poolpilot demo: flash crowd on {backend}   (updated every second)\n");
        println!("{line}");
        println!(
            "rollout {}   conditions {}",
            status.updated.as_deref().unwrap_or("-"),
            conditions
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        match decision {
            Some((at, what)) => println!("decision at t={at}s: {what}"),
            None => println!("decision: none yet (the operator decides every 10s)"),
        }
        if let Some(d) = latest {
            println!("operator's last decision: {:?}: {}", d.action, d.reason);
        }
        let _ = std::io::stdout().flush();
    } else {
        let marker = decision
            .filter(|(at, _)| *at == now)
            .map(|(_, what)| format!("   ◀ decision: {what}"))
            .unwrap_or_default();
        println!("{line}{marker}");
    }
}
