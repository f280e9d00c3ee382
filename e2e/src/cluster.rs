//! The embedded control plane as tests see it: start-or-reuse one cluster per machine, hand out
//! admin clients and a version-matched kubectl.

use std::ffi::OsStr;
use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Deserialize;
use tokio::sync::OnceCell;

use crate::paths;

/// What `cluster up` writes to `DIR/ready` once the cluster serves.
#[derive(Clone, Debug, Deserialize)]
pub struct ReadyMarker {
    /// Process id of `cluster up`.
    pub pid: u32,
    /// The apiserver URL, `https://127.0.0.1:PORT` (`https://10.244.254.1:PORT` with the real
    /// node, the node link's end on this side).
    pub server: String,
    /// Path of the admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// Kubernetes version of the control plane.
    pub version: String,
    /// URL of the cluster's Prometheus (Kubernetes service discovery of annotated pods).
    #[serde(default)]
    pub prometheus: Option<String>,
    /// The node's name (`cluster up --node`: the kubelet, containerd and kube-proxy in a
    /// network namespace of their own); empty for a cluster started without one (`cluster up`
    /// without `--node`: its pods stay Pending).
    #[serde(default)]
    pub node: String,
}

/// A running embedded cluster.
#[derive(Clone, Debug)]
pub struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
    marker: ReadyMarker,
}

/// How long a cold `cluster up` may take on a loaded 2-core machine.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(240);

/// How many times [`Cluster::apply`] applies a manifest that lost a race to another apply.
pub const APPLY_ATTEMPTS: u32 = 5;

static SHARED: OnceCell<Cluster> = OnceCell::const_new();

