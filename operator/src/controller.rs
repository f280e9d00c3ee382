//! Wiring: the Kubernetes client (every request counted by verb), caches of pods, EndpointSlices
//! and the operator's ConfigMaps, the Prometheus poller, the `/metrics` server, leader election,
//! and the Controller over ConnectionPolicy (each reconcile timed), which takes its reconciles
//! from the reconcile queue: the policies' changes, those of the pods they select, of the
//! backends' EndpointSlices and of the operator's own ConfigMaps, then each policy's periodic
//! reconcile. One watch per kind: the caches that the reconciles read also trigger them (no
//! second watch by the Controller), and they keep no `managedFields` nor last-applied
//! annotations. Runs until SIGTERM or Ctrl-C.

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt, future};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt, predicates, watcher};
use kube::{Client, ResourceExt};
use kube_lease_manager::LeaseManagerBuilder;
use parking_lot::{Mutex, RwLock};
use poolpilot_api::ConnectionPolicy;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::util::MapRequestLayer;
use tracing::{error, info, warn};

use crate::args::Args;
use crate::gateway::HttpGateways;
use crate::metrics::{Metrics, QueryLabel};
use crate::plan::selector;
use crate::prom::{self, Queries, SaturationQueries, Snapshot};
use crate::reconcile::observe::MANAGED_BY;
use crate::reconcile::world::{Digest, Digested, World};
use crate::reconcile::{self, Config, Context, Stores};

