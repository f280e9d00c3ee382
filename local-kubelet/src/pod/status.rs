//! The pod status the local kubelet reports: phase, conditions (whose `lastTransitionTime` moves
//! only on a flip), init and main container statuses, the pod and host addresses; patched into
//! the API only when it changed.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::state::{ContainerState, restart_policy};

/// Publishes one pod's status.
pub(super) struct StatusPublisher {
    api: Api<Pod>,
    start_time: Timestamp,
    conditions: BTreeMap<&'static str, (bool, Timestamp)>,
    last_status: Option<Value>,
}

impl StatusPublisher {
    pub fn new(api: Api<Pod>) -> Self {
        Self {
            api,
            start_time: Timestamp::now(),
            conditions: BTreeMap::new(),
            last_status: None,
        }
    }

    fn set_condition(&mut self, kind: &'static str, status: bool) {
        match self.conditions.get(kind) {
            Some((current, _)) if *current == status => {}
            _ => {
                self.conditions.insert(kind, (status, Timestamp::now()));
            }
        }
    }

    /// Computes the pod status and patches it when it changed.
    pub async fn publish(
        &mut self,
        pod: &Pod,
        containers: &[ContainerState],
        volumes_ready: bool,
        ip: Ipv4Addr,
        host_ip: &str,
    ) {
        let mains: Vec<&ContainerState> = containers.iter().filter(|c| !c.init).collect();
        let inits_done = containers
            .iter()
            .filter(|c| c.init)
            .all(|c| c.finished.as_ref().is_some_and(|t| t.exit_code == 0));
        let all_ready = inits_done && mains.iter().all(|c| c.ready && c.run.is_some());
        let phase = phase(containers, restart_policy(pod));
        let statuses = |init: bool| -> Vec<Value> {
            containers
                .iter()
                .filter(|c| c.init == init)
                .map(container_status)
                .collect()
        };
        let (init_statuses, main_statuses) = (statuses(true), statuses(false));
        self.set_condition("PodScheduled", true);
        self.set_condition("PodReadyToStartContainers", volumes_ready);
        self.set_condition("Initialized", inits_done);
        self.set_condition("ContainersReady", all_ready);
        self.set_condition("Ready", all_ready);
        let conditions: Vec<Value> = self
            .conditions
            .iter()
            .map(|(kind, (status, at))| json!({"type": kind, "status": if *status { "True" } else { "False" }, "lastTransitionTime": at.to_string()}))
            .collect();
        let host = host_ip;
        let (ip, ips) = if ip.is_unspecified() {
            (Value::Null, json!([]))
        } else {
            (json!(ip.to_string()), json!([{"ip": ip.to_string()}]))
        };
        let status = json!({
            "phase": phase,
            "hostIP": host, "hostIPs": [{"ip": host}],
            "podIP": ip, "podIPs": ips,
            "startTime": self.start_time.to_string(),
            "conditions": conditions,
            "initContainerStatuses": init_statuses,
            "containerStatuses": main_statuses,
        });
        if self.last_status.as_ref() == Some(&status) {
            return;
        }
        match self
            .api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
        {
            Ok(_) => self.last_status = Some(status),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                tracing::warn!(pod = %pod.name_any(), error = %e, "status patch failed; will retry")
            }
        }
    }
}

/// The pod phase: `Failed` when an init container failed for good or every main container
/// finished and one failed, `Succeeded` when they all finished with 0, `Running` once one has
/// run, else `Pending`.
fn phase(containers: &[ContainerState], restart_policy: &str) -> &'static str {
    let mains: Vec<&ContainerState> = containers.iter().filter(|c| !c.init).collect();
    let init_failed_for_good = restart_policy == "Never"
        && containers
            .iter()
            .any(|c| c.init && c.finished.as_ref().is_some_and(|t| t.exit_code != 0));
    if init_failed_for_good {
        "Failed"
    } else if !mains.is_empty() && mains.iter().all(|c| c.finished.is_some()) {
        if mains
            .iter()
            .all(|c| c.finished.as_ref().is_some_and(|t| t.exit_code == 0))
        {
            "Succeeded"
        } else {
            "Failed"
        }
    } else if mains
        .iter()
        .any(|c| c.run.is_some() || c.restart_count > 0 || c.finished.is_some())
    {
        "Running"
    } else {
        "Pending"
    }
}