impl Cluster {
    /// The cluster all tests of this machine share: the one already running in
    /// [`paths::cluster_dir`] (as `make cluster-up` leaves it), or a new one started for this test
    /// process, which stops when the process exits.
    pub async fn shared() -> anyhow::Result<&'static Cluster> {
        SHARED
            .get_or_try_init(|| Self::start_or_reuse(paths::cluster_dir(), paths::cluster_bin()))
            .await
    }

    /// The shared cluster, if this process has started or reused it already.
    pub fn shared_if_started() -> Option<&'static Cluster> {
        SHARED.get()
    }

    /// Reuses the cluster in `dir` if it answers, otherwise starts one there with `bin` and its
    /// node (running the images of `make node-images`). Either way, fails unless
    /// the host routes that keep the cluster's traffic on this machine are in force.
    pub async fn start_or_reuse(dir: PathBuf, bin: PathBuf) -> anyhow::Result<Cluster> {
        let cluster = Self::find_or_start(dir, &bin).await?;
        crate::hermetic::check_routes(&bin).await?;
        Ok(cluster)
    }

    async fn find_or_start(dir: PathBuf, bin: &Path) -> anyhow::Result<Cluster> {
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        if let Some(cluster) = Self::reuse(&dir, bin).await {
            return Ok(cluster);
        }
        // Several test binaries may start at once: one of them starts the cluster, the others
        // wait on the lock and then reuse it.
        let lock_path = dir.join("start.lock");
        let lock =
            File::create(&lock_path).with_context(|| format!("create {}", lock_path.display()))?;
        let lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock)).await??;
        if let Some(cluster) = Self::reuse(&dir, bin).await {
            drop(lock);
            return Ok(cluster);
        }
        let cluster = Self::start(&dir, bin).await;
        drop(lock);
        cluster
    }

    async fn reuse(dir: &Path, bin: &Path) -> Option<Cluster> {
        let marker: ReadyMarker =
            serde_json::from_slice(&std::fs::read(dir.join("ready")).ok()?).ok()?;
        let cluster = Cluster {
            dir: dir.to_owned(),
            bin: bin.to_owned(),
            marker,
        };
        // Register before checking: a cluster started for tests stays up while a client lives.
        register_client(dir).ok()?;
        let client = cluster.client().await.ok()?;
        client.apiserver_version().await.ok()?;
        Some(cluster)
    }

    async fn start(dir: &Path, bin: &Path) -> anyhow::Result<Cluster> {
        if !bin.exists() {
            bail!(
                "{} does not exist: build it with `make cluster` (or set POOLPILOT_CLUSTER_BIN)",
                bin.display()
            );
        }
        let prometheus = paths::prometheus_bin();
        let images = paths::node_images();
        let mut needed = vec![("Prometheus", &prometheus, "make cluster")];
        needed.extend(images.iter().map(|i| ("image", i, "make node-images")));
        for (what, path, how) in needed {
            if !path.exists() {
                bail!(
                    "the {what} {} does not exist: build it with `{how}`",
                    path.display()
                );
            }
        }
        register_client(dir)?;
        wait_for_previous_instance(dir).await;
        let log_path = dir.join("up.log");
        let log = File::create(&log_path)?;
        let mut child = tokio::process::Command::new(bin)
            .arg("up")
            .arg("--dir")
            .arg(dir)
            .arg("--watch-clients")
            .arg("--node")
            .args(images.iter().flat_map(|i| [OsStr::new("--image"), i.as_os_str()]))
            // The RuntimeClasses' handlers the tests use (`stack::nofile_template`).
            .args(["--node-nofile-class", "512", "--node-nofile-class", "4096"])
            .arg("--prometheus")
            .arg(&prometheus)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // The cluster outlives this test process while other registered clients live
            // (`--watch-clients`); it stops a few seconds after the last one.
            .kill_on_drop(false)
            .spawn()
            .with_context(|| format!("spawn {} up", bin.display()))?;
        let waited = tokio::time::timeout(STARTUP_TIMEOUT, async {
            loop {
                if let Some(status) = child.try_wait()? {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    bail!("`cluster up` exited with {status} before it was ready:\n{log}");
                }
                if let Some(cluster) = Self::reuse(dir, bin).await {
                    return Ok(cluster);
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
        .await;
        match waited {
            Ok(result) => result,
            Err(_) => {
                let _ = child.start_kill();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!("cluster not ready after {STARTUP_TIMEOUT:?}:\n{log}")
            }
        }
    }

    /// The state folder (`pki/`, `logs/`, `admin.kubeconfig`, `ready`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin kubeconfig path.
    pub fn kubeconfig(&self) -> &Path {
        &self.marker.kubeconfig
    }

    /// The apiserver URL.
    pub fn server(&self) -> &str {
        &self.marker.server
    }

    /// The cluster CA certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("pki/ca.crt")
    }

    /// The node's name: the kubelet with containerd in a network namespace of its own.
    pub fn node(&self) -> &str {
        &self.marker.node
    }

    /// The cluster's Prometheus URL.
    pub fn prometheus_url(&self) -> anyhow::Result<&str> {
        self.marker
            .prometheus
            .as_deref()
            .ok_or_else(|| anyhow::anyhow!("this cluster was started without Prometheus"))
    }

    /// Runs an instant PromQL query against the cluster's Prometheus; returns the result vector
    /// (each sample as `{metric: {labels}, value: [time, "value"]}`).
    pub async fn prometheus_query(&self, promql: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        let url = format!("{}/api/v1/query", self.prometheus_url()?);
        let body: serde_json::Value = reqwest::Client::new()
            .get(url)
            .query(&[("query", promql)])
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        anyhow::ensure!(
            body["status"] == "success",
            "query {promql:?} failed: {body}"
        );
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Waits until the instant query `promql` answers `want` as its first sample's value (the
    /// scrapes, the rule evaluations and the operator's writes take a moment to show).
    pub async fn wait_prometheus_value(
        &self,
        what: &str,
        promql: &str,
        want: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        crate::eventually(what, timeout, || async {
            let result = self.prometheus_query(promql).await?;
            let value = result
                .first()
                .and_then(|s| s["value"][1].as_str())
                .unwrap_or("none");
            anyhow::ensure!(value == want, "{promql} = {value}");
            Ok(())
        })
        .await
    }

    /// The Kubernetes version the control plane reports.
    pub fn version(&self) -> &str {
        &self.marker.version
    }

    /// A client with the admin identity (`system:masters`).
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        Ok(kube::Client::try_from(self.admin_config().await?)?)
    }

    /// A client that authenticates with a bearer token (a ServiceAccount's, say) and nothing else.
    pub async fn client_with_token(&self, token: &str) -> anyhow::Result<kube::Client> {
        let mut config = self.admin_config().await?;
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.to_owned().into()),
            ..Default::default()
        };
        Ok(kube::Client::try_from(config)?)
    }

    async fn admin_config(&self) -> anyhow::Result<kube::Config> {
        crate::install_crypto_provider();
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig())?;
        Ok(kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
    }

    /// Installs the ConnectionPolicy CRD as a user does (`kubectl apply -k manifests/crds`) and
    /// waits until it serves. Idempotent; callers that race on its creation retry the apply
    /// (the retry is an update).
    pub async fn install_crd(&self) -> anyhow::Result<()> {
        let crds = paths::workspace_root().join("manifests/crds");
        crate::eventually("the CRD is applied", Duration::from_secs(90), || async {
            run(self.kubectl().arg("apply").arg("-k").arg(&crds)).await
        })
        .await?;
        run(self.kubectl().args([
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/connectionpolicies.poolpilot.io",
        ]))
        .await?;
        Ok(())
    }

    /// `kubectl apply -f manifest`, as a user applies it (client-side apply), safe when several
    /// tests apply the same cluster-scoped objects at once (the operator's ClusterRole, its
    /// ValidatingAdmissionPolicy and binding): kubectl reads each object and creates it when it is
    /// absent, so of two applies that find a new object absent at the same moment, the slower
    /// one's create fails with `AlreadyExists` (8 applies at once of one new ClusterRole, 15
    /// times: 7 of the 120 failed so). That answer, or a `Conflict`, means another apply got there
    /// first: the apply runs again, now an update of what the other created (idempotent), up to
    /// [`APPLY_ATTEMPTS`] times. Any other failure fails at once. Returns kubectl's output.
    /// (The shared objects are never deleted by a test, which would race an apply's patch.)
    ///
    /// (`kubectl apply --server-side` had no such race in the same trial, 120 of 120 applied,
    /// but it is not how the manifests are documented to be applied, and it refuses to take
    /// over fields another manager set to other values.)
    pub async fn apply(&self, manifest: &Path) -> anyhow::Result<String> {
        let mut attempt = 1;
        loop {
            let out = output(self.kubectl().args(["apply", "-f"]).arg(manifest)).await?;
            if out.status.success() {
                return Ok(String::from_utf8(out.stdout)?);
            }
            let stderr = String::from_utf8_lossy(&out.stderr);
            let lost_a_race = stderr.contains("(AlreadyExists)") || stderr.contains("(Conflict)");
            if !lost_a_race || attempt == APPLY_ATTEMPTS {
                bail!(
                    "kubectl apply -f {} failed ({}, attempt {attempt} of {APPLY_ATTEMPTS}):\n{stderr}",
                    manifest.display(),
                    out.status
                );
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// [`Cluster::apply`] of `objects` as one `List`, in their order.
    pub async fn apply_list(&self, objects: &[serde_json::Value]) -> anyhow::Result<String> {
        let file = tempfile::NamedTempFile::new()?;
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
        std::fs::write(file.path(), serde_json::to_vec(&list)?)?;
        self.apply(file.path()).await
    }

    /// A `kubectl` command (the bundled, version-matched one) using the admin kubeconfig.
    pub fn kubectl(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig());
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        cmd
    }

    /// `kubectl port-forward` to `port` of `target` (`pod/NAME`) in `namespace`, on a port of
    /// 127.0.0.1 it picks: the running command (dropping it stops the forward) and the local
    /// `127.0.0.1:PORT`, once kubectl says it forwards.
    pub async fn port_forward(
        &self,
        namespace: &str,
        target: &str,
        port: u16,
    ) -> anyhow::Result<(tokio::process::Child, String)> {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = self
            .kubectl()
            .args(["port-forward", "-n", namespace, target, &format!(":{port}")])
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().context("kubectl's stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let local = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                // "Forwarding from 127.0.0.1:PORT -> 9901"
                if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
                    let local = rest.split_whitespace().next().unwrap_or_default();
                    return Ok(format!("127.0.0.1:{local}"));
                }
            }
            bail!("kubectl port-forward to {target}:{port} ended without forwarding")
        })
        .await
        .with_context(|| {
            format!("kubectl port-forward to {target}:{port} said nothing in 30 s")
        })??;
        // Keep reading what it prints, so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((child, local))
    }

    /// A `kubectl` command that talks to the apiserver as the holder of `token` and nothing else.
    pub fn kubectl_with_token(&self, token: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("kubectl")
            .arg("--kubeconfig=/dev/null")
            .arg(format!("--server={}", self.server()))
            .arg(format!(
                "--certificate-authority={}",
                self.ca_file().display()
            ))
            .arg(format!("--token={token}"));
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        cmd
    }
}

