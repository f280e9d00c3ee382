//! Command-line flags (each also readable from the environment).

use std::net::SocketAddr;

use clap::Parser;
use poolpilot_api::Duration;

/// poolpilot-operator: tunes gateway connection pools from Prometheus and rolls the limits out.
#[derive(Clone, Debug, Parser)]
#[command(version = poolpilot_telemetry::LONG_VERSION, about)]
pub struct Args {
    /// Prometheus base URL.
    #[arg(
        long,
        env = "POOLPILOT_PROMETHEUS_URL",
        default_value = "http://prometheus:9090"
    )]
    pub prometheus_url: String,
    /// A file holding a bearer token for Prometheus, re-read every round (rotations apply).
    #[arg(
        long,
        env = "POOLPILOT_PROMETHEUS_BEARER_TOKEN_FILE",
        conflicts_with = "prometheus_basic_auth_username"
    )]
    pub prometheus_bearer_token_file: Option<std::path::PathBuf>,
    /// Basic-auth user for Prometheus (with --prometheus-basic-auth-password-file).
    #[arg(
        long,
        env = "POOLPILOT_PROMETHEUS_BASIC_AUTH_USERNAME",
        requires = "prometheus_basic_auth_password_file"
    )]
    pub prometheus_basic_auth_username: Option<String>,
    /// A file holding the basic-auth password, re-read every round.
    #[arg(
        long,
        env = "POOLPILOT_PROMETHEUS_BASIC_AUTH_PASSWORD_FILE",
        requires = "prometheus_basic_auth_username"
    )]
    pub prometheus_basic_auth_password_file: Option<std::path::PathBuf>,
    /// CA bundle (PEM) that Prometheus' HTTPS certificate must chain to (instead of the system's).
    #[arg(
        long,
        env = "POOLPILOT_PROMETHEUS_CA_FILE",
        conflicts_with = "prometheus_insecure_skip_verify"
    )]
    pub prometheus_ca_file: Option<std::path::PathBuf>,
    /// Do not check Prometheus' HTTPS certificate (a trusted network and a self-signed
    /// certificate only).
    #[arg(long, env = "POOLPILOT_PROMETHEUS_INSECURE_SKIP_VERIFY")]
    pub prometheus_insecure_skip_verify: bool,
    /// An extra header for every query, `Name: value` (repeatable; in the environment, several
    /// separated by newlines): `X-Scope-OrgID: team-a` for Mimir, Cortex or Thanos tenants.
    #[arg(
        long = "prometheus-header",
        env = "POOLPILOT_PROMETHEUS_HEADERS",
        value_delimiter = '\n'
    )]
    pub prometheus_headers: Vec<String>,
    /// How often the batched Prometheus queries run.
    #[arg(long, env = "POOLPILOT_METRICS_INTERVAL", default_value = "15s")]
    pub metrics_interval: Duration,
    /// Prometheus' scrape interval of the gateways; samples older than two of them are stale.
    #[arg(long, env = "POOLPILOT_SCRAPE_INTERVAL", default_value = "15s")]
    pub scrape_interval: Duration,
    /// Name of the Secret, in each policy's namespace, holding the gateways' admin token.
    #[arg(
        long,
        env = "POOLPILOT_TOKEN_SECRET",
        default_value = "poolpilot-admin-token"
    )]
    pub token_secret: String,
    /// Key of the token in that Secret.
    #[arg(long, env = "POOLPILOT_TOKEN_KEY", default_value = "token")]
    pub token_key: String,
    /// The gateways' admin port (the pod annotation `poolpilot.io/admin-port` overrides it).
    #[arg(long, env = "POOLPILOT_ADMIN_PORT", default_value_t = 9901)]
    pub admin_port: u16,
    /// PEM bundle of the CA(s) that sign the gateways' admin certificates (a mounted
    /// `ca.crt`, re-read when it changes). Set: limits go to the gateways over HTTPS, verified
    /// against it. Empty: over plain HTTP, the admin token in clear text (loopback and tests
    /// only).
    #[arg(long, env = "POOLPILOT_GATEWAY_CA_FILE", default_value = "")]
    pub gateway_ca_file: String,
    /// The name each gateway's admin certificate must carry, `{namespace}` standing for the
    /// pod's namespace (the pods are reached by IP, which no shared certificate names).
    #[arg(
        long,
        env = "POOLPILOT_GATEWAY_SERVER_NAME",
        default_value = "poolpilot-gateway-admin.{namespace}.svc"
    )]
    pub gateway_server_name: String,
    /// How long one gateway pod has to answer a PUT of its limits document; a pod that does
    /// not is reported (`status.pods.failures`) and tried again at the next reconcile, and the
    /// rest of its wave does not wait for it.
    #[arg(long, env = "POOLPILOT_PUT_TIMEOUT", default_value = "5s")]
    pub put_timeout: Duration,
    /// How many gateway pods one reconcile sends documents to at once (at least 1): a wave of
    /// 1,000 pods goes out in 1,000 ÷ this many rounds of one PUT each.
    #[arg(long, env = "POOLPILOT_ROLLOUT_CONCURRENCY", default_value_t = crate::reconcile::DEFAULT_ROLLOUT_CONCURRENCY as u16, value_parser = clap::value_parser!(u16).range(1..))]
    pub rollout_concurrency: u16,
    /// How many policies are reconciled at once (at least 1). The reconciles of a namespace
    /// share its plan (one pass plans for every one waiting), so this bounds how many roll out
    /// and write their status at once, and how many one pass can serve.
    #[arg(long, env = "POOLPILOT_CONCURRENT_RECONCILES", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrent_reconciles: u16,
    /// Status writes per second spent refreshing observations (demand, utilization, the last
    /// decision's time and numbers, messages) over all policies: a policy whose status moved only
    /// in those is written once its turn comes, at least every `policies ÷ rate` seconds; a
    /// target, share, condition state or rollout step is written at once. 0: every change at
    /// once.
    #[arg(long, env = "POOLPILOT_STATUS_REFRESH_RATE", default_value_t = crate::reconcile::refresh::DEFAULT_REFRESH_RATE, value_parser = refresh_rate)]
    pub status_refresh_rate: f64,
    /// Longest time between two reconciles of a policy.
    #[arg(long, env = "POOLPILOT_MAX_REQUEUE", default_value = "60s")]
    pub max_requeue: Duration,
    /// Watch and reconcile only this namespace (empty: every namespace). Its policies, gateway
    /// pods, EndpointSlices and ConfigMaps must then all live there.
    #[arg(long, env = "POOLPILOT_NAMESPACE", default_value = "")]
    pub namespace: String,
    /// Namespaces besides its own whose Services a policy may name as backends
    /// (`endpoints.service.namespace`), comma-separated; a policy naming another is not accepted
    /// (reason `NamespaceNotAllowed`). The operator watches their EndpointSlices: with
    /// `--namespace`, one watch more per namespace listed (RBAC: list and watch
    /// endpointslices there).
    #[arg(long, env = "POOLPILOT_BACKEND_NAMESPACES", value_delimiter = ',', num_args = 0..)]
    pub backend_namespaces: Vec<String>,
    /// Label selector narrowing the pod watch (empty: every pod).
    #[arg(long, env = "POOLPILOT_POD_SELECTOR", default_value = "")]
    pub pod_selector: String,
    /// Address of the operator's own `/metrics` and `/healthz`.
    #[arg(long, env = "POOLPILOT_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Run leader election (turn off only when a single replica runs).
    #[arg(long, env = "POOLPILOT_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "POOLPILOT_LEASE_NAME",
        default_value = "poolpilot-operator"
    )]
    pub lease_name: String,
    /// This replica's identity in the Lease and in Events (defaults to the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Log format: `text` (or `plain`, the same) or `json`, as the gateway's `--log-format`.
    #[arg(long, env = "POOLPILOT_LOG_FORMAT", default_value = "text", value_parser = ["text", "plain", "json"])]
    pub log_format: String,
}

