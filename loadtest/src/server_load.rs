//! What a run cost the control plane, from creation to convergence: the CPU-seconds of
//! kube-apiserver and etcd (from /proc), and what kube-apiserver counted on its /metrics:
//! requests by verb and resource, and the watch events it sent by kind. Set against the
//! floor, which makes the same writes, it shows where an operator's extra time goes.

use std::collections::BTreeMap;

use kube::Client;
use serde_json::json;

use crate::sample;

/// The control plane's counters at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    cpu_seconds: BTreeMap<String, f64>,
    requests: BTreeMap<String, f64>,
    watch_events: BTreeMap<String, f64>,
    watch_event_bytes: BTreeMap<String, f64>,
}

pub async fn snapshot(cp: &controlplane::ControlPlane, client: &Client) -> anyhow::Result<Snapshot> {
    let text = client.request_text(http::Request::get("/metrics").body(Vec::new())?).await?;
    let mut snapshot = Snapshot {
        cpu_seconds: cp
            .pids()
            .into_iter()
            .filter_map(|(name, pid)| Some((name.to_string(), sample::cpu_seconds(pid)?)))
            .collect(),
        ..Default::default()
    };
    for line in text.lines() {
        let Some((name, labels, value)) = parse(line) else { continue };
        let label = |key: &str| labels.iter().find(|(k, _)| *k == key).map_or("", |(_, v)| *v);
        let into = match name {
            "apiserver_request_total" => {
                let resource = match label("subresource") {
                    "" => label("resource").to_string(),
                    sub => format!("{}/{sub}", label("resource")),
                };
                Some((&mut snapshot.requests, format!("{} {resource}", label("verb"))))
            }
            "apiserver_watch_events_total" => Some((&mut snapshot.watch_events, watched(&labels))),
            "apiserver_watch_events_sizes_sum" => Some((&mut snapshot.watch_event_bytes, watched(&labels))),
            _ => None,
        };
        if let Some((map, key)) = into {
            *map.entry(key).or_default() += value;
        }
    }
    Ok(snapshot)
}

/// What was spent between `before` and `after`; counters that did not move are left out.
pub fn report(before: &Snapshot, after: &Snapshot) -> serde_json::Value {
    let since = |now: &BTreeMap<String, f64>, then: &BTreeMap<String, f64>| -> BTreeMap<String, f64> {
        now.iter()
            .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or_default()))
            .filter(|(_, v)| *v > 0.0)
            .collect()
    };
    json!({
        "cpu_seconds": since(&after.cpu_seconds, &before.cpu_seconds),
        "requests": since(&after.requests, &before.requests),
        "watch_events": since(&after.watch_events, &before.watch_events),
        "watch_event_bytes": since(&after.watch_event_bytes, &before.watch_event_bytes),
    })
}

/// Two lines: the control plane's CPU, and the watch events it sent.
pub fn summary(report: &serde_json::Value) -> String {
    let entries = |field: &str| -> Vec<(String, f64)> {
        report[field]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or_default()))
            .collect()
    };
    let cpu: Vec<String> = entries("cpu_seconds").iter().map(|(k, v)| format!("{k} {v:.1}")).collect();
    let bytes = entries("watch_event_bytes");
    let all_events = entries("watch_events");
    let total: f64 = all_events.iter().map(|(_, n)| n).sum();
    // The kinds that carried at least 1 % of the events: the rest is the cluster's own chatter.
    let events: Vec<String> = all_events
        .iter()
        .filter(|(_, n)| *n >= total / 100.0)
        .map(|(k, n)| {
            let size = bytes.iter().find(|(b, _)| b == k).map_or(0.0, |(_, v)| *v);
            format!("{k} {n:.0} ({:.1} MiB)", size / 1048576.0)
        })
        .collect();
    let requests: f64 = entries("requests").iter().map(|(_, v)| v).sum();
    format!(
        "  control plane until convergence: CPU-s {}; {requests:.0} requests; watch events sent {total:.0}, most: {}\n",
        cpu.join(", "),
        if events.is_empty() { "none".to_string() } else { events.join(", ") },
    )
}

/// The kind (or resource) a watch-event series is about, with its group.
fn watched(labels: &[(&str, &str)]) -> String {
    let label = |key: &str| labels.iter().find(|(k, _)| *k == key).map_or("", |(_, v)| *v);
    let what = if label("kind").is_empty() { label("resource") } else { label("kind") };
    match label("group") {
        "" => what.to_string(),
        group => format!("{what}.{group}"),
    }
}

/// A series' labels, as (name, value) pairs.
type Labels<'a> = Vec<(&'a str, &'a str)>;

/// `name{a="b",c="d"} value` → (name, labels, value). Label values here hold no commas or
/// escaped quotes, which keeps this short.
fn parse(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    if line.starts_with('#') {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value = value.parse().ok()?;
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
    fn reads_a_series_and_its_labels() {
        let (name, labels, value) =
            parse(r#"apiserver_request_total{code="201",resource="configmaps",subresource="",verb="APPLY"} 42"#)
                .unwrap();
        assert_eq!(name, "apiserver_request_total");
        assert_eq!(value, 42.0);
        assert!(labels.contains(&("verb", "APPLY")) && labels.contains(&("subresource", "")));
        assert_eq!(parse("# HELP x y"), None);
        assert_eq!(
            watched(&[("group", "trafficpolicy.dev"), ("kind", "ApplicationTrafficPolicy")]),
            "ApplicationTrafficPolicy.trafficpolicy.dev"
        );
    }

    #[test]
    fn reports_only_what_moved() {
        let mut before = Snapshot::default();
        before.requests.insert("APPLY configmaps".into(), 10.0);
        before.requests.insert("GET leases".into(), 5.0);
        let mut after = before.clone();
        *after.requests.get_mut("APPLY configmaps").unwrap() += 7.0;
        let report = report(&before, &after);
        assert_eq!(report["requests"], json!({ "APPLY configmaps": 7.0 }));
        assert!(summary(&report).contains("7 requests"));
    }
}
