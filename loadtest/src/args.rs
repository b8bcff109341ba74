//! What a `loadtest run` is asked to do: the load, where it runs, and what converges it.

use std::path::PathBuf;

use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The operator converges the policies.
    Operator,
    /// The tool makes the operator's writes itself (two applies, a status patch and an event per policy).
    Floor,
    /// The same reconcile on controller-runtime (loadtest/peers/controller-runtime), one process.
    ControllerRuntime,
    /// controller-runtime tuned for many objects (`-tuned`): `--workers` concurrent reconciles,
    /// managed fields stripped from the cache, metadata-only children written by apply.
    ControllerRuntimeTuned,
    /// The same reconcile on a plain kube-rs `Controller` (the `kube-rs-peer` binary), one process.
    KubeRs,
    /// The same reconcile on kube-runtime's `Controller` with the operator's trimming, generation
    /// predicate and metadata-only child watches (`kube-rs-peer --trimmed`), one process.
    KubeRsTrimmed,
    /// The trimmed kube-rs peer with its concurrency bounded to `--workers` (kube-runtime's
    /// default is unbounded).
    KubeRsTuned,
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

    pub fn name(self) -> String {
        self.to_possible_value().expect("plain variants").get_name().to_string()
    }
}

/// How a run names its namespaces (`--namespace-names`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NamespaceNames {
    /// `load-0-ns`, `load-1-ns`, …: the number inside, which the shard selector's hash spreads.
    #[default]
    Suffixed,
    /// `team-1`, `team-2`, …: the number last, as people name namespaces.
    Team,
}

/// Which gateway a run puts in front of the policies (`--gateway`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GatewayKind {
    Traefik,
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
    /// How the namespaces are named.
    #[arg(long, value_enum, default_value_t)]
    pub namespace_names: NamespaceNames,
    #[arg(long, value_enum, default_value = "operator")]
    pub mode: Mode,
    /// Operator replicas (operator mode).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Each replica's `--capacity` (operator mode). The run then converges when every policy is
    /// Ready but exactly as many as the leader reports unplaced (`traffic_policy_unplaced_objects`),
    /// for 5 s. Needs --preload: a policy reconciled before its bucket was found not to fit
    /// stays Ready.
    #[arg(long, requires = "preload")]
    pub capacity: Option<u64>,
    /// Workers per replica (operator mode), and the tuned peers' concurrency.
    #[arg(long, default_value_t = traffic_policy_operator::cli::DEFAULT_WORKERS)]
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
    /// Put a real gateway in front of the policies (operator mode): each policy gets a route
    /// under one Gateway, and once converged, `--gateway-edits` single edits are timed from
    /// the spec edit to the gateway enforcing the new limit.
    #[arg(long, value_enum)]
    pub gateway: Option<GatewayKind>,
    /// With --gateway: how many edits to time.
    #[arg(long, default_value_t = 200)]
    pub gateway_edits: usize,
    /// With --gateway: how many policies get a route (spread evenly over the run; default:
    /// all). Traefik rebuilds its whole routing table on each change, so thousands of routes
    /// take it minutes on a small machine (docs/benchmarks.md).
    #[arg(long)]
    pub gateway_routes: Option<usize>,
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
    /// The replicas split crowded hash ranges (`--split-hash-ranges`; shard-selector mode).
    #[arg(long)]
    pub split_hash_ranges: bool,
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
    /// What every namespace of the run starts with: nothing on a local control plane, the
    /// run's id on another cluster.
    #[arg(skip)]
    pub namespace_prefix: String,
    /// The run's id, as a label on its policies (with --kubeconfig).
    #[arg(skip)]
    pub run_label: Option<String>,
}

impl Args {
    /// Whether policy `i` gets a route (with --gateway), and every how many policies one does.
    pub fn route_stride(&self) -> usize {
        (self.objects / self.gateway_routes.unwrap_or(self.objects).clamp(1, self.objects.max(1))).max(1)
    }

    /// The name of namespace number `n`.
    pub fn namespace_name(&self, n: usize) -> String {
        match self.namespace_names {
            // Not ending in the number: the shard selector's hash (FNV-1a) puts names that
            // differ only in their last characters in very few buckets (docs/sharding.md).
            NamespaceNames::Suffixed => format!("{}load-{n}-ns", self.namespace_prefix),
            NamespaceNames::Team => format!("{}team-{}", self.namespace_prefix, n + 1),
        }
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
