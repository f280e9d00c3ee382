//! Processes under test: started pinned to cores with `taskset` in a process group of their own,
//! the whole group killed when stopped or dropped (nginx's workers with their master), and read
//! from `/proc` over the process and its descendants (user and system ticks from `stat`, `VmRSS` /
//! `VmHWM` from `status`).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// A running process group that is killed (SIGKILL) when stopped or dropped.
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
            .process_group(0)
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

    /// Kills the whole group and waits for the process.
    pub async fn stop(mut self) {
        self.kill_group();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    fn kill_group(&mut self) {
        // Once the process is reaped (`id()` is gone) its group id may belong to another.
        if self.child.id().is_none() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.pid) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.child.start_kill();
    }

    /// CPU time used so far by the process and its descendants (every thread), in clock ticks.
    pub fn cpu_ticks(&self) -> anyhow::Result<Ticks> {
        self.over_tree(cpu_ticks)
    }

    /// Peak resident set (`VmHWM`) of the process and its descendants, in KiB.
    pub fn peak_rss_kib(&self) -> anyhow::Result<u64> {
        self.status_kib("VmHWM:")
    }

    /// Resident set now (`VmRSS`) of the process and its descendants, in KiB.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        self.status_kib("VmRSS:")
    }

    fn status_kib(&self, key: &str) -> anyhow::Result<u64> {
        self.over_tree(|pid| status_kib(pid, key))
    }

    /// The sum of `read` over the process and its descendants. A descendant that exited since
    /// it was listed (gone, or a zombie without memory figures) counts nothing; the process
    /// itself must answer.
    fn over_tree<T: std::ops::Add<Output = T>>(
        &self,
        read: impl Fn(u32) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut sum = read(self.pid)?;
        for pid in descendants(self.pid).into_iter().skip(1) {
            if let Ok(value) = read(pid) {
                sum = sum + value;
            }
        }
        Ok(sum)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// User and system CPU time, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ticks {
    /// `utime`.
    pub user: u64,
    /// `stime`.
    pub system: u64,
}

impl Ticks {
    /// User + system.
    pub fn total(self) -> u64 {
        self.user + self.system
    }

    /// What was used between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

impl std::ops::Add for Ticks {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            user: self.user + other.user,
            system: self.system + other.system,
        }
    }
}

/// `pid` and every process below it (`/proc/<pid>/task/<tid>/children`), parents first.
fn descendants(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while let Some(&p) = all.get(i) {
        let tasks = std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten();
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            all.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
        i += 1;
    }
    all
}

/// utime and stime of `pid` (every thread), in clock ticks.
pub fn cpu_ticks(pid: u32) -> anyhow::Result<Ticks> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = stat.rsplit_once(')').context("bad stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 of `rest`, from 1.
    Ok(Ticks {
        user: fields.get(11).context("no utime")?.parse()?,
        system: fields.get(12).context("no stime")?.parse()?,
    })
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
