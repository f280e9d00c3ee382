//! The local kubelet: makes this machine one Kubernetes node whose pods are local processes.
//!
//! ```text
//!  watch Pods ──► unbound pod ──► POST pods/binding (we are the only node, so the scheduler too)
//!      │
//!      └──► pod bound here ──► one worker per pod (pod.rs):
//!              pod IP 10.244.x.y on lo · volumes (volumes.rs) · processes (process.rs)
//!              · probes (probe.rs) · restarts with back-off · status patches · deletion
//! ```
//!
//! Each pod gets its own loopback address, so pods can listen on the same ports; processes run
//! in a private mount namespace where the pod's volumes are bind-mounted at their real
//! `mountPath`s (a ServiceAccount token at `/var/run/secrets/kubernetes.io/serviceaccount` makes
//! in-cluster clients work unchanged). Container logs are kept CRI style in
//! `<state-dir>/pods/<namespace>/<pod>/<container>.log` (and `.previous.log`, logs.rs) and
//! served to the apiserver by the kubelet API (api.rs), so `kubectl logs` works.

pub mod api;
pub mod logs;
mod node;
mod pod;
mod probe;
mod process;
mod volumes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Binding, ConfigMap, ObjectReference, Pod, Secret};
use kube::ResourceExt as _;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt as _, watcher};
use nix::sys::signal::Signal;
use parking_lot::Mutex;
use tokio::sync::watch;

pub use pod::NOFILE_ANNOTATION;
pub use process::ImageResolver;

/// An address in the pod range that no pod ever holds: the local kubelet never hands out
/// 10.244.255.0/24. A fixture that needs "an address nothing listens on" uses it: a connect
/// fails at once on this machine.
pub const UNHELD_POD_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 2);

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

/// What every pod worker shares.
pub(crate) struct KubeletContext {
    client: kube::Client,
    node_name: String,
    host_ip: String,
    state_dir: PathBuf,
    images: ImageResolver,
    apiserver: (String, u16),
    backoff: (Duration, Duration),
    volumes: volumes::VolumeSources,
    ips: Mutex<IpPool>,
    pids: Mutex<HashSet<u32>>,
    /// The running container instances' "has ended" signals, for the API's followers.
    instances: Arc<api::Instances>,
}

impl KubeletContext {
    /// The pod's address, put on the loopback interface (see [`IpPool`]).
    fn allocate_ip(&self, uid: &str, previous: Option<Ipv4Addr>) -> Option<Ipv4Addr> {
        self.ips.lock().allocate(uid, previous, add_host_address)
    }

    fn release_ip(&self, uid: &str) {
        if let Some(ip) = self.ips.lock().release(uid) {
            remove_host_address(ip);
        }
    }

    fn track_pid(&self, pid: u32, running: bool) {
        let mut pids = self.pids.lock();
        if running {
            pids.insert(pid);
        } else {
            pids.remove(&pid);
        }
    }

    fn configmap(&self, ns: &str, name: &str) -> Option<ConfigMap> {
        self.volumes
            .configmaps
            .get(&ObjectRef::new(name).within(ns))
            .map(|c| (*c).clone())
    }

    fn secret(&self, ns: &str, name: &str) -> Option<Secret> {
        self.volumes
            .secrets
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| (*s).clone())
    }
}

/// Pod addresses: 10.244.0.1 to 10.244.254.254 (kind's pod range), one per pod uid, each added
/// to the loopback interface while its pod lives, so that pods reach each other and Prometheus
/// reaches them. `cluster up` routes the rest of the range to nowhere, so a connect to a pod
/// that is gone fails on this machine; 10.244.255.0/24 is never handed
/// out, for fixtures that need an address nothing holds ([`UNHELD_POD_ADDRESS`]). Not 127.0.0.0/8 itself: the apiserver
/// refuses loopback addresses in Endpoints and EndpointSlices, so Services would have no
/// endpoints.
#[derive(Debug, Default)]
struct IpPool {
    by_uid: HashMap<String, Ipv4Addr>,
    next: u32,
}

impl IpPool {
    const FIRST: u32 = u32::from_be_bytes([10, 244, 0, 1]);
    const LAST: u32 = u32::from_be_bytes([10, 244, 254, 254]);

    /// The address of pod `uid`: the one it has, else its `previous` one (a restarted kubelet
    /// keeps what the pod status reports) when free and claimable, else the next free one.
    /// `claim` puts an address on the host and says false when it cannot be had (another
    /// kubelet on this machine holds it).
    fn allocate(
        &mut self,
        uid: &str,
        previous: Option<Ipv4Addr>,
        mut claim: impl FnMut(Ipv4Addr) -> bool,
    ) -> Option<Ipv4Addr> {
        if let Some(ip) = self.by_uid.get(uid) {
            return Some(*ip);
        }
        let used: HashSet<Ipv4Addr> = self.by_uid.values().copied().collect();
        let in_range = |ip: &Ipv4Addr| (Self::FIRST..=Self::LAST).contains(&u32::from(*ip));
        let ip = match previous.filter(|ip| in_range(ip) && !used.contains(ip) && claim(*ip)) {
            Some(ip) => ip,
            None => {
                let span = Self::LAST - Self::FIRST + 1;
                let mut tried = 0;
                loop {
                    let candidate = Ipv4Addr::from(Self::FIRST + self.next % span);
                    self.next += 1;
                    tried += 1;
                    if tried > span {
                        return None;
                    }
                    // Skip .0 and .255 in each /24, which some programs refuse to bind.
                    let last = candidate.octets()[3];
                    if last != 0 && last != 255 && !used.contains(&candidate) && claim(candidate) {
                        break candidate;
                    }
                }
            }
        };
        self.by_uid.insert(uid.to_owned(), ip);
        Some(ip)
    }

