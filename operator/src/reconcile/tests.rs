//! One reconcile against a mocked API server (tower-test): the exact request sequence (ConfigMap
//! apply, token Secret read, status apply, Event) and the PUT to the gateway pod, for an accepted
//! policy and for a conflicted one; the Warning Event of a failed reconcile; a reconcile with
//! nothing changed sending nothing; and a hung pod, through the operator's HTTP client against
//! admin servers on loopback.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use parking_lot::Mutex;
use poolpilot_api::{ConnectionPolicy, GatewayLimits};
use serde_json::{Value, json};
use tower_test::mock::{self, Handle};

use super::*;
use crate::gateway::{Gateways, PutError};
use crate::metrics::Metrics;
use crate::plan::{Acked, Timestamp};
use crate::reconcile::queue::ReconcileQueue;

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

/// Records every PUT and acknowledges it, or refuses it (422) when `refuse` is set, or answers
/// 401 when `unauthorized` is or the token is not among `tokens` (when given), or 503 from the
/// addresses in `starting`, or 409 "runs generation g" from the addresses in `newer`.
#[derive(Clone, Default)]
struct FakeGateways {
    puts: Arc<Mutex<Vec<(SocketAddr, String, GatewayLimits)>>>,
    refuse: Option<&'static str>,
    unauthorized: bool,
    tokens: Option<Vec<&'static str>>,
    starting: Vec<SocketAddr>,
    newer: Vec<(SocketAddr, u64)>,
    /// What `GET /v1/clients` answers per pod address (404 for the others).
    reports: Arc<Mutex<BTreeMap<SocketAddr, crate::gateway::ClientsReport>>>,
    /// The document each pod address runs (what `GET /v1/limits` answers; 404 for the
    /// others): the last one it acknowledged.
    running: Arc<Mutex<BTreeMap<SocketAddr, GatewayLimits>>>,
}

impl Gateways for FakeGateways {
    async fn put(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        doc: &GatewayLimits,
    ) -> Result<Acked, PutError> {
        assert_eq!(namespace, "ns", "the pod's namespace");
        self.puts.lock().push((addr, token.to_owned(), doc.clone()));
        let known = self.tokens.as_ref().is_none_or(|t| t.contains(&token));
        if self.unauthorized || !known {
            return Err(PutError::Unauthorized);
        }
        if self.starting.contains(&addr) {
            return Err(PutError::Unexpected {
                status: 503,
                body: "starting".into(),
            });
        }
        if let Some((_, g)) = self.newer.iter().find(|(a, _)| *a == addr) {
            return Err(PutError::Older {
                message: format!("runs generation {g}"),
                generation: Some(*g),
            });
        }
        match self.refuse {
            Some(why) => Err(PutError::Refused(why.to_owned())),
            None => {
                self.running.lock().insert(addr, doc.clone());
                Ok(Acked {
                    revision: doc.revision.clone(),
                    generation: doc.generation,
                })
            }
        }
    }

    async fn clients(
        &self,
        _namespace: &str,
        addr: SocketAddr,
        _token: &str,
        _by: crate::gateway::Ranking,
    ) -> Result<crate::gateway::ClientsReport, crate::gateway::ReportError> {
        self.reports
            .lock()
            .get(&addr)
            .cloned()
            .ok_or(crate::gateway::ReportError::Unexpected {
                status: 404,
                body: "no report".into(),
            })
    }

    async fn limits(
        &self,
        _namespace: &str,
        addr: SocketAddr,
        _token: &str,
    ) -> Result<GatewayLimits, crate::gateway::ReportError> {
        self.running
            .lock()
            .get(&addr)
            .cloned()
            .ok_or(crate::gateway::ReportError::Unexpected {
                status: 404,
                body: "no document".into(),
            })
    }
}

fn policy(name: &str, created: i64) -> ConnectionPolicy {
    serde_json::from_value(json!({
        "apiVersion": "poolpilot.io/v1alpha1",
        "kind": "ConnectionPolicy",
        "metadata": {
            "name": name, "namespace": "ns", "uid": format!("{name}-uid"), "generation": 1,
            "creationTimestamp": Time(Timestamp::from_second(1_700_000_000 + created).unwrap()),
            "finalizers": [FINALIZER],
        },
        "spec": {
            "gatewaySelector": {"matchLabels": {"app": "gw"}},
            "backends": [{
                "name": "model-a",
                "endpoints": {"addresses": [{"name": "model-a-0", "address": "10.0.0.10:8000"}]},
                "capacity": {"maxConnectionsPerEndpoint": 64},
            }],
            "autoscale": {"enabled": false},
            "rollout": {"strategy": "AllAtOnce"},
        },
    }))
    .expect("test policy parses")
}

fn gateway_pod() -> Pod {
    pod("gw-0", "127.0.0.7")
}

fn pod(name: &str, ip: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"), "labels": {"app": "gw"}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .expect("test pod parses")
}

fn store<K>(objects: Vec<K>) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    watched(objects, |_| {})
}

/// A cache of `objects` as its watch fills it, each event also told to `seen`.
fn watched<K>(objects: Vec<K>, mut seen: impl FnMut(&watcher::Event<K>)) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = reflector::store();
    for o in objects {
        let event = watcher::Event::Apply(o);
        writer.apply_watcher_event(&event);
        seen(&event);
    }
    reader
}

/// A cache of `objects` and the digest its watch keeps ([`world`]).
fn digested<K>(objects: Vec<K>) -> (Store<K>, Arc<world::Digest>)
where
    K: kube::Resource<DynamicType = ()> + world::Digested + Clone + 'static,
{
    let digest = Arc::new(world::Digest::default());
    (watched(objects, |e| digest.apply(e)), digest)
}

fn context_with(
    policies: Vec<ConnectionPolicy>,
    pods: Vec<Pod>,
    gateways: FakeGateways,
) -> (Arc<Context<FakeGateways>>, ApiHandle, FakeGateways) {
    let policies = policies
        .into_iter()
        .map(|p| DeserializeGuard(Ok(p)))
        .collect();
    context_full(policies, pods, vec![], gateways)
}

fn context_full<G: Gateways + Clone>(
    policies: Vec<DeserializeGuard<ConnectionPolicy>>,
    pods: Vec<Pod>,
    configmaps: Vec<ConfigMap>,
    gateways: G,
) -> (Arc<Context<G>>, ApiHandle, G) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "ns");
    let (policies, policy_digest) = digested(policies);
    let (pods, pod_digest) = digested(pods);
    let (slices, slice_digest) = digested::<EndpointSlice>(vec![]);
    let ctx = Context {
        client: client.clone(),
        config: Config {
            admin_port: 9901,
            token_secret: "poolpilot-admin-token".into(),
            token_key: "token".into(),
            snapshot_max_age: Duration::from_secs(60),
            max_requeue: Duration::from_secs(60),
            backend_namespaces: vec!["llm".into()],
            pushes: PushBound::default(),
        },
        stores: Stores {
            policies,
            pods,
            slices: vec![slices],
            configmaps: store(configmaps),
            world: world::World {
                policies: policy_digest,
                pods: pod_digest,
                slices: vec![slice_digest],
            },
        },
        snapshot: Arc::default(),
        saturation: Default::default(),
        memory: Mutex::default(),
        rollouts: Mutex::default(),
        selections: Mutex::default(),
        passes: Default::default(),
        samples: Mutex::default(),
        client_reports: Mutex::default(),
        status_refresh: Default::default(),
        queue: Arc::new(ReconcileQueue::new(8)),
        retries: Default::default(),
        gateways: gateways.clone(),
        recorder: Recorder::new(
            client,
            Reporter {
                controller: "poolpilot-operator".into(),
                instance: None,
            },
        ),
        metrics: Metrics::default(),
        clock: now,
    };
    (Arc::new(ctx), handle, gateways)
}

/// Waits for the next request, checks its method and path, answers it with `answer` and returns
/// the request body as JSON (`Null` when empty).
async fn expect(handle: &mut ApiHandle, method: Method, path: &str, answer: Value) -> Value {
    expect_answer(handle, method, path, http::StatusCode::OK, answer).await
}

/// [`expect`] with the answer's HTTP status. A `path` ending in `/` matches any path it starts.
async fn expect_answer(
    handle: &mut ApiHandle,
    method: Method,
    path: &str,
    code: http::StatusCode,
    answer: Value,
) -> Value {
    let (request, send) = handle
        .next_request()
        .await
        .expect("the reconciler made another request");
    assert_eq!(request.method(), method, "{}", request.uri());
    if path.ends_with('/') {
        assert!(request.uri().path().starts_with(path), "{}", request.uri());
    } else {
        assert_eq!(request.uri().path(), path);
    }
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    if content_type == Some("application/apply-patch+yaml") {
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains("fieldManager=poolpilot-operator"),
            "one field manager: {query}"
        );
        assert!(query.contains("force=true"), "{query}");
    }
    let body = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body");
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(&answer).unwrap()))
            .unwrap(),
    );
    if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).expect("request body is JSON")
    }
}

/// Answers the GET of the gateways' admin token Secret.
async fn expect_token_secret(api: &mut ApiHandle) {
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "poolpilot-admin-token"}, "data": {"token": "czNjcjN0"}});
    with_timeout(expect(
        api,
        Method::GET,
        "/api/v1/namespaces/ns/secrets/poolpilot-admin-token",
        secret,
    ))
    .await;
}

/// Answers the status PATCH of policy `models` with `p`, and returns the patch sent.
async fn expect_status_patch(api: &mut ApiHandle, p: &ConnectionPolicy) -> Value {
    with_timeout(expect(
        api,
        Method::PATCH,
        "/apis/poolpilot.io/v1alpha1/namespaces/ns/connectionpolicies/models/status",
        serde_json::to_value(p).unwrap(),
    ))
    .await
}

/// The condition `kind` of a status patch's `status`.
fn condition(status: &Value, kind: &str) -> Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap()
        .clone()
}

/// The creation of an Event; returns the Event sent.
async fn expect_event(api: &mut ApiHandle) -> Value {
    let path = "/apis/events.k8s.io/v1/namespaces/ns/events";
    with_timeout(expect(api, Method::POST, path, json!({}))).await
}

/// The server-side apply of ConfigMap `name`; returns the ConfigMap sent.
async fn expect_configmap_apply(api: &mut ApiHandle, name: &str) -> Value {
    let path = format!("/api/v1/namespaces/ns/configmaps/{name}");
    with_timeout(expect(api, Method::PATCH, &path, json!({}))).await
}

async fn with_timeout<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(5), f)
        .await
        .expect("the reconcile finished in time")
}

/// One reconcile of one policy against the mocked apiserver: the request sequence the tests
/// walk through (ConfigMap apply, token Secret, status patch, Event), each step checked for its
/// method and path and answered as the apiserver would.
struct Scenario {
    policy: ConnectionPolicy,
    ctx: Arc<Context<FakeGateways>>,
    api: ApiHandle,
    gateways: FakeGateways,
    reconciler: tokio::task::JoinHandle<Result<Action>>,
}

