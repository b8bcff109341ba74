//! `loadtest run`: N policies on a fresh local control plane, converged either by the
//! operator (R replicas, as separate processes) or, in `floor` mode, by the tool itself
//! making the operator's writes at full concurrency (what the API server can do for this
//! work). Convergence is seen through a watch: a policy counts once its status is Ready for
//! its latest generation. Everything it creates lives in its own control plane, which is
//! torn down at the end, also on Ctrl-C.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams};
use serde_json::json;
use tokio_util::task::AbortOnDropHandle;

use crate::args::{Args, Mode, OPERATOR_NAMESPACE, Sharding};
use crate::interrupt::{Interrupted, interrupts};
use crate::replicas::{Watched, controller_runtime_peer, sample_loop, start_peer, start_replicas};
use crate::sample::{self, Sample};
use crate::workload::{
    Tracker, create_all, delete_all, edit_during_backlog, edit_percentiles, latency_percentiles, progress, track,
    update_some, wait_converged,
};

pub async fn run(args: Args) -> anyhow::Result<serde_json::Value> {
    run_until_interrupted(args, &mut interrupts()?).await
}

/// A run that stops, after cleaning up, on the first Ctrl-C `interrupt` sees; one seen before
/// the run started stops it as soon as its control plane is up.
pub async fn run_until_interrupted(
    args: Args,
    interrupt: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<serde_json::Value> {
    if args.kubeconfig.is_some() {
        return crate::cluster::run(args, interrupt).await;
    }
    // Built before any clock starts: a first build must not count as the peer's time.
    if matches!(args.mode, Mode::ControllerRuntime | Mode::ControllerRuntimeTuned) {
        controller_runtime_peer()?;
    }
    let release = controlplane::Release::of_tests();
    let feature_gates = match args.sharding {
        Sharding::ShardSelector if !release.has_shard_selectors() => {
            anyhow::bail!("--sharding shard-selector needs kube-apiserver 1.36+, not {}", release.version())
        }
        Sharding::ShardSelector => vec![controlplane::SHARDED_LIST_AND_WATCH.to_string()],
        Sharding::Labels => vec![],
    };
    let config = controlplane::Config {
        controller_manager: false,
        apiserver_args: vec!["--max-requests-inflight=800".into(), "--max-mutating-requests-inflight=400".into()],
        feature_gates,
        ..Default::default()
    };
    let cp = tokio::task::spawn_blocking(move || controlplane::ControlPlane::start(config)).await??;
    eprintln!("control plane: {}", cp.dir().display());
    let outcome = tokio::select! {
        result = drive(&cp, &args) => result,
        _ = interrupt.recv() => Err(Interrupted.into()),
    };
    // Dropping the control plane removes every object and its directory.
    tokio::task::spawn_blocking(move || drop(cp)).await?;
    outcome
}

async fn drive(cp: &controlplane::ControlPlane, args: &Args) -> anyhow::Result<serde_json::Value> {
    let client = cp.client().await?;
    crate::cache_bytes::install_crd(&client).await?;
    for n in 0..args.namespaces {
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(args.namespace_name(n)), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    }
    // As deploy/overlays/bucket-labels/ installs it: in label mode, the API server copies each
    // namespace's bucket label onto the policies written there. (The replicas run as admin,
    // so they need none of its grants.)
    if args.mode == Mode::Operator && args.sharding == Sharding::Labels && cp.release().has_mutating_admission_policy()
    {
        crate::deploy::install_bucket_labels(&client, &args.namespace_name(0)).await?;
    }
    let gateway = match args.gateway {
        Some(_) if args.mode == Mode::Operator => Some(crate::gateway::start(cp, &client, args).await?),
        Some(_) => anyhow::bail!("--gateway needs the operator mode"),
        None => None,
    };
    let tracker = Arc::new(Mutex::new(Tracker::default()));
    let watch = AbortOnDropHandle::new(tokio::spawn(track(client.clone(), tracker.clone(), None)));
    let server_before = crate::server_load::snapshot(cp, &client).await?;
    let started = Instant::now();
    if args.preload {
        create_all(&client, args, &tracker).await?;
    }
    let mut replicas = match args.mode {
        Mode::Operator => start_replicas(cp, &client, args).await?,
        Mode::Floor => Vec::new(),
        _ => vec![start_peer(cp, args)?],
    };
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let pids: Watched =
        Arc::new(Mutex::new(replicas.iter().map(|r| (r.name.clone(), r.process.pid(), r.metrics_port)).collect()));
    let sampler = AbortOnDropHandle::new(tokio::spawn(sample_loop(pids.clone(), samples.clone(), started)));

    let ticker = AbortOnDropHandle::new(progress(args.objects, tracker.clone())?);

    let kill = args.kill_after.map(|after| started + Duration::from_secs_f64(after));
    if !args.preload {
        create_all(&client, args, &tracker).await?;
    }
    let creation_seconds = started.elapsed().as_secs_f64();
    let edit_latencies = edit_during_backlog(&client, args, &tracker).await?;
    wait_converged(&tracker, args, &mut replicas, cp, kill, &pids).await?;
    let converge_seconds = started.elapsed().as_secs_f64();
    let control_plane = crate::server_load::report(&server_before, &crate::server_load::snapshot(cp, &client).await?);

    let mut update_seconds = None;
    if args.update_fraction > 0.0 {
        let count = ((args.objects as f64) * args.update_fraction).round() as usize;
        let update_started = Instant::now();
        update_some(&client, args, count, &tracker).await?;
        wait_converged(&tracker, args, &mut replicas, cp, None, &pids).await?;
        update_seconds = Some(update_started.elapsed().as_secs_f64());
    }
    let mut balance = None;
    // With capacities the slices are bounded by them, not balanced.
    let unplaced = args.capacity.map(|_| crate::workload::unplaced_reported(&replicas));
    if args.mode == Mode::Operator && replicas.len() > 1 && args.capacity.is_none() {
        eprintln!("waiting until the slices are balanced...");
        balance = Some(crate::balance::settle(&client, args, OPERATOR_NAMESPACE, Duration::from_secs(300)).await?);
    }
    if args.idle_seconds > 0 {
        eprintln!("converged; sampling memory while idle for {} s...", args.idle_seconds);
        tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    }
    let mut at_rest = None;
    if args.at_rest && args.mode == Mode::Operator {
        at_rest = Some(crate::at_rest::measure(cp, &client, args, &mut replicas, &pids).await?);
    }
    let mut handoff = None;
    if args.handoff && args.mode == Mode::Operator {
        handoff = Some(crate::handoff::measure(cp, &client, args, &mut replicas, &pids, &tracker).await?);
    }
    let mut edit_to_enforcement = None;
    if let Some(gateway) = &gateway {
        eprintln!("timing {} edits from the spec to the gateway's enforcement...", args.gateway_edits);
        edit_to_enforcement =
            Some(crate::gateway::edit_to_enforcement(&client, args, gateway, args.gateway_edits).await?);
    }
    let mut delete_seconds = None;
    if args.delete {
        let delete_started = Instant::now();
        delete_all(&client, args, &tracker).await?;
        delete_seconds = Some(delete_started.elapsed().as_secs_f64());
    }
    ticker.abort();
    // The cache gauges refresh every 5 s: let the samples catch up with the settled state.
    let settle = Instant::now() + Duration::from_secs(6);
    while Instant::now() < settle && args.mode == Mode::Operator {
        let cached: f64 = replicas
            .iter()
            .map(|r| {
                sample::metric(
                    &controlplane::http_get_plain(r.metrics_port, "/metrics").unwrap_or_default(),
                    "traffic_policy_cached_objects",
                )
            })
            .sum();
        if cached as usize == args.objects {
            tokio::time::sleep(Duration::from_millis(600)).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sampler.abort();
    watch.abort();
    for replica in &mut replicas {
        replica.process.stop(Duration::from_secs(20));
    }

    let tracker = tracker.lock().unwrap();
    let samples = samples.lock().unwrap().clone();
    let per_replica: Vec<serde_json::Value> = pids
        .lock()
        .unwrap()
        .iter()
        .map(|(name, _, _)| {
            let mine: Vec<&Sample> = samples.iter().filter(|s| &s.replica == name).collect();
            json!({
                "replica": name,
                "cpu_seconds": mine.iter().map(|s| s.cpu_seconds).fold(0.0, f64::max),
                "peak_rss_bytes": mine.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
                "peak_anon_rss_bytes": mine.iter().map(|s| s.anon_rss_bytes).max().unwrap_or(0),
                "peak_cached_objects": mine.iter().map(|s| s.cached_objects).fold(0.0, f64::max),
                "final_rss_bytes": mine.last().map(|s| s.rss_bytes).unwrap_or(0),
                "final_cached_objects": mine.last().map(|s| s.cached_objects).unwrap_or(0.0),
                "final_metrics_series": mine.last().map(|s| s.series).unwrap_or(0),
            })
        })
        .collect();
    let converged = tracker.converged.len();
    crate::chart::write(&args.out.with_extension("svg"), &samples, &tracker.converged, started, args.objects)?;
    let result = json!({
        "mode": args.mode.to_possible_value().expect("plain variants").get_name().to_string(),
        "sharding": args.sharding.name(),
        "objects": args.objects,
        "namespaces": args.namespaces,
        "replicas": replicas.len(),
        "workers": args.workers,
        "converged": converged,
        "creation_seconds": creation_seconds,
        "convergence_seconds": converge_seconds,
        "update_seconds": update_seconds,
        "delete_seconds": delete_seconds,
        "edit_latency_ms": edit_percentiles(edit_latencies),
        "at_rest": at_rest,
        "handoff": handoff,
        "balance": balance,
        "capacity": args.capacity,
        "unplaced_objects": unplaced,
        "gateway_edit_to_enforcement_ms": edit_to_enforcement,
        "throughput_per_second": args.objects as f64 / converge_seconds,
        "latency_ms": latency_percentiles(&tracker.latencies_ms),
        "replica_stats": per_replica,
        "control_plane": control_plane,
        "samples": samples,
    });
    let expected = args.objects - unplaced.unwrap_or(0) as usize;
    anyhow::ensure!(converged == expected, "{converged} of {} policies converged, not {expected}", args.objects);
    Ok(result)
}

/// The text summary of one result.
pub fn summary(result: &serde_json::Value) -> String {
    if result["mode"] == "cluster" {
        return format!(
            "run {} on the cluster: {} of {} policies converged in {:.1} s; latency p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms; \
             {} not Ready; deepest high-priority queue {}\n",
            result["run"].as_str().unwrap_or_default(),
            result["converged"],
            result["objects"],
            result["convergence_seconds"].as_f64().unwrap_or_default(),
            result["latency_ms"]["p50"].as_f64().unwrap_or_default(),
            result["latency_ms"]["p95"].as_f64().unwrap_or_default(),
            result["latency_ms"]["p99"].as_f64().unwrap_or_default(),
            result["errors"],
            match result["max_queue_depth"].as_f64() {
                Some(depth) => depth.to_string(),
                None => format!("unknown ({})", result["queue_depth_error"].as_str().unwrap_or("no sample")),
            },
        );
    }
    let mut text = format!(
        "{} mode, {} policies in {} namespaces, {} replicas: converged {} in {:.1} s ({:.0}/s); latency p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms\n",
        result["mode"].as_str().unwrap_or_default(),
        result["objects"],
        result["namespaces"],
        result["replicas"],
        result["converged"],
        result["convergence_seconds"].as_f64().unwrap_or_default(),
        result["throughput_per_second"].as_f64().unwrap_or_default(),
        result["latency_ms"]["p50"].as_f64().unwrap_or_default(),
        result["latency_ms"]["p95"].as_f64().unwrap_or_default(),
        result["latency_ms"]["p99"].as_f64().unwrap_or_default(),
    );
    if result["control_plane"].is_object() {
        text += &crate::server_load::summary(&result["control_plane"]);
    }
    if let Some(g) = result["gateway_edit_to_enforcement_ms"].as_object() {
        text += &format!(
            "  gateway: {} routes, all answering {:.0} s after convergence; {} edits, spec edit to enforcement p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (the operator's Middleware write in the API server: p50 {:.0} ms, p99 {:.0} ms); not enforced within 60 s: {}\n",
            g["routes"],
            g["all_routed_after_convergence_seconds"].as_f64().unwrap_or_default(),
            g["count"],
            g["p50"].as_f64().unwrap_or_default(),
            g["p99"].as_f64().unwrap_or_default(),
            g["max"].as_f64().unwrap_or_default(),
            g["written_ms"]["p50"].as_f64().unwrap_or_default(),
            g["written_ms"]["p99"].as_f64().unwrap_or_default(),
            g["not_enforced_within_60_s"].as_array().map_or(0, Vec::len),
        );
    }
    if let Some(at_rest) = result["at_rest"].as_object() {
        for (phase, what) in [("resync", "a forced resync"), ("rolling_restart", "a rolling restart")] {
            let w = &at_rest[phase];
            text += &format!(
                "  at rest, {what}: {} child applies, {} status writes: {:.4} writes per policy\n",
                w["child_applies"],
                w["status_writes"],
                w["writes_per_policy"].as_f64().unwrap_or_default()
            );
        }
    }
    if result["handoff"].is_object() {
        text += &crate::handoff::summary(&result["handoff"]);
    }
    if let Some(capacity) = result["capacity"].as_u64() {
        text += &format!(
            "  capacity {capacity} a replica: {} policies unplaced, as the leader reports them and the run sees them\n",
            result["unplaced_objects"]
        );
    }
    if let Some(b) = result["balance"].as_object() {
        let ratio = b["largest_over_mean"].as_f64().unwrap_or_default();
        let slices: Vec<String> =
            b["policies_per_replica"].as_array().into_iter().flatten().map(|n| n.to_string()).collect();
        text += &format!(
            "  slices: {} policies ({}), largest / mean {ratio:.3} (target {}: {}; by bucket count alone: {:.3}), settled {:.1} s after convergence at assignment generation {}\n",
            slices.join(" / "),
            if b["by_objects"].as_bool() == Some(true) { "balanced by objects" } else { "balanced by buckets" },
            crate::balance::TARGET,
            if ratio <= crate::balance::TARGET { "pass" } else { "fail" },
            b["by_bucket_count_largest_over_mean"].as_f64().unwrap_or_default(),
            b["settled_seconds"].as_f64().unwrap_or_default(),
            b["generation"],
        );
    }
    for r in result["replica_stats"].as_array().into_iter().flatten() {
        // A peer serves no /metrics, so it has no cache figure to show.
        let cached = match r["final_metrics_series"].as_u64().unwrap_or(0) {
            0 => String::new(),
            _ => format!(
                ", {:.0} cached (at most {:.0})",
                r["final_cached_objects"].as_f64().unwrap_or_default(),
                r["peak_cached_objects"].as_f64().unwrap_or_default()
            ),
        };
        text += &format!(
            "  {}: {:.1} CPU-s, peak RSS {:.1} MiB ({:.1} MiB anonymous), last {:.1} MiB{cached}\n",
            r["replica"].as_str().unwrap_or_default(),
            r["cpu_seconds"].as_f64().unwrap_or_default(),
            r["peak_rss_bytes"].as_f64().unwrap_or_default() / 1048576.0,
            r["peak_anon_rss_bytes"].as_f64().unwrap_or_default() / 1048576.0,
            r["final_rss_bytes"].as_f64().unwrap_or_default() / 1048576.0,
        );
    }
    text
}
