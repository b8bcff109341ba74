//! Command-line flags, each with an environment fallback. No logic here.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kube::CustomResourceExt;

use crate::api::ApplicationTrafficPolicy;
use crate::coordination::{ShardConfig, validate_timings};
use crate::sharding::balance::Balance;
use crate::telemetry::logging::LogFormat;

/// Workers by default. A reconcile writes its two children at once, then its status and event
/// at once, so 32 workers keep up to 64 writes in flight. Fewer cost the control plane more
/// per write (most likely because etcd and kube-apiserver batch less): at 8, one replica
/// converged 20,000 policies in 1.09 to 1.45 x the time of 32 (docs/benchmarks.md, "What
/// bounds one replica").
pub const DEFAULT_WORKERS: u16 = 32;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Turns ApplicationTrafficPolicy objects into NetworkPolicies and gateway rate-limit ConfigMaps"
)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the CustomResourceDefinition YAML (as committed in crds/).
    Crd,
    /// Show which replica owns which namespaces.
    Shards {
        /// Kubeconfig file (default: the usual lookup).
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        /// The operator's namespace.
        #[arg(long, env = "POD_NAMESPACE", default_value = "traffic-policy-operator")]
        namespace: String,
    },
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Kubeconfig file; without it, the in-cluster config or the default kubeconfig is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Watch only this namespace (all namespaces when unset).
    #[arg(long, env = "WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// Reconciles that may run at once.
    #[arg(long, env = "TPO_WORKERS", default_value_t = DEFAULT_WORKERS, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: u16,

    /// Address of the metrics server (/metrics).
    #[arg(long, env = "TPO_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,

    /// Serve /metrics over HTTPS with this certificate (PEM; with --metrics-tls-key-file).
    #[arg(long, env = "TPO_METRICS_TLS_CERT_FILE", requires = "metrics_tls_key_file")]
    pub metrics_tls_cert_file: Option<PathBuf>,

    /// The private key (PEM) of --metrics-tls-cert-file.
    #[arg(long, env = "TPO_METRICS_TLS_KEY_FILE", requires = "metrics_tls_cert_file")]
    pub metrics_tls_key_file: Option<PathBuf>,

    /// Who may read /metrics: `none` (anyone who can reach the port) or `kubernetes` (a bearer
    /// token that a TokenReview authenticates and whose user a SubjectAccessReview allows
    /// `get` on the non-resource URL /metrics, as controller-runtime's metrics filter does).
    #[arg(long, env = "TPO_METRICS_AUTH", value_enum, default_value = "none")]
    pub metrics_auth: MetricsAuthMode,

    /// What the fencing and operator-reach admission policies not being in force for this
    /// replica's identity does: `reported` (a metric and a log line) or `required` (also
    /// readiness, which the shipped install sets; docs/operations.md, "Admission policies in
    /// force").
    #[arg(long, env = "TPO_ADMISSION_POLICIES", value_enum, default_value = "reported")]
    pub admission_policies: AdmissionPolicies,

    /// Address of the health-probe server (/livez, /readyz).
    #[arg(long, env = "TPO_HEALTH_PROBE_ADDR", default_value = "0.0.0.0:8081")]
    pub health_probe_addr: SocketAddr,

    /// Log format.
    #[arg(long, env = "TPO_LOG_FORMAT", value_enum, default_value = "json")]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `info,traffic_policy_operator=debug` (tracing's EnvFilter
    /// syntax). Without it, `RUST_LOG` applies, and without that, `info`.
    #[arg(long, env = "TPO_LOG_LEVEL")]
    pub log_level: Option<String>,

    /// How often every policy is reconciled even without changes (plus up to 10% jitter).
    #[arg(long, env = "TPO_RESYNC_PERIOD", default_value = "1h", value_parser = humantime::parse_duration)]
    pub resync_period: Duration,

    /// On SIGTERM, how long in-flight reconciles may take to finish.
    #[arg(long, env = "TPO_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// The longest a single reconcile may take before it counts as failed.
    #[arg(long, env = "TPO_RECONCILE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub reconcile_timeout: Duration,

    /// How long the watches may take to list a bucket this replica was given. Past it the
    /// replica gives its slice up, says why on its member Lease, and asks again later.
    #[arg(long, env = "TPO_LIST_DEADLINE", default_value = "60s", value_parser = humantime::parse_duration)]
    pub list_deadline: Duration,

    /// This replica's pod name (from the downward API in a StatefulSet). It names the member
    /// Lease; the Lease holder is the pod name plus a nonce new to every process, so a second
    /// process with the same pod name waits instead of sharing the slice.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,

    /// The operator's own namespace, holding the member and leader Leases and the assignment.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,

    /// How long a replica's lease lasts without renewal before others take its slice over.
    #[arg(long, env = "TPO_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,

    /// A replica that has not renewed its lease for this long stops all work (fail-stop).
    #[arg(long, env = "TPO_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub renew_deadline: Duration,

    /// How often leases are renewed and leadership is tried.
    #[arg(long, env = "TPO_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    pub retry_period: Duration,

    /// The leader moves buckets to even out the replicas' policy counts only when the largest
    /// replica holds this many policies more than the mean (and 5% more): a small imbalance is
    /// not worth a handoff.
    #[arg(long, env = "TPO_REBALANCE_MIN_OBJECTS", default_value_t = Balance::default().min_excess)]
    pub rebalance_min_objects: u64,

    /// How many policies this replica can hold; the leader never gives it more, and reports
    /// what no replica has room for. `auto`: from the container's memory limit (none without
    /// one); `none`: no bound.
    #[arg(long, env = "TPO_CAPACITY", default_value = "auto")]
    pub capacity: crate::coordination::capacity::Capacity,

    /// How a replica's watches select its slice: `shard-selector` (the API server's
    /// ShardedListAndWatch), `labels` (bucket labels), or `auto` (the shard
    /// selector if the server honours it). Every replica of a fleet must end up in one mode.
    #[arg(long, env = "TPO_SHARD_MODE", value_enum, default_value = "auto")]
    pub shard_mode: crate::coordination::mode::Requested,

    /// In shard-selector mode, the leader splits hash ranges that hold several namespaces'
    /// policies, where they crowd (names such as `team-1` … `team-200` share a few of the
    /// uniform ranges), so that slices balance for any naming. It counts every policy each
    /// 30 s to do so, and splits only while every replica reads split ranges.
    #[arg(long, env = "TPO_SPLIT_HASH_RANGES", default_value_t = false, action = clap::ArgAction::Set)]
    pub split_hash_ranges: bool,

    /// API requests per second this replica may make for its work (watches, reconciles,
    /// labelling, events), as client-go's `--kube-api-qps`; Lease renewals are not counted.
    /// `off` for no client-side limit; `auto`: off where the API server applies Priority and
    /// Fairness (it then queues and sheds load itself), 500 otherwise.
    #[arg(long, env = "TPO_KUBE_API_QPS", default_value = "auto")]
    pub kube_api_qps: crate::client::RateLimit,

    /// Requests the rate limit lets through at once, when a limit applies.
    #[arg(long, env = "TPO_KUBE_API_BURST", default_value = "1000")]
    pub kube_api_burst: NonZeroU32,

    /// Offer HTTP/2 to the API server, as client-go does: all of a client's requests and
    /// watches then share one connection. `false` keeps to HTTP/1.1 (a connection per request
    /// in flight).
    #[arg(long, env = "TPO_KUBE_API_HTTP2", default_value_t = true, action = clap::ArgAction::Set)]
    pub kube_api_http2: bool,

    /// Which gateway's own resource carries a policy's rate limit: `auto` follows the
    /// controllerName of the GatewayClass of the policy's Gateway (docs/gateways.md).
    #[arg(long, env = "TPO_GATEWAY_PROVIDER", value_enum, default_value = "auto")]
    pub gateway_provider: crate::reconcile::gateway::ProviderChoice,

    /// Test mode: append a JSON line per reconcile start, API write and reconcile end here.
    #[arg(long, env = "TPO_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,

    #[command(flatten)]
    pub test_faults: crate::test_faults::TestFaults,
}

