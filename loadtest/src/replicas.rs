//! The replicas (or the peer) a run starts, and the sampler of their CPU, memory and metrics.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::args::{Args, Mode, OPERATOR_NAMESPACE};
use crate::sample::{self, Sample};

/// (replica name, PID, metrics port) of each running replica, for the sampler.
pub type Watched = Arc<Mutex<Vec<(String, u32, u16)>>>;

pub struct Replica {
    pub name: String,
    pub process: controlplane::process::Process,
    pub metrics_port: u16,
}

pub(super) async fn start_replicas(
    cp: &controlplane::ControlPlane,
    client: &Client,
    args: &Args,
) -> anyhow::Result<Vec<Replica>> {
    let ns = Namespace {
        metadata: ObjectMeta { name: Some(OPERATOR_NAMESPACE.into()), ..Default::default() },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let mut replicas = Vec::new();
    for i in 0..args.replicas {
        replicas.push(start_replica(cp, args, &format!("load-{i}")).await?);
    }
    Ok(replicas)
}

pub async fn start_replica(cp: &controlplane::ControlPlane, args: &Args, name: &str) -> anyhow::Result<Replica> {
    let binary = match &args.operator_binary {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("traffic-policy-operator"),
    };
    anyhow::ensure!(
        binary.is_file(),
        "no operator binary at {} (build it, or pass --operator-binary)",
        binary.display()
    );
    let metrics_port = controlplane::free_port()?;
    let probe_port = controlplane::free_port()?;
    let mut process_args = vec![
        format!("--kubeconfig={}", cp.kubeconfig_path().display()),
        format!("--namespace={OPERATOR_NAMESPACE}"),
        format!("--pod-name={name}"),
        format!("--metrics-addr=127.0.0.1:{metrics_port}"),
        format!("--health-probe-addr=127.0.0.1:{probe_port}"),
        format!("--workers={}", args.workers),
        format!("--shard-mode={}", args.sharding.name()),
        "--log-level=warn".to_string(),
    ];
    if let Some(capacity) = args.capacity {
        process_args.push(format!("--capacity={capacity}"));
    }
    if let Some(seconds) = args.resync_seconds {
        process_args.push(format!("--resync-period={seconds}s"));
    }
    if args.split_hash_ranges {
        process_args.push("--split-hash-ranges=true".to_string());
    }
    let log = cp.dir().join(format!("{name}-{metrics_port}.log"));
    let mut process = controlplane::process::Process::start("traffic-policy-operator", &binary, &process_args, &log)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !controlplane::http_get_plain(probe_port, "/readyz").is_ok_and(|r| r.contains(" 200 ")) {
        if let Some(status) = process.exited() {
            return Err(process.failure(&format!("exited at start ({status})")));
        }
        anyhow::ensure!(Instant::now() < deadline, "{name} not ready within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Replica { name: name.to_string(), process, metrics_port })
}

/// A peer controller: one process, with only a kubeconfig. It has no metrics port.
pub(super) fn start_peer(cp: &controlplane::ControlPlane, args: &Args) -> anyhow::Result<Replica> {
    let kube_rs_peer = || std::env::current_exe().map(|exe| exe.with_file_name("kube-rs-peer"));
    let workers = args.workers.to_string();
    let (name, binary, extra_args) = match args.mode {
        Mode::KubeRs => ("kube-rs-peer", kube_rs_peer()?, vec![]),
        Mode::KubeRsTrimmed => ("kube-rs-trimmed-peer", kube_rs_peer()?, vec!["--trimmed"]),
        Mode::KubeRsTuned => ("kube-rs-tuned-peer", kube_rs_peer()?, vec!["--trimmed", "--concurrency", &workers]),
        Mode::ControllerRuntimeTuned => {
            ("controller-runtime-tuned-peer", controller_runtime_peer()?, vec!["-tuned", "-workers", &workers])
        }
        _ => ("controller-runtime-peer", controller_runtime_peer()?, vec![]),
    };
    anyhow::ensure!(binary.is_file(), "no peer binary at {}", binary.display());
    let log = cp.dir().join(format!("{name}.log"));
    let mut args = vec!["--kubeconfig".to_string(), cp.kubeconfig_path().display().to_string()];
    args.extend(extra_args.iter().map(|a| a.to_string()));
    let process = controlplane::process::Process::start(name, &binary, &args, &log)?;
    Ok(Replica { name: name.into(), process, metrics_port: 0 })
}

/// Builds the controller-runtime peer (Go, from the module proxy) into target/loadtest, once
/// and again whenever its source is newer than the binary.
pub(super) fn controller_runtime_peer() -> anyhow::Result<PathBuf> {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/controller-runtime");
    let binary = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/loadtest/controller-runtime-peer");
    let modified = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let stale = ["main.go", "go.mod"].iter().any(|file| modified(&source.join(file)) > modified(&binary));
    if stale {
        eprintln!("building the controller-runtime peer (once; a minute or two)...");
        let status = std::process::Command::new("go")
            .args(["build", "-trimpath", "-o"])
            .arg(&binary)
            .arg(".")
            .current_dir(&source)
            .env("CGO_ENABLED", "0")
            .status()
            .context("running go build for the controller-runtime peer")?;
        anyhow::ensure!(status.success(), "building the controller-runtime peer failed");
    }
    Ok(binary)
}

pub(super) async fn sample_loop(pids: Watched, samples: Arc<Mutex<Vec<Sample>>>, started: Instant) {
    loop {
        let current = pids.lock().unwrap().clone();
        for (replica, pid, port) in current {
            let metrics = if port == 0 {
                String::new()
            } else {
                controlplane::http_get_plain(port, "/metrics").unwrap_or_default()
            };
            let memory = sample::memory(pid).unwrap_or_default();
            samples.lock().unwrap().push(Sample {
                t: started.elapsed().as_secs_f64(),
                replica,
                cpu_seconds: sample::cpu_seconds(pid).unwrap_or_default(),
                rss_bytes: memory.rss,
                anon_rss_bytes: memory.anon_rss,
                queue_depth: sample::policy_controllers_metric(&metrics, "workqueue_depth"),
                cached_objects: sample::metric(&metrics, "traffic_policy_cached_objects"),
                series: sample::series_count(&metrics),
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
