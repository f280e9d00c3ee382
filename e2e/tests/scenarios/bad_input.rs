//! Scenario 8, bad input: (a) an invalid policy is refused by the schema (`kubectl apply` fails
//! with the CEL and range messages, nothing is stored); (b) a policy whose backend Service has
//! no endpoints says so in a condition naming the Service, until an instance comes up; (c) a
//! second policy defining the same backend on the same pods is the newer one, so it is
//! `Accepted=False, reason=Conflicted`, naming the older policy, while the older one stays in
//! force; (d) a gateway pod that refuses the operator's PUTs (it mounts a stale admin token)
//! makes `RolledOut=False` naming the pod and the refusal (401); (e) a static endpoint that
//! leads back into the gateway pod or to the node's metadata service is refused by the schema
//! unless `allowPrivateAddresses` says so; (f) a policy this operator cannot read (written under
//! a newer CRD) gets an `InvalidPolicy` Event while every other step above goes on.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::Api;
use poolpilot_e2e::cluster::output;
use poolpilot_e2e::eventually;
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, quick_policy, sample_policy, set, with_stack,
};
use serde_json::{Value, json};
use tokio::time::Instant;

const SCENARIO: &str = "bad-input";
/// The second, conflicting policy.
const DUPLICATE: &str = "models-again";
/// The gateway pod with a stale admin token. Its name sorts after the Deployment's pods, so
/// that its share differs from the one in the durable ConfigMap (which holds the first pod's
/// document) and only a PUT can bring it up to date.
const STALE_POD: &str = "poolpilot-gateway-zzzzzzzzzzz-stale-token";
/// The Secret the operator reads the gateways' token from (`--token-secret`).
const TOKEN_SECRET: &str = "poolpilot-admin-token";
/// The policy written under a newer CRD.
const FROM_THE_FUTURE: &str = "from-a-newer-crd";