/// The source address a test gives the `lo` address `127.A.B.C` of one of its distinct clients
/// (hostile and leaking clients, per-address limits): `10.244.(128 + 2A + B).C`, since the
/// node's pods see only what is routed to them: `cluster up --node` makes 10.244.128.0/18 local
/// here (any address of it can be bound) and routes it back from the node (e2e/cluster/node.go).
pub fn client_source(lo: Ipv4Addr) -> Ipv4Addr {
    let [_, a, b, c] = lo.octets();
    assert!(
        lo.is_loopback() && a < 32 && b < 2,
        "{lo}: a client address the real node maps is 127.A.B.C with A < 32 and B < 2"
    );
    Ipv4Addr::new(10, 244, 128 + 2 * a + b, c)
}

/// Registers this process as a user of the cluster in `dir` (see `cluster up --watch-clients`).
fn register_client(dir: &Path) -> std::io::Result<()> {
    let clients = dir.join("clients");
    std::fs::create_dir_all(&clients)?;
    std::fs::write(clients.join(std::process::id().to_string()), b"")
}

/// An earlier `cluster up` in the same folder may still be stopping; a new one must not wipe its
/// state under it.
async fn wait_for_previous_instance(dir: &Path) {
    let Ok(pid) = std::fs::read_to_string(dir.join("up.pid")) else {
        return;
    };
    let Ok(pid) = pid.trim().parse::<i32>() else {
        return;
    };
    for _ in 0..60 {
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs a prepared command, failing with its stderr when it exits non-zero; returns stdout.
pub async fn run(cmd: &mut tokio::process::Command) -> anyhow::Result<String> {
    let out = output(cmd).await?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}):\n{}",
            cmd.as_std(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Runs a prepared command and returns its whole output, whatever its exit status.
pub async fn output(cmd: &mut tokio::process::Command) -> anyhow::Result<std::process::Output> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.output()
        .await
        .with_context(|| format!("run {:?}", cmd.as_std()))
}
