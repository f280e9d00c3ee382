//! The four proxy benchmarks (overhead and throughput, pool under contention,
//! streaming, idle connections) and the gateway profile (part 4b, TLS to the upstream, is
//! `tls_upstream.rs`). Every run starts a fresh proxy; proxies
//! run in alternating order (reversed every round) so that drift in the machine's load spreads
//! over all of them, and the report takes medians over rounds. A part-1 run in which other tasks
//! (or the hypervisor) took more than [`DISTURBED`] of the proxy's CPU is measured again, up to
//! [`ATTEMPTS`] times, and the least disturbed attempt is kept.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;

use crate::cpus::{CpuCounters, CpuRun};
use crate::load::{self, Call, LoadResult, Stream};
use crate::peers::{self, Env, PeerSettings, Target, UpstreamTls};
use crate::procs::Proc;
use crate::stats::{median, percentile};

/// The share of the proxy's CPU that others may take in a run of part 1 before it is measured
/// again.
pub const DISTURBED: f64 = 0.03;

/// Attempts at a disturbed run of part 1.
pub const ATTEMPTS: usize = 3;

/// The most idle connections HAProxy holds under a hard fd limit of 20,000 (its `maxconn` 9,990
/// needs 19,994 fds).
pub const HAPROXY_MAX_IDLE: usize = 9_900;

/// Durations and sizes; `quick` shrinks all of them to validate the harness.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Validation mode.
    pub quick: bool,
    /// Rounds of part 1.
    pub rounds: usize,
    /// Rounds of the part-1 rows whose spread is reported (`spread_concurrency`).
    pub spread_rounds: usize,
    /// The closed-loop rows run `spread_rounds` times.
    pub spread_concurrency: Vec<u32>,
    /// The closed-loop rows run again with two workers per proxy.
    pub two_worker_concurrency: Vec<u32>,
    /// Seconds per measured run of part 1.
    pub secs: f64,
    /// Warm-up seconds before each measured run of part 1.
    pub warmup_secs: f64,
    /// Concurrency levels of part 1.
    pub concurrency: Vec<u32>,
    /// The fixed rate of part 1 (requests/s) and its connections.
    pub rate: u32,
    /// Connections of the fixed-rate row.
    pub rate_conns: u32,
    /// Rounds and seconds of part 2.
    pub contention_rounds: usize,
    /// Seconds per run of part 2.
    pub contention_secs: f64,
    /// Rounds of part 3.
    pub sse_rounds: usize,
    /// Concurrent streams, events per stream and ms between events, part 3.
    pub sse_streams: usize,
    /// Events per stream.
    pub sse_events: u32,
    /// Milliseconds between events.
    pub sse_every_ms: u32,
    /// Rounds of part 4b.
    pub tls_rounds: usize,
    /// Client connections of part 4b's rows.
    pub tls_concurrency: Vec<u32>,
    /// Seconds per measured run of part 4b.
    pub tls_secs: f64,
    /// Rounds and connections of part 4.
    pub idle_rounds: usize,
    /// Idle connections per proxy.
    pub idle_conns: usize,
    /// Seconds of `perf record`.
    pub profile_secs: u32,
}

impl Plan {
    /// The full plan (parts 1–4 in about 10 minutes) or the quick one (about 2).
    pub fn new(quick: bool, rate: u32) -> Self {
        if quick {
            Self {
                quick,
                rounds: 1,
                spread_rounds: 1,
                spread_concurrency: vec![1, 16],
                two_worker_concurrency: vec![64],
                secs: 2.0,
                warmup_secs: 1.0,
                concurrency: vec![1, 16, 64, 256],
                rate,
                rate_conns: 16,
                contention_rounds: 1,
                contention_secs: 3.0,
                sse_rounds: 1,
                sse_streams: 16,
                sse_events: 50,
                sse_every_ms: 20,
                tls_rounds: 1,
                tls_concurrency: vec![16, 64],
                tls_secs: 2.0,
                idle_rounds: 1,
                idle_conns: 2_000,
                profile_secs: 3,
            }
        } else {
            Self {
                quick,
                rounds: 3,
                spread_rounds: 5,
                spread_concurrency: vec![1, 16],
                two_worker_concurrency: vec![64],
                secs: 5.0,
                warmup_secs: 1.0,
                concurrency: vec![1, 16, 64, 256],
                rate,
                rate_conns: 16,
                contention_rounds: 3,
                contention_secs: 10.0,
                sse_rounds: 2,
                sse_streams: 16,
                sse_events: 200,
                sse_every_ms: 20,
                tls_rounds: 3,
                tls_concurrency: vec![16, 64],
                tls_secs: 5.0,
                idle_rounds: 2,
                idle_conns: 10_000,
                profile_secs: 8,
            }
        }
    }

