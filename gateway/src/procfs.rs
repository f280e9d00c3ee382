//! The process gauges (`process_open_fds`, `process_max_fds`, `process_resident_memory_bytes`)
//! read from `/proc/self`, the way the standard Prometheus process collector does. `None` where
//! `/proc` is unavailable.

use std::fs;

/// `(open, max)`: descriptors open now, and the soft `RLIMIT_NOFILE`.
pub fn fds() -> (Option<u64>, Option<u64>) {
    let open = fs::read_dir("/proc/self/fd")
        .ok()
        .map(|dir| dir.count() as u64);
    let max = fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| max_open_files(&s));
    (open, max)
}

/// Resident memory in bytes (`VmRSS` of `/proc/self/status`).
pub fn resident_bytes() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    vm_rss_bytes(&status)
}

fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The soft limit from the "Max open files" line of `/proc/<pid>/limits`.
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_limits_line() {
        let text = "Limit                     Soft Limit           Hard Limit           Units\n\
                    Max cpu time              unlimited            unlimited            seconds\n\
                    Max open files            1024                 524288               files\n";
        assert_eq!(max_open_files(text), Some(1024));
        assert_eq!(
            max_open_files("Max open files unlimited unlimited files"),
            None
        );
    }

    #[test]
    fn parses_the_resident_set_size() {
        assert_eq!(
            vm_rss_bytes("Name:\tgw\nVmRSS:\t   12345 kB\nThreads:\t2\n"),
            Some(12345 * 1024)
        );
        assert!(resident_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn reads_this_process() {
        let (open, max) = fds();
        let (open, max) = (
            open.expect("/proc is mounted"),
            max.expect("a limit is set"),
        );
        assert!(open >= 3 && open <= max, "{open} of {max}");
    }
}