impl Scenario {
    /// Reconciles `policy`, the only policy, on one ready gateway pod that takes every document.
    fn start(policy: ConnectionPolicy) -> Self {
        Self::start_alone(policy, vec![gateway_pod()], FakeGateways::default())
    }

    /// Reconciles `policy`, the only policy, on `pods` answered by `gateways`.
    fn start_alone(policy: ConnectionPolicy, pods: Vec<Pod>, gateways: FakeGateways) -> Self {
        let policies = vec![policy.clone()];
        Self::start_with(policy, policies, pods, gateways)
    }

    /// Reconciles `policy` with `policies` in the store, `pods` and `gateways`.
    fn start_with(
        policy: ConnectionPolicy,
        policies: Vec<ConnectionPolicy>,
        pods: Vec<Pod>,
        gateways: FakeGateways,
    ) -> Self {
        let (ctx, api, gateways) = context_with(policies, pods, gateways);
        let reconciler = tokio::spawn(reconcile(Arc::new(policy.clone()), ctx.clone()));
        Self {
            policy,
            ctx,
            api,
            gateways,
            reconciler,
        }
    }

    fn name(&self) -> String {
        self.policy.metadata.name.clone().unwrap_or_default()
    }

    /// The server-side apply of the policy's limits ConfigMap; returns the ConfigMap sent.
    async fn configmap_apply(&mut self) -> Value {
        let name = format!("{}-limits", self.name());
        expect_configmap_apply(&mut self.api, &name).await
    }

    /// The GET of the gateways' admin token Secret.
    async fn token_secret(&mut self) {
        expect_token_secret(&mut self.api).await;
    }

    /// The limits ConfigMap apply and the token Secret read of a reconcile that rolls out in
    /// one wave, then its status patch; returns the patch sent.
    async fn status_after_one_wave(&mut self) -> Value {
        self.configmap_apply().await;
        self.token_secret().await;
        self.status_patch().await
    }

    /// The status patch of the policy, answered with the policy; returns the patch sent.
    async fn status_patch(&mut self) -> Value {
        self.patch_policy("/status").await
    }

    /// The patch of the policy itself (its finalizers), answered with the policy.
    async fn policy_patch(&mut self) -> Value {
        self.patch_policy("").await
    }

    /// A PATCH of the policy (`subresource` "" or "/status"), answered with the policy.
    async fn patch_policy(&mut self, subresource: &str) -> Value {
        let path = format!(
            "/apis/poolpilot.io/v1alpha1/namespaces/ns/connectionpolicies/{}{subresource}",
            self.name()
        );
        let answer = serde_json::to_value(&self.policy).unwrap();
        with_timeout(expect(&mut self.api, Method::PATCH, &path, answer)).await
    }

    /// The creation of an Event; returns the Event sent.
    async fn event(&mut self) -> Value {
        expect_event(&mut self.api).await
    }

    /// Waits for the reconcile to end; its outcome.
    async fn outcome(&mut self) -> Result<Action> {
        with_timeout(&mut self.reconciler)
            .await
            .expect("the reconcile task ran")
    }

    /// Every PUT the gateways got: address, token, document.
    fn puts(&self) -> Vec<(SocketAddr, String, GatewayLimits)> {
        self.gateways.puts.lock().clone()
    }
}

#[tokio::test]
async fn accepted_policy_applies_configmap_puts_to_the_pod_then_writes_status_and_an_event() {
    let mut run = Scenario::start(policy("models", 0));

    let cm = run.configmap_apply().await;
    assert_eq!(cm["metadata"]["ownerReferences"][0]["uid"], "models-uid");
    assert_eq!(cm["metadata"]["ownerReferences"][0]["controller"], true);
    assert_eq!(
        cm["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "poolpilot-operator"
    );
    let doc: GatewayLimits =
        serde_json::from_str(cm["data"]["limits.json"].as_str().unwrap()).unwrap();
    assert_eq!(doc.generation, 1);
    assert_eq!(
        doc.backends[0].pool.max_connections_per_endpoint, 51,
        "64 × 0.8 for the one ready pod"
    );
    assert_eq!(
        (
            &cm["metadata"]["annotations"]["poolpilot.io/revision"],
            &cm["metadata"]["annotations"]["poolpilot.io/generation"]
        ),
        (&json!(doc.revision), &json!("1")),
        "the annotations repeat the document's revision and generation"
    );
    doc.validate().expect("the durable document validates");

    run.token_secret().await;

    let status = run.status_patch().await;
    let s = &status["status"];
    assert_eq!(s["observedGeneration"], 1);
    assert_eq!(s["revision"], doc.revision);
    assert_eq!(s["updated"], "1/1");
    assert_eq!(s["targets"], "model-a=51");
    let cond = |t: &str| condition(s, t);
    assert_eq!(cond("Accepted")["status"], "True");
    assert_eq!(cond("RolledOut")["status"], "True");
    assert_eq!(cond("Ready")["status"], "True");
    assert_eq!(cond("Ready")["observedGeneration"], 1);

    let event = run.event().await;
    assert_eq!(event["reason"], "RolledOut");
    assert_eq!(event["regarding"]["name"], "models");

    let action = run.outcome().await.expect("the reconcile succeeded");
    assert_eq!(
        action,
        Action::await_change(),
        "no requeue by the Controller"
    );
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(15)),
        "the queue has the next one at the policy's interval"
    );
    let puts = run.puts();
    assert_eq!(puts.len(), 1);
    assert_eq!(puts[0].0, "127.0.0.7:9901".parse().unwrap());
    assert_eq!(puts[0].1, "s3cr3t", "the token from the Secret");
    assert_eq!(puts[0].2, doc);
}

#[tokio::test]
async fn conflicted_policy_writes_only_status_and_a_warning() {
    let older = policy("older", 0);
    let newer = policy("newer", 100);
    let mut run = Scenario::start_with(
        newer.clone(),
        vec![older, newer],
        vec![gateway_pod()],
        FakeGateways::default(),
    );

    let status = run.status_patch().await;
    let accepted = condition(&status["status"], "Accepted");
    assert_eq!(accepted["status"], "False");
    assert_eq!(accepted["reason"], "Conflicted");
    assert_eq!(
        accepted["message"],
        "backend \"model-a\" is already defined by the older policy ns/older on pod gw-0"
    );

    let event = run.event().await;
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Warning"), Some("Conflicted"))
    );

    run.outcome().await.expect("the reconcile succeeded");
    assert!(
        run.puts().is_empty(),
        "nothing is rolled out for a conflicted policy"
    );
}

#[tokio::test]
async fn a_new_policy_gets_the_finalizer_and_is_rolled_out_in_the_same_reconcile() {
    let mut p = policy("models", 0);
    p.metadata.finalizers = Some(vec!["example.com/keep".into()]);
    let mut run = Scenario::start(p.clone());
    run.policy.metadata.finalizers = Some(vec!["example.com/keep".into(), FINALIZER.into()]);

    let patch = run.policy_patch().await;
    assert_eq!(
        patch,
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": ["example.com/keep"]},
            {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
        ]),
        "the finalizer is added unless the list changed meanwhile"
    );
    let status = run.status_after_one_wave().await;
    assert_eq!(condition(&status["status"], "RolledOut")["status"], "True");
    assert_eq!(run.event().await["reason"], "RolledOut");
    run.outcome().await.expect("the reconcile succeeded");
    assert_eq!(
        run.puts().len(),
        1,
        "rolled out by the reconcile that added the finalizer"
    );

    // A policy without any finalizer: the patch tests that there is none.
    p.metadata.finalizers = None;
    let mut run = Scenario::start(p);
    run.policy.metadata.finalizers = Some(vec![FINALIZER.into()]);
    let patch = run.policy_patch().await;
    assert_eq!(
        patch,
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
        ])
    );
}

#[tokio::test]
async fn deleting_a_policy_removes_its_backends_from_its_pods_then_the_finalizer() {
    let mut p = policy("models", 0);
    p.metadata.deletion_timestamp = Some(Time(now()));
    let mut run = Scenario::start(p);
    // A periodic reconcile planned before the deletion.
    run.ctx
        .queue
        .schedule(("ns".into(), "models".into()), Duration::from_secs(15));

    run.token_secret().await;
    let patch = run.policy_patch().await;
    assert!(
        patch.to_string().contains("/metadata/finalizers"),
        "the finalizer is removed: {patch}"
    );

    run.outcome().await.expect("the cleanup succeeded");
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        None,
        "a deleted policy is not reconciled again"
    );
    let puts = run.puts();
    assert_eq!(puts.len(), 1);
    assert!(
        puts[0].2.backends.is_empty(),
        "the pod gets a document without the deleted policy's backends"
    );
}

#[tokio::test]
async fn a_refused_canary_halts_a_progressive_rollout() {
    let mut p = policy("models", 0);
    p.spec.rollout.strategy = poolpilot_api::policy::RolloutStrategy::Progressive;
    let gateways = FakeGateways {
        refuse: Some("backends[0].pool: unsupported"),
        ..FakeGateways::default()
    };
    let pods = vec![pod("gw-0", "127.0.0.7"), pod("gw-1", "127.0.0.8")];
    let mut run = Scenario::start_alone(p, pods, gateways);

    let status = run.status_after_one_wave().await;
    let s = &status["status"];
    let rolled = condition(s, "RolledOut");
    assert_eq!(rolled["reason"], "Halted");
    assert!(
        rolled["message"]
            .as_str()
            .unwrap()
            .starts_with("pod gw-0 refused revision"),
        "{rolled}"
    );
    assert_eq!(s["pods"]["failures"][0]["pod"], "gw-0");
    assert_eq!(s["updated"], "0/2");

    let event = run.event().await;
    assert_eq!(event["reason"], "RolloutHalted");

    run.outcome().await.expect("the reconcile succeeded");
    let puts = run.puts();
    assert_eq!(puts.len(), 1, "only the canary was tried");
    assert_eq!(puts[0].0, "127.0.0.7:9901".parse().unwrap());
}

/// A policy rolled out to one canary, then to the rest as soon as it acknowledged.
fn progressive_without_verification() -> ConnectionPolicy {
    let mut p = policy("models", 0);
    p.spec.rollout.strategy = poolpilot_api::policy::RolloutStrategy::Progressive;
    p.spec.rollout.canary_pods = 1;
    p.spec.rollout.verify_intervals = 0;
    p
}

#[tokio::test]
async fn a_canary_verifies_from_its_acknowledgement_and_the_policy_comes_back_when_it_ends() {
    let mut p = progressive_without_verification();
    p.spec.rollout.verify_intervals = 2;
    let pods = vec![pod("gw-0", "127.0.0.7"), pod("gw-1", "127.0.0.8")];
    let mut run = Scenario::start_alone(p, pods, FakeGateways::default());

    let status = run.status_after_one_wave().await;
    assert_eq!(status["status"]["updated"], "1/2", "{status}");
    let message = condition(&status["status"], "RolledOut")["message"].clone();
    assert!(
        message
            .as_str()
            .unwrap()
            .ends_with("verifying 1 canary pod(s) for 30s more"),
        "the verification runs from the canary's acknowledgement, not from the next reconcile: {message}"
    );
    run.outcome().await.expect("the reconcile succeeded");
    let revision = status["status"]["revision"].as_str().unwrap().to_owned();
    let rollouts = run.ctx.rollouts.lock();
    assert_eq!(
        rollouts.canary_since.keys().collect::<Vec<_>>(),
        [&("ns".to_owned(), revision)],
        "kept under the policy's revision only (the pods' own revisions are never looked up)"
    );
    drop(rollouts);
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(15)),
        "the interval, shorter than the 30 s left"
    );
}