    /// Idle connections opened to `target` in part 4: HAProxy reserves two fds per connection
    /// under its `maxconn` and refuses to start when they exceed the hard fd limit, so it holds
    /// at most [`HAPROXY_MAX_IDLE`].
    pub fn idle_conns_of(&self, target: Target) -> usize {
        if target == Target::Haproxy {
            self.idle_conns.min(HAPROXY_MAX_IDLE)
        } else {
            self.idle_conns
        }
    }

    /// Part 1's rows in the order they run, each with its rounds.
    pub fn part1_rows(&self) -> Vec<(Row, usize)> {
        let rounds = |c: &u32| {
            if self.spread_concurrency.contains(c) {
                self.spread_rounds.max(self.rounds)
            } else {
                self.rounds
            }
        };
        let mut rows: Vec<(Row, usize)> = self
            .concurrency
            .iter()
            .map(|c| (Row::Concurrency(*c), rounds(c)))
            .collect();
        rows.push((Row::Rate(self.rate), self.rounds));
        rows.extend(
            self.two_worker_concurrency
                .iter()
                .map(|&c| (Row::TwoWorkers(c), self.rounds)),
        );
        rows
    }
}

/// Shared state of a run.
#[derive(Debug)]
pub struct Bench {
    /// Sizes.
    pub plan: Plan,
    /// Paths and pinning.
    pub env: Env,
    /// The core(s) of the upstream and the load generators.
    pub load_cpu: String,
    /// Clock ticks per second of `/proc/<pid>/stat`.
    pub ticks_per_sec: u64,
    /// The `wrk` script.
    pub wrk_script: PathBuf,
    /// Where the upstream listens.
    pub upstream: SocketAddr,
    /// Where and how it serves TLS (part 4b).
    pub upstream_tls: UpstreamTls,
    /// Where the proxy under test listens.
    pub listen: SocketAddr,
}

/// A row of part 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    /// Closed loop at this many connections.
    Concurrency(u32),
    /// Open loop at this rate.
    Rate(u32),
    /// Closed loop at this many connections, every proxy with two workers on both CPUs.
    TwoWorkers(u32),
}

/// The suffix of a 2-worker row's label.
const TWO_WORKERS: &str = ", 2 workers";

impl Row {
    /// Display label.
    pub fn label(self) -> String {
        match self {
            Self::Concurrency(c) => format!("c={c}"),
            Self::Rate(r) => format!("{r} req/s"),
            Self::TwoWorkers(c) => format!("c={c}{TWO_WORKERS}"),
        }
    }

    /// The row a [`Row::label`] names.
    pub fn parse(label: &str) -> anyhow::Result<Self> {
        let closed = |c: &str| c.parse().with_context(|| format!("load {label:?}"));
        if let Some(c) = label
            .strip_suffix(TWO_WORKERS)
            .and_then(|l| l.strip_prefix("c="))
        {
            Ok(Self::TwoWorkers(closed(c)?))
        } else if let Some(c) = label.strip_prefix("c=") {
            Ok(Self::Concurrency(closed(c)?))
        } else if let Some(r) = label.strip_suffix(" req/s") {
            Ok(Self::Rate(closed(r)?))
        } else {
            anyhow::bail!("unknown load {label:?}")
        }
    }

    /// Workers of every proxy in this row.
    pub fn workers(self) -> u32 {
        if matches!(self, Self::TwoWorkers(_)) {
            2
        } else {
            1
        }
    }

