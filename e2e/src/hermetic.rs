//! Hermetic tests: everything the tests, the demo and the benchmarks send stays on this machine.
//!
//! Two halves. At run time the embedded cluster routes its pod range and its Service range to
//! nowhere (`cluster net`, e2e/cluster/hostnet), so a connect to a pod that is gone or to a
//! ClusterIP fails here with "No route to host"; [`check_routes`] refuses to run tests without
//! those routes. In the sources, [`connection_targets`] finds every address and URL host a file
//! names, and a unit test fails when one outside [`is_local`] appears in e2e/, the gateway's
//! loopback tests or the local overlay.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::LazyLock;

use anyhow::Context as _;
use regex::Regex;

/// The cluster's pod range: the node's bridge gives pods addresses of 10.244.0.0/24 in it, each
/// routed here while its pod holds it (e2e/cluster/cniroute.go); the rest is unreachable.
pub const POD_RANGE: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 244, 0, 0), 16);
/// ClusterIPs the apiserver gives Services (kube-proxy serves them inside the node, for its pods;
/// from here they are unreachable).
pub const SERVICE_RANGE: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 96, 0, 0), 16);
/// An address in the pod range that no pod ever holds: 10.244.255.0/24 is never given out
/// (`cluster net check` probes 10.244.255.1, e2e/cluster/hostnet), and fixtures that need an
/// address nothing listens on take this one.
pub const UNHELD_POD_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 2);

/// Whether `ip` is somewhere tests may send to: loopback, the unspecified address (which
/// Linux connects to locally), the pod range or the Service range.
pub fn is_local(ip: IpAddr) -> bool {
    let in_range = |v4: Ipv4Addr, (net, bits): (Ipv4Addr, u8)| {
        let mask = u32::MAX << (32 - bits);
        u32::from(v4) & mask == u32::from(net) & mask
    };
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_unspecified()
                || in_range(v4, POD_RANGE)
                || in_range(v4, SERVICE_RANGE)
        }
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_unspecified(),
    }
}

/// Fails, with the reason `cluster net check` gives, unless the unreachable routes for the pod
/// and Service ranges are installed and in force on this machine.
pub async fn check_routes(cluster_bin: &Path) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(cluster_bin)
        .args(["net", "check"])
        .output()
        .await
        .with_context(|| format!("run {} net check", cluster_bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "the embedded cluster's traffic could leave this machine, so no test runs: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Host names that appear in URLs of the sources but are never resolved, each with the reason.
pub const NEVER_RESOLVED: &[(&str, &str)] = &[
    (
        "up",
        "the name of the upstream block in the benchmark's nginx.conf",
    ),
    (
        "modelsim",
        "the authority of a request written on an open connection",
    ),
    (
        "gateway.test",
        "the authority of a request written on an open connection",
    ),
    (
        "kubernetes.default.svc.cluster.local",
        "the ServiceAccount token issuer, an identifier",
    ),
];

/// A line carrying this word (in a comment) is exempt: an address that is only a value (a
/// header, an input to reject), never a destination. The comment says why.
pub const EXEMPT_MARK: &str = "hermetic: not a destination";

/// One address or URL host a file names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// 1-based line number.
    pub line: usize,
    /// What was found: an address (`192.0.2.1`) or a host name (`example.com`).
    pub host: String,
    /// The line, trimmed.
    pub text: String,
}

impl Target {
    /// Whether tests may send to this target: a local address or a name that is never resolved.
    pub fn is_allowed(&self) -> bool {
        match self.host.parse::<IpAddr>() {
            Ok(ip) => is_local(ip),
            Err(_) => {
                self.host == "localhost"
                    || NEVER_RESOLVED.iter().any(|(name, _)| *name == self.host)
            }
        }
    }
}

static DOTTED_QUAD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:^|[^\d.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?:$|[^\d.])").expect("regex")
});
/// `Ipv4Addr::new(a, b, c, d)`, and `([a, b, c, d]` (an address array passed to a function).
static OCTETS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?:Ipv4Addr::new\(|\(\s*\(?\[)\s*(\d{1,3})\s*,\s*(\d{1,3})\s*,\s*(\d{1,3})\s*,\s*(\d{1,3})\s*[\])]",
    )
    .expect("regex")
});
/// `scheme://host` for the URL schemes a test could connect with; an address host is left to
/// the patterns above.
static URL_HOST: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?:https?|wss?|tcp|grpc)://([A-Za-z][A-Za-z0-9.-]*)").expect("regex")
});