#[tokio::test]
async fn bad_input_is_refused_or_reported_with_clear_conditions() -> anyhow::Result<()> {
    let _serial = serial().await?;
    // model-b gets no instance: its Service has no endpoints.
    let spec = StackSpec {
        gateways: 2,
        operators: 1,
        backends: vec![BackendSpec::new("model-a", 1, 64)],
        ..StackSpec::default()
    };
    with_stack("badinput", spec, async |stack| {
        // === (a) the schema refuses an invalid policy ===
        // A CEL rule: validateAfterIdle above idleTimeout.
        let mut invalid = sample_policy()?;
        set(&mut invalid, "/metadata/name", json!("stale-checks"))?;
        set(&mut invalid, "/spec/backends/0/pool/validateAfterIdle", json!("45s"))?;
        set(&mut invalid, "/spec/backends/0/pool/idleTimeout", json!("30s"))?;
        refused(
            stack,
            &invalid,
            &[
                "\"stale-checks\" is invalid",
                "pool.validateAfterIdle must not exceed pool.idleTimeout",
            ],
        )
        .await?;
        // A range: headroom above 0.9.
        let mut invalid = sample_policy()?;
        set(&mut invalid, "/metadata/name", json!("no-headroom"))?;
        set(&mut invalid, "/spec/backends/1/capacity/headroom", json!(0.95))?;
        refused(
            stack,
            &invalid,
            &[
                "\"no-headroom\" is invalid",
                "spec.backends[1].capacity.headroom",
                "less than or equal to 0.9",
            ],
        )
        .await?;

        // Priority classes: an aging bound the pool queue never reaches, a trusted header
        // that is not named.
        let mut invalid = sample_policy()?;
        set(&mut invalid, "/metadata/name", json!("never-ages"))?;
        set(
            &mut invalid,
            "/spec/clients/priority",
            json!({"agingAfter": "300ms", "trustHeader": true}),
        )?;
        refused(
            stack,
            &invalid,
            &[
                "\"never-ages\" is invalid",
                "clients.priority.agingAfter must be shorter than every backend's pool.leaseTimeout",
                "clients.priority.trustHeader needs clients.priority.header",
            ],
        )
        .await?;

        // === (e) static endpoints into the pod or to the node's metadata service ===
        for (name, address) in [
            ("to-metadata", "169.254.169.254:80"), // hermetic: not a destination (refused by the schema)
            ("to-itself", "127.0.0.1:9901"),
        ] {
            let mut invalid = sample_policy()?;
            set(&mut invalid, "/metadata/name", json!(name))?;
            set(
                &mut invalid,
                "/spec/backends/0/endpoints",
                json!({"addresses": [{"address": address}]}),
            )?;
            refused(
                stack,
                &invalid,
                &[&format!("\"{name}\" is invalid"), "need endpoints.allowPrivateAddresses"],
            )
            .await?;
        }

        // === (f) a policy this operator cannot read, present through every step below ===
        let created = Instant::now();
        create_from_a_newer_crd(stack).await?;
        let event = stack
            .wait_event(FROM_THE_FUTURE, "InvalidPolicy", "Unknown variant BlueGreen")
            .await?;
        figure(
            SCENARIO,
            "(f) unreadable policy → InvalidPolicy Event seconds",
            format!(
                "{:.1}: {}",
                created.elapsed().as_secs_f64(),
                event.message.unwrap_or_default()
            ),
        );

        // === (b) a backend whose Service has no endpoints ===
        let policy = quick_policy()?;
        let applied = Instant::now();
        stack.apply(&policy).await?;
        stack.wait_gateways(2).await?;
        let saturated = stack
            .wait_condition(POLICY, "Saturated", "True", WAIT)
            .await?;
        let said_after = applied.elapsed();
        assert_eq!(saturated.reason, "Saturated");
        assert!(
            saturated
                .message
                .contains("model-b: no endpoints: Service model-b has no ready endpoint on port 8000"),
            "{saturated:?}"
        );
        stack
            .wait_condition(POLICY, "Accepted", "True", WAIT)
            .await?;
        let status = stack.policy(POLICY).await?.status.context("status")?;
        let endpoints: Vec<(String, u32)> = status
            .backends
            .iter()
            .map(|b| (b.name.clone(), b.endpoints))
            .collect();
        assert_eq!(
            endpoints,
            [("model-a".to_owned(), 1), ("model-b".to_owned(), 0)]
        );
        // What the message promises: requests for model-b fail fast with 503.
        let gateway = stack.gateways().await?.into_iter().next().context("a gateway")?;
        let answer = reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", gateway.proxy()))
            .bearer_auth("bad-input")
            .json(&json!({"model": "model-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
            .timeout(Duration::from_secs(10))
            .send()
            .await?;
        assert_eq!(answer.status(), 503, "a model-b request without endpoints");
        figure(
            SCENARIO,
            "(b) apply → Saturated=True (no endpoints) seconds",
            format!("{:.1}: {}", said_after.as_secs_f64(), saturated.message),
        );
        // An instance comes up: the condition clears.
        let scaled = Instant::now();
        stack.scale("model-b", 1).await?;
        let cleared = eventually("model-b has an endpoint and the condition clears", WAIT, || async {
            let s = stack.policy(POLICY).await?.status.context("status")?;
            let c = s
                .conditions
                .iter()
                .find(|c| c.type_ == "Saturated")
                .context("Saturated")?;
            anyhow::ensure!(
                !c.message.contains("no endpoints")
                    && s.backends.iter().all(|b| b.endpoints == 1),
                "{c:?} endpoints {:?}",
                s.backends.iter().map(|b| b.endpoints).collect::<Vec<_>>()
            );
            Ok(c.clone())
        })
        .await?;
        figure(
            SCENARIO,
            "(b) model-b scaled to 1 → condition cleared seconds",
            format!(
                "{:.1}: Saturated={} {}",
                scaled.elapsed().as_secs_f64(),
                cleared.status,
                cleared.message
            ),
        );
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;

        // === (c) a newer policy defining the same backend on the same pods ===
        let mut duplicate = quick_policy()?;
        set(&mut duplicate, "/metadata/name", json!(DUPLICATE))?;
        duplicate
            .pointer_mut("/spec/backends")
            .and_then(Value::as_array_mut)
            .context("backends")?
            .retain(|b| b["name"] == "model-a");
        let applied = Instant::now();
        stack.apply(&duplicate).await?;
        let conflicted = stack
            .wait_condition(DUPLICATE, "Accepted", "False", WAIT)
            .await?;
        let conflicted_after = applied.elapsed();
        assert_eq!(conflicted.reason, "Conflicted", "{conflicted:?}");
        let older = format!("{}/{POLICY}", stack.name());
        assert!(
            conflicted.message.contains("\"model-a\"") && conflicted.message.contains(&older),
            "{conflicted:?}"
        );
        let ready = stack
            .wait_condition(DUPLICATE, "Ready", "False", WAIT)
            .await?;
        assert_eq!(ready.reason, "NotAccepted");
        let event = stack.wait_event(DUPLICATE, "Conflicted", &older).await?;
        // The older policy stays accepted and in force.
        assert_eq!(
            stack
                .condition(POLICY, "Accepted")
                .await?
                .map(|c| c.status),
            Some("True".to_owned())
        );
        stack
            .wait_limits("model-a defined once on every gateway", 2, WAIT, |l| {
                let owners: Vec<_> = l
                    .backends
                    .iter()
                    .filter(|b| b.name == "model-a")
                    .map(|b| b.policy.clone())
                    .collect();
                anyhow::ensure!(owners.len() == 1, "model-a from {owners:?}");
                Ok(())
            })
            .await?;
        figure(
            SCENARIO,
            "(c) apply → Conflicted seconds",
            format!(
                "{:.1}: {} (Event: {})",
                conflicted_after.as_secs_f64(),
                conflicted.message,
                event.message.unwrap_or_default()
            ),
        );
        run_ok(stack.kubectl().args(["delete", "cpol", "-n", stack.name(), DUPLICATE])).await?;

        // === (d) a gateway pod that refuses the operator's token ===
        let model = stack
            .ready_pods("app.kubernetes.io/name=poolpilot-gateway")
            .await?
            .into_iter()
            .next()
            .context("a gateway pod")?;
        stack
            .apply(&json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "poolpilot-admin-token-stale"},
                "stringData": {"token": "a-token-from-before-the-rotation"},
            }))
            .await?;
        stack.apply(&stale_pod(&model)?).await?;
        let created = Instant::now();
        let rolled = eventually(
            "RolledOut=False naming the pod that refuses the token",
            WAIT,
            || async {
                let c = stack
                    .condition(POLICY, "RolledOut")
                    .await?
                    .context("no RolledOut")?;
                // Until the pod has an IP the message says so; then the refusal, with its 401.
                anyhow::ensure!(
                    c.status == "False" && c.message.contains(STALE_POD) && c.message.contains("401"),
                    "{c:?}"
                );
                Ok(c)
            },
        )
        .await?;
        let nacked_after = created.elapsed();
        let status = stack.policy(POLICY).await?.status.context("status")?;
        let pods = status.pods.clone().context("pods")?;
        let failure = pods
            .failures
            .iter()
            .find(|f| f.pod == STALE_POD)
            .with_context(|| format!("no failure for {STALE_POD}: {pods:?}"))?;
        assert!(failure.message.contains("401"), "{failure:?}");
        let ready = stack.condition(POLICY, "Ready").await?.context("Ready")?;
        assert_eq!(ready.status, "False", "{ready:?}");
        // The other gateways took the new limits: 3 pods now share the target. (The stale pod
        // itself stays unready until its awaitOperator wait is over: no PUT reaches it.)
        assert_eq!(pods.selected, 3, "{pods:?}");
        assert_eq!(pods.updated, 2, "{pods:?}");
        figure(
            SCENARIO,
            "(d) stale-token pod created → RolledOut=False seconds",
            format!(
                "{:.1}: {} ({}); updated {}",
                nacked_after.as_secs_f64(),
                rolled.reason,
                rolled.message,
                status.updated.unwrap_or_default()
            ),
        );
        Ok(())
    })
    .await
}