    /// A closed-loop row with one worker: the rows the targets are judged on.
    pub fn is_judged_closed_loop(self) -> bool {
        matches!(self, Self::Concurrency(_))
    }
}

/// One measured run of part 1.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Which row.
    pub row: Row,
    /// Which target.
    pub target: Target,
    /// The load generator's figures.
    pub load: LoadResult,
    /// Proxy CPU seconds per 10k completed requests (NaN for direct).
    pub cpu_per_10k: f64,
    /// Proxy peak RSS, KiB (NaN for direct).
    pub peak_rss_kib: f64,
    /// The proxy's CPU time per request, µs, in user mode and in the kernel (NaN for direct).
    pub user_us: f64,
    /// In the kernel.
    pub system_us: f64,
    /// Interrupts (device and inter-processor) delivered to the proxy's CPUs per request.
    pub interrupts_per_req: f64,
    /// Share of the proxy's CPU taken by others (other tasks, steal); NaN when the proxy ran on
    /// every CPU (the 2-worker rows), where no CPU is the proxy's alone.
    pub others: f64,
    /// Runs made for this sample (more than one when a run was disturbed).
    pub attempts: usize,
}

impl Sample {
    /// A sample known only by what a report's main table shows (a committed report read back):
    /// the CPU split, interrupts and disturbance unknown.
    pub fn from_table(
        row: Row,
        target: Target,
        load: LoadResult,
        cpu_per_10k: f64,
        peak_rss_kib: f64,
    ) -> Self {
        Self {
            row,
            target,
            load,
            cpu_per_10k,
            peak_rss_kib,
            user_us: f64::NAN,
            system_us: f64::NAN,
            interrupts_per_req: f64::NAN,
            others: f64::NAN,
            attempts: 1,
        }
    }
}

/// One run of part 2.
#[derive(Clone, Debug)]
pub struct ContentionRun {
    /// Which proxy.
    pub target: Target,
    /// Successful calls per second.
    pub completed_per_s: f64,
    /// Queue wait (send → upstream receipt) p50 and p99, µs.
    pub queue_p50_us: f64,
    /// p99 of the same.
    pub queue_p99_us: f64,
    /// End-to-end latency p99, µs.
    pub latency_p99_us: f64,
    /// Failed calls / all calls.
    pub error_rate: f64,
    /// Largest |share − 1/clients| relative to the fair share, per cent.
    pub share_deviation_pct: f64,
    /// Successful calls per client.
    pub per_client: Vec<u64>,
}

/// One run of part 3.
#[derive(Clone, Debug)]
pub struct SseRun {
    /// Which target.
    pub target: Target,
    /// Time to first event over the streams: p50 and max, µs.
    pub ttfb_p50_us: f64,
    /// Worst stream.
    pub ttfb_max_us: f64,
    /// Per-event transit (upstream write → client read): p50, p99, p99.9, µs.
    pub transit_p50_us: f64,
    /// p99.
    pub transit_p99_us: f64,
    /// p99.9.
    pub transit_p999_us: f64,
    /// Streams that received every event.
    pub complete: usize,
    /// Streams started.
    pub streams: usize,
}

/// One run of part 4.
#[derive(Clone, Debug)]
pub struct IdleRun {
    /// Which proxy.
    pub target: Target,
    /// Whether the proxy kept its upstream connections (`false`: the upstream closed each one
    /// after its answer, so only the client connections are held).
    pub pooled: bool,
    /// RSS before the connections, KiB.
    pub base_kib: u64,
    /// RSS with them open, KiB.
    pub loaded_kib: u64,
    /// Connections opened.
    pub opened: usize,
    /// Still open when RSS was read.
    pub still_open: usize,
}

impl IdleRun {
    /// Bytes of RSS per idle connection.
    pub fn bytes_per_conn(&self) -> f64 {
        (self.loaded_kib as f64 - self.base_kib as f64) * 1024.0 / self.opened.max(1) as f64
    }
}

/// The profile of the gateway at peak throughput.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// The `perf report` text, or why there is none.
    pub text: String,
    /// The top symbol lines.
    pub top: Vec<String>,
    /// The load during it.
    pub load: Option<LoadResult>,
    /// The concurrency used.
    pub conns: u32,
}