#[tokio::test]
async fn without_verification_the_rest_follow_the_acknowledged_canary_in_the_same_reconcile() {
    let p = progressive_without_verification();
    let pods = vec![
        pod("gw-0", "127.0.0.7"),
        pod("gw-1", "127.0.0.8"),
        pod("gw-2", "127.0.0.9"),
    ];
    let mut run = Scenario::start_alone(p, pods, FakeGateways::default());

    run.configmap_apply().await;
    // The token is read once, for the canary's wave and the rest's.
    run.token_secret().await;
    let status = run.status_patch().await;
    assert_eq!(status["status"]["updated"], "3/3", "{status}");
    assert_eq!(
        condition(&status["status"], "RolledOut")["status"],
        "True",
        "{status}"
    );
    run.event().await;
    run.outcome().await.expect("the reconcile succeeded");
    let order: Vec<SocketAddr> = run.puts().iter().map(|(addr, _, _)| *addr).collect();
    assert_eq!(order.len(), 3, "every pod got its document: {order:?}");
    assert_eq!(
        order[0],
        "127.0.0.7:9901".parse().unwrap(),
        "the canary went first: {order:?}"
    );
}

#[tokio::test]
async fn without_verification_a_canary_that_did_not_take_it_holds_the_rest_and_is_tried_once() {
    let p = progressive_without_verification();
    let pods = vec![pod("gw-0", "127.0.0.7"), pod("gw-1", "127.0.0.8")];
    let gateways = FakeGateways {
        starting: vec!["127.0.0.7:9901".parse().unwrap()],
        ..FakeGateways::default()
    };
    let mut run = Scenario::start_alone(p, pods, gateways);

    let status = run.status_after_one_wave().await;
    assert_eq!(status["status"]["updated"], "0/2", "{status}");
    run.outcome().await.expect("the reconcile succeeded");
    let tried: Vec<SocketAddr> = run.puts().iter().map(|(addr, _, _)| *addr).collect();
    assert_eq!(
        tried,
        vec!["127.0.0.7:9901".parse::<SocketAddr>().unwrap()],
        "one try of the canary, none of the rest"
    );
}

#[tokio::test]
async fn a_pod_already_running_a_newer_pass_brings_the_policy_back_as_a_change() {
    let gateways = FakeGateways {
        newer: vec![("127.0.0.7:9901".parse().unwrap(), 9)],
        ..FakeGateways::default()
    };
    let mut run = Scenario::start_alone(policy("models", 0), vec![gateway_pod()], gateways);

    let status = run.status_after_one_wave().await;
    assert_eq!(status["status"]["updated"], "0/1", "{status}");
    run.outcome().await.expect("the reconcile succeeded");
    assert!(
        run.ctx.queue.change_waits(&("ns".into(), "models".into())),
        "reconciled again as a change, ahead of the periodic reconciles"
    );
    assert_eq!(
        run.ctx.rollouts.lock().seen_generation.get("ns"),
        Some(&9),
        "the next pass numbers its documents above the pod's"
    );
    // Answered the same again within a second (two writers raising the generation over each
    // other): paced to a second, not reconciled again at once.
    run.reconciler = tokio::spawn(reconcile(Arc::new(run.policy.clone()), run.ctx.clone()));
    run.status_after_one_wave().await;
    run.outcome().await.expect("the reconcile succeeded");
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(1))
    );

    // Every pod took the document: no change is queued, only the periodic reconcile.
    let mut run = Scenario::start(policy("models", 0));
    run.status_after_one_wave().await;
    run.event().await;
    run.outcome().await.expect("the reconcile succeeded");
    assert!(!run.ctx.queue.change_waits(&("ns".into(), "models".into())));
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(15))
    );
}

#[tokio::test]
async fn a_pod_refusing_the_token_is_named_with_the_401_in_rolled_out() {
    let p = policy("models", 0);
    let gateways = FakeGateways {
        unauthorized: true,
        ..FakeGateways::default()
    };
    let pods = vec![pod("gw-0", "127.0.0.7")];
    let mut run = Scenario::start_alone(p, pods, gateways);

    let status = run.status_after_one_wave().await;
    let s = &status["status"];
    let rolled = condition(s, "RolledOut");
    assert_eq!(rolled["status"], "False");
    let message = rolled["message"].as_str().unwrap();
    assert!(
        message.contains("pod gw-0 not updated: HTTP 401: the admin token was not accepted"),
        "{rolled}"
    );
    assert_eq!(s["pods"]["failures"][0]["pod"], "gw-0");
    assert!(
        s["pods"]["failures"][0]["message"]
            .as_str()
            .unwrap()
            .contains("differs from Secret poolpilot-admin-token"),
        "{s}"
    );
    assert_eq!(s["updated"], "0/1");
    run.reconciler.abort();
}

/// The fake API's answer to a request for `path`: the token Secret with `token`, the status
/// apply with `p`, anything else `{}`.
fn api_answer(path: &str, p: &ConnectionPolicy, token: &str) -> Value {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    if path.contains("/secrets/") {
        let secret = Secret {
            data: Some([("token".to_owned(), ByteString(token.into()))].into()),
            ..Secret::default()
        };
        serde_json::to_value(secret).unwrap()
    } else if path.ends_with("/status") {
        serde_json::to_value(p).unwrap()
    } else {
        json!({})
    }
}

/// Answers every API request of a reconcile until it ends: the token Secret with `token`, the
/// status apply with `p`, anything else with `{}`. Returns the reconcile's outcome.
async fn answer_all(
    api: &mut ApiHandle,
    p: &ConnectionPolicy,
    token: &str,
    mut reconciler: tokio::task::JoinHandle<Result<Action>>,
) -> Result<Action> {
    loop {
        tokio::select! {
            done = &mut reconciler => return done.expect("the reconcile task ran"),
            next = api.next_request() => {
                let (request, send) = next.expect("a request");
                let path = request.uri().path().to_owned();
                let answer = api_answer(&path, p, token);
                send.send_response(
                    Response::builder()
                        .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                        .unwrap(),
                );
            }
        }
    }
}

#[tokio::test]
async fn after_the_token_secret_changes_pods_still_on_the_old_token_are_updated_with_it() {
    // The pod's mounted copy of the Secret lags behind the API: it still accepts only the
    // token it was started with.
    let gateways = FakeGateways {
        tokens: Some(vec!["old-token-old-token-old-token-old"]),
        ..FakeGateways::default()
    };
    let p = policy("models", 0);
    let (ctx, mut api, gateways) = context_with(vec![p.clone()], vec![gateway_pod()], gateways);
    let first = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    with_timeout(answer_all(
        &mut api,
        &p,
        "old-token-old-token-old-token-old",
        first,
    ))
    .await
    .expect("the first reconcile succeeded");

    // The Secret is rotated and the policy edited: the new document goes out with the new
    // token, refused, then with the previous one, taken.
    let mut edited = p.clone();
    edited.spec.backends[0]
        .capacity
        .max_connections_per_endpoint = 32;
    let second = tokio::spawn(reconcile(Arc::new(edited.clone()), ctx.clone()));
    with_timeout(answer_all(
        &mut api,
        &edited,
        "new-token-new-token-new-token-new",
        second,
    ))
    .await
    .expect("the second reconcile succeeded");
    let puts = gateways.puts.lock().clone();
    let tokens: Vec<&str> = puts.iter().map(|(_, t, _)| t.as_str()).collect();
    assert_eq!(
        tokens,
        [
            "old-token-old-token-old-token-old",
            "new-token-new-token-new-token-new",
            "old-token-old-token-old-token-old"
        ]
    );
    let acked = ctx.rollouts.lock().acked.values().next().cloned().unwrap();
    assert_eq!(
        acked.revision, puts[2].2.revision,
        "the pod took the new document"
    );
}

#[tokio::test]
async fn an_implausible_generation_is_reported_and_the_next_document_goes_above_the_real_ones() {
    // A ConfigMap annotation edited (or corrupted) to u64::MAX: following it would wrap.
    let forged: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "models-limits", "namespace": "ns",
                     "labels": {"app.kubernetes.io/managed-by": "poolpilot-operator"},
                     "annotations": {"poolpilot.io/revision": "ffffffffffff",
                                     "poolpilot.io/generation": u64::MAX.to_string()}},
        "data": {"limits.json": "{}"},
    }))
    .unwrap();
    let p = policy("models", 0);
    let (ctx, mut api, gateways) = context_full(
        vec![DeserializeGuard(Ok(p.clone()))],
        vec![gateway_pod()],
        vec![forged],
        FakeGateways::default(),
    );
    let reconciler = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    let event = expect_event(&mut api).await;
    assert_eq!(event["reason"], "ImplausibleGeneration", "{event}");
    assert_eq!(event["type"], "Warning");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains(&u64::MAX.to_string()) && note.contains("ignored"),
        "{note}"
    );
    // The ConfigMap exists: it is rewritten once the pod runs the new document.
    expect_token_secret(&mut api).await;
    let cm = expect_configmap_apply(&mut api, "models-limits").await;
    assert_eq!(
        cm["metadata"]["annotations"]["poolpilot.io/generation"],
        "1"
    );
    expect_status_patch(&mut api, &p).await;
    reconciler.abort();
    assert_eq!(gateways.puts.lock()[0].2.generation, 1);
    let text = {
        let mut registry = prometheus_client::registry::Registry::default();
        ctx.metrics.clone().register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    };
    assert!(text.contains("generations_ignored_total 1"), "{text}");
}

/// A policy written under a newer CRD, as JSON: a rollout strategy this operator does not know.
fn newer_crd_json(name: &str) -> Value {
    let mut object = serde_json::to_value(policy(name, 50)).unwrap();
    object["spec"]["rollout"]["strategy"] = json!("BlueGreen");
    object
}

/// [`newer_crd_json`], as the Controller hands it over.
fn from_a_newer_crd(name: &str, deleting: bool) -> DeserializeGuard<ConnectionPolicy> {
    let mut object = newer_crd_json(name);
    object["metadata"]["resourceVersion"] = json!("42");
    if deleting {
        object["metadata"]["deletionTimestamp"] = json!("2027-01-15T08:00:00Z");
        object["metadata"]["finalizers"] = json!([FINALIZER, "example.com/keep"]);
    }
    let guard: DeserializeGuard<ConnectionPolicy> = serde_json::from_value(object).unwrap();
    assert!(guard.0.is_err(), "the test object must not deserialize");
    guard
}

