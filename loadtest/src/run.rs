//! `loadtest run`: N policies on a fresh local control plane, converged either by the
//! operator (R replicas, as separate processes) or, in `floor` mode, by the tool itself
//! making the operator's writes at full concurrency (what the API server can do for this
//! work). Convergence is seen through a watch: a policy counts once its status is Ready for
//! its latest generation. Everything it creates lives in its own control plane, which is
//! torn down at the end, also on Ctrl-C.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::FIELD_MANAGER;

use crate::sample::{self, Sample};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The operator converges the policies.
    Operator,
    /// The tool makes the operator's writes itself (two applies, a status patch and an event per policy).
    Floor,
    /// The same reconcile on controller-runtime (loadtest/peers/controller-runtime), one process.
    ControllerRuntime,
    /// The same reconcile on a plain kube-rs `Controller` (the `kube-rs-peer` binary), one process.
    KubeRs,
    /// The same reconcile on kube-runtime's `Controller` with the operator's trimming, generation
    /// predicate and metadata-only child watches (`kube-rs-peer --trimmed`), one process.
    KubeRsTrimmed,
}

/// How the operator's replicas select their slices (operator mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sharding {
    /// kube-apiserver runs with `ShardedListAndWatch`; the operator uses shard selectors.
    ShardSelector,
    /// kube-apiserver without the gate; the operator's leader labels every policy.
    Labels,
}

impl Sharding {
    /// The shard selector, unless `TPO_TEST_SHARDED_LIST_AND_WATCH=off` (as for the suites).
    fn from_env() -> Self {
        if controlplane::sharded_list_and_watch() { Sharding::ShardSelector } else { Sharding::Labels }
    }

    fn name(self) -> String {
        self.to_possible_value().expect("plain variants").get_name().to_string()
    }
}

#[derive(clap::Args, Clone)]
pub struct Args {
    #[arg(long, default_value_t = 1000)]
    pub objects: usize,
    /// The sharding mode of the local control plane and the operator.
    #[arg(long, value_enum, default_value_t = Sharding::from_env())]
    pub sharding: Sharding,
    #[arg(long, default_value_t = 50)]
    pub namespaces: usize,
    /// Namespace sizes follow Zipf's law with this exponent (the i-th largest holds a share
    /// proportional to 1/i^s) instead of being equal.
    #[arg(long)]
    pub zipf: Option<f64>,
    #[arg(long, value_enum, default_value = "operator")]
    pub mode: Mode,
    /// Operator replicas (operator mode).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Workers per replica (operator mode).
    #[arg(long, default_value_t = 8)]
    pub workers: u16,
    /// Requests the tool keeps in flight while creating (and, in floor mode, writing).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// After everything converged, change this fraction of the specs and converge again.
    #[arg(long, default_value_t = 0.0)]
    pub update_fraction: f64,
    /// Chaos: SIGKILL replica 0 this many seconds into the run, then start it again.
    #[arg(long)]
    pub kill_after: Option<f64>,
    /// The operator binary (default: next to this one).
    #[arg(long)]
    pub operator_binary: Option<PathBuf>,
    /// Create every policy before the controller starts, so it begins with a full backlog.
    #[arg(long)]
    pub preload: bool,
    /// While the backlog is worked off, edit this many policies one at a time (100 ms apart)
    /// and report their latency separately: real changes should not wait behind the backlog.
    #[arg(long, default_value_t = 0)]
    pub edits: usize,
    /// After convergence (operator mode), count what the API server receives when nothing
    /// changes: a forced resync of every policy, then a rolling restart of every replica.
    /// Needs `--resync-seconds`.
    #[arg(long, requires = "resync_seconds")]
    pub at_rest: bool,
    /// After convergence (operator mode), one more replica joins and leaves again while
    /// single edits go on: the policies each handoff lists against those it moves, and the
    /// edits' latency.
    #[arg(long)]
    pub handoff: bool,
    /// The replicas' `--resync-period`, in seconds (default: the operator's).
    #[arg(long)]
    pub resync_seconds: Option<u64>,
    /// At the end, delete every policy and wait until the watch has seen them all go.
    #[arg(long)]
    pub delete: bool,
    /// After convergence (and balancing), leave the replicas idle this long, so that the
    /// last memory sample (`final_rss_bytes`) is the RSS at rest rather than at the peak.
    /// With --at-rest or --delete, the last sample is taken after those instead.
    #[arg(long, default_value_t = 0)]
    pub idle_seconds: u64,
    /// Give up when not converged after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_seconds: u64,
    #[arg(long, default_value = "target/loadtest/run.json")]
    pub out: PathBuf,
    /// Aim at an existing cluster where the operator already runs, instead of starting a
    /// local control plane: nothing there is started or stopped; the run's own namespaces
    /// are deleted at the end.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// With --kubeconfig: the operator's namespace, whose pods' metrics give the queue depth.
    #[arg(long, default_value = "traffic-policy-operator", requires = "kubeconfig")]
    pub operator_namespace: String,
    /// Thresholds (YAML: convergence_p99_seconds, max_errors, max_queue_depth); the run
    /// exits non-zero when one is missed and prints which.
    #[arg(long)]
    pub slo: Option<PathBuf>,
    /// Where the run's namespaces are: this prefix and a number.
    #[arg(skip = String::from("load-"))]
    pub namespace_prefix: String,
    /// The run's id, as a label on its policies (with --kubeconfig).
    #[arg(skip)]
    pub run_label: Option<String>,
}