/// Every address and URL host named outside comments in `source` (Rust, Go, YAML, shell or a
/// Makefile), except on lines carrying [`EXEMPT_MARK`].
pub fn connection_targets(source: &str) -> Vec<Target> {
    let mut found = Vec::new();
    for (i, line) in source.lines().enumerate() {
        let code = line.trim();
        if code.starts_with("//") || code.starts_with('#') || line.contains(EXEMPT_MARK) {
            continue;
        }
        let mut push = |host: String| {
            found.push(Target {
                line: i + 1,
                host,
                text: code.to_owned(),
            })
        };
        for caps in DOTTED_QUAD.captures_iter(line) {
            if caps[1].parse::<Ipv4Addr>().is_ok() {
                push(caps[1].to_owned());
            }
        }
        for caps in OCTETS.captures_iter(line) {
            let octets: Option<Vec<u8>> = (1..=4).map(|k| caps[k].parse().ok()).collect();
            if let Some(o) = octets {
                push(Ipv4Addr::new(o[0], o[1], o[2], o[3]).to_string());
            }
        }
        for caps in URL_HOST.captures_iter(line) {
            let host = caps[1].trim_end_matches('.');
            if host.parse::<Ipv4Addr>().is_err() {
                push(host.to_owned());
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_ranges_are_allowed_and_the_rest_is_not() {
        for ip in [
            "127.0.0.1",
            "127.4.5.6",
            "0.0.0.0",
            "10.244.0.1",
            "10.244.255.2",
            "10.96.0.1",
            "::1",
        ] {
            assert!(is_local(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "10.245.0.1",      // hermetic: not a destination (test input)
            "10.95.255.255",   // hermetic: not a destination (test input)
            "10.0.0.1",        // hermetic: not a destination (test input)
            "192.0.2.1",       // hermetic: not a destination (test input)
            "169.254.169.254", // hermetic: not a destination (test input)
            "fd00::1",
        ] {
            assert!(!is_local(ip.parse().unwrap()), "{ip}");
        }
        assert!(is_local(IpAddr::V4(UNHELD_POD_ADDRESS)));
    }

    #[test]
    fn every_form_of_a_destination_is_found() {
        let source = [
            r#"const ADDRESS: &str = "192.0.2.1:8000";"#, // hermetic: not a destination (test input)
            r#"let a = Ipv4Addr::new(203, 0, 113, 7);"#, // hermetic: not a destination (test input)
            r#"connect_from([198, 51, 100, 1], addr).await;"#, // hermetic: not a destination (test input)
            r#"SocketAddr::from(([8, 8, 8, 8], 53))"#, // hermetic: not a destination (test input)
            r#"- --prometheus-url=http://prometheus-operated.monitoring.svc:9090"#, // hermetic: not a destination (test input)
            r#"url: "https://169.254.169.254/latest""#, // hermetic: not a destination (test input)
            r#"	resp, err := http.Get("http://example.com/")"#, // hermetic: not a destination (test input)
        ]
        .join("\n");
        let hosts: Vec<String> = connection_targets(&source)
            .into_iter()
            .map(|t| t.host)
            .collect();
        assert_eq!(
            hosts,
            [
                "192.0.2.1",    // hermetic: not a destination (test input)
                "203.0.113.7",  // hermetic: not a destination (test input)
                "198.51.100.1", // hermetic: not a destination (test input)
                "8.8.8.8",      // hermetic: not a destination (test input)
                "prometheus-operated.monitoring.svc",
                "169.254.169.254", // hermetic: not a destination (test input)
                "example.com",
            ]
        );
        assert!(connection_targets(&source).iter().all(|t| !t.is_allowed()));
    }

    #[test]
    fn local_destinations_comments_versions_and_marked_values_pass() {
        let source = [
            r#"let addr = "127.0.0.1:0";"#,
            r#"connect_from([127, 0, 0, 2], addr).await;"#,
            r#"let pod = "http://10.244.0.6:8080/v1/limits";"#,
            r#"let levels = vec![1, 20, 50, 200];"#,
            r#"let v = "v1.37.2"; let w = "1.2.3.4.5";"#,
            r#"// an example: curl http://192.0.2.9/"#, // hermetic: not a destination (test input)
            r#"    # a YAML comment naming 203.0.113.9"#, // hermetic: not a destination (test input)
            r#"("x-forwarded-for", "10.9.8.7"), // hermetic: not a destination (a header value)"#,
            r#"proxy_pass http://up;"#,
        ]
        .join("\n");
        let rejected: Vec<Target> = connection_targets(&source)
            .into_iter()
            .filter(|t| !t.is_allowed())
            .collect();
        assert!(rejected.is_empty(), "{rejected:#?}");
    }

    /// The files that make up the tests, the demo, the benchmarks and what they deploy
    /// locally: every destination they name is on this machine.
    #[test]
    fn no_test_demo_bench_or_local_manifest_names_a_destination_off_this_machine() {
        let root = crate::paths::workspace_root();
        let scanned = [
            "e2e",
            "modelsim",
            "gateway/tests",
            "manifests/overlays/local",
            ".ci",
        ];
        let mut files = vec![root.join("Makefile"), root.join("Dockerfile")];
        for dir in scanned {
            for entry in walkdir::WalkDir::new(root.join(dir)) {
                let entry = entry.expect("walk the sources");
                let path = entry.path();
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let kind = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if entry.file_type().is_file()
                    && (matches!(kind, "rs" | "go" | "yaml" | "yml" | "sh" | "toml")
                        || name == "run"
                        || name.ends_with("Dockerfile"))
                {
                    files.push(path.to_owned());
                }
            }
        }
        assert!(files.len() > 50, "found only {} files", files.len());
        let mut offenders = Vec::new();
        for path in &files {
            let text = std::fs::read_to_string(path).expect("read a source file");
            for target in connection_targets(&text) {
                if !target.is_allowed() {
                    let shown = path.strip_prefix(&root).unwrap_or(path).display();
                    offenders.push(format!("{shown}:{}: {}", target.line, target.text));
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "destinations off this machine (tests may reach only 127.0.0.0/8, 10.244.0.0/16 and \
             10.96.0.0/16; mark a value that is never connected to with `{EXEMPT_MARK}`):\n{}",
            offenders.join("\n")
        );
    }
}
