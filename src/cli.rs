//! Command-line flags, each with an environment fallback. No logic here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::telemetry::logging::LogFormat;

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
    #[arg(long, env = "TPO_WORKERS", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: u16,

    /// Address of the admin server (/livez, /readyz, /metrics).
    #[arg(long, env = "TPO_ADMIN_ADDR", default_value = "0.0.0.0:8080")]
    pub admin_addr: SocketAddr,

    /// Log format.
    #[arg(long, env = "TPO_LOG_FORMAT", value_enum, default_value = "json")]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `info,traffic_policy_operator=debug`.
    #[arg(long, env = "TPO_LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// How often every policy is reconciled even without changes (plus up to 10% jitter).
    #[arg(long, env = "TPO_RESYNC_PERIOD", default_value = "1h", value_parser = humantime::parse_duration)]
    pub resync_period: Duration,

    /// On SIGTERM, how long in-flight reconciles may take to finish.
    #[arg(long, env = "TPO_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// The longest a single reconcile may take before it counts as failed.
    #[arg(long, env = "TPO_RECONCILE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub reconcile_timeout: Duration,

    /// This replica's name, used as the event reporter instance (the pod name in a StatefulSet).
    #[arg(long, env = "POD_NAME", default_value = "traffic-policy-operator")]
    pub pod_name: String,
}