/// The proxies in round `round`'s order: reversed on odd rounds.
pub(crate) fn order(targets: &[Target], round: usize) -> Vec<Target> {
    let mut t = targets.to_vec();
    if round % 2 == 1 {
        t.reverse();
    }
    t
}

impl Bench {
    fn settings(&self, cap: u32) -> PeerSettings {
        PeerSettings {
            listen: self.listen,
            upstream: self.upstream,
            cap,
            queue_timeout_s: 5,
            idle_timeout_s: 60,
            workers: 1,
            upstream_tls: None,
        }
    }

    /// The settings of part 1 (cap 256 = the largest concurrency, so nothing queues).
    pub fn part1_settings(&self) -> PeerSettings {
        self.settings(256)
    }

    /// The settings of part 1 with `workers` per proxy.
    pub fn part1_settings_with(&self, workers: u32) -> PeerSettings {
        PeerSettings {
            workers,
            ..self.part1_settings()
        }
    }

    /// The settings of part 2.
    pub fn part2_settings(&self) -> PeerSettings {
        self.settings(32)
    }

    /// Where `target` is reached.
    fn addr(&self, target: Target) -> SocketAddr {
        if target == Target::Direct {
            self.upstream
        } else {
            self.listen
        }
    }

    pub(crate) async fn start(
        &self,
        target: Target,
        s: &PeerSettings,
    ) -> anyhow::Result<Option<Proc>> {
        if target == Target::Direct {
            return Ok(None);
        }
        Ok(Some(peers::start(target, s, &self.env).await?))
    }

    async fn drive(&self, row: Row, addr: SocketAddr, secs: f64) -> anyhow::Result<LoadResult> {
        let url = format!("http://{addr}/v1/fast");
        match row {
            Row::Concurrency(c) | Row::TwoWorkers(c) => {
                load::wrk(
                    &self.load_cpu,
                    &load::wrk_args(&self.wrk_script, c, secs, &url),
                )
                .await
            }
            Row::Rate(r) => load::fixed_rate(addr, "/v1/fast", r, self.plan.rate_conns, secs).await,
        }
    }

    /// Part 1: every row × every target × its rounds.
    pub async fn part1(&self) -> anyhow::Result<Vec<Sample>> {
        let targets = [
            Target::Direct,
            Target::Poolpilot,
            Target::Haproxy,
            Target::Nginx,
        ];
        let rows = self.plan.part1_rows();
        let most = rows.iter().map(|&(_, r)| r).max().unwrap_or(0);
        let mut samples = Vec::new();
        for round in 0..most {
            for &(row, rounds) in &rows {
                if round >= rounds {
                    continue;
                }
                for target in order(&targets, round) {
                    samples.push(self.part1_sample(row, target, round).await?);
                }
            }
        }
        Ok(samples)
    }

    /// One sample of part 1: a run, measured again while others disturbed it (up to
    /// [`ATTEMPTS`], the least disturbed kept).
    pub async fn part1_sample(
        &self,
        row: Row,
        target: Target,
        round: usize,
    ) -> anyhow::Result<Sample> {
        let mut best: Option<Sample> = None;
        for attempt in 1..=ATTEMPTS {
            let mut sample = self.part1_run(row, target).await?;
            sample.attempts = attempt;
            eprintln!(
                "part1 round {round} {:>17} {:>9}: {:>9.0} req/s p50 {:.3} ms p99 {:.3} ms \
                 p99.9 {:.3} ms errors {} cpu/10k {:.3} s (user {:.1} + sys {:.1} µs/req, \
                 {:.2} irq/req), others {:.1}%",
                row.label(),
                target.name(),
                sample.load.rps,
                sample.load.p50_us / 1e3,
                sample.load.p99_us / 1e3,
                sample.load.p999_us / 1e3,
                sample.load.errors,
                sample.cpu_per_10k,
                sample.user_us,
                sample.system_us,
                sample.interrupts_per_req,
                sample.others * 100.0,
            );
            // Direct-to-upstream leaves the proxy's CPU idle: nothing to disturb.
            let disturbed = target != Target::Direct && sample.others > DISTURBED;
            if best.as_ref().is_none_or(|b| sample.others < b.others) {
                best = Some(sample);
            }
            if !disturbed {
                break;
            }
            eprintln!(
                "part1: others took more than {:.0}% of the proxy's CPU: measured again",
                DISTURBED * 100.0
            );
        }
        best.context("no attempt ran")
    }

