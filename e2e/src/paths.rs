//! Where the e2e tooling finds its binaries and keeps its state: one cache folder outside the
//! clone (`$POOLPILOT_CACHE`, default `~/.cache/poolpilot`), shared by make, tests and the demo.

use std::path::{Path, PathBuf};

/// The root of this workspace's source tree (manifests, CRDs, examples): `$POOLPILOT_WORKSPACE`,
/// else the nearest ancestor of the working directory that is a poolpilot workspace (make runs
/// from the root, `cargo test` from the crate), else where this crate was compiled. The
/// compile-time path alone is not enough: two clones sharing one `CARGO_TARGET_DIR` (a CI
/// checkout and a working copy) reuse each other's build, path included.
pub fn workspace_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("POOLPILOT_WORKSPACE") {
        return PathBuf::from(dir);
    }
    let compiled_in = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ lies inside the workspace")
        .to_path_buf();
    std::env::current_dir()
        .ok()
        .and_then(|cwd| {
            cwd.ancestors()
                .find(|dir| is_workspace(dir))
                .map(Path::to_path_buf)
        })
        .unwrap_or(compiled_in)
}

/// The package folders the workspace at `root` lists in its Cargo.toml (`members`), relative to
/// it: `gateway`, `e2e/plot`, ...
pub fn workspace_members(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    manifest
        .split_once("members")
        .and_then(|(_, rest)| rest.split_once('[')?.1.split_once(']'))
        .map(|(list, _)| {
            list.split(',')
                .map(|m| m.trim().trim_matches('"').to_owned())
                .filter(|m| !m.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `dir` holds a poolpilot workspace: the e2e crate and the CRD manifests.
fn is_workspace(dir: &Path) -> bool {
    dir.join("e2e/Cargo.toml").is_file() && dir.join("manifests/crds").is_dir()
}

/// The cache root: `$POOLPILOT_CACHE` or `$HOME/.cache/poolpilot`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("POOLPILOT_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/poolpilot")
}

/// The embedded control plane binary (`make cluster` builds it): `$POOLPILOT_CLUSTER_BIN` or
/// `<cache>/bin/cluster`.
pub fn cluster_bin() -> PathBuf {
    std::env::var_os("POOLPILOT_CLUSTER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/cluster"))
}

/// The Prometheus binary (`make cluster` builds it): `$POOLPILOT_PROMETHEUS_BIN` or
/// `<cache>/bin/prometheus`.
pub fn prometheus_bin() -> PathBuf {
    std::env::var_os("POOLPILOT_PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/prometheus"))
}

/// The helm binary (`make cluster` builds it): `$POOLPILOT_HELM_BIN` or `<cache>/bin/helm`.
pub fn helm_bin() -> PathBuf {
    std::env::var_os("POOLPILOT_HELM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/helm"))
}

/// The state folder of the shared test cluster: `$POOLPILOT_CLUSTER_DIR` or `<cache>/cluster`.
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("POOLPILOT_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("cluster"))
}

/// The folder holding this workspace's binaries (`target/debug` or `target/release`), found
/// next to the running executable: a test binary lives in `<profile>/deps/`, a bin in `<profile>/`.
pub fn workspace_bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().map(PathBuf::from).unwrap_or(dir)
    } else {
        dir
    }
}

/// The OCI archives `cluster up --node` imports into the node's containerd (`make node-images`
/// builds them): `operator`, `gateway`, `modelsim` and the sandbox's `pause`, each `NAME.tar` in
/// `$POOLPILOT_IMAGES_DIR` or `<cache>/images`.
pub fn node_images() -> Vec<PathBuf> {
    let dir = std::env::var_os("POOLPILOT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("images"));
    ["operator", "gateway", "modelsim", "pause"]
        .iter()
        .map(|name| dir.join(format!("{name}.tar")))
        .collect()
}

/// The folder of prometheus-operator's CRDs (`make cluster` extracts them from the Go module
/// pinned in e2e/prometheus-operator): `$POOLPILOT_PROMETHEUS_OPERATOR_CRDS` or
/// `<cache>/bin/prometheus-operator-crds`.
pub fn prometheus_operator_crds() -> PathBuf {
    std::env::var_os("POOLPILOT_PROMETHEUS_OPERATOR_CRDS")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/prometheus-operator-crds"))
}

/// prometheus-operator (`make cluster` builds it from the Go module pinned in
/// e2e/prometheus-operator): `$POOLPILOT_PROMETHEUS_OPERATOR_BIN` or
/// `<cache>/bin/prometheus-operator`.
pub fn prometheus_operator_bin() -> PathBuf {
    std::env::var_os("POOLPILOT_PROMETHEUS_OPERATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/prometheus-operator"))
}

/// prometheus-operator's config reloader, from the same module:
/// `$POOLPILOT_PROMETHEUS_CONFIG_RELOADER_BIN` or `<cache>/bin/prometheus-config-reloader`.
pub fn prometheus_config_reloader_bin() -> PathBuf {
    std::env::var_os("POOLPILOT_PROMETHEUS_CONFIG_RELOADER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/prometheus-config-reloader"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_is_found_above_the_working_directory() {
        // `cargo test` runs this in e2e/: the nearest workspace above it is this clone.
        let cwd = std::env::current_dir().unwrap();
        let root = workspace_root();
        assert!(is_workspace(&root), "{}", root.display());
        if std::env::var_os("POOLPILOT_WORKSPACE").is_none() {
            assert_eq!(root, cwd.parent().unwrap());
        }
        assert!(!is_workspace(&root.join("e2e")));
    }
}
