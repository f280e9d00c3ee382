//! The process fd gauges (`process_open_fds`, `process_max_fds`) read from `/proc/self`, the
//! way the standard Prometheus process collector does. `None` where `/proc` is unavailable.

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
    fn reads_this_process() {
        let (open, max) = fds();
        let (open, max) = (
            open.expect("/proc is mounted"),
            max.expect("a limit is set"),
        );
        assert!(open >= 3 && open <= max, "{open} of {max}");
    }
}
