//! The worker loop of one pod on the local node, from binding to deletion: its pod IP (on the
//! loopback interface), volumes, container processes (init containers first), restarts with
//! back-off, readiness and liveness probes, and graceful termination.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, ContainerStateTerminated, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Preconditions};
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::spec::SpecInputs;
use super::state::{ContainerState, ProbeContext, ProbeState, Run, restart_policy};
use super::status::StatusPublisher;
use crate::context::KubeletContext;
use crate::logs;
use crate::probe::{self, ProbeTiming};
use crate::process;
use crate::volumes::PodVolumes;

/// What a container's processes and probes report back to the pod worker.
#[derive(Debug)]
enum Report {
    Exited {
        container: usize,
        run: u64,
        code: i32,
    },
    Probed {
        container: usize,
        run: u64,
        kind: ProbeKind,
        result: Result<(), String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProbeKind {
    Readiness,
    Liveness,
}

/// The pod worker's whole state.
struct PodWorker {
    ctx: Arc<KubeletContext>,
    pod: Pod,
    api: Api<Pod>,
    dir: PathBuf,
    ip: Ipv4Addr,
    volumes: PodVolumes,
    volume_error: Option<String>,
    next_volume_sync: Instant,
    containers: Vec<ContainerState>,
    status: StatusPublisher,
    run_ids: u64,
    reports_tx: mpsc::UnboundedSender<Report>,
}

/// Runs one pod until it is deleted. `updates` carries the latest version of the pod, `None`
/// once it is gone from the API.
pub async fn run_pod(ctx: Arc<KubeletContext>, mut updates: watch::Receiver<Option<Pod>>) {
    let Some(pod) = updates.borrow_and_update().clone() else {
        return;
    };
    let (reports_tx, mut reports) = mpsc::unbounded_channel();
    let mut worker = PodWorker::new(ctx, pod, reports_tx);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    // Whether the pod is still in the API, terminating, and waits for our last word.
    let terminating = loop {
        tokio::select! {
            changed = updates.changed() => {
                let latest = if changed.is_ok() { updates.borrow_and_update().clone() } else { None };
                match latest {
                    Some(pod) if pod.metadata.deletion_timestamp.is_none() => worker.pod = pod,
                    Some(pod) => {
                        worker.pod = pod;
                        worker.terminate(&mut reports).await;
                        break true;
                    }
                    None => {
                        worker.terminate(&mut reports).await;
                        break false;
                    }
                }
            }
            Some(report) = reports.recv() => worker.handle(report),
            _ = tick.tick() => worker.step().await,
        }
        worker.publish_status().await;
    };
    // As a kubelet tears down the pod sandbox: the address is gone before the pod leaves the
    // API, so whoever sees the pod gone finds its address unreachable.
    worker
        .ctx
        .release_ip(worker.pod.uid().as_deref().unwrap_or_default());
    if terminating {
        worker.finalize_deletion().await;
    }
    let _ = std::fs::remove_dir_all(worker.dir.join("volumes"));
}

impl PodWorker {
    fn new(ctx: Arc<KubeletContext>, pod: Pod, reports_tx: mpsc::UnboundedSender<Report>) -> Self {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let dir = ctx.state_dir.join("pods").join(&ns).join(&name);
        let _ = std::fs::create_dir_all(&dir);
        let uid = pod.uid().unwrap_or_default();
        let previous_ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        // Unspecified until an address could be put on the host: `step` retries, the pod waits.
        let ip = ctx
            .allocate_ip(&uid, previous_ip)
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let spec = pod.spec.clone().unwrap_or_default();
        let now = Instant::now();
        let state = |spec: Container, init: bool| ContainerState {
            spec,
            init,
            run: None,
            restart_count: 0,
            last_terminated: None,
            finished: None,
            waiting: Some(("ContainerCreating".into(), String::new())),
            next_start: now,
            backoff: ctx.backoff.0,
            ready: false,
            readiness: ProbeState::default(),
            liveness: ProbeState::default(),
        };
        let containers = spec
            .init_containers
            .unwrap_or_default()
            .into_iter()
            .map(|c| state(c, true))
            .chain(spec.containers.into_iter().map(|c| state(c, false)))
            .collect();
        let api = Api::namespaced(ctx.client.clone(), &ns);
        let status = StatusPublisher::new(api.clone());
        Self {
            volumes: PodVolumes::new(dir.join("volumes")),
            volume_error: Some("volumes not rendered yet".into()),
            next_volume_sync: now,
            ctx,
            pod,
            api,
            dir,
            ip,
            containers,
            status,
            run_ids: 0,
            reports_tx,
        }
    }

    /// What this pod's process specs are built from.
    fn spec_inputs(&self) -> SpecInputs<'_> {
        SpecInputs {
            pod: &self.pod,
            ip: self.ip,
            node_name: &self.ctx.node_name,
            host_ip: &self.ctx.host_ip,
            apiserver: &self.ctx.apiserver,
            images: &self.ctx.images,
            volumes: &self.volumes,
            dir: &self.dir,
            objects: &self.ctx.volumes,
        }
    }

    /// Periodic work: keep volumes in sync, start what is due, schedule probes.
    async fn step(&mut self) {
        let now = Instant::now();
        if self.ip.is_unspecified() {
            let uid = self.pod.uid().unwrap_or_default();
            match self.ctx.allocate_ip(&uid, None) {
                Some(ip) => self.ip = ip,
                None => {
                    let why = "no pod address: adding one to the loopback interface failed \
                               (the local kubelet needs root and iproute2's `ip`)";
                    for c in self.containers.iter_mut().filter(|c| c.run.is_none()) {
                        c.waiting = Some(("ContainerCreating".into(), why.into()));
                    }
                    return;
                }
            }
        }
        if now >= self.next_volume_sync {
            self.next_volume_sync = now + Duration::from_secs(1);
            self.volume_error = self
                .volumes
                .sync(&self.pod, &self.ctx.volumes)
                .await
                .err()
                .map(|e| e.to_string());
        }
        if let Some(err) = &self.volume_error {
            for c in self
                .containers
                .iter_mut()
                .filter(|c| c.run.is_none() && c.finished.is_none())
            {
                c.waiting = Some(("ContainerCreating".into(), err.clone()));
            }
            return;
        }
        // Init containers run one at a time, in order; the others wait for all of them.
        let init_pending = self
            .containers
            .iter()
            .position(|c| c.init && c.finished.as_ref().is_none_or(|t| t.exit_code != 0));
        let startable: Vec<usize> = match init_pending {
            Some(i) => vec![i],
            None => (0..self.containers.len())
                .filter(|&i| !self.containers[i].init)
                .collect(),
        };
        for i in startable {
            let c = &self.containers[i];
            if c.run.is_none() && c.finished.is_none() && now >= c.next_start {
                self.start(i);
            }
        }
        self.schedule_probes(now);
    }

    fn start(&mut self, index: usize) {
        match self
            .spec_inputs()
            .process_spec(&self.containers[index].spec)
        {
            Ok(spec) => match process::spawn(&spec) {
                Ok(mut child) => {
                    self.run_ids += 1;
                    let run = self.run_ids;
                    let pid = child.id().unwrap_or_default();
                    self.record_logs(index, &mut child);
                    let tx = self.reports_tx.clone();
                    tokio::spawn(async move {
                        let code = process::exit_code(child.wait().await);
                        let _ = tx.send(Report::Exited {
                            container: index,
                            run,
                            code,
                        });
                    });
                    self.ctx.track_pid(pid, true);
                    let c = &mut self.containers[index];
                    let ports = c
                        .spec
                        .ports
                        .iter()
                        .flatten()
                        .filter_map(|p| {
                            Some((p.name.clone()?, u16::try_from(p.container_port).ok()?))
                        })
                        .collect();
                    let probe_context = Arc::new(ProbeContext {
                        ip: self.ip.to_string(),
                        ports,
                        env: spec.env,
                    });
                    c.run = Some(Run {
                        id: run,
                        pid,
                        started_at: Timestamp::now(),
                        started: Instant::now(),
                        killed_for: None,
                        probe_context,
                    });
                    c.waiting = None;
                    c.ready = false;
                    let first_probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
                        p.as_ref()
                            .map(|p| Instant::now() + ProbeTiming::of(p).initial_delay)
                    };
                    c.readiness = ProbeState {
                        next: first_probe(&c.spec.readiness_probe),
                        ..Default::default()
                    };
                    c.liveness = ProbeState {
                        next: first_probe(&c.spec.liveness_probe),
                        ..Default::default()
                    };
                    tracing::info!(pod = %self.pod.name_any(), container = %c.spec.name, pid, "started");
                }
                Err(e) => self.start_failed(index, e.reason(), e.to_string()),
            },
            Err(e) => self.start_failed(index, e.reason(), e.to_string()),
        }
    }

