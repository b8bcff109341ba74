//! Samples of a running replica: CPU and memory from /proc, queue depth and cache size
//! from its /metrics.

use serde::Serialize;

/// Clock ticks per second for /proc/PID/stat times (sysconf(_SC_CLK_TCK), 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    pub replica: String,
    pub cpu_seconds: f64,
    pub rss_bytes: u64,
    pub queue_depth: f64,
    pub cached_objects: f64,
    /// Series in the replica's /metrics exposition (comment lines excluded).
    pub series: usize,
}

pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split(' ').collect();
    // After the command: utime is field 14, stime 15 of stat(5), i.e. indexes 11 and 12 here.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / TICKS_PER_SECOND)
}

/// (current RSS, peak RSS) in bytes.
pub fn memory(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// How many series an exposition holds.
pub fn series_count(exposition: &str) -> usize {
    exposition.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).count()
}

/// The sum of every series of `name` in a Prometheus text exposition.
pub fn metric(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .filter(|line| line.split(['{', ' ']).next() == Some(name))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        assert!(cpu_seconds(std::process::id()).is_some());
        let (rss, peak) = memory(std::process::id()).unwrap();
        assert!(rss > 0 && peak >= rss);
    }

    #[test]
    fn sums_metric_series() {
        let text =
            "# HELP x y\nworkqueue_depth{name=\"a\"} 3\nworkqueue_depth{name=\"b\"} 4\nworkqueue_depth_other 9\n";
        assert_eq!(metric(text, "workqueue_depth"), 7.0);
    }
}
