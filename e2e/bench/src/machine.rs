//! The machine a benchmark run saw, for its report: the load average and the time it started.

/// The first three fields of `/proc/loadavg` (the 1, 5 and 15-minute load averages); empty when
/// unreadable.
pub fn loadavg() -> String {
    loadavg_of(&std::fs::read_to_string("/proc/loadavg").unwrap_or_default())
}

fn loadavg_of(text: &str) -> String {
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `date -u` as `2026-11-30 12:00 UTC`; empty when `date` cannot run.
pub fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_is_the_three_averages_without_the_task_counts() {
        assert_eq!(loadavg_of("0.52 0.58 0.59 2/345 12345\n"), "0.52 0.58 0.59");
        assert_eq!(loadavg_of(""), "");
        let here = loadavg();
        assert_eq!(here.split(' ').count(), 3, "{here}");
    }

    #[test]
    fn the_start_time_is_a_utc_minute() {
        let now = utc_now();
        assert!(
            now.ends_with(" UTC") && now.len() == "2026-11-30 12:00 UTC".len(),
            "{now}"
        );
    }
}