/// Why the operator could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No usable kubeconfig or in-cluster config.
    #[error("no usable kubeconfig or in-cluster config")]
    Config(#[source] kube::config::InferConfigError),
    /// The Kubernetes client could not be built from its config.
    #[error("failed to create a Kubernetes client")]
    Client(#[source] kube::Error),
    /// The CRD is not installed (or not readable).
    #[error(
        "cannot list ConnectionPolicies; is the CRD installed? (kubectl apply -f crds/connectionpolicy.yaml)"
    )]
    Crd(#[source] kube::Error),
    /// The metrics address could not be bound.
    #[error("failed to listen on {addr}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection to Prometheus cannot be set up as the flags say.
    #[error("cannot set up the connection to Prometheus")]
    Prometheus(#[from] crate::prom_connection::ConnectionError),
    /// The gateway HTTP client could not be built.
    #[error("failed to build the gateway HTTP client")]
    Gateways(#[source] reqwest::Error),
    /// The gateways' CA bundle or server name cannot be used.
    #[error(transparent)]
    GatewayTrust(#[from] crate::gateway::TrustError),
    /// Leader election failed.
    #[error("leader election failed")]
    Lease(#[source] kube_lease_manager::LeaseManagerError),
}

/// Runs the operator until a shutdown signal.
pub async fn run(args: Args) -> Result<(), RunError> {
    let (registry, metrics) = crate::metrics::registry(Metrics::default());
    let config = kube::Config::infer().await.map_err(RunError::Config)?;
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(RunError::Client)?
        .with_layer(&MapRequestLayer::new(metrics.kube_request_counter()))
        .build();
    let scope = Scope::new(&args.namespace);
    info!(
        namespace = scope.0.as_deref().unwrap_or("(all)"),
        "watching ConnectionPolicies"
    );
    scope
        .api::<DeserializeGuard<ConnectionPolicy>>(&client)
        .list(&ListParams::default().limit(1))
        .await
        .map_err(RunError::Crd)?;

    let shutdown = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone()));

    let listener = crate::admin::bind(args.listen)
        .await
        .map_err(|source| RunError::Listen {
            addr: args.listen,
            source,
        })?;
    tokio::spawn(crate::admin::serve(
        listener,
        Arc::new(registry),
        shutdown.clone(),
    ));

    // The pod and EndpointSlice watches also keep the namespace fingerprint's digests.
    let pod_digest = Arc::new(Digest::default());
    let pods = cache::<Pod>(
        scope.api(&client),
        watcher::Config::default().labels(&args.pod_selector),
        &shutdown,
        digesting(&pod_digest),
    );
    let slice_digest = Arc::new(Digest::default());
    let slices = cache::<EndpointSlice>(
        scope.api(&client),
        watcher::Config::default(),
        &shutdown,
        digesting(&slice_digest),
    );
    // Watching one namespace, the backend namespaces' EndpointSlices need a watch each (whose
    // changes reconcile like the namespace's own); watching all, the one watch sees them.
    let mut slice_stores = vec![slices.store.clone()];
    let mut slice_digests = vec![slice_digest];
    if let Some(own) = &scope.0 {
        for ns in args.backend_namespaces.iter().filter(|ns| *ns != own) {
            let digest = Arc::new(Digest::default());
            let extra = cache_feeding::<EndpointSlice>(
                Api::namespaced(client.clone(), ns),
                watcher::Config::default(),
                &shutdown,
                slices.touched.clone(),
                digesting(&digest),
            );
            slice_stores.push(extra.store);
            slice_digests.push(digest);
        }
    }
    let managed = format!("{}={}", MANAGED_BY.0, MANAGED_BY.1);
    let configmaps = cache::<ConfigMap>(
        scope.api(&client),
        watcher::Config::default().labels(&managed),
        &shutdown,
        |_| {},
    );

    let snapshot = Arc::new(RwLock::new(Snapshot::default()));
    let saturation = SaturationQueries::default();
    let prometheus = crate::prom_connection::Connection::new(
        &args.prometheus_connection(),
        args.metrics_interval.get(),
    )?;
    tokio::spawn(poll_prometheus(
        prometheus,
        queries(&args),
        saturation.clone(),
        snapshot.clone(),
        metrics.clone(),
        args.metrics_interval.get(),
        shutdown.clone(),
    ));

    let identity = args.identity.clone().unwrap_or_else(hostname);
    let gateways = gateway_client(&args)?;
    let term = Term {
        client: client.clone(),
        scope,
        args: args.clone(),
        identity: identity.clone(),
        metrics,
        snapshot,
        saturation,
        gateways,
        pods,
        slices,
        slice_stores,
        configmaps,
        world: World {
            policies: Arc::default(),
            pods: pod_digest,
            slices: slice_digests,
        },
    };

    if !args.leader_election {
        term.run(shutdown.clone()).await;
        return Ok(());
    }
    let manager = LeaseManagerBuilder::new(client, &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_identity(&identity)
        .build()
        .await
        .map_err(RunError::Lease)?;
    let (mut leader, task) = manager.watch().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            changed = leader.changed() => if changed.is_err() { break },
        }
        if !*leader.borrow_and_update() {
            continue;
        }
        info!(%identity, "became the leader");
        let stop = shutdown.child_token();
        let watch_stop = stop.clone();
        let mut lost = leader.clone();
        tokio::spawn(async move {
            // Ends with the term either way, so that no receiver outlives it: the lease task
            // finishes only once every receiver is gone.
            tokio::select! {
                _ = lost.wait_for(|is_leader| !is_leader) => watch_stop.cancel(),
                () = watch_stop.cancelled() => {}
            }
        });
        term.run(stop).await;
        if shutdown.is_cancelled() {
            break;
        }
        warn!(%identity, "lost the leadership; stopped reconciling");
    }
    drop(leader);
    match task.await {
        Ok(Ok(manager)) => {
            if let Err(e) = manager.release().await {
                warn!(error = %crate::report(&e), "failed to release the lease");
            }
        }
        Ok(Err(e)) => return Err(RunError::Lease(e)),
        Err(e) => warn!(error = %e, "the lease task panicked"),
    }
    Ok(())
}

/// The client that PUTs limits to the gateways: HTTPS verified against `--gateway-ca-file`, or
/// plain HTTP without one (said in the log, once).
fn gateway_client(args: &Args) -> Result<HttpGateways, RunError> {
    let timeout = args.put_timeout.get();
    if args.gateway_ca_file.is_empty() {
        warn!(
            "no --gateway-ca-file: limits and the admin token go to the gateways over plain HTTP"
        );
        return HttpGateways::new(timeout).map_err(RunError::Gateways);
    }
    let trust = crate::gateway::GatewayTrust::load(
        args.gateway_ca_file.clone().into(),
        args.gateway_server_name.clone(),
        timeout,
    )?;
    info!(
        ca = %args.gateway_ca_file,
        name = %args.gateway_server_name,
        "limits go to the gateways over HTTPS"
    );
    HttpGateways::with_trust(timeout, trust).map_err(RunError::Gateways)
}

/// Everything one leadership term needs.
struct Term {
    client: Client,
    scope: Scope,
    args: Args,
    identity: String,
    metrics: Metrics,
    snapshot: Arc<RwLock<Snapshot>>,
    saturation: SaturationQueries,
    gateways: HttpGateways,
    pods: Cached<Pod>,
    slices: Cached<EndpointSlice>,
    /// The slices' stores: the scope's, then one per backend namespace outside it.
    slice_stores: Vec<Store<EndpointSlice>>,
    configmaps: Cached<ConfigMap>,
    /// The pods' and slices' digests (the policies' is each term's own, as its cache is).
    world: World,
}

impl Term {
    /// Runs the Controller until `stop` is cancelled.
    async fn run(&self, stop: CancellationToken) {
        let c = &self.client;
        // Policies this operator cannot read arrive as errors, reported and skipped one by one,
        // instead of failing the whole list and with it every other policy's reconcile.
        // The policy cache keeps no server-side-apply bookkeeping either.
        let (policies, writer) = reflector::store();
        let world = World {
            policies: Arc::new(Digest::default()),
            ..self.world.clone()
        };
        let policy_digest = digesting(&world.policies);
        let watch = reflector::reflector(
            writer,
            watcher(
                self.scope.api::<DeserializeGuard<ConnectionPolicy>>(c),
                watcher::Config::default(),
            )
            .modify(strip_bookkeeping::<DeserializeGuard<ConnectionPolicy>>),
        )
        .default_backoff()
        .inspect_ok(policy_digest)
        // A deleted policy has nothing left to reconcile (its cleanup ran behind the finalizer
        // while it was being deleted).
        .applied_objects()
        // A policy's own writes do not reconcile it again (with thousands of policies those
        // echoes would queue ahead of the first reconciles of the rest): neither its status nor
        // the finalizer its first reconcile adds before applying it. Only a change of its spec
        // (its generation; marking it deleted bumps that too) does. What else a reconcile reads
        // has triggers of its own (pods, EndpointSlices, ConfigMaps), and every policy is
        // reconciled again at its interval (a finalizer someone removed is back by then).
        .predicate_filter(predicates::generation, PredicateConfig::default());
        // Every reason to reconcile goes to the reconcile queue, which hands the Controller only
        // what its free slots take: changes first, then the periodic reconciles due
        // (`reconcile/queue.rs`). The Controller's own triggers are the queue's.
        let queue = Arc::new(reconcile::queue::ReconcileQueue::new(usize::from(
            self.args.concurrent_reconciles,
        )));
        let controller = Controller::for_stream(futures::stream::pending(), policies.clone())
            .with_config(
                controller::Config::default().concurrency(self.args.concurrent_reconciles),
            );
        // `poolpilot_operator_leader` is 1 and `poolpilot_operator_policies` counts from this
        // cache while this replica leads.
        let _leading = self.metrics.leading(policies.clone());
        let ctx = Arc::new(Context {
            client: c.clone(),
            config: Config {
                admin_port: self.args.admin_port,
                token_secret: self.args.token_secret.clone(),
                token_key: self.args.token_key.clone(),
                snapshot_max_age: self.args.metrics_interval.get() * 2
                    + self.args.scrape_interval.get() * 2,
                max_requeue: self.args.max_requeue.get(),
                backend_namespaces: self.args.backend_namespaces.clone(),
                pushes: reconcile::PushBound {
                    concurrency: usize::from(self.args.rollout_concurrency),
                    timeout: self.args.put_timeout.get(),
                },
            },
            stores: Stores {
                policies: policies.clone(),
                pods: self.pods.store.clone(),
                slices: self.slice_stores.clone(),
                configmaps: self.configmaps.store.clone(),
                world,
            },
            snapshot: self.snapshot.clone(),
            saturation: self.saturation.clone(),
            memory: Mutex::default(),
            rollouts: Mutex::default(),
            selections: Mutex::default(),
            passes: Default::default(),
            samples: Mutex::default(),
            client_reports: Mutex::default(),
            status_refresh: reconcile::refresh::StatusRefresh::new(self.args.status_refresh_rate),
            queue: queue.clone(),
            retries: Default::default(),
            gateways: self.gateways.clone(),
            recorder: Recorder::new(
                c.clone(),
                Reporter {
                    controller: "poolpilot-operator".into(),
                    instance: Some(self.identity.clone()),
                },
            ),
            metrics: self.metrics.clone(),
            clock: crate::clock::now,
        });
        let (by_pod, by_slice) = (policies.clone(), policies.clone());
        let pods = self
            .pods
            .touched()
            .flat_map(move |pod| futures::stream::iter(policies_selecting(&by_pod, &pod)));
        let slices = self
            .slices
            .touched()
            .flat_map(move |slice| futures::stream::iter(policies_using(&by_slice, &slice)));
        let configmaps = self
            .configmaps
            .touched()
            .flat_map(|cm| futures::stream::iter(owning_policies(&cm)));
        let named = |r: ObjectRef<DeserializeGuard<ConnectionPolicy>>| {
            (r.namespace.unwrap_or_default(), r.name)
        };
        let changes = futures::stream::select_all([
            watch
                .filter_map(|changed| {
                    future::ready(match changed {
                        Ok(policy) => Some(reconcile::queue::policy_ref(&policy)),
                        Err(e) => {
                            warn!(error = %crate::report(&e), "ConnectionPolicy watch error");
                            None
                        }
                    })
                })
                .boxed(),
            pods.map(named).boxed(),
            slices.map(named).boxed(),
            configmaps.map(named).boxed(),
        ]);
        tokio::spawn(queue_changes(changes, queue.clone(), stop.clone()));
        let (lag, cache, given_back) = (
            self.metrics.requeue_lag.clone(),
            policies.clone(),
            queue.clone(),
        );
        let handed = queue.handed_over().filter_map(move |((ns, name), late)| {
            let (lag, cache, given_back) = (lag.clone(), cache.clone(), given_back.clone());
            async move {
                let policy = ObjectRef::new(&name).within(&ns);
                // The Controller runs only what its cache holds: one that is gone frees its slot.
                if cache.wait_until_ready().await.is_err() || cache.get(&policy).is_none() {
                    given_back.gone(&(ns, name));
                    return None;
                }
                if let Some(late) = late {
                    lag.observe(late.as_secs_f64());
                }
                Some(policy)
            }
        });
        controller
            .reconcile_on(handed)
            .graceful_shutdown_on(stop.cancelled_owned())
            .run(timed_reconcile, reconcile::error_policy, ctx)
            .for_each(|res| {
                if let Err(e) = res {
                    warn!(error = %crate::report(&e), "reconcile error");
                }
                future::ready(())
            })
            .await;
    }
}

/// [`reconcile::reconcile_object`], timed into `poolpilot_operator_reconcile_duration_seconds`.
async fn timed_reconcile(
    policy: Arc<DeserializeGuard<ConnectionPolicy>>,
    ctx: Arc<reconcile::Context<HttpGateways>>,
) -> crate::Result<Action> {
    let start = Instant::now();
    let histogram = ctx.metrics.reconcile_duration.clone();
    let queue = ctx.queue.clone();
    let _slot = queue.start(&reconcile::queue::policy_ref(&*policy));
    let out = reconcile::reconcile_object(policy, ctx).await;
    histogram.observe(start.elapsed().as_secs_f64());
    out
}

/// Puts every change `changes` tells into `queue`, until `stop`.
async fn queue_changes(
    changes: impl futures::Stream<Item = reconcile::queue::PolicyRef> + Unpin,
    queue: Arc<reconcile::queue::ReconcileQueue>,
    stop: CancellationToken,
) {
    let mut changes = changes;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            changed = changes.next() => match changed {
                Some(policy) => queue.changed(policy),
                None => return,
            },
        }
    }
}

