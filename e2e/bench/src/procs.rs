//! Processes under test: started pinned to a core with `taskset`, killed when dropped, and read
//! from `/proc` (CPU ticks from `stat`, `VmRSS` / `VmHWM` from `status`).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::process::{Child, Command};

/// A running process that is killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct Proc {
    /// Short name for messages.
    pub name: String,
    child: Child,
    /// Its pid.
    pub pid: u32,
}

impl Proc {
    /// Starts `program args` pinned to `cpus` (a `taskset -c` list), output appended to `log`.
    pub fn spawn(
        name: &str,
        cpus: &str,
        program: &str,
        args: &[String],
        envs: &[(&str, &str)],
        log: &Path,
    ) -> anyhow::Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new("taskset");
        cmd.arg("-c")
            .arg(cpus)
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({program})"))?;
        let pid = child.id().context("no pid")?;
        Ok(Self {
            name: name.to_string(),
            child,
            pid,
        })
    }

    /// Fails when the process has exited already.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited: {status}", self.name);
        }
        Ok(())
    }

    /// Kills it and waits for it.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    /// CPU time (user + system, all threads) used so far, in clock ticks.
    pub fn cpu_ticks(&self) -> anyhow::Result<u64> {
        cpu_ticks(self.pid)
    }

    /// Peak resident set (`VmHWM`), in KiB.
    pub fn peak_rss_kib(&self) -> anyhow::Result<u64> {
        status_kib(self.pid, "VmHWM:")
    }

    /// Resident set now (`VmRSS`), in KiB.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        status_kib(self.pid, "VmRSS:")
    }
}

/// utime + stime of `pid`, in clock ticks.
pub fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = stat.rsplit_once(')').context("bad stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 of `rest`, from 1.
    let utime: u64 = fields.get(11).context("no utime")?.parse()?;
    let stime: u64 = fields.get(12).context("no stime")?.parse()?;
    Ok(utime + stime)
}

fn status_kib(pid: u32, key: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .with_context(|| format!("no {key} for {pid}"))?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("bad status line")?
        .parse()?)
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux when that is missing).
pub fn clock_ticks_per_sec() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// The first line of a command's output (stdout, else stderr), for the machine description.
pub fn first_line(program: &str, args: &[&str]) -> String {
    match std::process::Command::new(program).args(args).output() {
        Ok(o) => {
            let text = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        }
        Err(_) => format!("{program}: not found"),
    }
}