impl Args {
    /// How to reach Prometheus, from the `--prometheus-*` flags.
    pub fn prometheus_connection(&self) -> crate::prom_connection::ConnectionSpec {
        use crate::prom_connection::{Auth, Trust};
        let auth = match (
            &self.prometheus_bearer_token_file,
            &self.prometheus_basic_auth_username,
            &self.prometheus_basic_auth_password_file,
        ) {
            (Some(token), _, _) => Auth::BearerTokenFile(token.clone()),
            (None, Some(username), Some(password)) => Auth::Basic {
                username: username.clone(),
                password_file: password.clone(),
            },
            _ => Auth::None,
        };
        let trust = match &self.prometheus_ca_file {
            Some(ca) => Trust::CaFile(ca.clone()),
            None if self.prometheus_insecure_skip_verify => Trust::InsecureSkipVerify,
            None => Trust::System,
        };
        crate::prom_connection::ConnectionSpec {
            url: self.prometheus_url.clone(),
            auth,
            trust,
            headers: self.prometheus_headers.clone(),
        }
    }
}

/// `--status-refresh-rate`: a finite number of writes per second, 0 or more.
fn refresh_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!(
            "{s:?} is not a rate: writes per second, 0 or more (0: every change at once)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_auth_flags_become_a_connection_spec() {
        use crate::prom_connection::{Auth, Trust};
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("poolpilot-operator").chain(args.iter().copied()))
        };
        let a = parse(&[
            "--prometheus-bearer-token-file=/var/run/token",
            "--prometheus-header=X-Scope-OrgID: team-a",
            "--prometheus-header=X-Other: 1",
            "--prometheus-ca-file=/etc/ca.crt",
        ])
        .unwrap()
        .prometheus_connection();
        assert_eq!(a.auth, Auth::BearerTokenFile("/var/run/token".into()));
        assert_eq!(a.trust, Trust::CaFile("/etc/ca.crt".into()));
        assert_eq!(a.headers, ["X-Scope-OrgID: team-a", "X-Other: 1"]);
        let b = parse(&[
            "--prometheus-basic-auth-username=op",
            "--prometheus-basic-auth-password-file=/p",
            "--prometheus-insecure-skip-verify",
        ])
        .unwrap()
        .prometheus_connection();
        assert_eq!(
            b.auth,
            Auth::Basic {
                username: "op".into(),
                password_file: "/p".into()
            }
        );
        assert_eq!(b.trust, Trust::InsecureSkipVerify);
        // Contradictions are refused at start.
        for bad in [
            &[
                "--prometheus-bearer-token-file=/t",
                "--prometheus-basic-auth-username=u",
                "--prometheus-basic-auth-password-file=/p",
            ][..],
            &["--prometheus-basic-auth-username=u"],
            &[
                "--prometheus-ca-file=/c",
                "--prometheus-insecure-skip-verify",
            ],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse(&[]).unwrap().prometheus_connection().auth, Auth::None);
    }

    #[test]
    fn defaults_and_durations_parse() {
        let a = Args::try_parse_from([
            "poolpilot-operator",
            "--metrics-interval",
            "30s",
            "--leader-election",
            "false",
        ])
        .unwrap();
        assert_eq!(a.metrics_interval, Duration::from_secs(30));
        assert_eq!(a.scrape_interval, Duration::from_secs(15));
        assert_eq!(a.admin_port, 9901);
        assert!(!a.leader_election);
        assert_eq!(a.namespace, "", "every namespace by default");
        assert_eq!(a.concurrent_reconciles, 8);
        assert_eq!(a.rollout_concurrency, 32);
        assert_eq!(
            a.gateway_ca_file, "",
            "plain HTTP unless a CA bundle is given"
        );
        assert_eq!(
            a.gateway_server_name,
            "poolpilot-gateway-admin.{namespace}.svc"
        );
        assert!(
            Args::try_parse_from(["poolpilot-operator", "--concurrent-reconciles", "0"]).is_err(),
            "0 would mean unbounded to the Controller"
        );
        assert!(Args::try_parse_from(["poolpilot-operator", "--put-timeout", "soon"]).is_err());
        assert!(
            Args::try_parse_from(["poolpilot-operator", "--rollout-concurrency", "0"]).is_err(),
            "0 would send nothing"
        );
        for rate in ["-1", "NaN", "inf", "fast"] {
            assert!(
                Args::try_parse_from(["poolpilot-operator", "--status-refresh-rate", rate])
                    .is_err(),
                "{rate}"
            );
        }
        let a = Args::try_parse_from(["poolpilot-operator", "--status-refresh-rate", "0"]).unwrap();
        assert_eq!(a.status_refresh_rate, 0.0);
    }

    /// The chart spells these flags out with its own values; the kustomize bases leave them at
    /// the binary's defaults (and the chart-versus-bases e2e test ignores them for that reason),
    /// so the chart's defaults must be the binary's.
    #[test]
    fn the_charts_default_values_are_the_binarys_defaults() {
        let values: serde_norway::Value = serde_norway::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../charts/poolpilot/values.yaml"
            ))
            .unwrap(),
        )
        .unwrap();
        let defaults = format!(
            "{:?}",
            Args::try_parse_from(["poolpilot-operator"]).unwrap()
        );
        for (flag, path) in [
            ("--concurrent-reconciles", "operator.concurrentReconciles"),
            ("--rollout-concurrency", "operator.rolloutConcurrency"),
            ("--put-timeout", "operator.putTimeout"),
            ("--status-refresh-rate", "operator.statusRefreshRate"),
            ("--leader-election", "operator.leaderElection"),
            ("--token-secret", "adminToken.secretName"),
        ] {
            let value = path.split('.').fold(&values, |v, key| &v[key]).clone();
            let value = match value {
                serde_norway::Value::String(s) => s,
                serde_norway::Value::Bool(b) => b.to_string(),
                serde_norway::Value::Number(n) => n.to_string(),
                other => panic!("{path}: {other:?}"),
            };
            let given = Args::try_parse_from(["poolpilot-operator", &format!("{flag}={value}")])
                .unwrap_or_else(|e| panic!("{flag}={value}: {e}"));
            assert_eq!(
                format!("{given:?}"),
                defaults,
                "{path} ({value}) is not {flag}'s default"
            );
        }
    }
}
