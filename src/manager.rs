//! The manager: builds the client, telemetry, sharding, watches and controller, runs them
//! as one supervised set of tasks until SIGTERM or SIGINT (or until a critical task ends,
//! which ends the process), then shuts down in the order that hands work over safely:
//! drain in-flight reconciles, stop following the assignment, give up every bucket and
//! wait until nothing of them can still land, release our Lease, and, if leading, publish
//! our buckets' new owners and step down.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::events::Reporter;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::client::Clients;
use crate::coordination::follower::{Follower, slice_selector};
use crate::coordination::labeller;
use crate::coordination::leader::Leader;
use crate::coordination::lease::MemberLease;
use crate::coordination::load::LoadReport;
use crate::coordination::members::Members;
use crate::coordination::ownership::Ownership;
use crate::coordination::published::AssignmentView;
use crate::coordination::sharded::{Sharded, bucket_of_meta};
use crate::reconcile::cached::CachedPolicy;
use crate::reconcile::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::reconcile::events::Events;
use crate::reconcile::{CONTENT_STAMP, TrafficPolicyReconciler};
use crate::runtime::backoff::Backoff;
use crate::runtime::cache::Cache;
use crate::runtime::child_versions::ChildVersions;
use crate::runtime::parts::{self, Slicing};
use crate::runtime::stored::Stored as _;
use crate::runtime::watch_health::WatchHealth;
use crate::runtime::{Controller, Settings, watch};
use crate::telemetry::audit::Audit;
use crate::telemetry::{admin, logging, metrics};

pub const CONTROLLER_NAME: &str = "applicationtrafficpolicy";

