//! `loadtest run --handoff`: what moving buckets costs, after convergence. One more replica
//! joins and then leaves again (3 → 4 → 3 with `--replicas 3`), while single edits go on one
//! at a time. For each of the two handoffs it reports, per replica, the policies its lists
//! brought (`traffic_policy_listed_objects_total`) against the policies of the buckets it
//! gained, in every assignment the leader published meanwhile (read from a watch of the
//! assignment); the policies that changed owner between the first and the last assignment;
//! and the latency of the edits made meanwhile.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use serde_json::json;
use tokio_util::task::AbortOnDropHandle;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::coordination::published::record_published;
use traffic_policy_operator::sharding::assignment::Assignment;
use traffic_policy_operator::sharding::membership::pod_of;

use crate::args::{Args, OPERATOR_NAMESPACE};
use crate::replicas::{Replica, Watched, start_replica};
use crate::sample::{self, label};
use crate::workload::{Tracker, edit_and_wait, edit_percentiles};

/// The target of docs/benchmarks.md for an edit made during a handoff.
const EDIT_P99_TARGET_MS: f64 = 1000.0;

/// Per replica: (policies its lists brought so far, policies it caches).
type Counts = Vec<(String, f64, f64)>;

fn counts(replicas: &[Replica]) -> Counts {
    replicas
        .iter()
        .map(|r| {
            let text = controlplane::http_get_plain(r.metrics_port, "/metrics").unwrap_or_default();
            let listed = sample::metric_where(&text, "traffic_policy_listed_objects_total", |l| {
                label(l, "resource") == "ApplicationTrafficPolicy"
            });
            (r.name.clone(), listed, sample::metric(&text, "traffic_policy_cached_objects"))
        })
        .collect()
}