    /// One measured run of part 1: a fresh proxy, the warm-up, the measured load, and what the
    /// proxy's CPU did meanwhile.
    async fn part1_run(&self, row: Row, target: Target) -> anyhow::Result<Sample> {
        let settings = self.part1_settings_with(row.workers());
        let proc = self.start(target, &settings).await?;
        let addr = self.addr(target);
        let warm = match row {
            Row::Rate(_) => Row::Concurrency(self.plan.rate_conns),
            closed => closed,
        };
        self.drive(warm, addr, self.plan.warmup_secs).await?;
        let ticks0 = proc.as_ref().map(Proc::cpu_ticks).transpose()?;
        let cpus0 = CpuCounters::read()?;
        let result = self.drive(row, addr, self.plan.secs).await?;
        let cpus1 = CpuCounters::read()?;
        let ticks = match (&proc, ticks0) {
            (Some(p), Some(t0)) => Some(p.cpu_ticks()?.since(t0)),
            _ => None,
        };
        let rss = proc.as_ref().map(Proc::peak_rss_kib).transpose()?;
        if let Some(p) = proc {
            p.stop().await;
        }
        // The proxy's CPUs: the one it is pinned to, or every one with two workers.
        let cpus: Vec<usize> = if row.workers() > 1 {
            (0..cpus0.time.len()).collect()
        } else {
            vec![self.env.proxy_cpu.parse().context("the proxy's CPU")?]
        };
        let requests = result.requests.max(1) as f64;
        let per_req = |t: u64| t as f64 * 1e6 / self.ticks_per_sec as f64 / requests;
        let interrupts: u64 = cpus
            .iter()
            .map(|&c| CpuRun::between(&cpus0, &cpus1, c, 0).interrupts)
            .sum();
        let others = match (ticks, cpus.as_slice()) {
            (Some(t), &[cpu]) => CpuRun::between(&cpus0, &cpus1, cpu, t.total()).others,
            // Direct: the proxy's CPU should stay idle; what others did there is shown anyway.
            (None, &[cpu]) => CpuRun::between(&cpus0, &cpus1, cpu, 0).others,
            _ => f64::NAN,
        };
        Ok(Sample {
            row,
            target,
            cpu_per_10k: ticks.map_or(f64::NAN, |t| per_req(t.total()) / 100.0),
            peak_rss_kib: rss.map_or(f64::NAN, |r| r as f64),
            user_us: ticks.map_or(f64::NAN, |t| per_req(t.user)),
            system_us: ticks.map_or(f64::NAN, |t| per_req(t.system)),
            interrupts_per_req: if target == Target::Direct {
                f64::NAN
            } else {
                interrupts as f64 / requests
            },
            others,
            attempts: 1,
            load: result,
        })
    }

    /// Part 2: 4 clients × 32 connections against a cap of 32 and a 50 ms service time.
    pub async fn part2(&self) -> anyhow::Result<Vec<ContentionRun>> {
        let targets = [Target::Poolpilot, Target::Haproxy];
        let s = self.part2_settings();
        let clients = 4;
        let mut runs = Vec::new();
        for round in 0..self.plan.contention_rounds {
            for target in order(&targets, round) {
                let proc = self.start(target, &s).await?;
                let secs = self.plan.contention_secs;
                let calls = load::contention(self.listen, "/v1/slow?ms=50", clients, 32, secs)
                    .await
                    .context("contention load")?;
                if let Some(p) = proc {
                    p.stop().await;
                }
                let run = contention_summary(target, &calls, clients, secs);
                eprintln!(
                    "part2 round {round} {:>9}: {:.1} completed/s queue p99 {:.1} ms errors {:.3}% \
                     share deviation {:.1}% {:?}",
                    target.name(),
                    run.completed_per_s,
                    run.queue_p99_us / 1e3,
                    run.error_rate * 100.0,
                    run.share_deviation_pct,
                    run.per_client,
                );
                runs.push(run);
            }
        }
        Ok(runs)
    }