fn container_status(c: &ContainerState) -> Value {
    let terminated = |t: &ContainerStateTerminated| json!({"terminated": t});
    let state = match (&c.run, &c.finished, &c.waiting) {
        (Some(r), _, _) => json!({"running": {"startedAt": r.started_at.to_string()}}),
        (None, Some(t), _) => terminated(t),
        (None, None, Some((reason, message))) => {
            json!({"waiting": {"reason": reason, "message": message}})
        }
        (None, None, None) => json!({"waiting": {"reason": "ContainerCreating"}}),
    };
    let image = c.spec.image.clone().unwrap_or_default();
    json!({
        "name": c.spec.name,
        "image": image,
        "imageID": format!("local://{image}"),
        "containerID": c.run.as_ref().map(|r| format!("local://{}", r.pid)),
        "ready": c.ready && c.run.is_some(),
        "started": c.run.is_some(),
        "restartCount": c.restart_count,
        "state": state,
        "lastState": c.last_terminated.as_ref().map(terminated).unwrap_or_else(|| json!({})),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Container;
    use tokio::time::Instant;

    use super::*;
    use crate::pod::state::{ProbeContext, ProbeState, Run};

    fn container(init: bool) -> ContainerState {
        ContainerState {
            spec: Container {
                name: if init { "setup" } else { "main" }.into(),
                image: Some("poolpilot/modelsim".into()),
                ..Default::default()
            },
            init,
            run: None,
            restart_count: 0,
            last_terminated: None,
            finished: None,
            waiting: None,
            next_start: Instant::now(),
            backoff: Duration::from_secs(1),
            ready: false,
            readiness: ProbeState::default(),
            liveness: ProbeState::default(),
        }
    }

    fn running(mut c: ContainerState) -> ContainerState {
        c.run = Some(Run {
            id: 1,
            pid: 4242,
            started_at: Timestamp::UNIX_EPOCH,
            started: Instant::now(),
            killed_for: None,
            probe_context: Arc::new(ProbeContext {
                ip: "10.244.0.7".into(),
                ports: BTreeMap::new(),
                env: BTreeMap::new(),
            }),
        });
        c
    }

    fn exited(mut c: ContainerState, code: i32) -> ContainerState {
        c.finished = Some(ContainerStateTerminated {
            exit_code: code,
            ..Default::default()
        });
        c
    }

    #[test]
    fn a_pod_is_pending_until_a_main_container_has_run() {
        assert_eq!(phase(&[container(false)], "Always"), "Pending");
        assert_eq!(
            phase(&[running(container(true)), container(false)], "Always"),
            "Pending",
            "an init container running is not the pod running"
        );
        assert_eq!(phase(&[running(container(false))], "Always"), "Running");
        let mut restarting = container(false);
        restarting.restart_count = 1;
        assert_eq!(
            phase(&[restarting], "Always"),
            "Running",
            "between restarts"
        );
    }

    #[test]
    fn a_pod_whose_main_containers_all_finished_succeeded_only_if_all_exited_zero() {
        assert_eq!(
            phase(
                &[exited(container(false), 0), exited(container(false), 0)],
                "Never"
            ),
            "Succeeded"
        );
        assert_eq!(
            phase(
                &[exited(container(false), 0), exited(container(false), 3)],
                "Never"
            ),
            "Failed"
        );
        assert_eq!(
            phase(
                &[exited(container(false), 0), running(container(false))],
                "Never"
            ),
            "Running",
            "one still running"
        );
    }

    #[test]
    fn a_failed_init_container_fails_the_pod_only_when_it_is_never_restarted() {
        let pod = [exited(container(true), 1), container(false)];
        assert_eq!(phase(&pod, "Never"), "Failed");
        assert_eq!(phase(&pod, "OnFailure"), "Pending");
        assert_eq!(phase(&pod, "Always"), "Pending");
    }

    #[test]
    fn a_container_status_reports_its_state_and_readiness_only_while_running() {
        let mut c = running(container(false));
        c.ready = true;
        let status = container_status(&c);
        assert_eq!(
            status["state"]["running"]["startedAt"],
            "1970-01-01T00:00:00Z"
        );
        assert_eq!(status["containerID"], "local://4242");
        assert_eq!(status["ready"], true);
        assert_eq!(status["lastState"], json!({}));

        let mut waiting = container(false);
        waiting.ready = true;
        waiting.waiting = Some(("CrashLoopBackOff".into(), "back-off 2s".into()));
        let status = container_status(&waiting);
        assert_eq!(status["state"]["waiting"]["reason"], "CrashLoopBackOff");
        assert_eq!(status["ready"], false, "not ready without a process");
        assert_eq!(status["containerID"], Value::Null);

        let done = container_status(&exited(container(false), 0));
        assert_eq!(done["state"]["terminated"]["exitCode"], 0);
    }
}
