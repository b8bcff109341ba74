//! `loadtest run --kubeconfig PATH`: the same load on a cluster where the operator already
//! runs. Nothing is started or stopped there: the run creates its policies in namespaces of
//! its own, labelled with the run's id, measures convergence, and deletes those namespaces
//! at the end, also on Ctrl-C and on failure. The operator's queue depth is read from its
//! pods' `/metrics` through the API server's pod proxy. With `--slo FILE`, the run exits
//! non-zero when a threshold is missed, naming it, as kube-burner and clusterloader2 do.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::json;
use tokio_util::task::AbortOnDropHandle;
use traffic_policy_operator::api::ApplicationTrafficPolicy;

use crate::args::{Args, Mode};
use crate::interrupt::Interrupted;
use crate::sample;
use crate::workload::{
    RUN_LABEL, Tracker, create_all, edit_during_backlog, edit_percentiles, latency_percentiles, progress, track,
    wait_pending,
};

/// Thresholds a run must meet (`--slo FILE`, YAML); each is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub struct Slo {
    /// 99th percentile of the time from a policy's write to its Ready status, in seconds.
    pub convergence_p99_seconds: Option<f64>,
    /// Policies not Ready at the end (not converged, or Ready=False).
    pub max_errors: Option<usize>,
    /// The deepest any operator replica's high-priority queue lane got during the run.
    pub max_queue_depth: Option<f64>,
}

impl Slo {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        serde_saphyr::from_str(&text).with_context(|| format!("{}: not a valid SLO file", path.display()))
    }

    /// One line per threshold: (met, what was required and what was measured).
    pub fn judge(&self, result: &serde_json::Value) -> Vec<(bool, String)> {
        let mut verdicts = Vec::new();
        if let Some(limit) = self.convergence_p99_seconds {
            let p99 = result["latency_ms"]["p99"].as_f64().unwrap_or(f64::INFINITY) / 1000.0;
            verdicts.push((p99 <= limit, format!("convergence p99 {p99:.2} s (at most {limit} s)")));
        }
        if let Some(limit) = self.max_errors {
            let errors = result["errors"].as_u64().unwrap_or(u64::MAX);
            verdicts.push((errors <= limit as u64, format!("errors {errors} (at most {limit})")));
        }
        if let Some(limit) = self.max_queue_depth {
            match result["max_queue_depth"].as_f64() {
                Some(depth) => verdicts.push((depth <= limit, format!("max queue depth {depth} (at most {limit})"))),
                None => verdicts.push((
                    false,
                    format!("max queue depth unknown (at most {limit}): {}", result["queue_depth_error"]),
                )),
            }
        }
        verdicts
    }
}

pub async fn run(mut args: Args, interrupt: &mut tokio::signal::unix::Signal) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(args.mode == Mode::Operator, "--kubeconfig measures the operator that runs there: no --mode");
    anyhow::ensure!(
        args.kill_after.is_none() && !args.at_rest && args.replicas == 1,
        "--kubeconfig starts and stops nothing: --kill-after, --at-rest and --replicas do not apply"
    );
    let path = args.kubeconfig.clone().expect("called with --kubeconfig");
    let client = Client::try_from(traffic_policy_operator::client::config(Some(&path)).await?)?;
    Api::<ApplicationTrafficPolicy>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await
        .context("the cluster does not serve ApplicationTrafficPolicies (is the operator installed?)")?;
    let id = format!("{:08x}", rand_id());
    args.namespace_prefix = format!("tpo-{id}-");
    args.run_label = Some(id.clone());
    eprintln!(
        "run {id}: {} policies in namespaces {} .. {} (label {RUN_LABEL}={id}); deleted at the end",
        args.objects,
        args.namespace_name(0),
        args.namespace_name(args.namespaces - 1)
    );
    let outcome = tokio::select! {
        result = drive(&client, &args, &id) => result,
        _ = interrupt.recv() => Err(Interrupted.into()),
    };
    let cleaned = clean_up(&client, &id).await;
    let result = outcome?;
    cleaned?;
    Ok(result)
}

