//! Reads the replicas' audit logs and checks the sharding guarantees against them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct Entry {
    pub t: u128,
    pub replica: String,
    pub incarnation: String,
    pub event: String,
    pub object: String,
    pub detail: String,
}

pub fn read_all(dir: &Path) -> Vec<Entry> {
    let mut entries = Vec::new();
    for file in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(file.unwrap().path()).unwrap();
        // A running replica may be writing its last line as we read (a line that crosses a
        // page can be seen half written): only lines ended by a newline are whole.
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        for line in whole.lines() {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("bad audit line {line:?}: {e}"));
            let field = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            entries.push(Entry {
                t: field("t").parse().unwrap(),
                replica: field("replica"),
                incarnation: field("incarnation"),
                event: field("event"),
                object: field("object"),
                detail: field("detail"),
            });
        }
    }
    entries.sort_by_key(|e| e.t);
    entries
}

/// A replica's reconcile of one object, from start to end.
#[derive(Clone, Debug)]
pub struct Interval {
    pub replica: String,
    pub object: String,
    pub start: u128,
    pub end: u128,
}

/// Reconcile intervals. `forced_ends` are the moments the test ended a replica's work from
/// outside: a `kill -9`, or the renew deadline of a frozen replica (whose writes after that
/// are checked separately). A reconcile still open then ends there; one never ended ends at
/// `cut`.
pub fn reconcile_intervals(entries: &[Entry], forced_ends: &[(u128, String)], cut: u128) -> Vec<Interval> {
    let mut open: BTreeMap<(String, String), u128> = BTreeMap::new();
    let mut intervals = Vec::new();
    let mut ends: Vec<&(u128, String)> = forced_ends.iter().collect();
    ends.sort();
    let mut ends = ends.into_iter().peekable();
    for e in entries {
        while let Some((t, replica)) = ends.next_if(|(t, _)| *t <= e.t) {
            let closed: Vec<(String, String)> =
                open.keys().filter(|(incarnation, _)| pod_of(incarnation) == replica).cloned().collect();
            for key in closed {
                let start = open.remove(&key).expect("listed");
                intervals.push(Interval { replica: key.0, object: key.1, start, end: *t });
            }
        }
        // Processes, not pod names: two processes with one pod name are two writers.
        let key = (e.incarnation.clone(), e.object.clone());
        match e.event.as_str() {
            "reconcile_start" => {
                open.insert(key, e.t);
            }
            "reconcile_end" => {
                if let Some(start) = open.remove(&key) {
                    intervals.push(Interval { replica: key.0, object: key.1, start, end: e.t });
                }
            }
            _ => {}
        }
    }
    intervals.extend(open.into_iter().map(|((replica, object), start)| Interval { replica, object, start, end: cut }));
    intervals
}

/// The pod an incarnation (`<pod>_<nonce>`) runs as.
pub fn pod_of(incarnation: &str) -> &str {
    incarnation.rsplit_once('_').map_or(incarnation, |(pod, _)| pod)
}

/// Pairs of reconciles of one object by two processes at overlapping times.
pub fn overlaps(intervals: &[Interval]) -> Vec<(Interval, Interval)> {
    let mut by_object: BTreeMap<&str, Vec<&Interval>> = BTreeMap::new();
    for i in intervals {
        by_object.entry(&i.object).or_default().push(i);
    }
    let mut found = Vec::new();
    for list in by_object.values_mut() {
        list.sort_by_key(|i| i.start);
        // Sweep: compare each interval with those still running when it starts.
        let mut running: Vec<&Interval> = Vec::new();
        for i in list.iter() {
            running.retain(|r| r.end > i.start);
            for r in &running {
                if r.replica != i.replica {
                    found.push(((*r).clone(), (*i).clone()));
                }
            }
            running.push(i);
        }
    }
    found
}

/// The buckets each replica announced as owned over time: (t, replica, buckets).
pub fn ownership_changes(entries: &[Entry]) -> Vec<(u128, String, BTreeSet<u16>)> {
    entries.iter().filter(|e| e.event == "owned").map(|e| (e.t, e.replica.clone(), parse_ranges(&e.detail))).collect()
}

pub fn parse_ranges(text: &str) -> BTreeSet<u16> {
    text.split(',')
        .filter(|p| !p.is_empty())
        .flat_map(|p| match p.split_once('-') {
            Some((a, b)) => a.parse::<u16>().unwrap()..=b.parse::<u16>().unwrap(),
            None => p.parse::<u16>().unwrap()..=p.parse::<u16>().unwrap(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(replica: &str, start: u128, end: u128) -> Interval {
        Interval { replica: replica.into(), object: "ns/a".into(), start, end }
    }

    #[test]
    fn finds_overlaps_between_replicas_only() {
        assert!(overlaps(&[interval("a", 0, 10), interval("a", 5, 15)]).is_empty());
        assert!(overlaps(&[interval("a", 0, 10), interval("b", 10, 15)]).is_empty());
        assert_eq!(overlaps(&[interval("a", 0, 10), interval("b", 9, 15)]).len(), 1);
        assert_eq!(parse_ranges("0-2,7"), BTreeSet::from([0, 1, 2, 7]));
    }
}