    /// Part 3: concurrent SSE streams through each target.
    pub async fn part3(&self) -> anyhow::Result<Vec<SseRun>> {
        let targets = [
            Target::Direct,
            Target::Poolpilot,
            Target::Haproxy,
            Target::Nginx,
        ];
        let s = self.settings(64);
        let mut runs = Vec::new();
        for round in 0..self.plan.sse_rounds {
            for target in order(&targets, round) {
                let proc = self.start(target, &s).await?;
                let streams = load::sse(
                    self.addr(target),
                    self.plan.sse_streams,
                    self.plan.sse_events,
                    self.plan.sse_every_ms,
                )
                .await
                .with_context(|| format!("SSE through {}", target.name()))?;
                if let Some(p) = proc {
                    p.stop().await;
                }
                let run = sse_summary(target, &streams);
                eprintln!(
                    "part3 round {round} {:>9}: ttfb p50 {:.3} ms transit p50 {:.3} p99 {:.3} ms, \
                     {}/{} complete",
                    target.name(),
                    run.ttfb_p50_us / 1e3,
                    run.transit_p50_us / 1e3,
                    run.transit_p99_us / 1e3,
                    run.complete,
                    run.streams,
                );
                runs.push(run);
            }
        }
        Ok(runs)
    }

    /// Part 4: RSS with many idle keep-alive client connections, each after one call whose
    /// upstream connection the proxy keeps (`pooled`), or one the upstream closes.
    pub async fn part4(&self) -> anyhow::Result<Vec<IdleRun>> {
        let targets = [Target::Poolpilot, Target::Haproxy, Target::Nginx];
        // Above the 128 connections opened at a time: nginx answers 502 past `max_conns`.
        let s = self.settings(256);
        let mut runs = Vec::new();
        let mut source = 20u8;
        for round in 0..self.plan.idle_rounds {
            for (target, pooled) in order(&targets, round)
                .into_iter()
                .flat_map(|t| [(t, true), (t, false)])
            {
                let proc = self.start(target, &s).await?.context("a proxy is needed")?;
                tokio::time::sleep(Duration::from_millis(500)).await;
                let base_kib = proc.rss_kib()?;
                // A fresh source address per run: the ports of the last one may be in TIME_WAIT.
                let from = IpAddr::V4(Ipv4Addr::new(127, 0, 1, source));
                source = source.wrapping_add(1).max(20);
                let path = if pooled { "/v1/fast" } else { "/v1/close" };
                let conns =
                    load::open_idle(self.listen, from, path, self.plan.idle_conns_of(target))
                        .await
                        .with_context(|| format!("idle connections to {}", target.name()))?;
                tokio::time::sleep(Duration::from_secs(2)).await;
                let loaded_kib = proc.rss_kib()?;
                let still_open = load::still_open(&conns);
                let run = IdleRun {
                    target,
                    pooled,
                    base_kib,
                    loaded_kib,
                    opened: conns.len(),
                    still_open,
                };
                drop(conns);
                proc.stop().await;
                eprintln!(
                    "part4 round {round} {:>9} ({}): {} → {} KiB with {} idle connections ({} \
                     still open): {:.0} bytes each",
                    target.name(),
                    if run.pooled {
                        "pooled"
                    } else {
                        "upstream closed"
                    },
                    run.base_kib,
                    run.loaded_kib,
                    run.opened,
                    run.still_open,
                    run.bytes_per_conn(),
                );
                runs.push(run);
            }
        }
        Ok(runs)
    }