/// Stores a policy as a newer poolpilot's CRD would let it through (a rollout strategy this
/// operator does not know): the CRD is widened for the one write, then put back, so that the
/// stored object outlives the schema that admitted it, as after an upgrade of the CRD ahead of
/// the operator. Scenarios run one at a time: no other test sees the wider CRD.
async fn create_from_a_newer_crd(stack: &Stack<'_>) -> anyhow::Result<()> {
    let crd = "crd/connectionpolicies.poolpilot.io";
    let current = run_ok(stack.kubectl().args(["get", crd, "-o", "json"])).await?;
    let mut wider: Value = serde_json::from_str(&current)?;
    let strategies = wider
        .pointer_mut(
            "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/rollout/properties/strategy/enum",
        )
        .and_then(Value::as_array_mut)
        .context("the rollout strategy enum in the CRD")?;
    strategies.push(json!("BlueGreen"));
    let mut policy = sample_policy()?;
    set(&mut policy, "/metadata/name", json!(FROM_THE_FUTURE))?;
    set(&mut policy, "/spec/rollout/strategy", json!("BlueGreen"))?;
    let replace = |object: Value| async move {
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(&object)?)?;
        run_ok(stack.kubectl().args(["replace", "-f"]).arg(file.path())).await
    };
    replace(wider).await?;
    let created = poolpilot_e2e::eventually("the wider CRD admits the policy", WAIT, || {
        stack.apply(&policy)
    })
    .await;
    // Put the CRD back whatever happened, before anything else.
    let mut current: Value = serde_json::from_str(&current)?;
    if let Some(meta) = current["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
    }
    replace(current).await?;
    stack.ns().cluster().install_crd().await?;
    created?;
    Ok(())
}

