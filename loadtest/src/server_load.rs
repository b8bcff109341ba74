//! What a run cost the control plane, from creation to convergence: the CPU-seconds of
//! kube-apiserver, etcd and (when it runs) kube-controller-manager, from /proc; and what
//! kube-apiserver counted on its /metrics: requests by verb and resource, its requests to
//! etcd by operation and kind, and the watch events it sent by kind; and what etcd counted:
//! its gRPC calls by method and the bytes they carried. Set against the floor, which makes
//! the same writes, it shows where an operator's extra time goes.

use std::collections::BTreeMap;

use kube::Client;
use serde_json::json;

use crate::sample::{self, Labels, label};

/// The control plane's counters at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    cpu_seconds: BTreeMap<String, f64>,
    requests: BTreeMap<String, f64>,
    etcd_requests: BTreeMap<String, f64>,
    etcd_calls: BTreeMap<String, f64>,
    watch_events: BTreeMap<String, f64>,
    watch_event_bytes: BTreeMap<String, f64>,
}

pub async fn snapshot(cp: &controlplane::ControlPlane, client: &Client) -> anyhow::Result<Snapshot> {
    let text = sample::apiserver_metrics(client).await?;
    let mut snapshot = Snapshot {
        cpu_seconds: cp
            .pids()
            .into_iter()
            .filter_map(|(name, pid)| Some((name.to_string(), sample::cpu_seconds(pid)?)))
            .collect(),
        ..Default::default()
    };
    for line in text.lines() {
        let Some((name, labels, value)) = sample::parse(line) else { continue };
        let into = match name {
            "apiserver_request_total" => Some((&mut snapshot.requests, requested(&labels))),
            "etcd_requests_total" => Some((
                &mut snapshot.etcd_requests,
                format!("{} {}", label(&labels, "operation"), label(&labels, "type")),
            )),
            "apiserver_watch_events_total" => Some((&mut snapshot.watch_events, watched(&labels))),
            "apiserver_watch_events_sizes_sum" => Some((&mut snapshot.watch_event_bytes, watched(&labels))),
            _ => None,
        };
        if let Some((map, key)) = into {
            *map.entry(key).or_default() += value;
        }
    }
    // Absent when etcd is down (a run that restarts it): its figures are then left out.
    for line in cp.etcd_metrics().unwrap_or_default().lines() {
        let Some((name, labels, value)) = sample::parse(line) else { continue };
        let key = match name {
            "grpc_server_handled_total" => format!("{} {}", label(&labels, "grpc_method"), label(&labels, "grpc_code")),
            "etcd_network_client_grpc_received_bytes_total" => "bytes received".to_string(),
            "etcd_network_client_grpc_sent_bytes_total" => "bytes sent".to_string(),
            _ => continue,
        };
        *snapshot.etcd_calls.entry(key).or_default() += value;
    }
    Ok(snapshot)
}

/// What was spent between `before` and `after`; counters that did not move are left out.
/// A counter that went down or disappeared (kube-apiserver or etcd restarted meanwhile) is
/// named in `went_down`, since the figures then miss what was counted before the restart.
pub fn report(before: &Snapshot, after: &Snapshot) -> serde_json::Value {
    let mut went_down: Vec<String> = Vec::new();
    let mut since = |field: &str, now: &BTreeMap<String, f64>, then: &BTreeMap<String, f64>| {
        let fell = then.iter().filter(|(k, v)| now.get(*k).is_none_or(|n| n < *v));
        went_down.extend(fell.map(|(k, _)| format!("{field} {k}")));
        let moved = now.iter().map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or_default()));
        moved.filter(|(_, v)| *v > 0.0).collect::<BTreeMap<String, f64>>()
    };
    let mut report = json!({
        "cpu_seconds": since("cpu_seconds", &after.cpu_seconds, &before.cpu_seconds),
        "requests": since("requests", &after.requests, &before.requests),
        "etcd_requests": since("etcd_requests", &after.etcd_requests, &before.etcd_requests),
        "etcd_calls": since("etcd_calls", &after.etcd_calls, &before.etcd_calls),
        "watch_events": since("watch_events", &after.watch_events, &before.watch_events),
        "watch_event_bytes": since("watch_event_bytes", &after.watch_event_bytes, &before.watch_event_bytes),
    });
    if !went_down.is_empty() {
        report["went_down"] = json!(went_down);
    }
    report
}