/// Waits until the leader has settled, and every replica's cache gauge shows its share of
/// every policy (each gauge refreshes every 5 s: one that shows nothing has not counted yet,
/// and one that still shows its share from before the handoff makes the sum differ).
async fn settled(client: &Client, args: &Args, replicas: &[Replica], what: &str) -> anyhow::Result<Counts> {
    crate::balance::settle(client, args, OPERATOR_NAMESPACE, Duration::from_secs(300)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let now = counts(replicas);
        let cached: f64 = now.iter().map(|(_, _, c)| c).sum();
        if now.iter().all(|(_, _, c)| *c > 0.0) && cached as usize == args.objects {
            return Ok(now);
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the caches did not settle after {what}: {now:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Policies the API server has returned in lists so far, whether from its watch cache or
/// from etcd: the cost of handoffs as the server sees it, whichever operator build lists.
async fn server_listed(client: &Client) -> anyhow::Result<f64> {
    let text = sample::apiserver_metrics(client).await?;
    let policies = |labels: &sample::Labels<'_>| labels.iter().any(|(_, v)| v.contains("applicationtrafficpolicies"));
    Ok(["apiserver_cache_list_returned_objects_total", "apiserver_storage_list_returned_objects_total"]
        .into_iter()
        .map(|counter| sample::metric_where(&text, counter, policies))
        .sum())
}

/// What a handoff cost, from the replicas' counts before and after it and the assignments
/// published from its start to its end.
fn cost(args: &Args, before: &Counts, after: &Counts, history: &[Assignment], server_listed: f64) -> serde_json::Value {
    let created = crate::balance::created_per_namespace(args);
    let (Some(first), Some(last)) = (history.first(), history.last()) else { return serde_json::Value::Null };
    let per_bucket = first.count(&created);
    let policies = |bucket: u16| f64::from(per_bucket.get(&bucket).copied().unwrap_or(0));
    // Each replica gains a bucket whenever an assignment gives it one that the previous did not.
    let mut gained: BTreeMap<&str, f64> = BTreeMap::new();
    for (member, bucket) in Assignment::gains_over(history) {
        *gained.entry(pod_of(member)).or_default() += policies(bucket);
    }
    let net_moved: f64 = last.gained_since(first).into_iter().map(|(_, bucket)| policies(bucket)).sum();
    let replicas: Vec<serde_json::Value> = after
        .iter()
        .map(|(name, listed, cached)| {
            let listed_before = before.iter().find(|(n, _, _)| n == name).map_or(0.0, |(_, l, _)| *l);
            json!({
                "replica": name,
                "listed": listed - listed_before,
                "gained": gained.get(name.as_str()).copied().unwrap_or_default(),
                "slice": cached,
            })
        })
        .collect();
    let sum = |field: &str| replicas.iter().map(|r| r[field].as_f64().unwrap_or_default()).sum::<f64>();
    let (listed, gained) = (sum("listed"), sum("gained"));
    json!({
        "replicas": replicas,
        "listed": listed,
        "server_listed": server_listed,
        "gained": gained,
        "listed_over_gained": listed / gained.max(1.0),
        "net_moved": net_moved,
        "assignments": history.len(),
        "generations": [first.generation, last.generation],
    })
}

/// The assignments recorded since the `from`-th, and how many there are now.
fn since(recorded: &Mutex<Vec<Assignment>>, from: usize) -> (Vec<Assignment>, usize) {
    let recorded = recorded.lock().unwrap();
    // The phase starts from the last assignment before it.
    (recorded[from.saturating_sub(1)..].to_vec(), recorded.len())
}

pub async fn measure(
    cp: &controlplane::ControlPlane,
    client: &Client,
    args: &Args,
    replicas: &mut Vec<Replica>,
    pids: &Watched,
    tracker: &Arc<Mutex<Tracker>>,
) -> anyhow::Result<serde_json::Value> {
    let before = settled(client, args, replicas, "convergence").await?;
    let (recorded, recorder) =
        record_published(Api::<ConfigMap>::namespaced(client.clone(), OPERATOR_NAMESPACE), ASSIGNMENT_CONFIGMAP);
    let recorder = AbortOnDropHandle::new(recorder);
    tokio::time::timeout(Duration::from_secs(30), async {
        while recorded.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("no assignment seen"))?;
    let start = recorded.lock().unwrap().len();
    let listed_at_start = server_listed(client).await?;
    // Edits one at a time, 100 ms apart, through both handoffs.
    let stop = Arc::new(AtomicBool::new(false));
    let editor = {
        let (client, args, tracker, stop) = (client.clone(), args.clone(), tracker.clone(), stop.clone());
        AbortOnDropHandle::new(tokio::spawn(async move {
            let mut latencies = Vec::new();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                latencies.push(edit_and_wait(&client, &args, &tracker, n, 500_000 + n as u64).await?);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(latencies)
        }))
    };

    let name = format!("load-{}", replicas.len());
    eprintln!("handoff: starting {name}...");
    let joined = start_replica(cp, args, &name).await?;
    pids.lock().unwrap().push((name.clone(), joined.process.pid(), joined.metrics_port));
    replicas.push(joined);
    let grown = settled(client, args, replicas, &format!("{name} joined")).await?;
    let (join_history, joined_at) = since(&recorded, start);
    let listed_at_join = server_listed(client).await?;

    eprintln!("handoff: stopping {name}...");
    let mut leaving = replicas.pop().expect("the replica that joined");
    let status = leaving.process.stop(Duration::from_secs(30));
    anyhow::ensure!(status.is_some_and(|s| s.success()), "{name} did not exit 0 on SIGTERM: {status:?}");
    pids.lock().unwrap().retain(|(n, _, _)| *n != name);
    let shrunk = settled(client, args, replicas, &format!("{name} left")).await?;
    let (leave_history, _) = since(&recorded, joined_at);
    let listed_at_end = server_listed(client).await?;
    recorder.abort();

    stop.store(true, Ordering::Relaxed);
    let latencies = editor.await??;
    let edits = edit_percentiles(latencies);
    let p99 = edits["p99"].as_f64().unwrap_or(f64::INFINITY);
    Ok(json!({
        "join": cost(args, &before, &grown, &join_history, listed_at_join - listed_at_start),
        "leave": cost(args, &grown, &shrunk, &leave_history, listed_at_end - listed_at_join),
        "edit_latency_ms": edits,
        "edit_p99_target_ms": EDIT_P99_TARGET_MS,
        "edit_p99_pass": p99 <= EDIT_P99_TARGET_MS,
    }))
}

/// The text summary of a handoff measurement.
pub fn summary(handoff: &serde_json::Value) -> String {
    let n = |v: &serde_json::Value| format!("{:.0}", v.as_f64().unwrap_or_default().abs());
    let mut text = String::new();
    for (phase, what) in [("join", "a replica joins"), ("leave", "it leaves again")] {
        let h = &handoff[phase];
        let each: Vec<String> = h["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let name = r["replica"].as_str().unwrap_or_default();
                format!("{name} listed {} / gained {} (slice {})", n(&r["listed"]), n(&r["gained"]), n(&r["slice"]))
            })
            .collect();
        text += &format!(
            "  handoff, {what}: {} policies listed ({} by the API server's count) for {} gained in {} assignments ({:.2}); {} changed owner from the first to the last: {}\n",
            n(&h["listed"]),
            n(&h["server_listed"]),
            n(&h["gained"]),
            h["assignments"],
            h["listed_over_gained"].as_f64().unwrap_or_default(),
            n(&h["net_moved"]),
            each.join(", ")
        );
    }
    let edits = &handoff["edit_latency_ms"];
    text += &format!(
        "  handoff, edits meanwhile: {} edits, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (target p99 ≤ {:.0} ms: {})\n",
        edits["count"],
        edits["p50"].as_f64().unwrap_or_default(),
        edits["p99"].as_f64().unwrap_or_default(),
        edits["max"].as_f64().unwrap_or_default(),
        EDIT_P99_TARGET_MS,
        if handoff["edit_p99_pass"].as_bool() == Some(true) { "pass" } else { "fail" }
    );
    text
}