impl RunArgs {
    /// The sharding settings, checked: a clear error names what is missing or wrong.
    pub fn shard_config(&self) -> Result<ShardConfig, String> {
        let identity =
            self.pod_name.clone().filter(|n| !n.is_empty()).ok_or(
                "POD_NAME is not set: set it from the downward API (fieldRef metadata.name) or pass --pod-name",
            )?;
        let namespace = self.namespace.clone().filter(|n| !n.is_empty()).ok_or(
            "POD_NAMESPACE is not set: set it from the downward API (fieldRef metadata.namespace) or pass --namespace",
        )?;
        if !is_dns_label(&namespace) {
            return Err(format!("the operator namespace {namespace:?} is not a valid namespace name (RFC 1123 label)"));
        }
        if !is_dns_subdomain(&identity) || identity.len() > 200 {
            return Err(format!(
                "POD_NAME {identity:?} is not a valid object name (RFC 1123 subdomain, at most 200 characters)"
            ));
        }
        validate_timings(self.lease_duration, self.renew_deadline, self.retry_period)?;
        let nonce = format!("{:08x}", rand::random::<u32>());
        Ok(ShardConfig {
            incarnation: crate::sharding::membership::incarnation(&identity, &nonce),
            identity,
            namespace,
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            drain_timeout: self.drain_timeout,
            balance: Balance { min_excess: self.rebalance_min_objects, ..Balance::default() },
            floor_object: ApplicationTrafficPolicy::crd_name().to_string(),
            names: crate::coordination::NAMES,
            version: env!("CARGO_PKG_VERSION").into(),
            capacity: self.capacity.resolve(),
            split_ranges: self.split_hash_ranges,
            watch_namespace: self.watch_namespace.clone(),
        })
    }
}

