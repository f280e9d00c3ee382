//! What every measurement of `poolpilot-bench` shares: the CPUs the proxy and the rest run on
//! ([`Pinning`], the driver's runtime pinned before it starts its threads), the fd limit, and
//! the stage ([`Stage`]): the upstream process (plain and TLS, with the run's own CA) and the
//! `wrk` script.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use nix::sched::{CpuSet, sched_setaffinity};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use nix::unistd::Pid;

use crate::load;
use crate::parts::{Bench, Plan};
use crate::peers::{self, Env, UpstreamTls};
use crate::pki::{self, Pki};
use crate::procs::{self, Proc};

/// The driver's runtime, pinned before it starts its threads, which inherit the mask: the
/// driver's own load (the fixed-rate row, parts 2–4) stays off the proxy's CPU.
pub fn pinned_runtime() -> anyhow::Result<(tokio::runtime::Runtime, Pinning)> {
    let pinning = Pinning::of_machine();
    let mut set = CpuSet::new();
    set.set(pinning.load_cpu.parse()?)?;
    sched_setaffinity(Pid::from_raw(0), &set)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    Ok((rt, pinning))
}

/// Which CPUs the proxy and everything else run on.
#[derive(Clone, Copy, Debug)]
pub struct Pinning {
    /// CPUs of the machine (as this process may use them).
    pub cpus: usize,
    /// The proxy's CPU.
    pub proxy_cpu: &'static str,
    /// The upstream's, the load generators' and the driver's.
    pub load_cpu: &'static str,
}

/// What every measurement shares: the upstream process (stopped when dropped), its address, and
/// the `wrk` summary script.
pub struct Stage {
    /// The upstream every proxy fronts.
    pub upstream: Proc,
    upstream_addr: SocketAddr,
    upstream_tls: UpstreamTls,
    wrk_script: PathBuf,
    pinning: Pinning,
    run_dir: PathBuf,
}

impl Stage {
    /// Raises the fd limit, writes the `wrk` script and the run's PKI into `run_dir` and starts
    /// the upstream on the load CPU.
    pub async fn start(run_dir: &Path, pinning: Pinning) -> anyhow::Result<Self> {
        let fds = raise_nofile()?;
        std::fs::create_dir_all(run_dir)?;
        let wrk_script = run_dir.join("summary.lua");
        std::fs::write(&wrk_script, load::WRK_SCRIPT)?;
        eprintln!(
            "poolpilot-bench: fd limit {fds}, proxy on CPU {}, load on CPU {}",
            pinning.proxy_cpu, pinning.load_cpu
        );
        let upstream_addr: SocketAddr = "127.0.0.1:18000".parse()?;
        let Pki {
            ca_file,
            cert_file,
            key_file,
        } = Pki::create(run_dir)?;
        let upstream_tls = UpstreamTls {
            addr: "127.0.0.1:18443".parse()?,
            ca_file,
            server_name: pki::SERVER_NAME.to_owned(),
        };
        let exe = std::env::current_exe()?;
        let mut upstream = Proc::spawn(
            "upstream",
            pinning.load_cpu,
            &exe.display().to_string(),
            &[
                "upstream".to_string(),
                upstream_addr.to_string(),
                format!("--tls={}", upstream_tls.addr),
                format!("--cert={}", cert_file.display()),
                format!("--key={}", key_file.display()),
            ],
            &[],
            &run_dir.join("upstream.log"),
        )?;
        peers::wait_ready(&mut upstream, upstream_addr).await?;
        Ok(Self {
            upstream,
            upstream_addr,
            upstream_tls,
            wrk_script,
            pinning,
            run_dir: run_dir.to_path_buf(),
        })
    }

    /// The benchmark of `gateway_bin` with `plan` on this stage.
    pub fn bench(&self, plan: Plan, gateway_bin: &Path) -> anyhow::Result<Bench> {
        let p = self.pinning;
        Ok(Bench {
            plan,
            env: Env {
                run_dir: self.run_dir.clone(),
                gateway_bin: gateway_bin.to_path_buf(),
                proxy_cpu: p.proxy_cpu.into(),
                all_cpus: format!("0-{}", p.cpus - 1),
            },
            load_cpu: p.load_cpu.into(),
            ticks_per_sec: procs::clock_ticks_per_sec(),
            wrk_script: self.wrk_script.clone(),
            upstream: self.upstream_addr,
            upstream_tls: self.upstream_tls.clone(),
            listen: "127.0.0.1:18080".parse()?,
        })
    }
}

impl Pinning {
    fn of_machine() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (proxy_cpu, load_cpu) = if cpus >= 2 { ("0", "1") } else { ("0", "0") };
        Self {
            cpus,
            proxy_cpu,
            load_cpu,
        }
    }
}

/// Raises the soft fd limit to the hard one (children inherit it).
fn raise_nofile() -> anyhow::Result<u64> {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(hard)
}
