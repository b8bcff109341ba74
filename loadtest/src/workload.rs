//! What a run does to the policies (create, edit, delete, and in floor mode the operator's
//! writes) and how it sees them converge.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::FIELD_MANAGER;

use crate::args::{Args, Mode};
use crate::replicas::{Replica, Watched, start_replica};

/// The label on every namespace and policy a run creates; its value is the run's id.
pub const RUN_LABEL: &str = "trafficpolicy.dev/loadtest";

/// Per policy: when its latest generation was sent, and when that generation was Ready.
#[derive(Default)]
pub struct Tracker {
    sent: HashMap<String, (i64, Instant)>,
    pub converged: HashMap<String, (i64, Instant)>,
    pub latencies_ms: Vec<f64>,
    deleted: usize,
    /// The latest generation seen Ready, per policy.
    ready: HashMap<String, i64>,
}

impl Tracker {
    fn sent(&mut self, key: String, generation: i64) {
        self.sent.insert(key.clone(), (generation, Instant::now()));
        // The watch may have shown it Ready before the write's response came back (its
        // latency is then the caller's to measure).
        if self.ready.get(&key).is_some_and(|g| *g >= generation) {
            self.converged.insert(key, (generation, Instant::now()));
        }
    }

    fn observed(&mut self, policy: &ApplicationTrafficPolicy) {
        let key = format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any());
        let generation = policy.metadata.generation.unwrap_or(0);
        let ready = policy.is_ready();
        if ready {
            self.ready.insert(key.clone(), generation);
        }
        let Some(&(wanted, sent)) = self.sent.get(&key) else { return };
        if ready && generation >= wanted && self.converged.get(&key).is_none_or(|(g, _)| *g < wanted) {
            self.converged.insert(key, (wanted, Instant::now()));
            self.latencies_ms.push(sent.elapsed().as_secs_f64() * 1000.0);
        }
    }

    fn pending(&self) -> usize {
        self.sent.iter().filter(|(k, (g, _))| self.converged.get(*k).is_none_or(|(c, _)| c < g)).count()
    }
}

/// A progress bar of policies converged, kept current until the returned task is aborted
/// (invisible when stderr is not a terminal).
pub fn progress(objects: usize, tracker: Arc<Mutex<Tracker>>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let progress = indicatif::ProgressBar::new(objects as u64);
    progress.set_style(indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {pos}/{len} converged {msg}",
    )?);
    Ok(tokio::spawn(async move {
        loop {
            let (converged, sent, pending) = {
                let t = tracker.lock().unwrap();
                (t.converged.len(), t.sent.len(), t.pending())
            };
            progress.set_position(converged as u64);
            progress.set_message(format!("({sent} sent, {pending} pending)"));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }))
}

/// p50, p95 and p99 of `latencies` (milliseconds).
pub fn latency_percentiles(latencies: &[f64]) -> serde_json::Value {
    let sorted = sorted(latencies);
    json!({ "p50": percentile(&sorted, 0.5), "p95": percentile(&sorted, 0.95), "p99": percentile(&sorted, 0.99) })
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

/// The `p` quantile (0 to 1) of `sorted`, nearest rank; 0 when empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// With --gateway: the Gateway every routed policy's route hangs under, in the run's first
/// namespace, and the Service every namespace has, backed by the run's one backend.
pub const GATEWAY: &str = "edge";
pub const SERVICE: &str = "app";

/// The host of policy `i`'s route.
pub fn host(i: usize) -> String {
    format!("app-{i}.load.test")
}

fn policy(i: usize, args: &Args, port: i32) -> anyhow::Result<ApplicationTrafficPolicy> {
    let labels: std::collections::BTreeMap<&str, &str> =
        args.run_label.iter().map(|id| (RUN_LABEL, id.as_str())).collect();
    let mut policy = json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": format!("app-{i}"), "namespace": args.namespace_of(i), "labels": labels },
        "spec": {
            "applicationSelector": { "matchLabels": { "app": format!("app-{i}") } },
            "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"] } }],
                               "ports": [{ "protocol": "HTTP", "port": port }] }],
            "egressRules": [{ "to": [{ "ipBlock": { "cidr": "10.96.0.0/12" } }], "ports": [{ "protocol": "UDP", "port": 53 }] }],
            "rateLimit": { "requestsPerSecond": 100, "burst": 20 }
        }
    });
    if args.gateway.is_some() && i.is_multiple_of(args.route_stride()) {
        policy["spec"]["gateway"] = json!({ "parentRef": { "name": GATEWAY, "namespace": args.namespace_name(0) },
                                            "hostnames": [host(i)], "backendRef": { "name": SERVICE, "port": 80 } });
    }
    Ok(serde_json::from_value(policy)?)
}