async fn drive(client: &Client, args: &Args, id: &str) -> anyhow::Result<serde_json::Value> {
    let namespaces = Api::<Namespace>::all(client.clone());
    for n in 0..args.namespaces {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(args.namespace_name(n)),
                labels: Some(BTreeMap::from([(RUN_LABEL.to_string(), id.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        };
        namespaces.create(&PostParams::default(), &ns).await.context("creating the run's namespaces")?;
    }
    let tracker = Arc::new(Mutex::new(Tracker::default()));
    let watch =
        AbortOnDropHandle::new(tokio::spawn(track(client.clone(), tracker.clone(), Some(format!("{RUN_LABEL}={id}")))));
    let depth = Arc::new(Mutex::new(QueueDepth::default()));
    let sampler = AbortOnDropHandle::new(tokio::spawn(sample_queue_depth(
        client.clone(),
        args.operator_namespace.clone(),
        depth.clone(),
    )));
    let started = Instant::now();
    let progress = AbortOnDropHandle::new(progress(args.objects, tracker.clone())?);
    create_all(client, args, &tracker).await?;
    let creation_seconds = started.elapsed().as_secs_f64();
    let edit_latencies = edit_during_backlog(client, args, &tracker).await?;
    let converged_in_time = wait_pending(&tracker, args).await;
    let convergence_seconds = started.elapsed().as_secs_f64();
    progress.abort();
    sampler.abort();
    watch.abort();

    // What the server says at the end: every policy of the run, Ready or not.
    let listed = Api::<ApplicationTrafficPolicy>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{RUN_LABEL}={id}")))
        .await?;
    let not_ready: Vec<String> = listed.items.iter().filter(|p| !p.is_ready()).map(|p| p.name_any()).collect();
    let errors = not_ready.len() + args.objects.saturating_sub(listed.items.len());
    let tracker = tracker.lock().unwrap();
    let depth = depth.lock().unwrap();
    let mut result = json!({
        "mode": "cluster",
        "run": id,
        "objects": args.objects,
        "namespaces": args.namespaces,
        "converged": tracker.converged.len(),
        "errors": errors,
        "creation_seconds": creation_seconds,
        "convergence_seconds": convergence_seconds,
        "throughput_per_second": args.objects as f64 / convergence_seconds,
        "latency_ms": latency_percentiles(&tracker.latencies_ms),
        "edit_latency_ms": edit_percentiles(edit_latencies),
        "max_queue_depth": depth.max,
        "queue_depth_by_pod": depth.by_pod,
    });
    if let Some(error) = &depth.error {
        result["queue_depth_error"] = error.clone().into();
    }
    if let Err(error) = converged_in_time {
        result["timeout"] = error.to_string().into();
    }
    Ok(result)
}

/// The deepest high-priority lane seen per operator pod, read through the pod proxy.
#[derive(Default)]
struct QueueDepth {
    max: Option<f64>,
    by_pod: BTreeMap<String, f64>,
    error: Option<String>,
}

async fn sample_queue_depth(client: Client, namespace: String, depth: Arc<Mutex<QueueDepth>>) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let selector = ListParams::default().labels("app.kubernetes.io/name=traffic-policy-operator");
    loop {
        let sampled = match pods.list(&selector).await {
            Ok(listed) if listed.items.is_empty() => Err(format!("no operator pods in namespace {namespace}")),
            Ok(listed) => {
                let mut sampled = Ok(());
                for pod in listed.items {
                    match proxy_metrics(&client, &namespace, &pod.name_any()).await {
                        Ok(text) => {
                            let high = high_lane_depth(&text);
                            let mut depth = depth.lock().unwrap();
                            let seen = depth.by_pod.entry(pod.name_any()).or_insert(0.0);
                            *seen = seen.max(high);
                            depth.max = Some(depth.max.unwrap_or(0.0).max(high));
                        }
                        Err(error) => sampled = Err(error),
                    }
                }
                sampled
            }
            Err(error) => Err(format!("listing the operator's pods in {namespace}: {error}")),
        };
        if let Err(error) = sampled {
            depth.lock().unwrap().error = Some(error);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A pod's `/metrics`, through the API server's pod proxy (by the port's name, so it needs
/// `get` on `pods/proxy` in the operator's namespace and nothing else).
async fn proxy_metrics(client: &Client, namespace: &str, pod: &str) -> Result<String, String> {
    let path = format!("/api/v1/namespaces/{namespace}/pods/{pod}:metrics/proxy/metrics");
    let request = http::Request::get(&path).body(Vec::new()).map_err(|e| e.to_string())?;
    client.request_text(request).await.map_err(|e| format!("reading {pod}'s metrics through the pod proxy: {e}"))
}

/// The sum of `workqueue_depth` over the policy controller's high-priority lane in one
/// replica's metrics.
fn high_lane_depth(metrics: &str) -> f64 {
    let policies_high = |labels: &sample::Labels<'_>| {
        sample::label(labels, "controller") == "applicationtrafficpolicy" && sample::label(labels, "priority") == "high"
    };
    sample::metric_where(metrics, "workqueue_depth", policies_high)
}

/// Deletes every namespace of run `id` and waits until they are gone, with progress.
async fn clean_up(client: &Client, id: &str) -> anyhow::Result<()> {
    let namespaces = Api::<Namespace>::all(client.clone());
    let ours = ListParams::default().labels(&format!("{RUN_LABEL}={id}"));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = namespaces.list(&ours).await.context("listing the run's namespaces")?.items;
        if left.is_empty() {
            eprintln!("run {id}: cleaned up");
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "run {id}: {} namespaces still terminating after 5 minutes",
            left.len()
        );
        eprintln!("run {id}: deleting {} namespaces...", left.len());
        for ns in left.iter().filter(|ns| ns.metadata.deletion_timestamp.is_none()) {
            namespaces.delete(&ns.name_any(), &DeleteParams::background()).await?;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// A run id from the clock and the process id: unique enough for namespaces of one cluster.
fn rand_id() -> u32 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    nanos ^ std::process::id().rotate_left(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_slo_names_what_it_missed() {
        let slo: Slo =
            serde_saphyr::from_str("convergence_p99_seconds: 2\nmax_errors: 0\nmax_queue_depth: 10\n").unwrap();
        let result = json!({ "latency_ms": { "p99": 3500.0 }, "errors": 0, "max_queue_depth": 4.0 });
        let verdicts = slo.judge(&result);
        assert_eq!(verdicts.iter().map(|(met, _)| *met).collect::<Vec<_>>(), [false, true, true]);
        assert!(verdicts[0].1.contains("3.50 s"), "{}", verdicts[0].1);
        assert!(serde_saphyr::from_str::<Slo>("max_error: 1").is_err(), "a misspelt threshold is an error");
    }

    #[test]
    fn reads_the_policy_controllers_high_lane_only() {
        let text = "workqueue_depth{name=\"applicationtrafficpolicy\",controller=\"applicationtrafficpolicy\",priority=\"high\"} 7\n\
                    workqueue_depth{name=\"applicationtrafficpolicy\",controller=\"applicationtrafficpolicy\",priority=\"low\"} 900\n\
                    workqueue_depth{name=\"policy-labels\",controller=\"policy-labels\",priority=\"high\"} 50\n";
        assert_eq!(high_lane_depth(text), 7.0);
    }
}
