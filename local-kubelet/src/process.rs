//! Container processes: turning a container spec into a local process with its binary, argv,
//! environment, volume mounts (bind-mounted at their real paths in a private mount namespace),
//! open-files limit and piped output (for its log); and stopping its whole process group.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::{Pid, setsid};

/// The `PATH` every container process gets, and where commands are looked up.
pub const CONTAINER_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Why a container could not be started; shown as the container's waiting reason.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No binary stands for the image (the local kubelet's "image pull" failed).
    #[error("no local binary for image {image:?} (looked for {looked_for})")]
    ImageNotFound { image: String, looked_for: String },
    /// The command named in the spec does not exist.
    #[error("command {0:?} not found")]
    CommandNotFound(String),
    /// A volume mount names a volume the pod does not have.
    #[error("volume mount {0:?} has no volume")]
    MissingVolume(String),
    /// Spawning failed.
    #[error("could not start the process: {0}")]
    Spawn(#[from] std::io::Error),
}

impl StartError {
    /// The Kubernetes-style waiting reason.
    pub fn reason(&self) -> &'static str {
        match self {
            StartError::ImageNotFound { .. } => "ErrImagePull",
            StartError::CommandNotFound(_) | StartError::MissingVolume(_) => {
                "CreateContainerConfigError"
            }
            StartError::Spawn(_) => "RunContainerError",
        }
    }
}

/// Where images come from: explicit `image=path` mappings, then binaries found in the bin dirs
/// under the image's last path segment (`ghcr.io/poolpilot/gateway:v1` → `gateway` or
/// `poolpilot-gateway`).
#[derive(Clone, Debug, Default)]
pub struct ImageResolver {
    /// Exact image names (without tag) mapped to binaries.
    pub images: BTreeMap<String, PathBuf>,
    /// Folders searched for `<name>` and `poolpilot-<name>`.
    pub bin_dirs: Vec<PathBuf>,
}

