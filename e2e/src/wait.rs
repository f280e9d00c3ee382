//! Waiting in tests: for a Kubernetes object to reach a condition, or for any check to pass,
//! always with a deadline and an error that shows the last state seen.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use anyhow::anyhow;
use kube::Resource;
use kube::api::Api;
use kube::runtime::wait::{Condition, await_condition};
use serde::de::DeserializeOwned;

/// Waits until the object `name` satisfies `condition` (which also sees `None` while the object
/// does not exist, so "is deleted" is a condition too). Returns the object as last seen.
///
/// On timeout the error names `what` was awaited and carries the object's last state.
pub async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    condition: impl Condition<K>,
) -> anyhow::Result<Option<K>>
where
    K: Resource + Clone + Debug + DeserializeOwned + serde::Serialize + Send + 'static,
{
    match tokio::time::timeout(timeout, await_condition(api.clone(), name, condition)).await {
        Ok(result) => Ok(result?),
        Err(_) => {
            let last = match api.get_opt(name).await {
                Ok(Some(obj)) => serde_json::to_string_pretty(&obj).unwrap_or_default(),
                Ok(None) => "(does not exist)".to_owned(),
                Err(e) => format!("(could not read it: {e})"),
            };
            Err(anyhow!(
                "timed out after {timeout:?} waiting for {name} to be {what}; last state:\n{last}"
            ))
        }
    }
}

/// Retries `check` every 200 ms until it succeeds or `timeout` passes; the error is the last
/// failure of the check, prefixed with `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return Ok(value),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(e.context(format!("{what}: still failing after {timeout:?}")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
