//! Policy fixtures of the scenarios: the sample ConnectionPolicy and its test pacings, edits by
//! JSON pointer, and what a gateway's limits document says of a backend.

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::limits::GatewayLimits;
use serde_json::{Value, json};

use crate::paths::workspace_root;

/// The sample policy (`manifests/samples/connectionpolicy.yaml`) as JSON, to edit and apply.
pub fn sample_policy() -> anyhow::Result<Value> {
    let path = workspace_root().join("manifests/samples/connectionpolicy.yaml");
    Ok(serde_norway::from_str(&std::fs::read_to_string(path)?)?)
}

/// The quick policy reduced to `backend`, deciding every `interval` within [`min`, `max`],
/// and shrinking in one step after a 10 s stabilization window: where a load test finds the
/// target at `min` soon after a light load starts.
pub fn one_backend_policy(
    backend: &str,
    interval: Duration,
    min: u32,
    max: u32,
) -> anyhow::Result<Value> {
    let mut policy = quick_policy()?;
    only_backend(&mut policy, backend)?;
    set(
        &mut policy,
        "/spec/autoscale/interval",
        json!(format!("{}s", interval.as_secs())),
    )?;
    set(&mut policy, "/spec/autoscale/min", json!(min))?;
    set(&mut policy, "/spec/autoscale/max", json!(max))?;
    set(
        &mut policy,
        "/spec/autoscale/scaleDown",
        json!({"stabilizationWindow": "10s", "maxStepPercent": 100}),
    )?;
    Ok(policy)
}

/// The sample policy paced for tests: decisions every 5 s, scale-down stabilized over 30 s,
/// canary pods acknowledged then the rest at once (no verification intervals).
pub fn quick_policy() -> anyhow::Result<Value> {
    let mut policy = sample_policy()?;
    set(&mut policy, "/spec/autoscale/interval", json!("5s"))?;
    set(
        &mut policy,
        "/spec/autoscale/scaleDown",
        json!({"stabilizationWindow": "30s", "maxStepPercent": 20}),
    )?;
    set(
        &mut policy,
        "/spec/rollout",
        json!({"strategy": "Progressive", "canaryPods": 1, "verifyIntervals": 0}),
    )?;
    Ok(policy)
}

/// Sets the field at a JSON pointer (`/spec/autoscale/min`) of a policy; its parent must exist.
pub fn set(object: &mut Value, pointer: &str, value: Value) -> anyhow::Result<()> {
    let (parent, key) = pointer.rsplit_once('/').context("a JSON pointer")?;
    let parent = object
        .pointer_mut(parent)
        .with_context(|| format!("no {parent} in the object"))?;
    match parent {
        Value::Object(map) => {
            map.insert(key.to_owned(), value);
        }
        Value::Array(items) => {
            let i: usize = key.parse().context("an array index")?;
            *items.get_mut(i).with_context(|| format!("no {pointer}"))? = value;
        }
        _ => anyhow::bail!("{parent} is neither an object nor an array"),
    }
    Ok(())
}

/// Backend `backend`'s per-pod share in a gateway's limits.
pub fn share(limits: &GatewayLimits, backend: &str) -> anyhow::Result<u32> {
    Ok(limits
        .backends
        .iter()
        .find(|b| b.name == backend)
        .with_context(|| format!("no {backend} in the limits"))?
        .pool
        .max_connections_per_endpoint)
}

/// The `clients.maxConcurrency` in force for `backend` in a gateway's limits, if it runs the
/// backend.
pub fn client_max_concurrency(limits: &GatewayLimits, backend: &str) -> Option<u32> {
    let b = limits.backends.iter().find(|b| b.name == backend)?;
    let name = b.client_policy.as_deref()?;
    limits
        .client_policies
        .iter()
        .find(|c| c.name == name)
        .map(|c| c.max_concurrency)
}

/// Keeps only backend `name` in a policy's `spec.backends`.
pub fn only_backend(policy: &mut Value, name: &str) -> anyhow::Result<()> {
    let backends = policy
        .pointer_mut("/spec/backends")
        .and_then(Value::as_array_mut)
        .context("spec.backends")?;
    backends.retain(|b| b["name"] == name);
    anyhow::ensure!(!backends.is_empty(), "no backend {name} in the policy");
    Ok(())
}
