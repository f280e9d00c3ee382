//! What the scenarios read of a pod's status.

use std::net::IpAddr;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;

/// Whether the pod's Ready condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's IP.
pub fn pod_ip(pod: &Pod) -> anyhow::Result<IpAddr> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .with_context(|| format!("pod {} has no IP", pod.name_any()))?
        .parse()
        .context("pod IP")
}