#[test]
fn one_unreadable_policy_fails_a_typed_list_but_not_a_guarded_one() {
    // What the Controller's watch gets from the apiserver: the typed list (the operator before
    // DeserializeGuard) fails as a whole, so no policy at all was reconciled.
    let list = json!({
        "apiVersion": "poolpilot.io/v1alpha1", "kind": "ConnectionPolicyList",
        "metadata": {"resourceVersion": "7"},
        "items": [policy("models", 0), newer_crd_json("from-the-future")],
    });
    assert!(
        serde_json::from_value::<kube::core::ObjectList<ConnectionPolicy>>(list.clone()).is_err()
    );
    let guarded: kube::core::ObjectList<DeserializeGuard<ConnectionPolicy>> =
        serde_json::from_value(list).unwrap();
    let readable: Vec<bool> = guarded.items.iter().map(|g| g.0.is_ok()).collect();
    assert_eq!(readable, [true, false]);
}

#[tokio::test]
async fn a_policy_this_operator_cannot_read_is_reported_and_skipped_while_the_others_reconcile() {
    let unreadable = from_a_newer_crd("from-the-future", false);
    let p = policy("models", 0);
    let (ctx, mut api, gateways) = context_full(
        vec![DeserializeGuard(Ok(p.clone())), unreadable.clone()],
        vec![gateway_pod()],
        vec![],
        FakeGateways::default(),
    );
    let skipped = tokio::spawn(reconcile_object(Arc::new(unreadable), ctx.clone()));
    let event = expect_event(&mut api).await;
    assert_eq!(event["reason"], "InvalidPolicy", "{event}");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["name"], "from-the-future");
    let note = event["note"].as_str().unwrap();
    assert!(note.contains("Unknown variant BlueGreen"), "{note}");
    let action = with_timeout(skipped).await.unwrap().unwrap();
    assert_eq!(action, Action::await_change());
    assert!(gateways.puts.lock().is_empty(), "nothing sent for it");

    // The readable policy reconciles as if the other were not there.
    let reconciled = tokio::spawn(reconcile_object(
        Arc::new(DeserializeGuard(Ok(p.clone()))),
        ctx.clone(),
    ));
    with_timeout(answer_all(&mut api, &p, "s3cr3t", reconciled))
        .await
        .expect("the readable policy reconciles");
    let puts = gateways.puts.lock().clone();
    assert_eq!(puts.len(), 1);
    let names: Vec<Option<&str>> = puts[0]
        .2
        .backends
        .iter()
        .map(|b| b.policy.as_deref())
        .collect();
    assert_eq!(
        names,
        [Some("ns/models")],
        "only the readable policy's backends"
    );
}

#[tokio::test]
async fn an_unreadable_policy_being_deleted_loses_only_the_operators_finalizer() {
    let unreadable = from_a_newer_crd("from-the-future", true);
    let (ctx, mut api, _) = context_full(vec![], vec![], vec![], FakeGateways::default());
    ctx.queue.schedule(
        ("ns".into(), "from-the-future".into()),
        Duration::from_secs(15),
    );
    let skipped = tokio::spawn(reconcile_object(Arc::new(unreadable), ctx.clone()));
    expect_event(&mut api).await;
    let patch = with_timeout(expect(
        &mut api,
        Method::PATCH,
        "/apis/poolpilot.io/v1alpha1/namespaces/ns/connectionpolicies/from-the-future",
        json!({}),
    ))
    .await;
    assert_eq!(
        patch,
        json!({"metadata": {"finalizers": ["example.com/keep"], "resourceVersion": "42"}})
    );
    assert_eq!(
        with_timeout(skipped).await.unwrap().unwrap(),
        Action::await_change()
    );
    assert_eq!(
        requeued_after(&ctx, "from-the-future"),
        None,
        "looked at again only when it changes"
    );
}

#[tokio::test]
async fn starting_pods_get_their_share_and_terminating_pods_keep_theirs_until_gone() {
    // gw-0 serves, gw-1 is starting (an IP, not Ready, its admin port not answering yet), gw-2
    // is terminating: all three hold a share of 51, but only gw-0 and gw-1 are sent documents,
    // and the starting one is tried again in a second.
    let p = policy("models", 0);
    let starting: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gw-1", "namespace": "ns", "uid": "gw-1-uid", "labels": {"app": "gw"}},
        "status": {"phase": "Running", "podIP": "127.0.0.8", "conditions": [{"type": "Ready", "status": "False"}]},
    }))
    .unwrap();
    let terminating: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gw-2", "namespace": "ns", "uid": "gw-2-uid", "labels": {"app": "gw"},
                     "deletionTimestamp": "2027-01-15T08:00:00Z"},
        "status": {"phase": "Running", "podIP": "127.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap();
    let gateways = FakeGateways {
        starting: vec!["127.0.0.8:9901".parse().unwrap()],
        ..FakeGateways::default()
    };
    let pods = vec![pod("gw-0", "127.0.0.7"), starting, terminating];
    let mut run = Scenario::start_alone(p, pods, gateways);

    let cm = run.configmap_apply().await;
    let doc: GatewayLimits =
        serde_json::from_str(cm["data"]["limits.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        doc.backends[0].pool.max_connections_per_endpoint, 17,
        "51 over the three pods that may hold connections"
    );
    run.token_secret().await;
    let status = run.status_patch().await;
    let s = &status["status"];
    assert_eq!(s["updated"], "1/2", "gw-0 of gw-0 and gw-1");
    let rolled = condition(s, "RolledOut");
    assert_eq!(rolled["status"], "False");
    assert!(
        rolled["message"]
            .as_str()
            .unwrap()
            .contains("pod gw-1 not updated: unexpected answer 503"),
        "{rolled}"
    );
    run.outcome().await.expect("the reconcile succeeded");
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(1)),
        "the starting pod is tried again soon"
    );
    let mut sent: Vec<(String, u32)> = run
        .puts()
        .iter()
        .map(|(addr, _, d)| {
            (
                addr.to_string(),
                d.backends[0].pool.max_connections_per_endpoint,
            )
        })
        .collect();
    sent.sort();
    assert_eq!(
        sent,
        [
            ("127.0.0.7:9901".to_owned(), 17),
            ("127.0.0.8:9901".to_owned(), 17)
        ],
        "no document for the terminating pod"
    );
}

/// The apiserver's answer when the operator's role lacks `create` on configmaps.
fn forbidden_configmap() -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "configmaps \"models-limits\" is forbidden: User \"system:serviceaccount:ns:poolpilot-operator\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"ns\"",
        "reason": "Forbidden", "details": {"name": "models-limits", "kind": "configmaps"}, "code": 403,
    })
}

#[tokio::test]
async fn a_failed_reconcile_is_told_in_one_warning_event_series_naming_the_step_and_the_error() {
    let p = policy("models", 0);
    let mut run = Scenario::start(p.clone());
    with_timeout(expect_answer(
        &mut run.api,
        Method::PATCH,
        "/api/v1/namespaces/ns/configmaps/models-limits",
        http::StatusCode::FORBIDDEN,
        forbidden_configmap(),
    ))
    .await;
    let error = run
        .outcome()
        .await
        .expect_err("a forbidden ConfigMap apply fails the reconcile");
    assert_eq!(error.step(), "rollout");
    assert!(run.puts().is_empty(), "nothing reached the pods");
    let ctx = run.ctx.clone();

    // The Controller hands the error to error_policy: a Warning Event on the policy.
    let action = error_policy(
        Arc::new(DeserializeGuard(Ok(p.clone()))),
        &error,
        ctx.clone(),
    );
    assert_eq!(action, Action::requeue(Duration::from_secs(5)));
    let event = run.event().await;
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "ReconcileFailed");
    assert_eq!(event["action"], "RollOut");
    assert_eq!(event["regarding"]["kind"], "ConnectionPolicy");
    assert_eq!(event["regarding"]["name"], "models");
    assert_eq!(event["regarding"]["uid"], "models-uid");
    assert_eq!(
        event["note"],
        "rollout step failed: failed to apply ConfigMap models-limits: configmaps \"models-limits\" \
         is forbidden: User \"system:serviceaccount:ns:poolpilot-operator\" cannot create resource \
         \"configmaps\" in API group \"\" in the namespace \"ns\": Forbidden",
        "the step and the apiserver's denial, once, without kube's Status dump"
    );
    let name = event["metadata"]["name"]
        .as_str()
        .expect("the Event has a name")
        .to_owned();

    // The same failure again: the same Event, its series counted up, no new Event; the retry
    // waits twice as long.
    let again = error_policy(Arc::new(DeserializeGuard(Ok(p))), &error, ctx);
    assert_eq!(again, Action::requeue(Duration::from_secs(10)));
    let again = with_timeout(expect(
        &mut run.api,
        Method::PATCH,
        &format!("/apis/events.k8s.io/v1/namespaces/ns/events/{name}"),
        json!({}),
    ))
    .await;
    assert_eq!(again["series"]["count"], 2, "{again}");
    assert_eq!(again["reason"], "ReconcileFailed");
}

#[test]
fn failure_events_name_each_step_and_fit_the_note_limit() {
    let plan = failure_event(&Error::Plan("no plan for ns/models".into()));
    assert_eq!(
        (plan.type_, plan.reason.as_str(), plan.action.as_str()),
        (EventType::Warning, "ReconcileFailed", "Plan")
    );
    assert_eq!(
        plan.note.as_deref(),
        Some("plan step failed: no plan for ns/models")
    );
    let long = failure_event(&Error::Plan("é".repeat(800)));
    let note = long.note.unwrap();
    assert!(note.len() <= 1000, "{} bytes", note.len());
    assert!(note.ends_with('…'));
    assert_eq!(event_note("short"), "short");
}

/// The Events of status changes and decisions (built with the status step's test plans) and of
/// failures, next to the API's list of Event reasons.
mod event_catalogue {
    use kube::runtime::events::{Event, EventType};
    use poolpilot_api::policy::Mode;

    use crate::plan::autoscale::{Decision, Scale};
    use crate::plan::idle_timeout::IdleTimeout;
    use crate::reconcile::status::events;
    use crate::reconcile::status::tests::{
        at, at_bound, cond, plan, plan_held, refused_and_unverified, status,
    };
    use crate::reconcile::{Error, failure_event, implausible_generation_event, unreadable_event};