    /// Copies the new instance's output into the container's log (the previous instance's
    /// becomes its previous log) and registers it for followers of `kubectl logs -f`.
    fn record_logs(&self, index: usize, child: &mut tokio::process::Child) {
        let name = self.containers[index].spec.name.clone();
        let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
            return;
        };
        match logs::LogFile::open(&self.dir, &name) {
            Ok(log) => {
                let key = (
                    self.pod.namespace().unwrap_or_default(),
                    self.pod.name_any(),
                    name,
                );
                let ended = log.record(out, err);
                self.ctx.instances.lock().insert(key, ended);
            }
            Err(e) => {
                tracing::warn!(pod = %self.pod.name_any(), container = %name, error = %e, "cannot open the container's log; its output is dropped");
                // Never leave the process writing into a pipe nobody reads.
                tokio::spawn(async move {
                    let (mut a, mut b) = (tokio::io::sink(), tokio::io::sink());
                    let _ = tokio::join!(
                        tokio::io::copy(&mut out, &mut a),
                        tokio::io::copy(&mut err, &mut b)
                    );
                });
            }
        }
    }

    fn start_failed(&mut self, index: usize, reason: &str, message: String) {
        let max = self.ctx.backoff.1;
        let c = &mut self.containers[index];
        tracing::warn!(pod = %self.pod.name_any(), container = %c.spec.name, %message, "cannot start");
        c.waiting = Some((reason.to_owned(), message));
        c.next_start = Instant::now() + c.backoff;
        c.backoff = (c.backoff * 2).min(max);
    }

    fn schedule_probes(&mut self, now: Instant) {
        for (index, c) in self.containers.iter_mut().enumerate() {
            let Some(run) = &c.run else { continue };
            if c.spec.readiness_probe.is_none() && !c.ready {
                c.ready = true;
            }
            for (kind, probe, state) in [
                (
                    ProbeKind::Readiness,
                    c.spec.readiness_probe.as_ref(),
                    &mut c.readiness,
                ),
                (
                    ProbeKind::Liveness,
                    c.spec.liveness_probe.as_ref(),
                    &mut c.liveness,
                ),
            ] {
                let Some(probe) = probe else { continue };
                if state.in_flight || state.next.is_none_or(|next| now < next) {
                    continue;
                }
                state.in_flight = true;
                state.next = Some(now + ProbeTiming::of(probe).period);
                let (tx, probe, context, run) = (
                    self.reports_tx.clone(),
                    probe.clone(),
                    run.probe_context.clone(),
                    run.id,
                );
                tokio::spawn(async move {
                    let result =
                        probe::run(&probe, &context.ip, &context.ports, &context.env).await;
                    let _ = tx.send(Report::Probed {
                        container: index,
                        run,
                        kind,
                        result,
                    });
                });
            }
        }
    }

    fn handle(&mut self, report: Report) {
        let pod_name = self.pod.name_any();
        let policy = restart_policy(&self.pod).to_owned();
        let (initial_backoff, max_backoff) = self.ctx.backoff;
        match report {
            Report::Exited {
                container,
                run,
                code,
            } => {
                let c = &mut self.containers[container];
                let Some(r) = c.run.take_if(|r| r.id == run) else {
                    return;
                };
                self.ctx.track_pid(r.pid, false);
                let terminated = ContainerStateTerminated {
                    exit_code: code,
                    reason: Some(r.killed_for.clone().unwrap_or_else(|| {
                        if code == 0 {
                            "Completed".into()
                        } else {
                            "Error".into()
                        }
                    })),
                    message: r.killed_for.clone(),
                    started_at: Some(Time(r.started_at)),
                    finished_at: Some(Time(Timestamp::now())),
                    ..Default::default()
                };
                tracing::info!(pod = %pod_name, container = %c.spec.name, code, "exited");
                c.ready = false;
                let restart = match policy.as_str() {
                    "Never" => false,
                    "OnFailure" => code != 0,
                    _ => !c.init || code != 0,
                };
                if restart {
                    if r.started.elapsed() > Duration::from_secs(30) {
                        c.backoff = initial_backoff;
                    }
                    c.restart_count += 1;
                    c.next_start = Instant::now() + c.backoff;
                    c.waiting = Some((
                        "CrashLoopBackOff".into(),
                        format!(
                            "back-off {:?} restarting failed container={} pod={pod_name}",
                            c.backoff, c.spec.name
                        ),
                    ));
                    c.backoff = (c.backoff * 2).min(max_backoff);
                    c.last_terminated = Some(terminated);
                } else {
                    c.finished = Some(terminated);
                }
            }
            Report::Probed {
                container,
                run,
                kind,
                result,
            } => {
                let c = &mut self.containers[container];
                let Some(r) = c.run.as_mut().filter(|r| r.id == run) else {
                    return;
                };
                let (probe, state) = match kind {
                    ProbeKind::Readiness => (c.spec.readiness_probe.as_ref(), &mut c.readiness),
                    ProbeKind::Liveness => (c.spec.liveness_probe.as_ref(), &mut c.liveness),
                };
                let Some(timing) = probe.map(ProbeTiming::of) else {
                    return;
                };
                state.in_flight = false;
                match &result {
                    Ok(()) => {
                        state.successes += 1;
                        state.failures = 0;
                    }
                    Err(why) => {
                        state.failures += 1;
                        state.successes = 0;
                        tracing::debug!(pod = %pod_name, container = %c.spec.name, ?kind, %why, "probe failed");
                    }
                }
                match kind {
                    ProbeKind::Readiness => {
                        if state.successes >= timing.success_threshold {
                            c.ready = true;
                        } else if state.failures >= timing.failure_threshold {
                            c.ready = false;
                        }
                    }
                    ProbeKind::Liveness => {
                        if state.failures >= timing.failure_threshold && r.killed_for.is_none() {
                            let why = result.err().unwrap_or_default();
                            tracing::info!(pod = %pod_name, container = %c.spec.name, %why, "liveness probe failed, restarting");
                            r.killed_for = Some(format!("liveness probe failed: {why}"));
                            process::signal_group(r.pid, Signal::SIGKILL);
                        }
                    }
                }
            }
        }
    }

    /// Stops every process: SIGTERM, then SIGKILL after the pod's grace period.
    async fn terminate(&mut self, reports: &mut mpsc::UnboundedReceiver<Report>) {
        let grace = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30)
            .clamp(0, 120) as u64;
        for c in &self.containers {
            if let Some(r) = &c.run {
                process::signal_group(r.pid, Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(grace);
        while self.containers.iter().any(|c| c.run.is_some()) {
            match tokio::time::timeout_at(deadline, reports.recv()).await {
                Ok(Some(report)) => self.handle(report),
                Ok(None) => break,
                Err(_) => {
                    for c in &self.containers {
                        if let Some(r) = &c.run {
                            process::signal_group(r.pid, Signal::SIGKILL);
                        }
                    }
                    // The exits arrive shortly; a restart they may schedule never happens.
                    let _ = tokio::time::timeout(Duration::from_secs(5), async {
                        while self.containers.iter().any(|c| c.run.is_some()) {
                            match reports.recv().await {
                                Some(report) => self.handle(report),
                                None => break,
                            }
                        }
                    })
                    .await;
                    break;
                }
            }
        }
    }

    /// The kubelet's last word on a deleted pod: remove it from the API for good.
    async fn finalize_deletion(&self) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: self.pod.uid(),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.api.delete(&self.pod.name_any(), &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                tracing::warn!(pod = %self.pod.name_any(), error = %e, "could not finalize deletion")
            }
        }
    }

    /// Reports the pod's status (patched only when it changed).
    async fn publish_status(&mut self) {
        self.status
            .publish(
                &self.pod,
                &self.containers,
                self.volume_error.is_none(),
                self.ip,
                &self.ctx.host_ip,
            )
            .await;
    }
}