    /// `perf record` of the gateway under `wrk` at `conns` connections.
    pub async fn profile(&self, conns: u32) -> anyhow::Result<Profile> {
        let perf_ok = std::process::Command::new("perf")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !perf_ok {
            return Ok(Profile {
                text: "perf is not available on this machine: no profile.\n".into(),
                ..Profile::default()
            });
        }
        let s = self.part1_settings();
        let proc = peers::start(Target::Poolpilot, &s, &self.env).await?;
        let data = self.env.run_dir.join("perf.data");
        let secs = self.plan.profile_secs;
        let load = self.drive(Row::Concurrency(conns), self.listen, f64::from(secs) + 2.0);
        let record = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::process::Command::new("perf")
                .args(["record", "-e", "cpu-clock", "-F", "999", "-g", "-o"])
                .arg(&data)
                .arg("-p")
                .arg(proc.pid.to_string())
                .arg("--")
                .args(["sleep", &secs.to_string()])
                .output()
                .await
        };
        let (load, record) = tokio::join!(load, record);
        proc.stop().await;
        let record = record.context("perf record")?;
        anyhow::ensure!(
            record.status.success(),
            "perf record failed: {}",
            String::from_utf8_lossy(&record.stderr)
        );
        let report = |sort: &'static str| {
            tokio::process::Command::new("perf")
                .args([
                    "report",
                    "--stdio",
                    "--no-children",
                    "-g",
                    "none",
                    "--sort",
                    sort,
                    "--percent-limit",
                    "0.5",
                    "-i",
                ])
                .arg(&data)
                .output()
        };
        let by_dso = report("dso").await.context("perf report")?;
        let by_symbol = report("dso,symbol").await.context("perf report")?;
        let clean = |out: &std::process::Output| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|l| l.trim_end_matches([' ', '-']))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let dso_text = clean(&by_dso);
        let symbol_text = clean(&by_symbol);
        let entries = |text: &str, n: usize| -> Vec<String> {
            text.lines()
                .filter(|l| !l.starts_with('#') && l.contains('%'))
                .take(n)
                .map(|l| l.trim().to_string())
                .collect()
        };
        let mut top = entries(&dso_text, 6);
        top.push(String::new());
        top.extend(entries(&symbol_text, 20));
        // Who calls the top symbol: the call graph of the hottest entry.
        let hottest = entries(&symbol_text, 1)
            .first()
            .and_then(|l| l.rsplit_once("] ").map(|(_, sym)| sym.trim().to_string()))
            .unwrap_or_default();
        let callers = if hottest.is_empty() {
            String::new()
        } else {
            let out = tokio::process::Command::new("perf")
                .args(["report", "--stdio", "--no-children", "-S", &hottest])
                .args(["-g", "caller,0.5,callee", "--percent-limit", "5", "-i"])
                .arg(&data)
                .output()
                .await
                .context("perf report -g")?;
            clean(&out)
        };
        let text = format!(
            "# poolpilot-gateway under wrk -c{conns}: perf record -e cpu-clock -F 999 -g, {secs} s\n\
             # by shared object\n{dso_text}\n\n# by shared object and symbol (self time)\n\
             {symbol_text}\n\n# call graph of the hottest symbol ({hottest})\n{callers}\n"
        );
        Ok(Profile {
            text,
            top,
            load: load.ok(),
            conns,
        })
    }
}

/// Summarises one contention run.
pub fn contention_summary(
    target: Target,
    calls: &[Call],
    clients: usize,
    secs: f64,
) -> ContentionRun {
    let ok: Vec<&Call> = calls.iter().filter(|c| c.ok).collect();
    let mut queue: Vec<u64> = ok.iter().filter_map(|c| c.queue_us).collect();
    let mut latency: Vec<u64> = ok.iter().map(|c| c.latency_us).collect();
    let mut per_client = vec![0u64; clients];
    for c in &ok {
        per_client[c.client] += 1;
    }
    let total: u64 = per_client.iter().sum();
    let fair = 1.0 / clients as f64;
    let share_deviation_pct = per_client
        .iter()
        .map(|&n| ((n as f64 / total.max(1) as f64) - fair).abs() / fair * 100.0)
        .fold(0.0, f64::max);
    ContentionRun {
        target,
        completed_per_s: ok.len() as f64 / secs,
        queue_p50_us: percentile(&mut queue, 50.0),
        queue_p99_us: percentile(&mut queue, 99.0),
        latency_p99_us: percentile(&mut latency, 99.0),
        error_rate: (calls.len() - ok.len()) as f64 / calls.len().max(1) as f64,
        share_deviation_pct,
        per_client,
    }
}