impl Args {
    /// The name of namespace number `n`.
    pub fn namespace_name(&self, n: usize) -> String {
        // Not ending in the number: the shard selector's hash (FNV-1a) puts names that differ
        // only in their last character in very few buckets (docs/sharding.md).
        format!("{}{}-ns", self.namespace_prefix, n)
    }

    /// The namespace of policy number `i`.
    pub fn namespace_of(&self, i: usize) -> String {
        let n = match self.zipf {
            None => i % self.namespaces,
            Some(s) => zipf_rank(i, self.namespaces, s),
        };
        self.namespace_name(n)
    }
}

/// The namespace of policy `i` when namespace `n` holds a share proportional to 1/(n+1)^s.
/// Policies are dealt along a low-discrepancy sequence (multiples of the golden ratio), so
/// consecutive policies land in different namespaces and every prefix of a run is Zipf too.
fn zipf_rank(i: usize, namespaces: usize, s: f64) -> usize {
    let weight = |n: usize| 1.0 / ((n + 1) as f64).powf(s);
    let total: f64 = (0..namespaces).map(weight).sum();
    let u = ((i as f64 + 0.5) * 0.618_033_988_749_895).fract() * total;
    let mut cumulative = 0.0;
    for n in 0..namespaces {
        cumulative += weight(n);
        if u < cumulative {
            return n;
        }
    }
    namespaces - 1
}

/// Where the replicas keep their Leases and the assignment.
pub const OPERATOR_NAMESPACE: &str = "tpo-system";

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

/// (replica name, PID, metrics port) of each running replica, for the sampler.
pub type Watched = Arc<Mutex<Vec<(String, u32, u16)>>>;

pub struct Replica {
    pub name: String,
    pub process: controlplane::process::Process,
    pub metrics_port: u16,
}

pub async fn run(args: Args) -> anyhow::Result<serde_json::Value> {
    if args.kubeconfig.is_some() {
        return crate::cluster::run(args).await;
    }
    // Built before any clock starts: a first build must not count as the peer's time.
    if args.mode == Mode::ControllerRuntime {
        controller_runtime_peer()?;
    }
    let feature_gates = match args.sharding {
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
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted; cleaning up")),
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
    let tracker = Arc::new(Mutex::new(Tracker::default()));
    let watch = tokio::spawn(track(client.clone(), tracker.clone(), None));
    let started = Instant::now();
    if args.preload {
        create_all(&client, args, &tracker).await?;
    }
    let mut replicas = match args.mode {
        Mode::Operator => start_replicas(cp, &client, args).await?,
        Mode::Floor => Vec::new(),
        Mode::ControllerRuntime | Mode::KubeRs | Mode::KubeRsTrimmed => vec![start_peer(cp, args)?],
    };
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let pids: Watched =
        Arc::new(Mutex::new(replicas.iter().map(|r| (r.name.clone(), r.process.pid(), r.metrics_port)).collect()));
    let sampler = tokio::spawn(sample_loop(pids.clone(), samples.clone(), started));

    let ticker = progress(args.objects, tracker.clone())?;

    let kill = args.kill_after.map(|after| started + Duration::from_secs_f64(after));
    if !args.preload {
        create_all(&client, args, &tracker).await?;
    }
    let creation_seconds = started.elapsed().as_secs_f64();
    let edit_latencies = edit_during_backlog(&client, args, &tracker).await?;
    wait_converged(&tracker, args, &mut replicas, cp, kill, &pids).await?;
    let converge_seconds = started.elapsed().as_secs_f64();

    let mut update_seconds = None;
    if args.update_fraction > 0.0 {
        let count = ((args.objects as f64) * args.update_fraction).round() as usize;
        let update_started = Instant::now();
        update_some(&client, args, count, &tracker).await?;
        wait_converged(&tracker, args, &mut replicas, cp, None, &pids).await?;
        update_seconds = Some(update_started.elapsed().as_secs_f64());
    }
    let mut balance = None;
    if args.mode == Mode::Operator && replicas.len() > 1 {
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
        "throughput_per_second": args.objects as f64 / converge_seconds,
        "latency_ms": latency_percentiles(&tracker.latencies_ms),
        "replica_stats": per_replica,
        "samples": samples,
    });
    anyhow::ensure!(converged == args.objects, "only {converged} of {} policies converged", args.objects);
    Ok(result)
}