    fn release(&mut self, uid: &str) -> Option<Ipv4Addr> {
        self.by_uid.remove(uid)
    }
}

/// Adds `ip`/32 to the loopback interface; false when it is already there (another kubelet's)
/// or cannot be added.
fn add_host_address(ip: Ipv4Addr) -> bool {
    let status = std::process::Command::new("ip")
        .args(["-4", "addr", "add", &format!("{ip}/32"), "dev", "lo"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match status {
        Ok(s) => s.success(),
        Err(e) => {
            tracing::error!(error = %e, "cannot run `ip` (iproute2) to add pod addresses");
            false
        }
    }
}

/// Whether `ip`/32 is on the loopback interface, i.e. a pod of a local kubelet holds it (a
/// released address is gone; a connection to it fails with "No route to host").
pub fn host_has_address(ip: IpAddr) -> bool {
    std::process::Command::new("ip")
        .args(["-o", "addr", "show", "dev", "lo"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .any(|word| word.split('/').next() == Some(ip.to_string().as_str()))
        })
}

/// Removes `ip`/32 from the loopback interface.
fn remove_host_address(ip: Ipv4Addr) {
    let _ = std::process::Command::new("ip")
        .args(["-4", "addr", "del", &format!("{ip}/32"), "dev", "lo"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
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
    let ips: Vec<Ipv4Addr> = ctx.ips.lock().by_uid.drain().map(|(_, ip)| ip).collect();
    for ip in ips {
        remove_host_address(ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_pool_gives_each_pod_its_own_address_in_the_pod_range() {
        let mut pool = IpPool::default();
        let free = |_: Ipv4Addr| true;
        let a = pool.allocate("a", None, free).unwrap();
        let b = pool.allocate("b", None, free).unwrap();
        assert_eq!(a, Ipv4Addr::new(10, 244, 0, 1));
        assert_eq!(b, Ipv4Addr::new(10, 244, 0, 2));
        assert!(!a.is_loopback(), "the apiserver refuses loopback endpoints");
        assert_eq!(pool.allocate("a", None, free), Some(a), "stable per pod");
        // A restarted kubelet keeps a pod's reported address when it is free.
        assert_eq!(
            pool.allocate("c", Some(Ipv4Addr::new(10, 244, 9, 9)), free),
            Some(Ipv4Addr::new(10, 244, 9, 9))
        );
        assert_ne!(
            pool.allocate("d", Some(a), free),
            Some(a),
            "an address in use is not handed out twice"
        );
        assert_eq!(pool.release("a"), Some(a));
        assert!(!pool.by_uid.contains_key("a"));
    }

    #[test]
    fn ip_pool_never_hands_out_the_unheld_addresses() {
        let unheld = UNHELD_POD_ADDRESS;
        let mut pool = IpPool {
            // The last address of 10.244.254.0/24 comes next; then the range wraps around.
            next: IpPool::LAST - IpPool::FIRST,
            ..Default::default()
        };
        assert_eq!(
            pool.allocate("reported", Some(unheld), |_| true),
            Some(Ipv4Addr::new(10, 244, 254, 254)),
            "a pod reporting an unheld address gets another"
        );
        assert_eq!(
            pool.allocate("next", None, |_| true),
            Some(Ipv4Addr::new(10, 244, 0, 1))
        );
        assert_eq!(unheld.octets()[..3], [10, 244, 255]);
    }

    #[test]
    fn ip_pool_skips_addresses_another_kubelet_holds() {
        let mut pool = IpPool::default();
        let taken = [Ipv4Addr::new(10, 244, 0, 1), Ipv4Addr::new(10, 244, 0, 2)];
        let claim = |ip: Ipv4Addr| !taken.contains(&ip);
        assert_eq!(
            pool.allocate("a", Some(taken[0]), claim),
            Some(Ipv4Addr::new(10, 244, 0, 3))
        );
    }

    #[test]
    fn ip_pool_skips_network_and_broadcast_octets() {
        let mut pool = IpPool {
            next: 253,
            ..Default::default()
        };
        let ips: Vec<Ipv4Addr> = (0..4)
            .map(|i| pool.allocate(&i.to_string(), None, |_| true).unwrap())
            .collect();
        assert_eq!(
            ips,
            [
                Ipv4Addr::new(10, 244, 0, 254),
                Ipv4Addr::new(10, 244, 1, 1),
                Ipv4Addr::new(10, 244, 1, 2),
                Ipv4Addr::new(10, 244, 1, 3)
            ]
        );
    }
}