/// The policies of a cache that this operator can read, each with its reference.
fn readable(
    policies: &[Arc<DeserializeGuard<ConnectionPolicy>>],
) -> impl Iterator<
    Item = (
        ObjectRef<DeserializeGuard<ConnectionPolicy>>,
        &ConnectionPolicy,
    ),
> {
    policies
        .iter()
        .filter_map(|g| Some((ObjectRef::from_obj(&**g), g.0.as_ref().ok()?)))
}

/// The policies whose gateway selector selects `pod`.
fn policies_selecting(
    store: &Store<DeserializeGuard<ConnectionPolicy>>,
    pod: &Pod,
) -> Vec<ObjectRef<DeserializeGuard<ConnectionPolicy>>> {
    let ns = pod.namespace();
    readable(&store.state())
        .filter(|(_, p)| {
            p.namespace() == ns && selector::matches(&p.spec.gateway_selector, pod.labels())
        })
        .map(|(r, _)| r)
        .collect()
}

/// The policies with a backend on the Service that `slice` belongs to.
fn policies_using(
    store: &Store<DeserializeGuard<ConnectionPolicy>>,
    slice: &EndpointSlice,
) -> Vec<ObjectRef<DeserializeGuard<ConnectionPolicy>>> {
    let ns = slice.namespace();
    let Some(service) = slice.labels().get("kubernetes.io/service-name") else {
        return Vec::new();
    };
    readable(&store.state())
        .filter(|(_, p)| {
            p.spec.backends.iter().any(|b| {
                b.endpoints.service.as_ref().is_some_and(|s| {
                    &s.name == service && s.namespace.clone().or_else(|| p.namespace()) == ns
                })
            })
        })
        .map(|(r, _)| r)
        .collect()
}