fn is_dns_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    (1..=253).contains(&s.len()) && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["traffic-policy-operator"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).unwrap().run
    }

    #[test]
    fn missing_or_invalid_identity_and_namespace_are_clear_errors() {
        // SAFETY: tests in this module do not read these variables concurrently.
        unsafe {
            std::env::remove_var("POD_NAME");
            std::env::remove_var("POD_NAMESPACE");
        }
        assert!(args(&["--namespace=ops"]).shard_config().unwrap_err().starts_with("POD_NAME is not set"));
        assert!(args(&["--pod-name=p-0"]).shard_config().unwrap_err().starts_with("POD_NAMESPACE is not set"));
        let bad = args(&["--pod-name=p-0", "--namespace=Not_Valid"]).shard_config().unwrap_err();
        assert!(bad.contains("\"Not_Valid\" is not a valid namespace name"), "{bad}");
        let ok = args(&["--pod-name=p-0", "--namespace=ops"]).shard_config().unwrap();
        assert_eq!((ok.lease_duration.as_secs(), ok.renew_deadline.as_secs(), ok.retry_period.as_secs()), (15, 10, 2));
    }

    #[test]
    fn every_flag_has_an_environment_fallback_that_the_readme_lists() {
        use clap::CommandFactory;
        let readme = include_str!("../README.md");
        for arg in Cli::command().get_arguments().filter(|a| !a.is_hide_set() && a.get_long().is_some()) {
            let flag = arg.get_long().unwrap();
            if ["help", "version"].contains(&flag) {
                continue;
            }
            let env = arg.get_env().unwrap_or_else(|| panic!("--{flag} has no environment fallback"));
            let env = env.to_str().unwrap();
            assert!(readme.contains(&format!("`{env}`")), "README.md does not list {env} (--{flag})");
        }
    }

    #[test]
    fn timings_are_validated() {
        let err = args(&["--pod-name=p", "--namespace=ops", "--renew-deadline=20s"]).shard_config().unwrap_err();
        assert!(err.contains("--lease-duration"), "{err}");
    }
}

/// `--admission-policies`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AdmissionPolicies {
    Reported,
    Required,
}

/// `--metrics-auth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsAuthMode {
    None,
    Kubernetes,
}