    #[test]
    fn every_event_reason_is_documented_in_the_api_and_every_documented_one_is_published() {
        use std::collections::BTreeSet;

        use poolpilot_api::policy::conditions::{CONDITIONS, EVENTS};

        let type_name = |t: EventType| match t {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        let mut published = BTreeSet::new();
        let mut add = |events: Vec<Event>| {
            for e in events {
                published.insert((type_name(e.type_), e.reason));
            }
        };
        let scale = Scale {
            at: at(15),
            from: 300,
            to: 540,
            reason: "demand 450".into(),
        };
        let none = status(vec![]);
        let down = Scale {
            from: 540,
            to: 300,
            ..scale.clone()
        };
        for mode in [Mode::Enforce, Mode::Recommend] {
            add(events(
                &none,
                &none,
                &plan(Some(Decision::ScaleUp(scale.clone()))),
                mode,
            ));
            add(events(
                &none,
                &none,
                &plan(Some(Decision::ScaleDown(down.clone()))),
                mode,
            ));
        }
        let stepped = events(
            &none,
            &none,
            &plan(Some(Decision::StepBack(down.clone()))),
            Mode::Enforce,
        );
        assert_eq!(
            (stepped[0].type_, stepped[0].reason.as_str()),
            (EventType::Warning, "SteppedBack"),
            "a step back is told as a warning"
        );
        add(stepped);
        let shadow = events(
            &none,
            &none,
            &plan(Some(Decision::ScaleUp(scale.clone()))),
            Mode::Recommend,
        );
        assert_eq!(
            shadow[0].note.as_deref(),
            Some("would scale model-a 300 → 540: demand 450"),
            "a recommendation tells what it would do"
        );
        add(events(
            &none,
            &none,
            &plan_held(Some(at_bound()), 3),
            Mode::Enforce,
        ));
        let mut lowered = plan(None);
        let spec = std::time::Duration::from_secs(30);
        let first = IdleTimeout::next(spec, None, Some(2.0), true, at(15));
        lowered.backends[0].idle_timeout = first;
        let mut tried = plan(None);
        tried.backends[0].idle_timeout =
            IdleTimeout::next(spec, Some(first), None, true, at(86_400));
        for mode in [Mode::Enforce, Mode::Recommend] {
            add(events(&none, &none, &lowered, mode));
            add(events(&none, &none, &tried, mode));
        }
        add(events(
            &none,
            &refused_and_unverified(),
            &plan(None),
            Mode::Enforce,
        ));
        // Every documented condition state, reached from an empty status.
        for c in CONDITIONS {
            for r in c.reasons {
                let new = status(vec![cond(c.type_, r.status, r.reason, "m")]);
                add(events(&none, &new, &plan(None), Mode::Enforce));
            }
        }
        add(vec![
            failure_event(&Error::Plan("x".into())),
            unreadable_event("x"),
            implausible_generation_event("x"),
        ]);
        let documented: BTreeSet<(&str, String)> = EVENTS
            .iter()
            .map(|e| (e.type_, e.reason.to_owned()))
            .collect();
        assert_eq!(
            published, documented,
            "Event reasons and crds/src/policy/conditions.rs EVENTS differ (then run `make crds`)"
        );
    }
}

/// One reconcile answered as the apiserver would for a quiet namespace ([`answer_all`]); how
/// many PUTs the gateways got.
async fn reconcile_once(p: &ConnectionPolicy, pods: Vec<Pod>, memory: &mut RolloutMemory) -> usize {
    reconcile_with(p, pods, FakeGateways::default(), memory)
        .await
        .len()
}

/// [`reconcile_once`] with these gateways; the addresses PUT to, in order.
async fn reconcile_with(
    p: &ConnectionPolicy,
    pods: Vec<Pod>,
    gateways: FakeGateways,
    memory: &mut RolloutMemory,
) -> Vec<SocketAddr> {
    let (ctx, mut api, gateways) = context_with(vec![p.clone()], pods, gateways);
    *ctx.rollouts.lock() = memory.clone();
    let reconciler = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    with_timeout(answer_all(&mut api, p, "s3cr3t", reconciler))
        .await
        .expect("the reconcile succeeded");
    memory.clone_from(&ctx.rollouts.lock());
    gateways.puts.lock().iter().map(|(a, _, _)| *a).collect()
}

/// A canary that gives no answer (a gateway still starting, one hung or cut off) is not tried
/// first forever: the next reconcile takes the next stale pod as its canary, the rest follow
/// it, and the pod that did not answer is tried again with them.
#[tokio::test]
async fn a_canary_that_gives_no_answer_gives_way_to_the_next_pod_and_the_rollout_goes_on() {
    let p = progressive_without_verification();
    let pods = || {
        vec![
            pod("gw-0", "127.0.0.7"),
            pod("gw-1", "127.0.0.8"),
            pod("gw-2", "127.0.0.9"),
        ]
    };
    let addr = |last: u8| SocketAddr::from(([127, 0, 0, last], 9901));
    let stuck = || FakeGateways {
        starting: vec![addr(7)],
        ..FakeGateways::default()
    };
    let mut memory = RolloutMemory::default();
    assert_eq!(
        reconcile_with(&p, pods(), stuck(), &mut memory).await,
        [addr(7)],
        "gw-0, first by name, is the first canary"
    );
    let mut second = reconcile_with(&p, pods(), stuck(), &mut memory).await;
    assert_eq!(
        second.first(),
        Some(&addr(8)),
        "gw-1 is the canary now: {second:?}"
    );
    second[1..].sort();
    assert_eq!(
        second,
        [addr(8), addr(7), addr(9)],
        "the rest follow the canary that answered, gw-0 among them"
    );
    // gw-0 answers again: it takes the revision, and is no longer remembered as unanswered.
    assert_eq!(
        reconcile_with(&p, pods(), FakeGateways::default(), &mut memory).await,
        [addr(7)]
    );
    assert!(memory.unanswered.is_empty(), "{:?}", memory.unanswered);
    // A pod that is gone takes what was known of it along; another namespace's pod of the
    // same name (planned by its own passes) keeps its entry.
    let elsewhere = ("other".to_owned(), "gw-0".to_owned(), "uid/0".to_owned());
    let known = memory.acked.values().next().cloned().expect("acknowledged");
    memory.acked.insert(elsewhere.clone(), known);
    memory
        .unanswered
        .insert(elsewhere.clone(), Timestamp::UNIX_EPOCH);
    reconcile_with(
        &p,
        pods()[1..].to_vec(),
        FakeGateways::default(),
        &mut memory,
    )
    .await;
    assert!(
        memory
            .acked
            .keys()
            .all(|(ns, pod, _)| pod != "gw-0" || ns == "other"),
        "{:?}",
        memory.acked
    );
    assert!(memory.acked.contains_key(&elsewhere), "{:?}", memory.acked);
    assert!(memory.unanswered.contains_key(&elsewhere));
}

/// Shares, bursts and client limits changed under the generation every pod ran are the
/// operator's own tuning (a decision, a re-division): every pod at once. The same numbers
/// changed by an edit of the policy (a newer generation) go to the canary first, the rest after
/// its verification.
#[tokio::test]
async fn the_operators_tuning_reaches_every_pod_at_once_and_a_users_edit_the_canary_first() {
    let pods = || {
        vec![
            pod("gw-0", "127.0.0.7"),
            pod("gw-1", "127.0.0.8"),
            pod("gw-2", "127.0.0.9"),
        ]
    };
    let mut p = policy("models", 0);
    p.spec.backends[0].capacity.max_connections_per_endpoint = 30;
    let mut memory = RolloutMemory::default();
    assert_eq!(
        reconcile_once(&p, pods(), &mut memory).await,
        3,
        "the first rollout, all at once"
    );

    // The same generation, the rollout now Progressive (as if it always was) and the target
    // moved: what an autoscale decision does to the documents.
    p.spec.rollout.strategy = poolpilot_api::policy::RolloutStrategy::Progressive;
    p.spec.rollout.canary_pods = 1;
    p.spec.rollout.verify_intervals = 2;
    p.spec.backends[0].capacity.max_connections_per_endpoint = 45;
    assert_eq!(
        reconcile_once(&p, pods(), &mut memory).await,
        3,
        "the operator's tuning: every pod in this reconcile"
    );

    // The user edits the same number: a new generation.
    p.metadata.generation = Some(2);
    p.spec.backends[0].capacity.max_connections_per_endpoint = 60;
    assert_eq!(
        reconcile_once(&p, pods(), &mut memory).await,
        1,
        "the user's edit: the canary alone until its verification"
    );
    assert_eq!(
        reconcile_once(&p, pods(), &mut memory).await,
        0,
        "the rest wait for the verification, not for another reconcile"
    );
}

/// An operator that just started, or took over from another leader, sent nothing itself: it
/// learns what each pod runs from the pods (`GET /v1/limits`) and that the policy's generation
/// was rolled out from its status, so that a re-division after the handover goes as its
/// predecessor's would have: the pods it lowers first, then the ones it raises, in one
/// reconcile and without a canary, the fleet inside its budget all along. Unlearned (a pod
/// that cannot tell, a status that says nothing), the rollout's waves decide: one canary.
#[tokio::test]
async fn an_operator_that_took_over_learns_what_the_pods_run_and_re_divides_lowering_first() {
    let pods = || {
        vec![
            pod("gw-0", "127.0.0.7"),
            pod("gw-1", "127.0.0.8"),
            pod("gw-2", "127.0.0.9"),
        ]
    };
    let addr = |last: u8| SocketAddr::from(([127, 0, 0, last], 9901));
    let mut p = policy("models", 0);
    p.spec.backends[0].capacity.max_connections_per_endpoint = 30;
    // The previous leader's rollout: every pod runs the even division.
    let before = FakeGateways::default();
    reconcile_with(&p, pods(), before.clone(), &mut RolloutMemory::default()).await;
    let even = before.running.lock().clone();
    assert_eq!(even.len(), 3, "{even:?}");
    let share = |d: &GatewayLimits| d.backends[0].pool.max_connections_per_endpoint;
    assert!(share(&even[&addr(7)]) >= 2, "{even:?}");
    // ... then a re-division it made before it went: gw-0 holds two more, gw-1 two fewer.
    let moved = |by: i64, doc: &GatewayLimits| {
        let mut doc = doc.clone();
        let pool = &mut doc.backends[0].pool.max_connections_per_endpoint;
        *pool = pool.checked_add_signed(by as i32).unwrap();
        doc.generation += 1;
        doc.revision = doc.content_revision();
        doc
    };
    let running = BTreeMap::from([
        (addr(7), moved(2, &even[&addr(7)])),
        (addr(8), moved(-2, &even[&addr(8)])),
        (addr(9), even[&addr(9)].clone()),
    ]);
    let pool: u32 = running.values().map(share).sum();

    // The new leader, under a rollout that would verify a canary for two intervals.
    p.spec.rollout.strategy = poolpilot_api::policy::RolloutStrategy::Progressive;
    p.spec.rollout.canary_pods = 1;
    p.spec.rollout.verify_intervals = 2;
    let told = |status: &str| poolpilot_api::ConnectionPolicyStatus {
        conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: "RolledOut".into(),
            status: status.into(),
            reason: "RolledOut".into(),
            message: "3/3 pods run revision r".into(),
            observed_generation: Some(1),
            last_transition_time: Time(now()),
        }],
        ..Default::default()
    };
    let gateways = |running: BTreeMap<SocketAddr, GatewayLimits>| FakeGateways {
        running: Arc::new(Mutex::new(running)),
        ..FakeGateways::default()
    };
    p.status = Some(told("True"));
    let after = gateways(running.clone());
    let sent = reconcile_with(&p, pods(), after.clone(), &mut RolloutMemory::default()).await;
    assert_eq!(
        sent,
        [addr(7), addr(8)],
        "the pod it lowers, then the pod it raises; the third already runs its share"
    );
    let now_running = after.running.lock().clone();
    assert_eq!(now_running, even, "every pod runs the division again");
    assert_eq!(now_running.values().map(share).sum::<u32>(), pool);

    // Pods that cannot tell what they run: the waves, a canary alone.
    let sent = reconcile_with(
        &p,
        pods(),
        gateways(BTreeMap::new()),
        &mut RolloutMemory::default(),
    )
    .await;
    assert_eq!(sent.len(), 1, "the canary alone: {sent:?}");
    // A status that does not say the generation was rolled out: a canary alone too.
    p.status = Some(told("False"));
    let sent = reconcile_with(&p, pods(), gateways(running), &mut RolloutMemory::default()).await;
    assert_eq!(sent.len(), 1, "the canary alone: {sent:?}");
}

