//! The operator reads a Prometheus that sits behind authentication, as Thanos, Mimir and managed
//! Prometheus users run it: the cluster's real Prometheus behind an authenticating proxy
//! (e2e/src/auth_proxy.rs) that demands credentials, a tenant header and, in some cases, HTTPS.
//! First the operator's connection (operator/src/prom_connection.rs) with each option, then the
//! operator deployed in a pod, reading through the proxy with a token from a mounted Secret.

use std::collections::BTreeMap;
use std::time::Duration;

use poolpilot_e2e::auth_proxy::{AuthProxy, Requirements};
use poolpilot_e2e::credentials::Pki;
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, TestSecret, one_backend_policy, with_stack,
};
use poolpilot_e2e::{Cluster, install_crypto_provider};
use poolpilot_operator::prom::{Queries, SaturationRound, query_round};
use poolpilot_operator::prom_connection::{Auth, Connection, ConnectionSpec, Trust};

const TENANT: (&str, &str) = ("X-Scope-OrgID", "team-a");

/// One round of the operator's queries through `spec`: Ok when every query got Prometheus'
/// answer (empty or not), else the first error of the round.
async fn one_round(spec: &ConnectionSpec) -> anyhow::Result<()> {
    install_crypto_provider();
    let connection = Connection::new(spec, Duration::from_secs(5))?;
    let queries = Queries {
        window: Duration::from_secs(30),
        freshness: Duration::from_secs(30),
    };
    let headers = connection.round_headers()?;
    let (snapshot, errors) = query_round(
        &connection.client,
        &headers,
        &queries,
        &SaturationRound::new(&[]),
        Duration::from_secs(5),
        poolpilot_operator::clock::now,
    )
    .await;
    if let Some(e) = errors.into_iter().next() {
        return Err(anyhow::Error::new(e));
    }
    anyhow::ensure!(snapshot.max_fds.is_some(), "no answer to the fd query");
    Ok(())
}

fn spec(url: String, auth: Auth, trust: Trust, tenant: bool) -> ConnectionSpec {
    ConnectionSpec {
        url,
        auth,
        trust,
        headers: if tenant {
            vec![format!("{}: {}", TENANT.0, TENANT.1)]
        } else {
            Vec::new()
        },
    }
}

#[tokio::test]
async fn every_prometheus_auth_option_gets_through_an_authenticating_proxy() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let prometheus = cluster.prometheus_url()?.to_owned();
    let dir = tempfile::tempdir()?;
    let write = |name: &str, content: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, content).map(|()| path)
    };
    let tenant = vec![(TENANT.0.to_owned(), TENANT.1.to_owned())];

    // A bearer token and the tenant header, over plain HTTP.
    let token = write("token", "first-token\n")?;
    let proxy = AuthProxy::start(
        &prometheus,
        Requirements {
            authorization: Some("Bearer first-token".into()),
            headers: tenant.clone(),
        },
        None,
    )
    .await?;
    let bearer = || Auth::BearerTokenFile(token.clone());
    one_round(&spec(proxy.url(), bearer(), Trust::System, true)).await?;
    let round = proxy.passed();
    assert!(round >= 9, "a round's queries went through: {round}");
    // Without the tenant, or without the token, the proxy refuses and the round fails.
    let missing_tenant = one_round(&spec(proxy.url(), bearer(), Trust::System, false)).await;
    assert!(missing_tenant.is_err(), "{missing_tenant:?}");
    let missing_token = one_round(&spec(proxy.url(), Auth::None, Trust::System, true)).await;
    assert!(missing_token.is_err(), "{missing_token:?}");
    // Every query of each round was refused, for its reason.
    let mut refusals = proxy.refusals();
    refusals.dedup();
    assert_eq!(
        refusals,
        ["no X-Scope-OrgID header", "no Authorization header"]
    );
    // A rotated token is read from its file at the next round.
    proxy.require(Requirements {
        authorization: Some("Bearer rotated-token".into()),
        headers: tenant.clone(),
    });
    write("token", "rotated-token")?;
    one_round(&spec(proxy.url(), bearer(), Trust::System, true)).await?;

    // Basic auth.
    let password = write("password", "s3cret")?;
    let basic = AuthProxy::start(
        &prometheus,
        Requirements {
            // base64("operator:s3cret")
            authorization: Some("Basic b3BlcmF0b3I6czNjcmV0".into()),
            headers: Vec::new(),
        },
        None,
    )
    .await?;
    let auth = Auth::Basic {
        username: "operator".into(),
        password_file: password,
    };
    one_round(&spec(basic.url(), auth, Trust::System, false)).await?;
    assert_eq!(basic.refused(), 0);

    // HTTPS from a private CA: trusted through the CA file, refused without it, accepted
    // unchecked only when asked.
    let pki = Pki::generate("test Prometheus CA", "localhost")?;
    let ca = write("ca.crt", &pki.ca_pem)?;
    let https = AuthProxy::start(
        &prometheus,
        Requirements {
            authorization: Some("Bearer rotated-token".into()),
            headers: tenant,
        },
        Some((&pki.cert_pem, &pki.key_pem)),
    )
    .await?;
    one_round(&spec(https.url(), bearer(), Trust::CaFile(ca), true)).await?;
    let untrusted = one_round(&spec(https.url(), bearer(), Trust::System, true)).await;
    assert!(
        untrusted.is_err(),
        "a private CA is not the system's: {untrusted:?}"
    );
    one_round(&spec(
        https.url(),
        bearer(),
        Trust::InsecureSkipVerify,
        true,
    ))
    .await?;
    let wrong_ca = Pki::generate("another CA", "localhost")?;
    let other = write("other.crt", &wrong_ca.ca_pem)?;
    let mismatch = one_round(&spec(https.url(), bearer(), Trust::CaFile(other), true)).await;
    assert!(mismatch.is_err(), "{mismatch:?}");
    Ok(())
}

#[tokio::test]
async fn the_operator_reads_through_a_proxy_that_demands_a_token_and_a_tenant() -> anyhow::Result<()>
{
    let cluster = Cluster::shared().await?;
    let token = "operator-reads-prometheus";
    let proxy = AuthProxy::start(
        cluster.prometheus_url()?,
        Requirements {
            authorization: Some(format!("Bearer {token}")),
            headers: vec![(TENANT.0.to_owned(), TENANT.1.to_owned())],
        },
        None,
    )
    .await?;
    let spec = StackSpec {
        gateways: 2,
        backends: vec![BackendSpec::new("model-a", 1, 16)],
        operator_args: vec![
            format!("--prometheus-url={}", proxy.url()),
            "--prometheus-bearer-token-file=/etc/poolpilot/prometheus/token".into(),
            format!("--prometheus-header={}: {}", TENANT.0, TENANT.1),
        ],
        operator_secrets: vec![TestSecret {
            name: "prometheus-token".into(),
            mount_path: "/etc/poolpilot/prometheus".into(),
            data: BTreeMap::from([("token".to_owned(), token.to_owned())]),
        }],
        ..StackSpec::default()
    };
    with_stack("prom-auth", spec, async |stack: &Stack<'_>| {
        let policy = one_backend_policy("model-a", Duration::from_secs(5), 2, 8)?;
        stack.apply(&policy).await?;
        stack
            .wait_condition(POLICY, "MetricsAvailable", "True", Duration::from_secs(120))
            .await?;
        anyhow::ensure!(proxy.passed() > 0, "nothing went through the proxy");
        anyhow::ensure!(
            proxy.refused() == 0,
            "the operator was refused: {:?}",
            proxy.refusals()
        );
        Ok(())
    })
    .await
}
