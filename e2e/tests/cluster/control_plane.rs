//! The embedded control plane is a real Kubernetes: kube-controller-manager drives Deployments
//! and garbage collection, kubectl applies CRDs, RBAC refuses what an identity may not do, and
//! the version is the real one. And the tests' shared apply (`Cluster::apply`) holds when
//! several tests apply one new cluster-scoped object at once, as they do on a fresh cluster.

use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use poolpilot_e2e::cluster::{output, run};
use poolpilot_e2e::{Cluster, eventually, wait_for, with_namespace};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn deployment_creates_pods_and_garbage_collection_removes_them() -> anyhow::Result<()> {
    with_namespace("cp-deploy", async |ns| {
        let deployments: Api<Deployment> = ns.api();
        let replicasets: Api<ReplicaSet> = ns.api();
        let pods: Api<Pod> = ns.api();
        // No node carries the selected label, so the pods stay unscheduled and Pending.
        let pod_spec = json!({
            "nodeSelector": {"poolpilot.io/e2e-no-such-node": "true"},
            "containers": [{"name": "web", "image": "poolpilot/modelsim:local"}]
        });
        let created = ns.create_deployment("web", 2, pod_spec).await?;
        let deployment_uid = created.uid().expect("created objects have a uid");

        // The deployment controller creates a ReplicaSet owned by the Deployment ...
        let rs = eventually("a ReplicaSet owned by the Deployment", WAIT, || async {
            let list = replicasets
                .list(&ListParams::default().labels("app=web"))
                .await?;
            list.items
                .into_iter()
                .find(|rs| {
                    rs.owner_references()
                        .iter()
                        .any(|o| o.uid == deployment_uid)
                })
                .ok_or_else(|| anyhow::anyhow!("no ReplicaSet yet"))
        })
        .await?;
        let rs_uid = rs.uid().expect("uid");

        // ... and the replicaset controller creates its two Pods, which stay Pending: no node
        // matches their selector.
        let owned = eventually("two Pods owned by the ReplicaSet", WAIT, || async {
            let list = pods.list(&ListParams::default().labels("app=web")).await?;
            let owned: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| p.owner_references().iter().any(|o| o.uid == rs_uid))
                .collect();
            anyhow::ensure!(owned.len() == 2, "{} pods so far", owned.len());
            Ok(owned)
        })
        .await?;
        for pod in &owned {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            assert_eq!(
                phase,
                Some("Pending"),
                "pod {} should be Pending without a matching node",
                pod.name_any()
            );
        }

        // Deleting the Deployment lets the garbage collector remove the ReplicaSet and its Pods.
        deployments.delete("web", &DeleteParams::default()).await?;
        wait_for(
            &replicasets,
            &rs.name_any(),
            "garbage-collected",
            WAIT,
            |o: Option<&ReplicaSet>| o.is_none(),
        )
        .await?;
        for pod in &owned {
            wait_for(
                &pods,
                &pod.name_any(),
                "garbage-collected",
                WAIT,
                |o: Option<&Pod>| o.is_none(),
            )
            .await?;
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn deleting_a_namespace_completes() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let namespaces: Api<Namespace> = Api::all(cluster.client().await?);
    let name = format!("cp-nsdelete-{}", std::process::id());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}}))?,
        )
        .await?;
    // Something inside it for the namespace controller to clean up.
    let sas: Api<ServiceAccount> = Api::namespaced(cluster.client().await?, &name);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "leftover"}}))?,
    )
    .await?;
    namespaces.delete(&name, &DeleteParams::default()).await?;
    wait_for(
        &namespaces,
        &name,
        "deleted",
        WAIT,
        |o: Option<&Namespace>| o.is_none(),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn kubectl_applies_a_crd_and_serves_its_custom_resources() -> anyhow::Result<()> {
    with_namespace("cp-crd", async |ns| {
        let cluster = ns.cluster();
        let crd = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.e2e.poolpilot.io}
spec:
  group: e2e.poolpilot.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer, minimum: 1}
"#;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("crd.yaml"), crd)?;
        run(cluster.kubectl().arg("apply").arg("-f").arg(dir.path().join("crd.yaml"))).await?;
        run(cluster.kubectl().args(["wait", "--for=condition=Established", "--timeout=60s", "crd/widgets.e2e.poolpilot.io"]))
            .await?;

        let widget = format!("apiVersion: e2e.poolpilot.io/v1\nkind: Widget\nmetadata: {{name: w1, namespace: {}}}\nspec: {{size: 3}}\n", ns.name());
        std::fs::write(dir.path().join("w1.yaml"), &widget)?;
        run(cluster.kubectl().arg("apply").arg("-f").arg(dir.path().join("w1.yaml"))).await?;
        let size = run(cluster.kubectl().args(["get", "widget", "w1", "-n", ns.name(), "-o", "jsonpath={.spec.size}"])).await?;
        assert_eq!(size, "3");

        // The schema is enforced by the real apiserver.
        std::fs::write(dir.path().join("bad.yaml"), widget.replace("w1", "w2").replace("size: 3", "size: 0"))?;
        let out = output(cluster.kubectl().arg("apply").arg("-f").arg(dir.path().join("bad.yaml"))).await?;
        assert!(!out.status.success(), "a widget of size 0 must be refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("should be greater than or equal to 1"), "unexpected refusal: {stderr}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn rbac_refuses_a_service_account_without_rights() -> anyhow::Result<()> {
    with_namespace("cp-rbac", async |ns| {
        let cluster = ns.cluster();
        let n = ns.name();
        run(cluster
            .kubectl()
            .args(["create", "serviceaccount", "reader", "-n", n]))
        .await?;
        run(cluster.kubectl().args([
            "create",
            "role",
            "configmap-reader",
            "--verb=get,list",
            "--resource=configmaps",
            "-n",
            n,
        ]))
        .await?;
        run(cluster.kubectl().args([
            "create",
            "rolebinding",
            "reader",
            "--role=configmap-reader",
            &format!("--serviceaccount={n}:reader"),
            "-n",
            n,
        ]))
        .await?;
        let token = run(cluster
            .kubectl()
            .args(["create", "token", "reader", "-n", n]))
        .await?;
        let token = token.trim();

        // Allowed: what the Role grants.
        let allowed = run(cluster.kubectl_with_token(token).args([
            "get",
            "configmaps",
            "-n",
            n,
            "-o",
            "name",
        ]))
        .await?;
        assert!(
            allowed.contains("configmap/kube-root-ca.crt"),
            "root CA publisher should have run: {allowed}"
        );

        // Refused: Secrets, through kubectl and through kube-rs alike.
        let out = output(
            cluster
                .kubectl_with_token(token)
                .args(["get", "secrets", "-n", n]),
        )
        .await?;
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("Forbidden")
                && stderr.contains(&format!("system:serviceaccount:{n}:reader")),
            "expected an RBAC refusal naming the identity, got: {stderr}"
        );
        let secrets: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(cluster.client_with_token(token).await?, n);
        match secrets.list(&ListParams::default()).await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
            other => panic!("listing secrets should be forbidden, got {other:?}"),
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn applies_of_one_new_cluster_scoped_object_at_once_all_succeed_and_one_creates_it()
-> anyhow::Result<()> {
    // As the tests of this binary apply the operator's ClusterRole on a fresh cluster; a plain
    // `kubectl apply` of a new object by 8 at once fails for some with AlreadyExists.
    const APPLIES: usize = 8;
    const ROUNDS: usize = 5;
    let cluster = Cluster::shared().await?;
    let dir = tempfile::tempdir()?;
    let mut names = Vec::new();
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        let name = format!("e2e-apply-race-{}-{round}", std::process::id());
        let manifest = dir.path().join(format!("{name}.json"));
        std::fs::write(
            &manifest,
            serde_json::to_vec(&json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": name},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
            }))?,
        )?;
        names.push(format!("clusterrole/{name}"));
        let applies = (0..APPLIES).map(|_| cluster.apply(&manifest));
        outcomes.push(futures::future::join_all(applies).await);
    }
    run(cluster
        .kubectl()
        .args(["delete", "--ignore-not-found"])
        .args(&names))
    .await?;
    for (round, results) in outcomes.into_iter().enumerate() {
        let said: Vec<String> = results.into_iter().collect::<anyhow::Result<_>>()?;
        let created = said
            .iter()
            .filter(|s| s.trim_end().ends_with(" created"))
            .count();
        assert_eq!(
            created, 1,
            "round {round}: one apply creates, the others update: {said:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn version_is_the_real_kubernetes_version() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let info = cluster.client().await?.apiserver_version().await?;
    assert_eq!((info.major.as_str(), info.minor.as_str()), ("1", "37"));
    assert_eq!(info.git_version, "v1.37.2");
    let json: serde_json::Value =
        serde_json::from_str(&run(cluster.kubectl().args(["version", "-o", "json"])).await?)?;
    assert_eq!(json["serverVersion"]["gitVersion"], "v1.37.2");
    assert_eq!(json["clientVersion"]["gitVersion"], "v1.37.2");
    Ok(())
}