/// Where the operator watches: one namespace (`--namespace`) or all of them.
#[derive(Clone, Debug)]
struct Scope(Option<String>);

impl Scope {
    fn new(namespace: &str) -> Self {
        Self((!namespace.is_empty()).then(|| namespace.to_owned()))
    }

    /// An API handle for namespaced kind `K` within the scope.
    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        match &self.0 {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
}

/// A cache of `K`, kept current by the one watch of `api` until `shutdown`, and the objects that
/// watch touches, for whoever reconciles on them (the leader's Controller; nobody on a standby,
/// and then they go nowhere).
struct Cached<K: kube::Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    touched: tokio::sync::broadcast::Sender<Arc<K>>,
}

impl<K: kube::Resource<DynamicType = ()> + Clone + Send + Sync + 'static> Cached<K> {
    /// The objects touched from now on. A receiver that falls behind skips what it missed: the
    /// store has the latest state, and every policy is reconciled again within `--max-requeue`.
    fn touched(&self) -> impl futures::Stream<Item = Arc<K>> + Send + 'static {
        use tokio::sync::broadcast::error::RecvError;
        futures::stream::unfold(self.touched.subscribe(), |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(object) => return Some((object, rx)),
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return None,
                }
            }
        })
    }
}

/// Objects touched and not yet taken by the Controller, per kind.
const TOUCHED_BUFFER: usize = 1024;