/// The floor's events, published as the operator publishes them.
fn floor_events(client: &Client) -> traffic_policy_operator::reconcile::events::Events {
    let reporter = kube::runtime::events::Reporter { controller: "loadtest-floor".into(), instance: None };
    traffic_policy_operator::reconcile::events::Events::new(client.clone(), reporter)
}

pub async fn create_all(client: &Client, args: &Args, tracker: &Arc<Mutex<Tracker>>) -> anyhow::Result<()> {
    let events = floor_events(client);
    futures::stream::iter(0..args.objects)
        .map(|i| {
            let (client, tracker, events) = (client.clone(), tracker.clone(), events.clone());
            async move {
                let policy = policy(i, args, 8080)?;
                let namespace = policy.namespace().unwrap_or_default();
                let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), &namespace);
                tracker.lock().unwrap().sent(format!("{namespace}/app-{i}"), 1);
                let created = api.create(&PostParams::default(), &policy).await.context("create")?;
                if args.mode == Mode::Floor {
                    loadtest::writes::converge_as_the_operator(&client, &events, &created, FIELD_MANAGER).await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<()>()
        .await
}

/// Single edits during the backlog, each waited for: their latencies (ms).
pub async fn edit_during_backlog(
    client: &Client,
    args: &Args,
    tracker: &Arc<Mutex<Tracker>>,
) -> anyhow::Result<Vec<f64>> {
    let mut latencies = Vec::new();
    for n in 0..args.edits {
        latencies.push(edit_and_wait(client, args, tracker, n, 1000 + n as u64).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(latencies)
}

/// Edits the `n`-th policy of a sequence spread over namespaces and over the backlog (its
/// rate set to `rate`, which must differ from its current one) and waits until it is Ready
/// for the new generation: the latency (ms).
pub async fn edit_and_wait(
    client: &Client,
    args: &Args,
    tracker: &Arc<Mutex<Tracker>>,
    n: usize,
    rate: u64,
) -> anyhow::Result<f64> {
    let i = (n * 7919) % args.objects;
    let namespace = args.namespace_of(i);
    let key = format!("{namespace}/app-{i}");
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), &namespace);
    let patch = json!({ "spec": { "rateLimit": { "requestsPerSecond": rate } } });
    let sent = Instant::now();
    let edited = api.patch(&format!("app-{i}"), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    let generation = edited.metadata.generation.unwrap_or(0);
    tracker.lock().unwrap().sent(key.clone(), generation);
    let deadline = sent + Duration::from_secs(args.timeout_seconds);
    loop {
        if tracker.lock().unwrap().converged.get(&key).is_some_and(|(g, _)| *g >= generation) {
            return Ok(sent.elapsed().as_secs_f64() * 1000.0);
        }
        anyhow::ensure!(Instant::now() < deadline, "edit of {key} did not converge");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn edit_percentiles(latencies: Vec<f64>) -> serde_json::Value {
    if latencies.is_empty() {
        return serde_json::Value::Null;
    }
    let sorted = sorted(&latencies);
    let at = |p: f64| percentile(&sorted, p);
    json!({ "count": latencies.len(), "p50": at(0.5), "p99": at(0.99), "max": at(1.0), "each_in_order": latencies })
}

pub(super) async fn delete_all(client: &Client, args: &Args, tracker: &Arc<Mutex<Tracker>>) -> anyhow::Result<()> {
    futures::stream::iter(0..args.objects)
        .map(|i| {
            let client = client.clone();
            async move {
                let namespace = args.namespace_of(i);
                let api = Api::<ApplicationTrafficPolicy>::namespaced(client, &namespace);
                api.delete(&format!("app-{i}"), &Default::default()).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<()>()
        .await?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    while tracker.lock().unwrap().deleted < args.objects {
        anyhow::ensure!(Instant::now() < deadline, "deletions not all seen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

pub(super) async fn update_some(
    client: &Client,
    args: &Args,
    count: usize,
    tracker: &Arc<Mutex<Tracker>>,
) -> anyhow::Result<()> {
    let events = floor_events(client);
    futures::stream::iter(0..count)
        .map(|i| {
            let (client, tracker, events) = (client.clone(), tracker.clone(), events.clone());
            async move {
                let namespace = args.namespace_of(i);
                let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), &namespace);
                let patch = json!({ "spec": { "ingressRules": [{ "ports": [{ "protocol": "TCP", "port": 9090 }] }] } });
                tracker.lock().unwrap().sent(format!("{namespace}/app-{i}"), 2);
                let updated = api.patch(&format!("app-{i}"), &PatchParams::default(), &Patch::Merge(&patch)).await?;
                if args.mode == Mode::Floor {
                    loadtest::writes::converge_as_the_operator(&client, &events, &updated, FIELD_MANAGER).await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<()>()
        .await
}

pub(super) async fn wait_converged(
    tracker: &Arc<Mutex<Tracker>>,
    args: &Args,
    replicas: &mut [Replica],
    cp: &controlplane::ControlPlane,
    mut kill: Option<Instant>,
    pids: &Watched,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    // With capacities: how long the pending policies have matched the leader's unplaced count.
    let mut matched_since: Option<Instant> = None;
    loop {
        let pending = tracker.lock().unwrap().pending();
        if pending == 0 {
            return Ok(());
        }
        if args.capacity.is_some() {
            let matched = pending as u64 == unplaced_reported(replicas);
            matched_since = matched_since.filter(|_| matched).or(matched.then(Instant::now));
            if matched_since.is_some_and(|since| since.elapsed() >= Duration::from_secs(5)) {
                return Ok(());
            }
        }
        if let Some(at) = kill
            && Instant::now() >= at
            && !replicas.is_empty()
        {
            kill = None;
            eprintln!("chaos: kill -9 {}", replicas[0].name);
            replicas[0].process.signal(libc::SIGKILL);
            replicas[0].process.stop(Duration::from_secs(5));
            let name = replicas[0].name.clone();
            replicas[0] = start_replica(cp, args, &name).await?;
            pids.lock().unwrap()[0].1 = replicas[0].process.pid();
            pids.lock().unwrap()[0].2 = replicas[0].metrics_port;
        }
        anyhow::ensure!(Instant::now() < deadline, "not converged after {} s", args.timeout_seconds);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The policies the leader reports that no replica has room for (the others report none).
pub(super) fn unplaced_reported(replicas: &[Replica]) -> u64 {
    let reported = replicas.iter().map(|r| {
        let metrics = controlplane::http_get_plain(r.metrics_port, "/metrics").unwrap_or_default();
        crate::sample::metric(&metrics, "traffic_policy_unplaced_objects") as u64
    });
    reported.max().unwrap_or(0)
}

/// Waits until every policy sent has converged, or `--timeout-seconds` passes.
pub async fn wait_pending(tracker: &Arc<Mutex<Tracker>>, args: &Args) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    while tracker.lock().unwrap().pending() > 0 {
        anyhow::ensure!(Instant::now() < deadline, "not converged after {} s", args.timeout_seconds);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Feeds `tracker` from a watch of the policies (those `labels` selects, if given).
pub async fn track(client: Client, tracker: Arc<Mutex<Tracker>>, labels: Option<String>) {
    let api = Api::<ApplicationTrafficPolicy>::all(client);
    let config = match &labels {
        Some(labels) => watcher::Config::default().labels(labels),
        None => watcher::Config::default(),
    };
    let mut events = watcher(api, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(policy) | watcher::Event::InitApply(policy)) => {
                tracker.lock().unwrap().observed(&policy)
            }
            Ok(watcher::Event::Delete(_)) => tracker.lock().unwrap().deleted += 1,
            _ => {}
        }
    }
}