/// A gateway whose container restarted (same pod, same uid) starts from the ConfigMap's
/// document: what it acknowledged before no longer holds, and it gets its own document again.
/// (Seen on clusters left running: a restarted gateway kept the ConfigMap's share while status
/// said it ran the new one.)
#[tokio::test]
async fn a_gateway_whose_container_restarted_gets_its_document_again() {
    let p = policy("models", 0);
    let restarted = |n: i32| {
        let mut pod = gateway_pod();
        pod.status.as_mut().unwrap().container_statuses = Some(vec![
            serde_json::from_value(json!({
                "name": "gateway", "image": "poolpilot/gateway", "imageID": "", "ready": true,
                "restartCount": n,
            }))
            .unwrap(),
        ]);
        pod
    };
    let mut memory = RolloutMemory::default();
    let first = reconcile_once(&p, vec![restarted(0)], &mut memory).await;
    let again = reconcile_once(&p, vec![restarted(0)], &mut memory).await;
    let after_restart = reconcile_once(&p, vec![restarted(1)], &mut memory).await;
    assert_eq!(
        (first, again, after_restart),
        (1, 0, 1),
        "sent, acknowledged, and sent again once the container restarted"
    );
}

#[tokio::test]
async fn a_recommend_policy_publishes_its_document_and_sends_nothing_to_the_pods() {
    let mut p = policy("models", 0);
    p.spec.mode = poolpilot_api::policy::Mode::Recommend;
    let pods = vec![pod("gw-0", "127.0.0.7"), pod("gw-1", "127.0.0.8")];
    let (ctx, mut api, gateways) = context_with(vec![p.clone()], pods, FakeGateways::default());
    let reconciler = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));

    // The recommended document, never the limits ConfigMap nor the admin token (no PUT).
    let cm = expect_configmap_apply(&mut api, "models-recommended").await;
    assert_eq!(cm["metadata"]["labels"]["poolpilot.io/policy"], "models");
    let doc: GatewayLimits =
        serde_json::from_str(cm["data"]["limits.json"].as_str().unwrap()).unwrap();
    let status = expect_status_patch(&mut api, &p).await;
    let s = &status["status"];
    assert_eq!(s["revision"], doc.revision.as_str(), "status names it");
    let rolled = condition(s, "RolledOut");
    assert_eq!(
        (&rolled["status"], &rolled["reason"]),
        (&json!("False"), &json!("Recommending"))
    );
    assert!(
        rolled["message"]
            .as_str()
            .unwrap()
            .contains("in ConfigMap models-recommended"),
        "{rolled}"
    );
    let ready = condition(s, "Ready");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("True"), &json!("Recommending"))
    );
    with_timeout(reconciler)
        .await
        .expect("the reconcile task ran")
        .expect("the reconcile succeeded");
    assert!(gateways.puts.lock().is_empty(), "nothing sent to the pods");
}

#[test]
fn only_a_document_that_lowers_shares_and_client_limits_reaches_the_configmap_first() {
    use crate::plan::tests::{pods, policy};
    use crate::plan::{FleetInput, Memory, plan};
    let spec = "gatewaySelector: {matchLabels: {app: gw}}\nbackends:\n- name: model-a\n  endpoints: {service: {name: model-a, port: 8000}}\n  capacity: {maxConnectionsPerEndpoint: 64}\nautoscale: {enabled: false}\nclients: {identity: {header: authorization}, maxConcurrency: 12, maxQueue: 6}\n";
    let document = |spec: &str, n: usize| {
        let input = FleetInput {
            policies: vec![policy("a", 0, spec, 2)],
            pods: pods(n),
            ..FleetInput::default()
        };
        let fleet = plan(&input, &mut Memory::default(), crate::plan::tests::at(0));
        (*fleet.policies[0].document.clone().unwrap()).clone()
    };
    let three = document(spec, 3);
    let six = document(spec, 6);
    assert!(
        six.backends[0].pool.max_connections_per_endpoint
            < three.backends[0].pool.max_connections_per_endpoint
    );
    assert!(
        rollout::only_lowers(&three, &six),
        "more pods: lower shares first"
    );
    assert!(
        !rollout::only_lowers(&six, &three),
        "higher shares wait for the waves"
    );
    let mut moved = six.clone();
    moved.backends[0].endpoints[0].address.set_port(9000);
    assert!(
        !rollout::only_lowers(&three, &moved),
        "an endpoint change goes through the canary"
    );
}

#[test]
fn a_re_division_is_a_tuning_that_lowers_or_raises_and_anything_else_is_content() {
    use crate::plan::tests::{pods, policy};
    use crate::plan::{FleetInput, Memory, plan};
    use poolpilot_api::limits::ClientShare;
    use rollout::Tuning;
    let spec = "gatewaySelector: {matchLabels: {app: gw}}\nbackends:\n- name: model-a\n  endpoints: {service: {name: model-a, port: 8000}}\n  capacity: {maxConnectionsPerEndpoint: 64}\nautoscale: {enabled: false}\nclients: {identity: {header: authorization}, maxConcurrency: 12, maxQueue: 6}\n";
    let input = FleetInput {
        policies: vec![policy("a", 0, spec, 2)],
        pods: pods(2),
        ..FleetInput::default()
    };
    let fleet = plan(&input, &mut Memory::default(), crate::plan::tests::at(0));
    let doc = (*fleet.documents["gw-0"]).clone();
    assert_eq!(
        rollout::tuning(&doc, &doc),
        Some(Tuning::Lowers),
        "no change lowers nothing"
    );

    let mut fewer = doc.clone();
    fewer.backends[0].pool.max_connections_per_endpoint -= 1;
    let mut burst = fewer.clone();
    burst.backends[0].pool.burst_per_endpoint = 4;
    assert_eq!(rollout::tuning(&doc, &fewer), Some(Tuning::Lowers));
    assert_eq!(rollout::tuning(&fewer, &doc), Some(Tuning::Raises));
    assert_eq!(
        rollout::tuning(&doc, &burst),
        Some(Tuning::Raises),
        "a share lowered and a burst raised raise"
    );
    assert_eq!(
        rollout::tuning(&burst, &fewer),
        Some(Tuning::Lowers),
        "the burst taken away"
    );

    let share = |c: u32| ClientShare {
        key_sha256: "ab".repeat(32),
        max_concurrency: c,
        max_queue: 1,
    };
    let mut shared = doc.clone();
    shared.client_policies[0].client_shares = vec![share(2)];
    assert_eq!(
        rollout::tuning(&doc, &shared),
        Some(Tuning::Raises),
        "a new client share may raise: {} → 2",
        doc.client_policies[0].max_concurrency
    );
    let mut less = shared.clone();
    less.client_policies[0].client_shares = vec![share(1)];
    assert_eq!(rollout::tuning(&shared, &less), Some(Tuning::Lowers));
    assert_eq!(
        rollout::tuning(&less, &doc),
        Some(Tuning::Raises),
        "the share removed: back to the policy's limit"
    );

    // A token budget's part on this pod: tuned, as its division over the pods moves it.
    let budget = |per_minute: u64| {
        let mut d = doc.clone();
        d.client_policies[0].tokens = Some(
            serde_json::from_value(
                serde_json::json!({"perMinute": per_minute, "perDay": 10 * per_minute}),
            )
            .unwrap(),
        );
        d
    };
    assert_eq!(
        rollout::tuning(&budget(900), &budget(300)),
        Some(Tuning::Lowers)
    );
    assert_eq!(
        rollout::tuning(&budget(300), &budget(900)),
        Some(Tuning::Raises)
    );
    assert_eq!(
        rollout::tuning(&doc, &budget(300)),
        None,
        "a budget that appears is content"
    );
    let mut counted = budget(300);
    if let Some(t) = &mut counted.client_policies[0].tokens {
        t.default_max_tokens = 7;
    }
    assert_eq!(
        rollout::tuning(&budget(300), &counted),
        None,
        "how a budget counts is content"
    );

    let mut moved = doc.clone();
    moved.backends[0].endpoints[0].address.set_port(9000);
    assert_eq!(
        rollout::tuning(&doc, &moved),
        None,
        "an endpoint change is content"
    );
    let mut timeout = doc.clone();
    timeout.backends[0].pool.lease_timeout = poolpilot_api::Duration::from(Duration::from_secs(9));
    assert_eq!(
        rollout::tuning(&doc, &timeout),
        None,
        "a timeout change is content"
    );
}

#[test]
fn a_revision_rolled_out_again_is_verified_anew_not_by_its_first_canary() {
    let start = now();
    let later = |s: i64| Timestamp::from_second(start.as_second() + s).unwrap();
    let mut memory = RolloutMemory::default();
    // Revision A: its canary is on it at the start, still on it 60 s later.
    assert_eq!(
        memory.verification_start("ns", "models", "rev-a", true, start),
        Some(start)
    );
    assert_eq!(
        memory.verification_start("ns", "models", "rev-a", true, later(60)),
        Some(start),
        "the verification runs from the first canary"
    );
    // An edit to B, then undone: A is verified from its canary's new acknowledgement.
    assert_eq!(
        memory.verification_start("ns", "models", "rev-b", false, later(120)),
        None
    );
    assert_eq!(
        memory.verification_start("ns", "models", "rev-a", false, later(180)),
        None,
        "nothing is on A yet: no verification"
    );
    assert_eq!(
        memory.verification_start("ns", "models", "rev-a", true, later(181)),
        Some(later(181))
    );
    // Another policy's rollout in the namespace is its own.
    assert_eq!(
        memory.verification_start("ns", "other", "rev-c", true, later(200)),
        Some(later(200))
    );
    assert_eq!(
        memory.verification_start("ns", "models", "rev-a", true, later(240)),
        Some(later(181))
    );
}

