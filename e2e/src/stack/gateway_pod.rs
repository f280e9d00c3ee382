//! A client of one gateway pod: its proxy address, and its admin API over verified HTTPS with the
//! install's token (the limits in force, `/v1/stats`, `/metrics`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use poolpilot_api::limits::GatewayLimits;

use super::pods::pod_ip;
use crate::credentials::AdminCredentials;

/// The gateway's proxy and admin ports (the overlay's listen flags).
pub const PROXY_PORT: u16 = 8080;
/// See [`PROXY_PORT`].
pub const ADMIN_PORT: u16 = 9901;

/// One Ready gateway pod.
#[derive(Clone, Debug)]
pub struct GatewayPod {
    /// Pod name.
    pub name: String,
    /// Pod IP (its proxy and admin ports listen there).
    pub ip: IpAddr,
    /// The install's admin credentials.
    credentials: Arc<AdminCredentials>,
    /// An HTTPS client of its admin port.
    admin: reqwest::Client,
}

impl GatewayPod {
    /// The gateway pod `pod` of the install whose credentials these are.
    pub fn of(pod: &Pod, credentials: &Arc<AdminCredentials>) -> anyhow::Result<Self> {
        let ip = pod_ip(pod)?;
        Ok(Self {
            name: pod.name_any(),
            ip,
            credentials: credentials.clone(),
            admin: credentials.client(SocketAddr::new(ip, ADMIN_PORT))?,
        })
    }

    /// Where clients send requests.
    pub fn proxy(&self) -> SocketAddr {
        SocketAddr::new(self.ip, PROXY_PORT)
    }

    /// The admin API.
    pub fn admin(&self) -> SocketAddr {
        SocketAddr::new(self.ip, ADMIN_PORT)
    }

    /// `GET /v1/limits` (with the token): the document in force.
    pub async fn limits(&self) -> anyhow::Result<GatewayLimits> {
        Ok(self.admin_get("/v1/limits").await?.json().await?)
    }

    /// A successful `GET path` of its admin port (HTTPS, with the token).
    async fn admin_get(&self, path: &str) -> anyhow::Result<reqwest::Response> {
        Ok(self
            .admin
            .get(self.credentials.url(ADMIN_PORT, path))
            .header("authorization", self.credentials.bearer())
            .send()
            .await?
            .error_for_status()?)
    }

    /// Polls `GET /v1/limits` every `every` until `done` holds of the document in force, and
    /// returns the time since `from`; fails once `timeout` has passed since `from`.
    pub async fn wait_applied<F>(
        &self,
        from: tokio::time::Instant,
        every: Duration,
        timeout: Duration,
        done: F,
    ) -> anyhow::Result<Duration>
    where
        F: Fn(&GatewayLimits) -> bool,
    {
        let deadline = from + timeout;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Ok(limits) = self.limits().await
                && done(&limits)
            {
                return Ok(from.elapsed());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{} did not apply the change within {timeout:?}",
                self.name
            );
        }
    }

    /// `GET /v1/stats` (with the token): its pools' and clients' counts.
    pub async fn stats(&self) -> anyhow::Result<serde_json::Value> {
        Ok(self.admin_get("/v1/stats").await?.json().await?)
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(self.admin_get("/metrics").await?.text().await?)
    }
}
