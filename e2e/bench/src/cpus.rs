//! What each CPU of the machine did during a run (`/proc/stat`, `/proc/interrupts`): the time
//! others took on the proxy's CPU (the check that has a disturbed run measured again) and the
//! interrupts per request.

use anyhow::Context as _;

/// The counters of every CPU at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuCounters {
    /// Per CPU: the time fields of its `cpuN` line of `/proc/stat`, in clock ticks.
    pub time: Vec<CpuTime>,
    /// Per CPU: the sum of its column of `/proc/interrupts` (device interrupts and IPIs).
    pub interrupts: Vec<u64>,
}

/// One `cpuN` line of `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTime {
    /// user + nice + system: time in tasks (the proxy's own and every other task's).
    pub tasks: u64,
    /// irq + softirq: interrupt handling (the kernel charges it to no task).
    pub interrupts: u64,
    /// steal: time the hypervisor gave to another machine.
    pub steal: u64,
    /// Every field: the time that passed on this CPU.
    pub all: u64,
}

impl CpuCounters {
    /// Reads both files now.
    pub fn read() -> anyhow::Result<Self> {
        let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        let interrupts =
            std::fs::read_to_string("/proc/interrupts").context("reading /proc/interrupts")?;
        Ok(Self {
            time: parse_stat(&stat),
            interrupts: parse_interrupts(&interrupts),
        })
    }
}

/// The `cpuN` lines of `/proc/stat`, in CPU order.
fn parse_stat(text: &str) -> Vec<CpuTime> {
    text.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let f: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .map(|v| v.parse().unwrap_or(0))
                .collect();
            let at = |i: usize| f.get(i).copied().unwrap_or(0);
            // user nice system idle iowait irq softirq steal guest guest_nice; guest time is
            // already inside user (and guest_nice inside nice).
            CpuTime {
                tasks: at(0) + at(1) + at(2),
                interrupts: at(5) + at(6),
                steal: at(7),
                all: (0..8).map(at).sum(),
            }
        })
        .collect()
}

/// The column sums of `/proc/interrupts`: lines with a count for every CPU (`ERR`/`MIS` have one).
fn parse_interrupts(text: &str) -> Vec<u64> {
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |h| h.split_whitespace().count());
    let mut sums = vec![0u64; cpus];
    for line in lines {
        let Some((_, counts)) = line.split_once(':') else {
            continue;
        };
        let counts: Vec<u64> = counts
            .split_whitespace()
            .take(cpus)
            .map_while(|v| v.parse().ok())
            .collect();
        if counts.len() == cpus {
            for (sum, n) in sums.iter_mut().zip(counts) {
                *sum += n;
            }
        }
    }
    sums
}

/// One CPU between two readings, with the proxy's own task time on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRun {
    /// Share of the CPU's time taken by tasks other than the proxy, and by the hypervisor
    /// (steal): 0 on a quiet machine.
    pub others: f64,
    /// Interrupts delivered to the CPU.
    pub interrupts: u64,
}

impl CpuRun {
    /// CPU `cpu` from `before` to `after`, `proxy_ticks` of it the proxy's (user + system).
    pub fn between(
        before: &CpuCounters,
        after: &CpuCounters,
        cpu: usize,
        proxy_ticks: u64,
    ) -> Self {
        let b = before.time.get(cpu).copied().unwrap_or_default();
        let a = after.time.get(cpu).copied().unwrap_or_default();
        let tasks = a.tasks.saturating_sub(b.tasks);
        let steal = a.steal.saturating_sub(b.steal);
        let all = a.all.saturating_sub(b.all).max(1);
        let irq = |c: &CpuCounters| c.interrupts.get(cpu).copied().unwrap_or(0);
        Self {
            others: (tasks.saturating_sub(proxy_ticks) + steal) as f64 / all as f64,
            interrupts: irq(after).saturating_sub(irq(before)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  3838807 282355 336604 2463111 8636 0 46402 98950 0 0\n\
                        cpu0 1920813 141044 168776 1229697 4657 0 22775 49404 0 0\n\
                        cpu1 1917994 141311 167828 1233414 3979 0 23627 49546 0 0\n\
                        intr 123 4 5\nctxt 99\n";

    const INTERRUPTS: &str = "           CPU0       CPU1       \n \
                              24:          1          0  IO-APIC   5-edge      ACPI:Ged\n\
                              LOC:     200     300   Local timer interrupts\n\
                              RES:      10      20   Rescheduling interrupts\n\
                              ERR:          0\n\
                              MIS:          0\n";

    #[test]
    fn every_cpu_line_is_read_and_the_summary_line_is_not() {
        let cpus = parse_stat(STAT);
        assert_eq!(cpus.len(), 2);
        assert_eq!(cpus[0].tasks, 1920813 + 141044 + 168776);
        assert_eq!(cpus[0].interrupts, 22775);
        assert_eq!(cpus[0].steal, 49404);
        assert_eq!(
            cpus[1].all,
            1917994 + 141311 + 167828 + 1233414 + 3979 + 23627 + 49546
        );
    }

    #[test]
    fn interrupts_are_summed_per_cpu_over_the_lines_with_a_count_for_each() {
        assert_eq!(parse_interrupts(INTERRUPTS), vec![211, 320]);
    }

    #[test]
    fn others_are_the_tasks_time_beyond_the_proxys_plus_steal() {
        let at = |tasks, steal, all, irq| CpuCounters {
            time: vec![CpuTime {
                tasks,
                interrupts: 0,
                steal,
                all,
            }],
            interrupts: vec![irq],
        };
        let before = at(1_000, 10, 10_000, 5);
        // 500 ticks passed: 430 in tasks (400 of them the proxy's), 5 stolen.
        let after = at(1_430, 15, 10_500, 905);
        let run = CpuRun::between(&before, &after, 0, 400);
        assert!((run.others - 35.0 / 500.0).abs() < 1e-12, "{run:?}");
        assert_eq!(run.interrupts, 900);
        // The proxy's ticks are sampled too: a count a tick above the CPU's is no negative.
        assert_eq!(CpuRun::between(&before, &after, 0, 431).others, 5.0 / 500.0);
    }
}
