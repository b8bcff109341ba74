//! The manager: builds the client, telemetry, sharding, watches and controller, runs them
//! as one supervised set of tasks until SIGTERM or SIGINT (or until a critical task ends,
//! which ends the process), then shuts down in the order that hands work over safely:
//! drain in-flight reconciles, stop following the assignment, give up every bucket and
//! wait until nothing of them can still land, release our Lease, and, if leading, publish
//! our buckets' new owners and step down.

use kube::Client;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::client::Clients;
use crate::coordination::admission;
use crate::coordination::audit::Audit;
use crate::coordination::install::{self, InstallRecord};
use crate::coordination::labeller::BucketLabelling;
use crate::coordination::tasks::Start;
use crate::coordination::{Coordination, ShardConfig};
use crate::telemetry::{admin, logging, metrics};

mod controller;

pub const CONTROLLER_NAME: &str = "applicationtrafficpolicy";

/// What `/readyz` waits for: no other install watching our namespaces, the member table, a
/// real assignment applied with a valid lease, and the first sync of the watches of our slice.
const READINESS_GATES: [&str; 6] =
    [install::READINESS_GATE, "members", "assignment", CONTROLLER_NAME, "NetworkPolicy", "ConfigMap"];

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let shard = args.shard_config().map_err(anyhow::Error::msg)?;
    logging::init(args.log_format, args.log_level.as_deref())?;
    let prometheus = metrics::install()?;
    let tls = args
        .metrics_tls_cert_file
        .as_deref()
        .zip(args.metrics_tls_key_file.as_deref())
        .map(|(cert, key)| admin::TlsFiles { cert, key });
    let admin_listeners = admin::Listeners::bind(args.health_probe_addr, args.metrics_addr, tls).await?;
    let audit = match &args.audit_log {
        Some(path) => Audit::open(path, &shard.identity, &shard.incarnation)?,
        None => Audit::default(),
    };
    let config = crate::client::config(args.kubeconfig.as_deref()).await?;
    let clients = Clients::connect(config, args.kube_api_http2, args.kube_api_qps, args.kube_api_burst).await?;
    let required = args.admission_policies == crate::cli::AdmissionPolicies::Required;
    let gates: Vec<&'static str> =
        READINESS_GATES.into_iter().chain(required.then_some(admission::READINESS_GATE)).collect();
    let health = admin::Health::with_gates(&gates);
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    tokio::spawn(metrics::upkeep(prometheus.clone()));
    let probe =
        admission::watch(clients.work.clone(), shard.namespace.clone(), health.clone(), required, shutdown.clone());
    tokio::spawn(probe);

    // Critical tasks: if one ends before shutdown, the process ends.
    let mut critical: JoinSet<&'static str> = JoinSet::new();
    let metrics_auth = (args.metrics_auth == crate::cli::MetricsAuthMode::Kubernetes)
        .then(|| crate::telemetry::metrics_auth::MetricsAuth::new(clients.work.clone()));
    let admin_shutdown = CancellationToken::new();
    critical.spawn({
        let (health, stop) = (health.clone(), admin_shutdown.clone());
        async move {
            if let Err(error) = admin::serve(admin_listeners, health, prometheus, metrics_auth, stop).await {
                tracing::error!(%error, "admin server failed");
            }
            "the admin server"
        }
    });
    let install = std::sync::Arc::new(InstallRecord::new(clients.coordination.clone(), &shard));
    if !install.wait_until_ours(&health, &shutdown).await {
        admin_shutdown.cancel();
        tracing::info!("stopped before starting: another install holds the install record");
        return Ok(());
    }
    critical.spawn({
        let install = install.clone();
        async move {
            let why = install.keep().await;
            tracing::error!("{why}");
            "the install record check"
        }
    });
    let mut sharding = start_coordination(&args, &shard, &clients, &health, &audit, &mut critical).await?;
    let controller = controller::start(&args, &shard, &clients.work, &sharding, &health, &audit, shutdown.clone());
    tracing::info!(incarnation = %shard.incarnation, namespace = %shard.namespace, workers = args.workers, "starting");

    // Run until shutdown; a critical task that ends first stops the process, after the
    // same orderly shutdown.
    let mut controller = std::pin::pin!(controller);
    let mut drained = None;
    let failure: Option<String> = tokio::select! {
        done = &mut controller => {
            drained = Some(done);
            None
        }
        ended = critical.join_next() => Some(match ended {
            Some(Ok(name)) => format!("{name} ended"),
            Some(Err(error)) => format!("a critical task failed: {error}"),
            None => "no critical task is left".into(),
        }),
        ended = sharding.task_ended() => Some(ended),
    };
    if let Some(ended) = &failure {
        tracing::error!(task = %ended, "stopping: a critical task ended");
        health.fail(ended.clone());
        shutdown.cancel();
    }
    let drained = match drained {
        Some(drained) => drained,
        None => controller.await,
    };
    if sharding.shut_down(drained, shard.landing_bound(), &audit).await {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), install.release()).await;
    }
    admin_shutdown.cancel();
    tracing::info!("stopped");
    match failure {
        Some(ended) => anyhow::bail!("{ended}"),
        None => Ok(()),
    }
}

/// Starts this replica's part in the sharding protocol. Leases and the assignment go through
/// the never-limited client; labelling is work.
async fn start_coordination(
    args: &RunArgs,
    shard: &ShardConfig,
    clients: &Clients,
    health: &std::sync::Arc<admin::Health>,
    audit: &Audit,
    critical: &mut JoinSet<&'static str>,
) -> anyhow::Result<Coordination> {
    let faults = args.test_faults.clone();
    let start = Start {
        config: shard,
        client: &clients.coordination,
        mode: args.shard_mode,
        health,
        audit,
        duties: std::sync::Arc::new(BucketLabelling {
            client: clients.work.clone(),
            watch_namespace: args.watch_namespace.clone(),
        }),
        follower_wrapper: Some(Box::new(move |follower| Box::pin(faults.follower(follower)))),
    };
    Coordination::start(start, critical).await
}

/// A client from `kubeconfig`, or from the in-cluster config or default kubeconfig.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    Ok(Client::try_from(crate::client::config(kubeconfig).await?)?)
}

async fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    shutdown.cancel();
}
