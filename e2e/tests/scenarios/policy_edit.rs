//! Scenario 9, policy edit and delete: `clients.maxConcurrency` of an applied policy changed with
//! `kubectl apply` reaches every gateway pod's `GET /v1/limits` within a few seconds (measured per
//! pod by polling every 50 ms); `kubectl delete` of the policy removes its backends from every
//! gateway (another policy's backends stay), its ConfigMap `models-limits` is garbage-collected,
//! and requests for its model get `404 no_route` from the gateways.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::eventually;
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, POLICY, StackSpec, WAIT, client_max_concurrency, quick_policy, set,
    with_stack,
};
use serde_json::{Value, json};
use tokio::time::Instant;

const SCENARIO: &str = "policy-edit";
/// The second policy, whose backend must survive the deletion of the first.
const OTHER: &str = "others";
/// How long every pod has to apply an edit: "a few seconds", wide for a loaded 2-core machine.
const APPLY_BUDGET: Duration = Duration::from_secs(10);

/// A policy of the quick sample with one backend of the sample, autoscale off (targets at their
/// upper bound, so that only the edit changes the documents).
fn policy(name: &str, backend: &str) -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    set(&mut p, "/metadata/name", json!(name))?;
    let backends: Vec<Value> = p["spec"]["backends"]
        .as_array()
        .context("backends")?
        .iter()
        .filter(|b| b["name"] == backend)
        .cloned()
        .collect();
    anyhow::ensure!(backends.len() == 1, "{backend} in the sample");
    set(&mut p, "/spec/backends", json!(backends))?;
    set(&mut p, "/spec/autoscale/enabled", json!(false))?;
    // Each pod runs the limit as written: the edit under test, not the fleet division.
    set(&mut p, "/spec/clients/scope", json!("PerPod"))?;
    // The sample's allowlist and slow-call demotion play no part here.
    if let Some(clients) = p["spec"]["clients"].as_object_mut() {
        clients.remove("overrides");
        clients.remove("slowCalls");
    }
    Ok(p)
}

/// One chat call for `model` through a gateway: (status, the gateway's `error.code` if any).
async fn call(gateway: &GatewayPod, model: &str) -> anyhow::Result<(u16, Option<String>)> {
    let response = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", gateway.proxy()))
        .bearer_auth("policy-edit")
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        .timeout(Duration::from_secs(30))
        .send()
        .await?;
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    Ok((status, body["error"]["code"].as_str().map(str::to_owned)))
}