async fn start_replicas(cp: &controlplane::ControlPlane, client: &Client, args: &Args) -> anyhow::Result<Vec<Replica>> {
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
    if let Some(seconds) = args.resync_seconds {
        process_args.push(format!("--resync-period={seconds}s"));
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
fn start_peer(cp: &controlplane::ControlPlane, args: &Args) -> anyhow::Result<Replica> {
    let kube_rs_peer = || std::env::current_exe().map(|exe| exe.with_file_name("kube-rs-peer"));
    let (name, binary, extra_args) = match args.mode {
        Mode::KubeRs => ("kube-rs-peer", kube_rs_peer()?, &[][..]),
        Mode::KubeRsTrimmed => ("kube-rs-trimmed-peer", kube_rs_peer()?, &["--trimmed"][..]),
        _ => ("controller-runtime-peer", controller_runtime_peer()?, &[][..]),
    };
    anyhow::ensure!(binary.is_file(), "no peer binary at {}", binary.display());
    let log = cp.dir().join(format!("{name}.log"));
    let mut args = vec!["--kubeconfig".to_string(), cp.kubeconfig_path().display().to_string()];
    args.extend(extra_args.iter().map(|a| a.to_string()));
    let process = controlplane::process::Process::start(name, &binary, &args, &log)?;
    Ok(Replica { name: name.into(), process, metrics_port: 0 })
}

/// Builds the controller-runtime peer once (Go, from the module proxy) into target/loadtest.
fn controller_runtime_peer() -> anyhow::Result<PathBuf> {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/controller-runtime");
    let binary = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/loadtest/controller-runtime-peer");
    if !binary.is_file() {
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

fn policy(i: usize, args: &Args, port: i32) -> anyhow::Result<ApplicationTrafficPolicy> {
    let labels: std::collections::BTreeMap<&str, &str> =
        args.run_label.iter().map(|id| (crate::cluster::RUN_LABEL, id.as_str())).collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": format!("app-{i}"), "namespace": args.namespace_of(i), "labels": labels },
        "spec": {
            "applicationSelector": { "matchLabels": { "app": format!("app-{i}") } },
            "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"] } }],
                               "ports": [{ "protocol": "HTTP", "port": port }] }],
            "egressRules": [{ "to": [{ "ipBlock": { "cidr": "10.96.0.0/12" } }], "ports": [{ "protocol": "UDP", "port": 53 }] }],
            "rateLimit": { "requestsPerSecond": 100, "burst": 20 }
        }
    }))?)
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

async fn delete_all(client: &Client, args: &Args, tracker: &Arc<Mutex<Tracker>>) -> anyhow::Result<()> {
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

async fn update_some(client: &Client, args: &Args, count: usize, tracker: &Arc<Mutex<Tracker>>) -> anyhow::Result<()> {
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

async fn wait_converged(
    tracker: &Arc<Mutex<Tracker>>,
    args: &Args,
    replicas: &mut [Replica],
    cp: &controlplane::ControlPlane,
    mut kill: Option<Instant>,
    pids: &Watched,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    loop {
        if tracker.lock().unwrap().pending() == 0 {
            return Ok(());
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
    let mut events = watcher(api, config).boxed();
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

async fn sample_loop(pids: Watched, samples: Arc<Mutex<Vec<Sample>>>, started: Instant) {
    loop {
        let current = pids.lock().unwrap().clone();
        for (replica, pid, port) in current {
            let metrics = if port == 0 {
                String::new()
            } else {
                controlplane::http_get_plain(port, "/metrics").unwrap_or_default()
            };
            let (rss, _) = sample::memory(pid).unwrap_or_default();
            samples.lock().unwrap().push(Sample {
                t: started.elapsed().as_secs_f64(),
                replica,
                cpu_seconds: sample::cpu_seconds(pid).unwrap_or_default(),
                rss_bytes: rss,
                queue_depth: sample::metric(&metrics, "workqueue_depth"),
                cached_objects: sample::metric(&metrics, "traffic_policy_cached_objects"),
                series: sample::series_count(&metrics),
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
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
            _ => format!(", {:.0} cached", r["final_cached_objects"].as_f64().unwrap_or_default()),
        };
        text += &format!(
            "  {}: {:.1} CPU-s, peak RSS {:.1} MiB, last {:.1} MiB{cached}\n",
            r["replica"].as_str().unwrap_or_default(),
            r["cpu_seconds"].as_f64().unwrap_or_default(),
            r["peak_rss_bytes"].as_f64().unwrap_or_default() / 1048576.0,
            r["final_rss_bytes"].as_f64().unwrap_or_default() / 1048576.0,
        );
    }
    text
}