/// The control plane's CPU, the watch events it sent, and the calls to etcd.
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
    let mut summary = format!(
        "  control plane until convergence: CPU-s {}; {requests:.0} requests; watch events sent {total:.0}, most: {}\n",
        cpu.join(", "),
        if events.is_empty() { "none".to_string() } else { events.join(", ") },
    );
    // By etcd method and by kube-apiserver's operation, summed over codes and kinds.
    let by_first_word = |field: &str| -> String {
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        for (key, n) in entries(field).into_iter().filter(|(k, _)| !k.starts_with("bytes")) {
            *sums.entry(key.split(' ').next().unwrap_or_default().to_string()).or_default() += n;
        }
        sums.iter().map(|(k, n)| format!("{k} {n:.0}")).collect::<Vec<_>>().join(", ")
    };
    let etcd_bytes = |key: &str| entries("etcd_calls").iter().find(|(k, _)| k == key).map_or(0.0, |(_, v)| *v);
    summary += &format!(
        "  etcd: calls {}; {:.1} MiB received, {:.1} MiB sent; kube-apiserver's requests to it: {}\n",
        by_first_word("etcd_calls"),
        etcd_bytes("bytes received") / 1048576.0,
        etcd_bytes("bytes sent") / 1048576.0,
        by_first_word("etcd_requests"),
    );
    if let Some(down) = report["went_down"].as_array() {
        summary += &format!("  (counters went down, so these figures are short: {} of them)\n", down.len());
    }
    summary
}

/// `VERB resource.group/subresource` of a request series, or `VERB /path` of a request for
/// no resource (kube-apiserver puts its path in `resource` or in `subresource` then).
fn requested(labels: &Labels<'_>) -> String {
    let (verb, resource, sub) = (label(labels, "verb"), label(labels, "resource"), label(labels, "subresource"));
    if resource.is_empty() || resource.starts_with('/') {
        return format!("{verb} {resource}{sub}");
    }
    let mut key = format!("{verb} {resource}");
    for (separator, part) in [('.', label(labels, "group")), ('/', sub)] {
        if !part.is_empty() {
            key.push(separator);
            key.push_str(part);
        }
    }
    key
}

/// The kind (or resource) a watch-event series is about, with its group.
fn watched(labels: &Labels<'_>) -> String {
    let what = match label(labels, "kind") {
        "" => label(labels, "resource"),
        kind => kind,
    };
    match label(labels, "group") {
        "" => what.to_string(),
        group => format!("{what}.{group}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_requests_and_watched_kinds() {
        let labels = |line: &'static str| sample::parse(line).unwrap().1;
        let status = labels(
            r#"apiserver_request_total{group="trafficpolicy.dev",resource="applicationtrafficpolicies",subresource="status",verb="PATCH"} 1"#,
        );
        assert_eq!(requested(&status), "PATCH applicationtrafficpolicies.trafficpolicy.dev/status");
        let core = labels(r#"apiserver_request_total{group="",resource="configmaps",subresource="",verb="APPLY"} 1"#);
        assert_eq!(requested(&core), "APPLY configmaps");
        let path = labels(r#"apiserver_request_total{group="",resource="",subresource="/metrics",verb="GET"} 1"#);
        assert_eq!(requested(&path), "GET /metrics");
        let path = labels(r#"apiserver_request_total{group="",resource="/openapi/v3",subresource="",verb="GET"} 1"#);
        assert_eq!(requested(&path), "GET /openapi/v3");
        assert_eq!(
            watched(&vec![("group", "trafficpolicy.dev"), ("kind", "ApplicationTrafficPolicy")]),
            "ApplicationTrafficPolicy.trafficpolicy.dev"
        );
    }

    #[test]
    fn reports_only_what_moved() {
        let mut before = Snapshot::default();
        before.requests.insert("APPLY configmaps".into(), 10.0);
        before.requests.insert("GET leases".into(), 5.0);
        before.etcd_calls.insert("Range OK".into(), 100.0);
        before.etcd_requests.insert("get /registry/configmaps".into(), 10.0);
        let mut after = before.clone();
        *after.requests.get_mut("APPLY configmaps").unwrap() += 7.0;
        *after.etcd_calls.get_mut("Range OK").unwrap() += 3.0;
        after.etcd_calls.insert("Range NotFound".into(), 1.0);
        after.etcd_calls.insert("bytes sent".into(), 2097152.0);
        *after.etcd_requests.get_mut("get /registry/configmaps").unwrap() += 5.0;
        let report = report(&before, &after);
        assert_eq!(report["requests"], json!({ "APPLY configmaps": 7.0 }));
        let text = summary(&report);
        assert!(text.contains("7 requests"));
        assert!(text.contains("etcd: calls Range 4; 0.0 MiB received, 2.0 MiB sent"), "{text}");
        assert!(text.contains("requests to it: get 5"), "{text}");
        assert!(report.get("went_down").is_none());

        // After a restart: one counter lower, one not counted again yet.
        let mut restarted = after.clone();
        restarted.requests = BTreeMap::from([("APPLY configmaps".into(), 2.0)]);
        let report = super::report(&after, &restarted);
        assert_eq!(report["went_down"], json!(["requests APPLY configmaps", "requests GET leases"]));
        assert!(summary(&report).contains("counters went down"));
    }
}