#[tokio::test]
async fn policy_edit_reaches_every_gateway_and_delete_removes_its_backends() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![
            BackendSpec::new("model-a", 2, 16),
            BackendSpec::new("model-b", 1, 16),
        ],
        ..StackSpec::default()
    };
    with_stack("edit", spec, async |stack| {
        let mut models = policy(POLICY, "model-a")?;
        let others = policy(OTHER, "model-b")?;
        stack.apply(&models).await?;
        stack.apply(&others).await?;
        stack.wait_gateways(3).await?;
        stack
            .wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;
        stack
            .wait_condition(OTHER, "RolledOut", "True", WAIT)
            .await?;
        let docs = stack
            .wait_limits(
                "every gateway runs both policies at maxConcurrency 8",
                3,
                WAIT,
                |l| {
                    anyhow::ensure!(
                        client_max_concurrency(l, "model-a") == Some(8)
                            && client_max_concurrency(l, "model-b") == Some(8),
                        "backends {:?}, client policies {:?}",
                        l.backends.iter().map(|b| &b.name).collect::<Vec<_>>(),
                        l.client_policies
                    );
                    Ok(())
                },
            )
            .await?;
        let gateways: Vec<GatewayPod> = docs.into_iter().map(|(g, _)| g).collect();
        for g in &gateways {
            assert_eq!(
                call(g, "model-a").await?.0,
                200,
                "model-a through {}",
                g.name
            );
        }

        // Edit: maxConcurrency 8 → 5, applied with kubectl; every pod polled every 50 ms.
        set(&mut models, "/spec/clients/maxConcurrency", json!(5))?;
        let edited = Instant::now();
        stack.apply(&models).await?;
        let applied = Instant::now();
        let kubectl_time = applied - edited;
        let times = futures::future::try_join_all(gateways.iter().map(|g| {
            g.wait_applied(
                edited,
                Duration::from_millis(50),
                APPLY_BUDGET + kubectl_time,
                |l| client_max_concurrency(l, "model-a") == Some(5),
            )
        }))
        .await?;
        for (g, t) in gateways.iter().zip(&times) {
            figure(
                SCENARIO,
                &format!("maxConcurrency edit applied on {} ms", g.name),
                t.as_millis(),
            );
        }
        let slowest = times.iter().max().copied().unwrap_or_default();
        // The object is stored before kubectl returns: the product's reaction lies between the
        // time from kubectl's return and the time from its start (which includes the kubectl
        // process on a loaded machine). The budget holds for the former.
        let after_apply = slowest.saturating_sub(kubectl_time);
        figure(SCENARIO, "kubectl apply ms", kubectl_time.as_millis());
        figure(
            SCENARIO,
            "kubectl apply start to last pod ms",
            slowest.as_millis(),
        );
        figure(
            SCENARIO,
            "kubectl apply return to last pod ms",
            after_apply.as_millis(),
        );
        assert!(
            after_apply <= APPLY_BUDGET,
            "every pod applies the edit within {APPLY_BUDGET:?} of the apply: {times:?} from \
             its start, kubectl took {kubectl_time:?}"
        );
        // The other policy's limit is untouched, and the status follows the edit.
        for g in &gateways {
            let l = g.limits().await?;
            assert_eq!(
                client_max_concurrency(&l, "model-b"),
                Some(8),
                "{} model-b",
                g.name
            );
        }
        stack
            .wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;

        // Delete: its backends leave every gateway, the ConfigMap goes, its model is no route.
        let configmaps: Api<ConfigMap> = stack.ns().api();
        anyhow::ensure!(
            configmaps.get_opt("models-limits").await?.is_some(),
            "the policy's ConfigMap exists before the delete"
        );
        let deleting = Instant::now();
        run(stack
            .kubectl()
            .args(["delete", "-n", stack.name(), "connectionpolicy", POLICY]))
        .await?;
        let deleted = deleting.elapsed();
        let removal = futures::future::try_join_all(gateways.iter().map(|g| {
            g.wait_applied(deleting, Duration::from_millis(50), WAIT, |l| {
                l.backends.iter().all(|b| b.name != "model-a")
            })
        }))
        .await?;
        for (g, t) in gateways.iter().zip(&removal) {
            figure(
                SCENARIO,
                &format!("model-a removed from {} ms", g.name),
                t.as_millis(),
            );
        }
        figure(SCENARIO, "kubectl delete ms", deleted.as_millis());
        figure(
            SCENARIO,
            "delete to last pod ms",
            removal
                .iter()
                .max()
                .copied()
                .unwrap_or_default()
                .as_millis(),
        );
        for g in &gateways {
            let l = g.limits().await?;
            let names: Vec<&str> = l.backends.iter().map(|b| b.name.as_str()).collect();
            assert_eq!(
                names,
                ["model-b"],
                "{} keeps the other policy's backend",
                g.name
            );
            assert!(
                l.client_policies.iter().all(|c| c.name != POLICY),
                "{} dropped the deleted policy's client policy: {:?}",
                g.name,
                l.client_policies
            );
        }
        let gone = eventually("ConfigMap models-limits is gone", WAIT, || async {
            anyhow::ensure!(
                configmaps.get_opt("models-limits").await?.is_none(),
                "models-limits still exists"
            );
            Ok(deleting.elapsed())
        })
        .await?;
        figure(SCENARIO, "delete to ConfigMap gone ms", gone.as_millis());
        for g in &gateways {
            let (status, error) = call(g, "model-a").await?;
            assert_eq!(
                (status, error.as_deref()),
                (404, Some("no_route")),
                "model-a through {} after the delete",
                g.name
            );
            assert_eq!(
                call(g, "model-b").await?.0,
                200,
                "model-b through {}",
                g.name
            );
        }
        figure(
            SCENARIO,
            "model-a after delete",
            "404 no_route on 3/3 gateways",
        );
        Ok(())
    })
    .await
}