/// A gateway pod like `model`, outside its ReplicaSet, that mounts a stale admin token: what a
/// pod started before a token rotation (or from a stale manifest) looks like.
fn stale_pod(model: &Pod) -> anyhow::Result<Value> {
    let mut labels = model.labels().clone();
    labels.remove("pod-template-hash");
    let mut spec = serde_json::to_value(model.spec.as_ref().context("pod spec")?)?;
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("nodeName");
    }
    let volumes = spec
        .pointer_mut("/volumes")
        .and_then(Value::as_array_mut)
        .context("volumes")?;
    let token = volumes
        .iter_mut()
        .find(|v| v.pointer("/secret/secretName") == Some(&json!(TOKEN_SECRET)))
        .context("the admin-token volume")?;
    token["secret"]["secretName"] = json!("poolpilot-admin-token-stale");
    Ok(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": STALE_POD,
            "labels": labels,
            "annotations": model.annotations(),
        },
        "spec": spec,
    }))
}

async fn run_ok(cmd: &mut tokio::process::Command) -> anyhow::Result<String> {
    poolpilot_e2e::cluster::run(cmd).await
}

/// `kubectl apply` of `policy` fails with every one of `needles` in its error, and stores
/// nothing.
async fn refused(stack: &Stack<'_>, policy: &Value, needles: &[&str]) -> anyhow::Result<()> {
    let name = policy["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_json::to_vec(policy)?)?;
    let asked = Instant::now();
    let answer = output(
        stack
            .kubectl()
            .args(["apply", "-n", stack.name(), "-f"])
            .arg(file.path()),
    )
    .await?;
    let took = asked.elapsed();
    let stderr = String::from_utf8_lossy(&answer.stderr).into_owned();
    assert!(
        !answer.status.success(),
        "an invalid policy was stored: {stderr}"
    );
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} missing from: {stderr}");
    }
    let policies: Api<poolpilot_api::ConnectionPolicy> = stack.ns().api();
    assert!(
        policies.get_opt(&name).await?.is_none(),
        "{name} was stored"
    );
    figure(
        SCENARIO,
        &format!("(a) {name} refused by kubectl apply seconds"),
        format!(
            "{:.2}: {}",
            took.as_secs_f64(),
            stderr.trim().replace('\n', " | ")
        ),
    );
    Ok(())
}