#[tokio::test]
async fn the_durable_document_goes_to_the_configmap_the_pods_name_and_keeps_its_owner() {
    let mut pod = gateway_pod();
    pod.metadata.annotations = Some(
        [(
            rollout::LIMITS_CONFIGMAP_ANNOTATION.to_owned(),
            "gw-limits".to_owned(),
        )]
        .into(),
    );
    let models = policy("models", 0);
    let mut other = policy("other", 1);
    other.spec.backends[0].name = "model-b".into();
    let mut run = Scenario::start_with(
        models.clone(),
        vec![models.clone(), other.clone()],
        vec![pod.clone()],
        FakeGateways::default(),
    );
    let cm = expect_configmap_apply(&mut run.api, "gw-limits").await;
    let labels = &cm["metadata"]["labels"];
    assert_eq!(labels["poolpilot.io/fleet-limits"], "true", "{cm}");
    assert_eq!(labels["poolpilot.io/policy"], "models");
    assert_eq!(cm["metadata"]["ownerReferences"][0]["uid"], "models-uid");
    assert_eq!(cm["metadata"]["ownerReferences"][0]["controller"], true);
    let doc: GatewayLimits =
        serde_json::from_str(cm["data"]["limits.json"].as_str().unwrap()).unwrap();
    let backends: Vec<&str> = doc.backends.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(backends, ["model-a", "model-b"], "both policies' backends");
    run.reconciler.abort();

    // The other policy writes it as the policy that created it: its ownerReferences never
    // change after the create.
    let existing: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "gw-limits", "namespace": "ns",
                     "labels": {"app.kubernetes.io/managed-by": "poolpilot-operator",
                                "poolpilot.io/policy": "models", "poolpilot.io/fleet-limits": "true"},
                     "ownerReferences": [{"apiVersion": "poolpilot.io/v1alpha1", "kind": "ConnectionPolicy",
                                          "name": "models", "uid": "models-uid", "controller": true}],
                     "annotations": {"poolpilot.io/revision": "000000000000", "poolpilot.io/generation": "0"}},
        "data": {"limits.json": "{}"},
    }))
    .unwrap();
    let (ctx, mut api, _) = context_full(
        vec![
            DeserializeGuard(Ok(models)),
            DeserializeGuard(Ok(other.clone())),
        ],
        vec![pod],
        vec![existing],
        FakeGateways::default(),
    );
    let reconciler = tokio::spawn(reconcile(Arc::new(other), ctx));
    let cm = loop {
        // The token Secret may be read first; the ConfigMap apply is what is checked.
        let (request, send) = with_timeout(api.next_request()).await.expect("a request");
        let path = request.uri().path().to_owned();
        if path.ends_with("/configmaps/gw-limits") {
            let body = request.into_body().collect_bytes().await.unwrap();
            let cm: Value = serde_json::from_slice(&body).unwrap();
            send.send_response(Response::builder().body(Body::from(body.to_vec())).unwrap());
            break cm;
        }
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "poolpilot-admin-token"}, "data": {"token": "czNjcjN0"}});
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&secret).unwrap()))
                .unwrap(),
        );
    };
    assert_eq!(
        cm["metadata"]["labels"]["poolpilot.io/policy"], "models",
        "{cm}"
    );
    assert_eq!(cm["metadata"]["ownerReferences"][0]["uid"], "models-uid");
    assert_eq!(
        cm["metadata"]["ownerReferences"].as_array().unwrap().len(),
        1
    );
    reconciler.abort();
}

#[tokio::test]
async fn a_backend_in_a_namespace_not_allowed_is_refused_in_status() {
    let mut p = policy("models", 0);
    p.spec.backends[0].endpoints = serde_json::from_value(
        json!({"service": {"name": "llama", "namespace": "elsewhere", "port": 8000}}),
    )
    .unwrap();
    let mut run = Scenario::start(p);
    // Its pods get documents without its backends; no ConfigMap is written for it.
    run.token_secret().await;
    let status = run.status_patch().await;
    let accepted = condition(&status["status"], "Accepted");
    assert_eq!(accepted["status"], "False", "{accepted}");
    assert_eq!(accepted["reason"], "NamespaceNotAllowed");
    let message = accepted["message"].as_str().unwrap();
    assert!(
        message.contains("\"elsewhere\"") && message.contains("llm"),
        "names the namespace and the allowed ones: {message}"
    );
    let puts = run.puts();
    assert!(
        puts.iter().all(|(_, _, doc)| doc.backends.is_empty()),
        "nothing of it reaches the pods: {puts:?}"
    );
    let event = run.event().await;
    assert_eq!(event["type"], "Warning", "{event}");
    run.outcome()
        .await
        .expect("the refusal is reported, not failed");
    assert_eq!(
        requeued_after(&run.ctx, "models"),
        Some(Duration::from_secs(60)),
        "looked at again after --max-requeue"
    );

    // An allowed namespace is accepted.
    let mut p = policy("models", 0);
    p.spec.backends[0].endpoints = serde_json::from_value(
        json!({"service": {"name": "llama", "namespace": "llm", "port": 8000}}),
    )
    .unwrap();
    assert!(observe::refused_namespaces(&["llm".to_owned()], &p).is_empty());
    assert_eq!(observe::refused_namespaces(&[], &p).len(), 1);
}

/// A gateway pod named `name` at `addr` (its IP, and its admin port by annotation).
fn pod_at(name: &str, addr: SocketAddr) -> Pod {
    let mut pod = pod(name, &addr.ip().to_string());
    pod.metadata.annotations = Some(
        [(
            observe::ADMIN_PORT_ANNOTATION.to_owned(),
            addr.port().to_string(),
        )]
        .into(),
    );
    pod
}