/// Drops what the operator never reads and every object would otherwise carry in memory: the
/// `managedFields` of server-side apply and kubectl's last-applied annotation.
fn strip_bookkeeping<K: ResourceExt>(object: &mut K) {
    object.managed_fields_mut().clear();
    object
        .annotations_mut()
        .remove("kubectl.kubernetes.io/last-applied-configuration");
}

/// Feeds a watch's events to `digest`.
fn digesting<K: Digested>(digest: &Arc<Digest>) -> impl FnMut(&watcher::Event<K>) + Send + 'static {
    let digest = digest.clone();
    move |event| digest.apply(event)
}

/// Starts the watch of `api` behind a [`Cached`], telling `seen` of each event after the cache
/// applied it.
fn cache<K>(
    api: Api<K>,
    config: watcher::Config,
    shutdown: &CancellationToken,
    seen: impl FnMut(&watcher::Event<K>) + Send + 'static,
) -> Cached<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (touched, _) = tokio::sync::broadcast::channel(TOUCHED_BUFFER);
    cache_feeding(api, config, shutdown, touched, seen)
}

/// [`cache`], telling the objects it touches to `touched` (another cache's, so that one stream
/// carries the changes of several watches).
fn cache_feeding<K>(
    api: Api<K>,
    config: watcher::Config,
    shutdown: &CancellationToken,
    touched: tokio::sync::broadcast::Sender<Arc<K>>,
    seen: impl FnMut(&watcher::Event<K>) + Send + 'static,
) -> Cached<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config).modify(strip_bookkeeping::<K>))
        .default_backoff()
        .inspect_ok(seen)
        .touched_objects();
    let shutdown = shutdown.clone();
    let sender = touched.clone();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                item = stream.next() => match item {
                    // No receiver (a standby): nobody reconciles, nothing to tell.
                    Some(Ok(object)) => { let _ = sender.send(Arc::new(object)); }
                    Some(Err(e)) => warn!(error = %crate::report(&e), "watch error"),
                    None => return,
                },
            }
        }
    });
    Cached { store, touched }
}

/// The policy that owns `configmap` (its limits ConfigMap), as the Controller's `owns` would
/// find it.
fn owning_policies(configmap: &ConfigMap) -> Vec<ObjectRef<DeserializeGuard<ConnectionPolicy>>> {
    let Some(ns) = configmap.namespace() else {
        return Vec::new();
    };
    configmap
        .owner_references()
        .iter()
        .filter(|o| o.kind == "ConnectionPolicy" && o.api_version.starts_with("poolpilot.io/"))
        .map(|o| ObjectRef::new(&o.name).within(&ns))
        .collect()
}

fn queries(args: &Args) -> Queries {
    Queries {
        window: args.metrics_interval.get(),
        freshness: args.scrape_interval.get() * 2,
    }
}