impl ImageResolver {
    /// The binary that stands for `image`: an explicit mapping, an image that is an absolute
    /// path to a file (a test or benchmark running another build), or `<name>` /
    /// `poolpilot-<name>` in the bin dirs.
    pub fn resolve(&self, image: &str) -> Result<PathBuf, StartError> {
        let untagged = strip_tag(image);
        if let Some(path) = self.images.get(untagged) {
            return Ok(path.clone());
        }
        if untagged.starts_with('/') && Path::new(untagged).is_file() {
            return Ok(PathBuf::from(untagged));
        }
        let name = untagged.rsplit('/').next().unwrap_or(untagged);
        let candidates: Vec<PathBuf> = self
            .bin_dirs
            .iter()
            .flat_map(|d| [d.join(name), d.join(format!("poolpilot-{name}"))])
            .collect();
        candidates
            .iter()
            .find(|p| p.is_file())
            .cloned()
            .ok_or_else(|| StartError::ImageNotFound {
                image: image.to_owned(),
                looked_for: candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The program for a container's `command[0]`: the image's binary when the name matches it,
    /// an absolute path as is, or a lookup in the bin dirs and then [`CONTAINER_PATH`].
    pub fn resolve_command(&self, image: &str, program: &str) -> Result<PathBuf, StartError> {
        let base = Path::new(program)
            .file_name()
            .map(|b| b.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Ok(bin) = self.resolve(image) {
            let bin_name = bin
                .file_name()
                .map(|b| b.to_string_lossy().into_owned())
                .unwrap_or_default();
            if bin_name == base || bin_name == format!("poolpilot-{base}") {
                return Ok(bin);
            }
        }
        if program.starts_with('/') && Path::new(program).is_file() {
            return Ok(PathBuf::from(program));
        }
        let path_dirs: Vec<PathBuf> = CONTAINER_PATH.split(':').map(PathBuf::from).collect();
        self.bin_dirs
            .iter()
            .chain(path_dirs.iter())
            .map(|d| d.join(&base))
            .find(|p| p.is_file())
            .ok_or_else(|| StartError::CommandNotFound(program.to_owned()))
    }
}

fn strip_tag(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    match image.rfind(':') {
        Some(i) if !image[i..].contains('/') => &image[..i],
        _ => image,
    }
}

/// One bind mount into the container's mount namespace.
#[derive(Clone, Debug)]
pub struct BindMount {
    /// The rendered volume (or a file or folder inside it) on the host.
    pub source: PathBuf,
    /// The container's `mountPath`.
    pub target: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

/// Everything needed to start one container process.
#[derive(Clone, Debug)]
pub struct ProcessSpec {
    /// The program.
    pub program: PathBuf,
    /// Its arguments (already `$(VAR)`-expanded).
    pub args: Vec<String>,
    /// The complete environment.
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub working_dir: PathBuf,
    /// Bind mounts, applied in order.
    pub mounts: Vec<BindMount>,
    /// `RLIMIT_NOFILE` (soft and hard) to set, if any.
    pub nofile_limit: Option<u64>,
}

/// Starts the process described by `spec`. It leads its own process group (so that
/// [`signal_group`] reaches everything it spawns); the returned child is to be awaited, and its
/// piped stdout and stderr copied into its log.
pub fn spawn(spec: &ProcessSpec) -> Result<tokio::process::Child, StartError> {
    // Mount targets must exist before the process can mount onto them; create them on the host
    // (an empty folder or file is all that is left behind).
    for m in &spec.mounts {
        if m.source.is_dir() {
            std::fs::create_dir_all(&m.target)?;
        } else {
            if let Some(parent) = m.target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            if !m.target.exists() {
                std::fs::File::create(&m.target)?;
            }
        }
    }
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(&spec.env)
        .current_dir(&spec.working_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mounts = MountPlan::new(&spec.mounts)?;
    let nofile = spec.nofile_limit;
    // SAFETY: the closure runs in the forked child before exec. It only makes system calls
    // (setsid, unshare, mount, setrlimit) on data prepared before the fork, and allocates nothing.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || mounts.enter(nofile));
    }
    Ok(cmd.spawn()?)
}

/// Sends `signal` to the process group led by `pid`.
pub fn signal_group(pid: u32, signal: Signal) {
    let _ = killpg(Pid::from_raw(pid as i32), signal);
}

/// The exit code of a finished process: its code, or 128 + the signal that killed it.
pub fn exit_code(status: std::io::Result<std::process::ExitStatus>) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    match status {
        Ok(status) => status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
        Err(_) => 255,
    }
}

/// Bind mounts prepared as C strings before the fork, so that the child allocates nothing.
struct MountPlan {
    binds: Vec<(CString, CString, bool)>,
}

impl MountPlan {
    fn new(mounts: &[BindMount]) -> std::io::Result<Self> {
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
        let binds = mounts
            .iter()
            .map(|m| Ok((c(&m.source)?, c(&m.target)?, m.read_only)))
            .collect::<std::io::Result<_>>()?;
        Ok(Self { binds })
    }

    /// In the child: own session and process group, private mount namespace with the binds,
    /// open-files limit.
    fn enter(&self, nofile: Option<u64>) -> std::io::Result<()> {
        setsid()?;
        if !self.binds.is_empty() {
            unshare(CloneFlags::CLONE_NEWNS)?;
            // Keep our mounts from propagating back to the host.
            mount(
                None::<&CStr>,
                c"/",
                None::<&CStr>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&CStr>,
            )?;
            for (source, target, read_only) in &self.binds {
                mount(
                    Some(source.as_c_str()),
                    target.as_c_str(),
                    None::<&CStr>,
                    MsFlags::MS_BIND | MsFlags::MS_REC,
                    None::<&CStr>,
                )?;
                if *read_only {
                    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
                    mount(
                        None::<&CStr>,
                        target.as_c_str(),
                        None::<&CStr>,
                        flags,
                        None::<&CStr>,
                    )?;
                }
            }
        }
        if let Some(n) = nofile {
            setrlimit(Resource::RLIMIT_NOFILE, n, n)?;
        }
        Ok(())
    }
}

/// Expands `$(VAR)` references in a container's command, args or env values the way the kubelet
/// does: known variables are replaced, `$$` escapes, unknown references stay as written.
pub fn expand(input: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) if vars.contains_key(&body[..end]) => {
                    out.push_str(&vars[&body[..end]]);
                    rest = &body[end + 1..];
                }
                _ => {
                    out.push('$');
                    rest = after;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_like_the_kubelet() {
        let vars: BTreeMap<String, String> = [("POD_IP".into(), "127.0.1.5".into())].into();
        assert_eq!(
            expand("--listen=$(POD_IP):8000", &vars),
            "--listen=127.0.1.5:8000"
        );
        assert_eq!(
            expand("$(UNKNOWN) $$(POD_IP) $5", &vars),
            "$(UNKNOWN) $(POD_IP) $5"
        );
        assert_eq!(expand("$(POD_IP", &vars), "$(POD_IP");
    }

    #[test]
    fn image_names_lose_registry_and_tag() {
        assert_eq!(
            strip_tag("ghcr.io/poolpilot/gateway:v1"),
            "ghcr.io/poolpilot/gateway"
        );
        assert_eq!(
            strip_tag("localhost:5000/gateway"),
            "localhost:5000/gateway"
        );
        assert_eq!(
            strip_tag("poolpilot/gateway@sha256:abc"),
            "poolpilot/gateway"
        );
    }

    #[test]
    fn images_resolve_to_binaries_in_the_bin_dirs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("poolpilot-gateway"), "").unwrap();
        let resolver = ImageResolver {
            images: BTreeMap::new(),
            bin_dirs: vec![dir.path().to_owned()],
        };
        assert_eq!(
            resolver.resolve("ghcr.io/poolpilot/gateway:v1").unwrap(),
            dir.path().join("poolpilot-gateway")
        );
        assert_eq!(
            resolver
                .resolve_command("poolpilot/gateway", "/poolpilot-gateway")
                .unwrap(),
            dir.path().join("poolpilot-gateway")
        );
        let other = tempfile::tempdir().unwrap();
        let release = other.path().join("poolpilot-gateway");
        std::fs::write(&release, "").unwrap();
        assert_eq!(
            resolver.resolve(&release.display().to_string()).unwrap(),
            release,
            "an image that is a path names its binary"
        );
        let err = resolver.resolve("poolpilot/nothing").unwrap_err();
        assert_eq!(err.reason(), "ErrImagePull");
        assert!(err.to_string().contains("poolpilot-nothing"), "{err}");
    }
}
