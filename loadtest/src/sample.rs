//! Samples of a running process: CPU and memory from /proc, and series read from a
//! Prometheus exposition (a replica's queue depth and cache size, kube-apiserver's counters).

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
    /// The anonymous part of `rss_bytes`: the heap and stacks, without the mapped code of the
    /// binary and its libraries (which the kernel reads ahead, so it depends on the binary's size).
    pub anon_rss_bytes: u64,
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

/// A process's memory from /proc/PID/status, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    pub rss: u64,
    /// RssAnon: the part of `rss` that is neither mapped files nor shared memory (0 before Linux 4.5).
    pub anon_rss: u64,
}

pub fn memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some(Memory { rss: field("VmRSS:")?, anon_rss: field("RssAnon:").unwrap_or(0) })
}

/// How many series an exposition holds.
pub fn series_count(exposition: &str) -> usize {
    exposition.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).count()
}

/// The sum of every series of `name` in a Prometheus text exposition.
pub fn metric(exposition: &str, name: &str) -> f64 {
    metric_where(exposition, name, |_| true)
}

/// The sum of the series of a work-queue or controller metric `name` of the controllers that
/// reconcile policies: the operator's leader also runs two labelling controllers
/// (`namespace-labels`, `policy-labels`) in label mode, which the measures leave out.
pub fn policy_controllers_metric(exposition: &str, name: &str) -> f64 {
    metric_where(exposition, name, |labels| {
        !matches!(label(labels, "controller"), "namespace-labels" | "policy-labels")
    })
}

/// The sum of the series of `name` whose labels `keep` accepts.
pub fn metric_where(exposition: &str, name: &str, keep: impl Fn(&Labels<'_>) -> bool) -> f64 {
    exposition
        .lines()
        .filter_map(parse)
        .filter(|(series, labels, _)| *series == name && keep(labels))
        .map(|(_, _, value)| value)
        .sum()
}

/// kube-apiserver's own /metrics exposition.
pub async fn apiserver_metrics(client: &kube::Client) -> anyhow::Result<String> {
    Ok(client.request_text(http::Request::get("/metrics").body(Vec::new())?).await?)
}

/// A series' labels, as (name, value) pairs.
pub type Labels<'a> = Vec<(&'a str, &'a str)>;

/// The value of one label, or "" when the series has none.
pub fn label<'a>(labels: &Labels<'a>, key: &str) -> &'a str {
    labels.iter().find(|(k, _)| *k == key).map_or("", |(_, v)| *v)
}

/// `name{a="b",c="d"} value [timestamp]` → (name, labels, value); `None` for comments. The
/// label values read here hold no commas, braces or escaped quotes, which keeps this short.
pub fn parse(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    if line.starts_with('#') {
        return None;
    }
    let (series, rest) = match line.rfind('}') {
        Some(end) => line.split_at(end + 1),
        None => line.split_once(' ')?,
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let labels = labels
        .split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            Some((k, v.trim_matches('"')))
        })
        .collect();
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        assert!(cpu_seconds(std::process::id()).is_some());
        let memory = memory(std::process::id()).unwrap();
        assert!(memory.anon_rss > 0 && memory.rss >= memory.anon_rss);
    }

    #[test]
    fn sums_metric_series() {
        let text =
            "# HELP x y\nworkqueue_depth{name=\"a\"} 3\nworkqueue_depth{name=\"b\"} 4\nworkqueue_depth_other 9\n";
        assert_eq!(metric(text, "workqueue_depth"), 7.0);
        assert_eq!(metric_where(text, "workqueue_depth", |l| label(l, "name") == "b"), 4.0);
    }

    #[test]
    fn reads_a_series_and_its_labels() {
        let (name, labels, value) =
            parse(r#"apiserver_request_total{code="201",resource="configmaps",subresource="",verb="APPLY"} 42"#)
                .unwrap();
        assert_eq!(name, "apiserver_request_total");
        assert_eq!(value, 42.0);
        assert_eq!((label(&labels, "verb"), label(&labels, "subresource"), label(&labels, "group")), ("APPLY", "", ""));
        assert_eq!(parse("# HELP x y"), None);
        // The exposition format allows a timestamp after the value.
        let (name, labels, value) = parse(r#"workqueue_depth{name="a"} 3 1764777600000"#).unwrap();
        assert_eq!((name, label(&labels, "name"), value), ("workqueue_depth", "a", 3.0));
        assert_eq!(parse("process_cpu_seconds_total 1.5 1764777600000").map(|(_, _, v)| v), Some(1.5));
        assert_eq!(parse(r#"go_info{version="go 1.25"} 1"#).map(|(_, l, _)| label(&l, "version")), Some("go 1.25"));
    }
}