/// One pod that answers and one that never does, through the operator's HTTP client: the
/// reconcile ends at the per-pod timeout with the answering pod updated, the hung one named in
/// status (tried again at the next reconcile, at the policy's interval, not in a second) and
/// counted as a timed-out PUT.
#[tokio::test(start_paused = true)]
async fn a_hung_pod_is_reported_and_tried_at_the_next_reconcile_while_the_others_are_updated() {
    use super::rollout::tests::{Answer, Seen, admin_server};
    let seen = Arc::new(Seen::default());
    let fast = admin_server(40, Answer::After(Duration::from_millis(20)), seen.clone()).await;
    let hung = admin_server(41, Answer::Never, seen.clone()).await;
    let gateways = crate::gateway::HttpGateways::new(Duration::from_secs(600)).unwrap();
    let p = policy("models", 0);
    let pods = vec![pod_at("gw-0", fast), pod_at("gw-1", hung)];
    let (ctx, mut api, _) = context_full(
        vec![DeserializeGuard(Ok(p.clone()))],
        pods,
        vec![],
        gateways,
    );
    let started = tokio::time::Instant::now();
    let mut reconciler = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    expect_configmap_apply(&mut api, "models-limits").await;
    expect_token_secret(&mut api).await;
    // Not `expect_status_patch`: its 5 s would race the per-pod timeout of 5 s.
    let path = "/apis/poolpilot.io/v1alpha1/namespaces/ns/connectionpolicies/models/status";
    let answer = serde_json::to_value(&p).unwrap();
    let status = tokio::time::timeout(
        Duration::from_secs(30),
        expect(&mut api, Method::PATCH, path, answer),
    )
    .await
    .expect("the status came");
    let took = started.elapsed();
    let s = &status["status"];
    assert_eq!(s["updated"], "1/2", "{s}");
    assert_eq!(s["pods"]["failures"][0]["pod"], "gw-1", "{s}");
    let why = s["pods"]["failures"][0]["message"].as_str().unwrap();
    assert!(
        why.contains("no answer within 5s") && why.contains("next reconcile"),
        "{why}"
    );
    assert!(
        took >= PushBound::default().timeout && took < Duration::from_secs(6),
        "the rollout step took {took:?}"
    );
    let action = loop {
        tokio::select! {
            done = &mut reconciler => break done.unwrap().unwrap(),
            next = api.next_request() => {
                let (_, send) = next.unwrap();
                send.send_response(Response::builder().body(Body::from(b"{}".to_vec())).unwrap());
            }
        }
    };
    assert_eq!(action, Action::await_change());
    assert_eq!(
        requeued_after(&ctx, "models"),
        Some(Duration::from_secs(15)),
        "at the policy's interval"
    );
    assert_eq!(ctx.rollouts.lock().acked.len(), 1, "gw-0 acknowledged");
    let text = {
        let mut registry = prometheus_client::registry::Registry::default();
        ctx.metrics.clone().register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    };
    assert!(
        text.contains(r#"gateway_puts_total{outcome="timeout"} 1"#),
        "{text}"
    );
}

/// Answers every API request of a reconcile as [`answer_all`] does (token `s3cr3t`); the
/// reconcile's outcome and each request: method, path and body.
async fn answer_recording(
    api: &mut ApiHandle,
    p: &ConnectionPolicy,
    mut reconciler: tokio::task::JoinHandle<Result<Action>>,
) -> (Result<Action>, Vec<(Method, String, Value)>) {
    let mut seen = Vec::new();
    loop {
        tokio::select! {
            done = &mut reconciler => return (done.expect("the reconcile task ran"), seen),
            next = api.next_request() => {
                // None: every client is gone, with the reconcile's context.
                let Some((request, send)) = next else {
                    return ((&mut reconciler).await.expect("the reconcile task ran"), seen);
                };
                let (method, path) = (request.method().clone(), request.uri().path().to_owned());
                let body = request.into_body().collect_bytes().await.unwrap();
                let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let answer = api_answer(&path, p, "s3cr3t");
                send.send_response(
                    Response::builder()
                        .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                        .unwrap(),
                );
                seen.push((method, path, body));
            }
        }
    }
}

/// A reconcile that finds everything as the last one left it (the status it wrote, the
/// ConfigMap it applied, every pod on its document) sends the API server nothing: no status
/// PATCH, no ConfigMap apply, no Secret read, no Event. With autoscale off, fifteen seconds
/// later too; with autoscale on, a reconcile between two decisions (another object's change
/// brought it).
#[tokio::test]
async fn a_reconcile_with_nothing_changed_writes_nothing() {
    let off = policy("models", 0);
    let in_15s = || Timestamp::from_second(now().as_second() + 15).unwrap();
    unchanged_writes_nothing(&off, [now, in_15s]).await;
    let mut on = policy("models", 0);
    on.spec.autoscale.enabled = true;
    let in_5s = || Timestamp::from_second(now().as_second() + 5).unwrap();
    unchanged_writes_nothing(&on, [now, in_5s]).await;
}

/// The two gateway pods of the tests that reconcile a policy again from what a first reconcile
/// left.
fn two_pods() -> Vec<Pod> {
    vec![pod("gw-0", "127.0.0.7"), pod("gw-1", "127.0.0.8")]
}

/// The `PATCH` of the path ending in `suffix` among `requests`, its body.
fn patch_of(requests: &[(Method, String, Value)], suffix: &str) -> Option<Value> {
    requests
        .iter()
        .find(|(m, path, _)| *m == Method::PATCH && path.ends_with(suffix))
        .map(|(_, _, body)| body.clone())
}

/// What a first reconcile of `p` on [`two_pods`] left: its context, the policy as the watches
/// show it next (with the status written), the ConfigMap applied, and the gateways.
async fn first_reconcile(
    p: &ConnectionPolicy,
) -> (
    Arc<Context<FakeGateways>>,
    ConnectionPolicy,
    ConfigMap,
    FakeGateways,
) {
    let (ctx, mut api, gateways) =
        context_with(vec![p.clone()], two_pods(), FakeGateways::default());
    let first = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    let (outcome, requests) = with_timeout(answer_recording(&mut api, p, first)).await;
    outcome.expect("the first reconcile succeeded");
    let find = |suffix: &str| {
        patch_of(&requests, suffix).unwrap_or_else(|| panic!("no PATCH of …{suffix}: {requests:?}"))
    };
    let mut stored = p.clone();
    stored.status = Some(serde_json::from_value(find("/models/status")["status"].clone()).unwrap());
    let configmap: ConfigMap = serde_json::from_value(find("/models-limits")).unwrap();
    (ctx, stored, configmap, gateways)
}

/// A context that goes on from `ctx` (its rollout and autoscale memory) with `policy` and
/// `configmap` in its caches, at `clock`; its API handle and gateways.
fn going_on_from(
    ctx: &Context<FakeGateways>,
    policy: &ConnectionPolicy,
    configmap: &ConfigMap,
    clock: fn() -> Timestamp,
) -> (Context<FakeGateways>, ApiHandle, FakeGateways) {
    let (again, api, gateways) = context_full(
        vec![DeserializeGuard(Ok(policy.clone()))],
        two_pods(),
        vec![configmap.clone()],
        FakeGateways::default(),
    );
    *again.rollouts.lock() = ctx.rollouts.lock().clone();
    *again.memory.lock() = ctx.memory.lock().clone();
    let again = Context {
        clock,
        ..Arc::into_inner(again).unwrap()
    };
    (again, api, gateways)
}

/// One reconcile of `p` on two pods, then one at each of `clocks` from what it left.
async fn unchanged_writes_nothing(p: &ConnectionPolicy, clocks: [fn() -> Timestamp; 2]) {
    let (ctx, stored, configmap, gateways) = first_reconcile(p).await;
    assert_eq!(gateways.puts.lock().len(), 2);
    for clock in clocks {
        let (again, mut api, gateways) = going_on_from(&ctx, &stored, &configmap, clock);
        let second = tokio::spawn(reconcile(Arc::new(stored.clone()), Arc::new(again)));
        let (outcome, requests) = with_timeout(answer_recording(&mut api, &stored, second)).await;
        outcome.expect("the second reconcile succeeded");
        assert!(requests.is_empty(), "at {}: {requests:?}", clock());
        assert!(gateways.puts.lock().is_empty(), "nothing sent to the pods");
    }
}

/// A decision later, a status that moved only in what the operator observed (the decision's
/// time and numbers) waits for the policy's refresh: not written while its turn has not come
/// (counted as deferred), written once it has. An edit of the policy is written at once.
#[tokio::test]
async fn a_status_that_moved_only_in_its_observations_waits_for_its_refresh() {
    let mut p = policy("models", 0);
    p.spec.autoscale.enabled = true;
    let (ctx, stored, configmap, _) = first_reconcile(&p).await;

    // The next decision, 15 s later, by an operator whose refresh comes every 100 s (a single
    // policy at 0.01 writes a second), by one at the default rate, and after an edit.
    let mut edited = stored.clone();
    edited.metadata.generation = Some(2);
    edited.spec.backends[0]
        .capacity
        .max_connections_per_endpoint = 48;
    let in_15s = || Timestamp::from_second(now().as_second() + 15).unwrap();
    for (policy, rate, written) in [
        (&stored, 0.01, false),
        (&stored, super::refresh::DEFAULT_REFRESH_RATE, true),
        (&edited, 0.01, true),
    ] {
        let (again, mut api, _) = going_on_from(&ctx, policy, &configmap, in_15s);
        let again = Arc::new(Context {
            status_refresh: super::refresh::StatusRefresh::new(rate),
            ..again
        });
        let second = tokio::spawn(reconcile(Arc::new(policy.clone()), again.clone()));
        let (outcome, requests) = with_timeout(answer_recording(&mut api, policy, second)).await;
        outcome.expect("the second reconcile succeeded");
        let what = format!("generation {:?} at {rate}/s", policy.metadata.generation);
        let status = patch_of(&requests, "/models/status");
        assert_eq!(status.is_some(), written, "{what}: {requests:?}");
        if !written {
            assert!(
                requests.is_empty(),
                "{what}: nothing else either: {requests:?}"
            );
        }
        let text = metrics_text(&again);
        let outcome = if written { "written" } else { "deferred" };
        assert!(
            text.contains(&format!("status_writes_total{{outcome=\"{outcome}\"}} 1")),
            "{what}: {text}"
        );
        if let Some(status) = status {
            let new: poolpilot_api::ConnectionPolicyStatus =
                serde_json::from_value(status["status"].clone()).unwrap();
            let old = policy.status.as_ref().unwrap();
            assert_eq!(
                crate::plan::observations::observations_only(old, &new),
                policy.metadata.generation == Some(1),
                "{what}: only the observations moved, unless the policy was edited"
            );
        }
    }
}

/// The wait before `name`'s next periodic reconcile that its last reconcile gave the pacer.
fn requeued_after<G: Gateways>(ctx: &Context<G>, name: &str) -> Option<Duration> {
    ctx.queue.asked(&("ns".to_owned(), name.to_owned()))
}

/// The operator's metrics as Prometheus text.
fn metrics_text(ctx: &Context<FakeGateways>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    ctx.metrics.clone().register(&mut registry);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    out
}

#[tokio::test]
async fn reconciles_waiting_together_share_one_namespace_pass_and_each_makes_its_decision() {
    // Three autoscaled policies on the same pod, each with a backend of its own.
    let policies: Vec<ConnectionPolicy> = ["a", "b", "c"]
        .into_iter()
        .map(|n| {
            let mut p = policy(n, 0);
            p.spec.backends[0].name = format!("model-{n}");
            p.spec.autoscale.enabled = true;
            p
        })
        .collect();
    let (ctx, mut api, gateways) = context_with(
        policies.clone(),
        vec![gateway_pod()],
        FakeGateways::default(),
    );
    // The three reconciles start while another pass plans: they wait for the next together.
    let turn = ctx.passes.hold_turn("ns").await;
    let reconciles: Vec<_> = policies
        .iter()
        .map(|p| tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone())))
        .collect();
    with_timeout(async {
        while ctx.passes.waiting("ns") < 3 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    drop(turn);
    let all = tokio::spawn(async move {
        let mut last = Ok(Action::await_change());
        for r in reconciles {
            last = r.await.expect("the reconcile task ran");
            last.as_ref().expect("the reconcile succeeded");
        }
        last
    });
    with_timeout(answer_all(&mut api, &policies[0], "s3cr3t", all))
        .await
        .expect("every reconcile succeeded");

    assert_eq!(
        ctx.passes.started("ns"),
        1,
        "one pass planned for the three"
    );
    let text = metrics_text(&ctx);
    assert!(
        text.contains("namespace_passes_total{outcome=\"planned\"} 3"),
        "{text}"
    );
    // Each reconcile was in the pass's focus: each backend got its decision.
    let memory = ctx.memory.lock();
    for p in &policies {
        let key = (
            crate::plan::PolicyKey {
                namespace: "ns".into(),
                name: p.metadata.name.clone().unwrap(),
            },
            p.spec.backends[0].name.clone(),
        );
        assert!(
            memory["ns"].backends[&key].last_decision.is_some(),
            "{key:?} decided"
        );
    }
    // The pod runs one document with the three backends.
    let puts = gateways.puts.lock();
    let last = &puts.last().expect("a document went out").2;
    assert_eq!(last.backends.len(), 3, "{last:?}");
    assert!(
        puts.iter().all(|(_, _, d)| d.revision == last.revision),
        "every reconcile sent the same pass's document"
    );
}

#[tokio::test]
async fn a_reconcile_reuses_the_last_pass_while_nothing_it_was_made_from_changed() {
    let p = policy("models", 0);
    let (ctx, mut api, _gateways) = context_with(
        vec![p.clone()],
        vec![gateway_pod()],
        FakeGateways::default(),
    );
    reconcile_in(&ctx, &mut api, &p).await;
    // Its own status write and a second reconcile: nothing the plan was made from changed.
    reconcile_in(&ctx, &mut api, &p).await;
    assert_eq!(ctx.passes.started("ns"), 1);
    let text = metrics_text(&ctx);
    assert!(
        text.contains("namespace_passes_total{outcome=\"reused\"} 1"),
        "{text}"
    );

    // A new Prometheus snapshot: the next reconcile plans again.
    ctx.snapshot.write().at = Some(now());
    reconcile_in(&ctx, &mut api, &p).await;
    assert_eq!(ctx.passes.started("ns"), 2);

    // An edit the cache has not caught up with (the object handed over is newer): planned on
    // its own, as handed over.
    let mut edited = p.clone();
    edited.metadata.generation = Some(2);
    edited.spec.backends[0]
        .capacity
        .max_connections_per_endpoint = 32;
    reconcile_in(&ctx, &mut api, &edited).await;
    let text = metrics_text(&ctx);
    assert!(
        text.contains("namespace_passes_total{outcome=\"private\"} 1"),
        "{text}"
    );
}

/// One reconcile of `p`, every API request answered.
async fn reconcile_in(ctx: &Arc<Context<FakeGateways>>, api: &mut ApiHandle, p: &ConnectionPolicy) {
    let reconciler = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
    with_timeout(answer_all(api, p, "s3cr3t", reconciler))
        .await
        .expect("the reconcile succeeded");
}

#[tokio::test]
async fn a_decision_made_in_another_policys_pass_is_told_once_by_its_own_next_reconcile() {
    let [a, b] = ["a", "b"].map(|n| {
        let mut p = policy(n, 0);
        p.spec.backends[0].name = format!("model-{n}");
        p.spec.autoscale.enabled = true;
        p
    });
    let (ctx, _api, _gateways) = context_with(
        vec![a.clone(), b.clone()],
        vec![gateway_pod()],
        FakeGateways::default(),
    );
    let key = |p: &ConnectionPolicy| observe::key(p).unwrap();
    // a's reconcile plans: both decisions are due, both made in its pass.
    let first = pass::plan_for(&ctx, &a, &key(&a)).await.unwrap();
    let decided = |news: &[crate::plan::BackendPlan]| -> Vec<String> {
        news.iter()
            .filter(|b| b.decision.is_some())
            .map(|b| b.name.clone())
            .collect()
    };
    assert_eq!(decided(&first.news), ["model-a"]);
    // b's reconcile reuses that pass and tells b's decision; its next one has nothing to tell.
    let second = pass::plan_for(&ctx, &b, &key(&b)).await.unwrap();
    assert!(Arc::ptr_eq(&first.pass, &second.pass), "the pass reused");
    assert_eq!(decided(&second.news), ["model-b"]);
    let third = pass::plan_for(&ctx, &b, &key(&b)).await.unwrap();
    assert!(third.news.is_empty(), "{:?}", third.news);
}
