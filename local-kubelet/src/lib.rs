//! The local kubelet: makes this machine one Kubernetes node whose pods are local processes.
//!
//! ```text
//!  watch Pods ──► unbound pod ──► POST pods/binding (we are the only node, so the scheduler too)
//!      │
//!      └──► pod bound here ──► one worker per pod (pod/worker.rs):
//!              pod IP 10.244.x.y on lo (addresses.rs) · volumes (volumes.rs)
//!              · processes (pod/spec.rs builds them, process.rs runs them) · probes (probe.rs)
//!              · restarts with back-off · status patches (pod/status.rs) · deletion
//! ```
//!
//! Modules depend one way: `addresses`, `logs`, `node`, `probe`, `process` and `volumes` import
//! no module of this crate; `api` imports `logs`; `context` (what every pod worker shares)
//! imports `addresses`, `api`, `process` and `volumes`; `pod` imports `context` and the leaves;
//! the crate root (watching pods, binding them, starting workers) imports what it runs.
//!
//! Each pod gets its own loopback address, so pods can listen on the same ports; processes run
//! in a private mount namespace where the pod's volumes are bind-mounted at their real
//! `mountPath`s (a ServiceAccount token at `/var/run/secrets/kubernetes.io/serviceaccount` makes
//! in-cluster clients work unchanged). Container logs are kept CRI style in
//! `<state-dir>/pods/<namespace>/<pod>/<container>.log` (and `.previous.log`, logs.rs) and
//! served to the apiserver by the kubelet API (api.rs), so `kubectl logs` works.

mod addresses;
pub mod api;
mod context;
pub mod logs;
mod node;
mod pod;
mod probe;
mod process;
mod volumes;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Binding, ConfigMap, ObjectReference, Pod, Secret};
use kube::ResourceExt as _;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt as _, watcher};
use nix::sys::signal::Signal;
use parking_lot::Mutex;
use tokio::sync::watch;

pub use addresses::{UNHELD_POD_ADDRESS, host_has_address};
pub use pod::NOFILE_ANNOTATION;
pub use process::ImageResolver;

use addresses::IpPool;
use context::KubeletContext;

/// How the local kubelet is set up.
#[derive(Clone, Debug)]
pub struct KubeletConfig {
    /// Name of the Node it registers.
    pub node_name: String,
    /// Where pod folders (volumes, logs) live.
    pub state_dir: PathBuf,
    /// Which binary stands for which image.
    pub images: ImageResolver,
    /// How pods reach the apiserver (`KUBERNETES_SERVICE_HOST`/`_PORT`).
    pub apiserver: (String, u16),
    /// First and longest restart back-off.
    pub backoff: (Duration, Duration),
    /// Where the kubelet API listens (the Node's InternalIP and kubelet port) and its TLS;
    /// `None`: no API, `kubectl logs` does not work.
    pub api: Option<(std::net::SocketAddr, api::ApiTls)>,
}

