//! `loadtest run --handoff`: what moving buckets costs, after convergence. One more replica
//! joins and then leaves again (3 → 4 → 3 with `--replicas 3`), while single edits go on one
//! at a time. For each of the two handoffs it reports, per replica, the policies its lists
//! brought (`traffic_policy_listed_objects_total`) against the policies it gained, and the
//! latency of the edits made meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use serde_json::json;

use crate::run::{Args, OPERATOR_NAMESPACE, Replica, Tracker, Watched, edit_and_wait, edit_percentiles, start_replica};

/// The target of docs/benchmarks.md for an edit made during a handoff.
const EDIT_P99_TARGET_MS: f64 = 1000.0;

/// Per replica: (policies its lists brought so far, policies it caches).
type Counts = Vec<(String, f64, f64)>;

fn counts(replicas: &[Replica]) -> Counts {
    replicas
        .iter()
        .map(|r| {
            let text = controlplane::http_get_plain(r.metrics_port, "/metrics").unwrap_or_default();
            let listed = text
                .lines()
                .filter(|l| {
                    l.starts_with("traffic_policy_listed_objects_total{") && l.contains("ApplicationTrafficPolicy")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            (r.name.clone(), listed, crate::sample::metric(&text, "traffic_policy_cached_objects"))
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

/// Each replica's policies listed and gained between `before` and `after`.
fn moved(before: &Counts, after: &Counts) -> serde_json::Value {
    let replicas: Vec<serde_json::Value> = after
        .iter()
        .map(|(name, listed, cached)| {
            let (listed_before, cached_before) =
                before.iter().find(|(n, _, _)| n == name).map_or((0.0, 0.0), |(_, l, c)| (*l, *c));
            json!({
                "replica": name,
                "listed": listed - listed_before,
                "gained": (cached - cached_before).max(0.0),
                "slice": cached,
            })
        })
        .collect();
    let sum = |field: &str| replicas.iter().map(|r| r[field].as_f64().unwrap_or_default()).sum::<f64>();
    let (listed, gained) = (sum("listed"), sum("gained"));
    json!({ "replicas": replicas, "listed": listed, "gained": gained, "listed_over_gained": listed / gained.max(1.0) })
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
    // Edits one at a time, 100 ms apart, through both handoffs.
    let stop = Arc::new(AtomicBool::new(false));
    let editor = {
        let (client, args, tracker, stop) = (client.clone(), args.clone(), tracker.clone(), stop.clone());
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                latencies.push(edit_and_wait(&client, &args, &tracker, n, 500_000 + n as u64).await?);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(latencies)
        })
    };

    let name = format!("r-{}", replicas.len());
    eprintln!("handoff: starting {name}...");
    let joined = start_replica(cp, args, &name).await?;
    pids.lock().unwrap().push((name.clone(), joined.process.pid(), joined.metrics_port));
    replicas.push(joined);
    let grown = settled(client, args, replicas, &format!("{name} joined")).await?;

    eprintln!("handoff: stopping {name}...");
    let mut leaving = replicas.pop().expect("the replica that joined");
    let status = leaving.process.stop(Duration::from_secs(30));
    anyhow::ensure!(status.is_some_and(|s| s.success()), "{name} did not exit 0 on SIGTERM: {status:?}");
    pids.lock().unwrap().retain(|(n, _, _)| *n != name);
    let shrunk = settled(client, args, replicas, &format!("{name} left")).await?;

    stop.store(true, Ordering::Relaxed);
    let latencies = editor.await??;
    let edits = edit_percentiles(latencies);
    let p99 = edits["p99"].as_f64().unwrap_or(f64::INFINITY);
    Ok(json!({
        "join": moved(&before, &grown),
        "leave": moved(&grown, &shrunk),
        "edit_latency_ms": edits,
        "edit_p99_target_ms": EDIT_P99_TARGET_MS,
        "edit_p99_pass": p99 <= EDIT_P99_TARGET_MS,
    }))
}

/// The text summary of a handoff measurement.
pub fn summary(handoff: &serde_json::Value) -> String {
    let mut text = String::new();
    for (phase, what) in [("join", "a replica joins"), ("leave", "it leaves again")] {
        let h = &handoff[phase];
        let each: Vec<String> = h["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| format!("{} listed {} / gained {} (slice {})", r["replica"], r["listed"], r["gained"], r["slice"]))
            .collect();
        text += &format!(
            "  handoff, {what}: {} policies listed for {} gained ({:.2}): {}\n",
            h["listed"],
            h["gained"],
            h["listed_over_gained"].as_f64().unwrap_or_default(),
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