/// What `/readyz` waits for: the member table, a real assignment applied with a valid
/// lease, and the first sync of the watches of our slice.
const READINESS_GATES: [&str; 5] = ["members", "assignment", CONTROLLER_NAME, "NetworkPolicy", "ConfigMap"];

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
    let Clients { work: client, coordination } =
        Clients::connect(config, args.kube_api_http2, args.kube_api_qps, args.kube_api_burst).await?;
    let health = admin::Health::with_gates(&READINESS_GATES);
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    tokio::spawn(metrics::upkeep(prometheus.clone()));

    // Sharding: our lease and its renewal cycles, the member table, the leader, and the
    // assignment follower, which re-targets the watches below through `slice`.
    let mode = crate::coordination::mode::choose(&coordination, &shard.namespace, args.shard_mode).await?;
    let ownership = Ownership::new(&shard.incarnation, mode, shard.renew_deadline, shard.write_bound());
    let members = Arc::new(Members::default());
    let view = Arc::new(AssignmentView::default());
    let load = Arc::new(LoadReport::default());
    // Refused watches make this replica give its slice up (see `coordination::lease`).
    let watch_health = WatchHealth::new();
    let member_lease = Arc::new(MemberLease::new(
        coordination.clone(),
        &shard,
        ownership.clone(),
        view.clone(),
        load.clone(),
        watch_health.clone(),
    ));
    let leader = Arc::new(Leader::new(
        coordination.clone(),
        client.clone(),
        &shard,
        ownership.clone(),
        members.clone(),
        view.clone(),
    ));
    let (slice_tx, slice) = tokio::sync::watch::channel(None);
    let follower = Follower::new(
        coordination.clone(),
        &shard,
        ownership.clone(),
        member_lease.clone(),
        view.clone(),
        slice_tx,
        health.clone(),
        audit.clone(),
    );
    let stop_lease = CancellationToken::new();
    let stop_sharding = CancellationToken::new();
    // Critical tasks: if one ends before shutdown, the process ends.
    let mut critical: JoinSet<&'static str> = JoinSet::new();
    critical.spawn({
        let (members, client, namespace, health) =
            (members.clone(), coordination.clone(), shard.namespace.clone(), health.clone());
        async move {
            members.watch(client, &namespace, &health).await;
            "the member lease watch"
        }
    });
    let lease_task = tokio::spawn({
        let (lease, stop) = (member_lease.clone(), stop_lease.clone());
        async move { lease.keep(stop).await }
    });
    let leader_task = tokio::spawn({
        let (leader, stop) = (leader.clone(), stop_sharding.clone());
        async move { leader.run(stop).await }
    });
    let follower_task = tokio::spawn(args.test_faults.clone().follower(follower.run(stop_sharding.clone())));

    // The controller: watches of our slice only, filtered by the API server.
    let (cache, writer) = crate::runtime::cache::new();
    tokio::spawn(report_policies(cache.clone()));
    // Objects fall into buckets as the API server's filter sees them, as the write gate does.
    let slicing = Slicing::new(
        move |meta| bucket_of_meta(meta, mode),
        move |namespace| mode.bucket_of(namespace),
        move |buckets| slice_selector(mode, buckets),
    );
    let policies = parts::watch(api(&client, &args), None, slice.clone(), slicing.clone(), watch_health.clone());
    let primary = watch::primary(policies, labeller::labelled_from_backlog, writer);
    let owned = Some(format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let owner_kind = "ApplicationTrafficPolicy";
    let children = vec![
        watch::children(
            parts::watch(
                api::<PartialObjectMeta<NetworkPolicy>>(&client, &args),
                owned.clone(),
                slice.clone(),
                slicing.clone(),
                watch_health.clone(),
            ),
            "NetworkPolicy",
            owner_kind,
            CONTENT_STAMP,
        )
        .boxed(),
        watch::children(
            parts::watch(
                api::<PartialObjectMeta<ConfigMap>>(&client, &args),
                owned,
                slice.clone(),
                slicing.clone(),
                watch_health.clone(),
            ),
            "ConfigMap",
            owner_kind,
            CONTENT_STAMP,
        )
        .boxed(),
    ];
    let child_versions = Arc::new(ChildVersions::default());
    let reporter = Reporter { controller: "traffic-policy-operator".into(), instance: Some(shard.identity.clone()) };
    let events = Events::new(client.clone(), reporter);
    let mut reconciler = TrafficPolicyReconciler::new(client.clone(), events, child_versions.clone());
    reconciler.faults = args.test_faults.clone();
    reconciler.gateway_provider = args.gateway_provider;
    let reconciler = Arc::new(reconciler);
    let gatekeeper = Arc::new(Sharded::new(ownership.clone(), audit.clone()));
    let settings = Settings {
        name: CONTROLLER_NAME,
        workers: args.workers.into(),
        resync: args.resync_period,
        drain_timeout: args.drain_timeout,
        reconcile_timeout: args.reconcile_timeout,
        list_deadline: args.list_deadline,
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, cache.clone(), health.clone(), watch_health);
    tokio::spawn({
        let (ownership, listed) = (ownership.clone(), controller.listed());
        async move { load.keep(cache, ownership, listed).await }
    });
    tracing::info!(incarnation = %shard.incarnation, namespace = %shard.namespace, workers = args.workers, "starting");

    let metrics_auth = (args.metrics_auth == crate::cli::MetricsAuthMode::Kubernetes)
        .then(|| crate::telemetry::metrics_auth::MetricsAuth::new(client.clone()));
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
    // Run until shutdown; a critical task that ends first stops the process, after the
    // same orderly shutdown.
    let controller = controller.run(primary, children, slice, child_versions, reconciler, gatekeeper, shutdown.clone());
    let mut controller = std::pin::pin!(controller);
    let (mut lease_task, mut leader_task, mut follower_task) =
        (Some(lease_task), Some(leader_task), Some(follower_task));
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
        ended = async { lease_task.as_mut().expect("running").await } => {
            lease_task = None;
            Some(format!("the lease task ended: {ended:?}"))
        }
        ended = async { leader_task.as_mut().expect("running").await } => {
            leader_task = None;
            Some(format!("the leader task ended: {ended:?}"))
        }
        ended = async { follower_task.as_mut().expect("running").await } => {
            follower_task = None;
            Some(format!("the follower task ended: {ended:?}"))
        }
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

    stop_sharding.cancel();
    if let Some(task) = follower_task {
        let _ = task.await;
    }
    let was_leading = match leader_task {
        Some(task) => task.await.unwrap_or(false),
        None => false,
    };
    ownership.release_all();
    audit.record("owned", &"shutdown", "");
    // Nothing of ours may land after we say we let go: wait out abandoned writes too.
    let drained = drained && ownership.drained(shard.landing_bound() + Duration::from_millis(100)).await;
    stop_lease.cancel();
    if let Some(task) = lease_task {
        let _ = task.await;
    }
    if drained {
        // Hand our slice over at once.
        member_lease.release().await;
        if was_leading {
            leader.hand_over().await;
        }
    } else {
        // A write may still be on its way: let our Lease expire instead, so that the
        // margin between renew deadline and lease duration covers it.
        tracing::warn!("not drained: leaving the Lease to expire instead of handing over");
    }
    admin_shutdown.cancel();
    tracing::info!("stopped");
    match failure {
        Some(ended) => anyhow::bail!("{ended}"),
        None => Ok(()),
    }
}

/// All namespaces, or the one `--watch-namespace` names.
fn api<K>(client: &Client, args: &RunArgs) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
{
    match &args.watch_namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    }
}

/// A client from `kubeconfig`, or from the in-cluster config or default kubeconfig.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    Ok(Client::try_from(crate::client::config(kubeconfig).await?)?)
}

/// Keeps `traffic_policy_policies` (our slice by Ready status and reason) current.
async fn report_policies(cache: Cache<CachedPolicy>) {
    use crate::reconcile::status::{READY_STATES, ready_state};
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    loop {
        tick.tick().await;
        let mut tally = [0; READY_STATES.len()];
        for (_, policy) in cache.state() {
            tally[ready_state(policy.generation(), policy.ready())] += 1;
        }
        metrics::set_policies(&READY_STATES, &tally);
    }
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