/// Runs the kubelet until `shutdown` resolves, then stops every pod process.
pub async fn run(
    client: kube::Client,
    config: KubeletConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    // The API is listening before the Node says where it is.
    let api = match &config.api {
        Some((addr, tls)) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("kubelet API: cannot listen on {addr}: {e}"))?;
            Some((listener.local_addr()?, listener, tls.server_config()?))
        }
        None => None,
    };
    let endpoint = api.as_ref().map(|(addr, _, _)| *addr);
    node::register(&client, &config.node_name, endpoint).await?;
    let (configmaps, configmaps_writer) = reflector::store::<ConfigMap>();
    let (secrets, secrets_writer) = reflector::store::<Secret>();
    tokio::spawn(
        watcher(
            Api::<ConfigMap>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(configmaps_writer)
        .for_each(|_| async {}),
    );
    tokio::spawn(
        watcher(
            Api::<Secret>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(secrets_writer)
        .for_each(|_| async {}),
    );
    configmaps.wait_until_ready().await?;
    secrets.wait_until_ready().await?;
    let ctx = Arc::new(KubeletContext {
        client: client.clone(),
        node_name: config.node_name.clone(),
        host_ip: endpoint.map_or_else(|| "127.0.0.1".into(), |a| a.ip().to_string()),
        state_dir: config.state_dir,
        images: config.images,
        apiserver: config.apiserver,
        backoff: config.backoff,
        volumes: volumes::VolumeSources {
            configmaps,
            secrets,
            client: client.clone(),
        },
        ips: Mutex::new(IpPool::default()),
        pids: Mutex::new(HashSet::new()),
        instances: Arc::default(),
    });
    if let Some((addr, listener, tls)) = api {
        tokio::spawn(api::serve(
            listener,
            tls,
            ctx.state_dir.join("pods"),
            Arc::clone(&ctx.instances),
        ));
        tracing::info!(%addr, "kubelet API serving container logs");
    }
    tokio::spawn(node::heartbeat(
        client.clone(),
        config.node_name.clone(),
        endpoint,
    ));
    tracing::info!(node = %config.node_name, "local kubelet running");

    tokio::select! {
        result = watch_pods(ctx.clone()) => result?,
        () = shutdown => tracing::info!("shutting down: stopping all pod processes"),
    }
    stop_all(&ctx).await;
    Ok(())
}

/// Binds unscheduled pods to this node and keeps one worker per pod bound here.
async fn watch_pods(ctx: Arc<KubeletContext>) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    let mut workers: BTreeMap<String, watch::Sender<Option<Pod>>> = BTreeMap::new();
    let mut stream = watcher(pods.clone(), watcher::Config::default())
        .default_backoff()
        .boxed();
    // Pods seen during a relist, to notice the ones deleted while the watch was down.
    let mut relist: Option<HashSet<String>> = None;
    while let Some(event) = stream.try_next().await? {
        match event {
            watcher::Event::Init => relist = Some(HashSet::new()),
            watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) => {
                if let Some(seen) = relist.as_mut() {
                    seen.extend(pod.uid());
                }
                handle_pod(&ctx, &mut workers, pod).await;
            }
            watcher::Event::Delete(pod) => {
                if let Some(tx) = pod.uid().and_then(|uid| workers.remove(&uid)) {
                    let _ = tx.send(None);
                }
            }
            watcher::Event::InitDone => {
                if let Some(seen) = relist.take() {
                    workers.retain(|uid, tx| {
                        let keep = seen.contains(uid);
                        if !keep {
                            let _ = tx.send(None);
                        }
                        keep
                    });
                }
            }
        }
        workers.retain(|_, tx| !tx.is_closed());
    }
    Ok(())
}

async fn handle_pod(
    ctx: &Arc<KubeletContext>,
    workers: &mut BTreeMap<String, watch::Sender<Option<Pod>>>,
    pod: Pod,
) {
    let Some(uid) = pod.uid() else { return };
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    match node.as_deref() {
        None if pod.metadata.deletion_timestamp.is_none() && fits(&ctx.node_name, &pod) => {
            bind(ctx, &pod).await
        }
        Some(n) if n == ctx.node_name => {
            if let Some(tx) = workers.get(&uid) {
                let _ = tx.send(Some(pod));
            } else if !is_finished(&pod) {
                let (tx, rx) = watch::channel(Some(pod));
                workers.insert(uid, tx);
                tokio::spawn(pod::run_pod(ctx.clone(), rx));
            }
        }
        _ => {}
    }
}

/// Whether the pod's `nodeSelector` matches the local Node (the only scheduling rule we apply).
fn fits(node_name: &str, pod: &Pod) -> bool {
    let labels = node::labels(node_name);
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn is_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

async fn bind(ctx: &KubeletContext, pod: &Pod) {
    let ns = pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(pod.name_any()),
            namespace: Some(ns),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(ctx.node_name.clone()),
            ..Default::default()
        },
    };
    match api
        .create_subresource::<Binding, Binding>(
            "binding",
            &pod.name_any(),
            &PostParams::default(),
            &binding,
        )
        .await
    {
        Ok(_) => tracing::info!(pod = %pod.name_any(), "bound"),
        // Already bound (a racing event) or gone: the next watch event settles it.
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
        Err(e) => tracing::warn!(pod = %pod.name_any(), error = %e, "binding failed"),
    }
}

async fn stop_all(ctx: &KubeletContext) {
    let pids: Vec<u32> = ctx.pids.lock().iter().copied().collect();
    for pid in &pids {
        process::signal_group(*pid, Signal::SIGTERM);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for pid in &pids {
        process::signal_group(*pid, Signal::SIGKILL);
    }
    ctx.release_all_ips();
}