/// Runs the batched queries (and the backends' saturation queries) every `interval` and
/// publishes the snapshot.
async fn poll_prometheus(
    prometheus: crate::prom_connection::Connection,
    queries: Queries,
    saturation: SaturationQueries,
    snapshot: Arc<RwLock<Snapshot>>,
    metrics: Metrics,
    interval: std::time::Duration,
    shutdown: CancellationToken,
) {
    let fixed = queries.all();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let backends = saturation.all();
        let saturation_round = prom::SaturationRound::new(&backends);
        let distinct = saturation_round.distinct.len();
        metrics.query_rounds.inc();
        for name in fixed
            .iter()
            .map(|q| q.name)
            .chain(std::iter::repeat_n("saturation", distinct))
        {
            metrics
                .queries
                .get_or_create(&QueryLabel { query: name })
                .inc();
        }
        // A round never outlasts the interval: the next one starts on time. Credentials that
        // cannot be read make the whole round missing data, the reason logged below.
        let (round, errors) = match prometheus.round_headers() {
            Ok(headers) => {
                prom::query_round(
                    &prometheus.client,
                    &headers,
                    &queries,
                    &saturation_round,
                    interval,
                    crate::clock::now,
                )
                .await
            }
            Err(e) => (
                Snapshot::fold(
                    crate::clock::now(),
                    queries.rate_window(),
                    &std::collections::BTreeMap::new(),
                ),
                vec![prom::PromError::Credentials(e)],
            ),
        };
        for e in &errors {
            if let prom::PromError::Query { name, .. } | prom::PromError::Timeout { name, .. } = e {
                metrics
                    .query_errors
                    .get_or_create(&QueryLabel { query: name })
                    .inc();
            }
        }
        if let Some(first) = errors.first() {
            let (failed, of) = (errors.len(), fixed.len() + distinct);
            warn!(failed, of, error = %crate::report(first), "Prometheus queries failed; their inputs count as missing");
        }
        *snapshot.write() = round;
    }
}

/// Cancels `token` on SIGTERM or Ctrl-C.
async fn signals(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            error!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the operator");
            let _ = ctrl_c.await;
        }
    }
    info!("shutting down");
    token.cancel();
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "poolpilot-operator".into())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn cached_objects_keep_no_server_side_apply_bookkeeping() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "gw-0",
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"a\": 1}",
                    "keep": "me"
                },
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
            }
        }))
        .unwrap();
        strip_bookkeeping(&mut pod);
        assert!(pod.managed_fields().is_empty());
        assert_eq!(
            pod.annotations().keys().collect::<Vec<_>>(),
            ["keep"],
            "only the last-applied annotation goes"
        );
    }

    #[test]
    fn a_limits_configmap_triggers_the_policy_that_owns_it() {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {
                "name": "models-limits",
                "namespace": "ns",
                "ownerReferences": [
                    {"apiVersion": "poolpilot.io/v1alpha1", "kind": "ConnectionPolicy",
                     "name": "models", "uid": "u1"},
                    {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other", "uid": "u2"}
                ]
            }
        }))
        .unwrap();
        let owners = owning_policies(&cm);
        assert_eq!(owners, [ObjectRef::new("models").within("ns")]);
        let orphan: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": "x", "namespace": "ns"}})).unwrap();
        assert!(owning_policies(&orphan).is_empty());
    }

    #[tokio::test]
    async fn touched_objects_reach_the_current_subscribers_and_no_one_else() {
        let (touched, _) = tokio::sync::broadcast::channel(4);
        let cached = Cached::<ConfigMap> {
            store: reflector::store().0,
            touched,
        };
        // No subscriber (a standby): sending fails quietly, nothing piles up.
        assert!(cached.touched.send(Arc::new(ConfigMap::default())).is_err());
        let mut stream = Box::pin(cached.touched());
        let named = |n: &str| {
            let mut cm = ConfigMap::default();
            cm.metadata.name = Some(n.into());
            Arc::new(cm)
        };
        // More than the buffer: the subscriber skips what it missed and goes on.
        for n in ["a", "b", "c", "d", "e", "f"] {
            cached.touched.send(named(n)).unwrap();
        }
        let first = stream.next().await.unwrap();
        assert_eq!(
            first.name_any(),
            "c",
            "the oldest two were dropped for the lagging receiver"
        );
        assert_eq!(stream.next().await.unwrap().name_any(), "d");
        drop(cached);
        let rest: Vec<_> = stream.map(|cm| cm.name_any()).collect().await;
        assert_eq!(rest, ["e", "f"], "the stream ends once the cache is gone");
    }
}