/// Summarises one streaming run.
pub fn sse_summary(target: Target, streams: &[Stream]) -> SseRun {
    let mut ttfb: Vec<u64> = streams.iter().map(|s| s.ttfb_us).collect();
    let mut transit: Vec<u64> = streams
        .iter()
        .flat_map(|s| s.transit_us.iter().copied())
        .collect();
    SseRun {
        target,
        ttfb_p50_us: percentile(&mut ttfb, 50.0),
        ttfb_max_us: percentile(&mut ttfb, 100.0),
        transit_p50_us: percentile(&mut transit, 50.0),
        transit_p99_us: percentile(&mut transit, 99.0),
        transit_p999_us: percentile(&mut transit, 99.9),
        complete: streams.iter().filter(|s| s.complete).count(),
        streams: streams.len(),
    }
}

/// Medians over rounds of one (row, target) of part 1.
#[derive(Clone, Copy, Debug)]
pub struct Cell {
    /// req/s.
    pub rps: f64,
    /// Latency percentiles, µs.
    pub p50: f64,
    /// 99th.
    pub p99: f64,
    /// 99.9th.
    pub p999: f64,
    /// Proxy CPU seconds per 10k requests.
    pub cpu: f64,
    /// Peak RSS, KiB.
    pub rss_kib: f64,
    /// Failed requests over every round.
    pub errors: u64,
    /// Proxy CPU µs per request in user mode.
    pub user_us: f64,
    /// In the kernel.
    pub system_us: f64,
    /// Interrupts on the proxy's CPUs per request.
    pub interrupts_per_req: f64,
    /// The largest share of the proxy's CPU others took in a kept run.
    pub others_max: f64,
    /// Runs measured again because others disturbed them.
    pub redone: usize,
    /// The rounds.
    pub runs: usize,
    /// The lowest and highest req/s over the rounds.
    pub rps_range: (f64, f64),
    /// The lowest and highest CPU per request over the rounds, s per 10k requests.
    pub cpu_range: (f64, f64),
    /// The lowest and highest p99 over the rounds, µs.
    pub p99_range: (f64, f64),
}

/// The medians of `target`'s runs in `row`.
pub fn cell(samples: &[Sample], row: Row, target: Target) -> Cell {
    let runs: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.row == row && s.target == target)
        .collect();
    let m = |f: &dyn Fn(&Sample) -> f64| median(&runs.iter().map(|s| f(s)).collect::<Vec<_>>());
    let range = |f: &dyn Fn(&Sample) -> f64| {
        runs.iter()
            .map(|s| f(s))
            .fold((f64::NAN, f64::NAN), |(lo, hi), x| (lo.min(x), hi.max(x)))
    };
    Cell {
        user_us: m(&|s| s.user_us),
        system_us: m(&|s| s.system_us),
        interrupts_per_req: m(&|s| s.interrupts_per_req),
        others_max: runs.iter().map(|s| s.others).fold(f64::NAN, f64::max),
        redone: runs.iter().map(|s| s.attempts.saturating_sub(1)).sum(),
        runs: runs.len(),
        rps_range: range(&|s| s.load.rps),
        cpu_range: range(&|s| s.cpu_per_10k),
        p99_range: range(&|s| s.load.p99_us),
        rps: m(&|s| s.load.rps),
        p50: m(&|s| s.load.p50_us),
        p99: m(&|s| s.load.p99_us),
        p999: m(&|s| s.load.p999_us),
        cpu: m(&|s| s.cpu_per_10k),
        rss_kib: m(&|s| s.peak_rss_kib),
        errors: runs.iter().map(|s| s.load.errors).sum(),
    }
}

/// The rows of part 1 in the order they ran.
pub fn rows(samples: &[Sample]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for s in samples {
        if !rows.contains(&s.row) {
            rows.push(s.row);
        }
    }
    rows
}
