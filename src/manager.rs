//! The manager: builds the client, telemetry, sharding, watches and controller, runs them
//! until SIGTERM or SIGINT, then shuts down in the order that hands work over safely:
//! drain in-flight reconciles, stop following the assignment, give up every bucket,
//! release our Lease, and, if leading, publish our buckets' new owners and step down.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::reconcile::TrafficPolicyReconciler;
use crate::reconcile::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::runtime::backoff::Backoff;
use crate::runtime::child_versions::ChildVersions;
use crate::runtime::{Controller, Settings, watch};
use crate::shard::follower::{AssignmentView, Follower};
use crate::shard::leader::Leader;
use crate::shard::lease::MemberLease;
use crate::shard::members::Members;
use crate::shard::ownership::Ownership;
use crate::telemetry::audit::Audit;
use crate::telemetry::{admin, logging, metrics};

pub const CONTROLLER_NAME: &str = "applicationtrafficpolicy";

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let shard = args.shard_config().map_err(anyhow::Error::msg)?;
    logging::init(args.log_format, &args.log_level)?;
    let prometheus = metrics::install()?;
    let admin_listener = admin::bind(args.admin_addr).await?;
    let audit = match &args.audit_log {
        Some(path) => Audit::open(path, &shard.identity)?,
        None => Audit::default(),
    };
    let client = client(args.kubeconfig.as_deref()).await?;
    let health = Arc::new(admin::Health::default());
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    tokio::spawn(metrics::upkeep(prometheus.clone()));

    // Sharding: our lease, the member table, the leader, and the assignment follower,
    // which re-targets the watches below through `selector`.
    let ownership = Ownership::new(shard.renew_deadline);
    let members = Arc::new(Members::default());
    let view = Arc::new(AssignmentView::default());
    let member_lease = Arc::new(MemberLease::new(client.clone(), &shard, ownership.clone()));
    let leader = Arc::new(Leader::new(client.clone(), &shard, ownership.clone(), members.clone(), view.clone()));
    let (selector_tx, selector) = tokio::sync::watch::channel(None);
    let follower = Follower::new(
        client.clone(),
        &shard,
        ownership.clone(),
        member_lease.clone(),
        view.clone(),
        selector_tx,
        audit.clone(),
    );
    let stop_lease = CancellationToken::new();
    let stop_sharding = CancellationToken::new();
    let members_task = tokio::spawn({
        let (members, client, namespace) = (members.clone(), client.clone(), shard.namespace.clone());
        async move { members.watch(client, &namespace).await }
    });
    let lease_task = tokio::spawn({
        let (lease, stop) = (member_lease.clone(), stop_lease.clone());
        async move { lease.keep(stop).await }
    });
    let leader_task = tokio::spawn({
        let (leader, stop) = (leader.clone(), stop_sharding.clone());
        async move { leader.run(stop).await }
    });
    let follower_task = tokio::spawn(follower.run(stop_sharding.clone()));

    // The controller: watches of our slice only, filtered by the API server.
    let (store, writer) = reflector::store();
    let policies = watch::retargetable(api(&client, &args), None, selector.clone());
    let primary = watch::primary(policies, crate::reconcile::trim_for_cache, writer);
    let owned = Some(format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let owner_kind = "ApplicationTrafficPolicy";
    let children = vec![
        watch::children(
            watch::retargetable(
                api::<PartialObjectMeta<NetworkPolicy>>(&client, &args),
                owned.clone(),
                selector.clone(),
            ),
            "NetworkPolicy",
            owner_kind,
        )
        .boxed(),
        watch::children(
            watch::retargetable(api::<PartialObjectMeta<ConfigMap>>(&client, &args), owned, selector),
            "ConfigMap",
            owner_kind,
        )
        .boxed(),
    ];
    let child_versions = Arc::new(ChildVersions::default());
    let reporter = Reporter { controller: "traffic-policy-operator".into(), instance: Some(shard.identity.clone()) };
    let recorder = Recorder::new(client.clone(), reporter);
    let reconciler = Arc::new(TrafficPolicyReconciler::new(
        client.clone(),
        recorder,
        child_versions.clone(),
        ownership.clone(),
        audit.clone(),
    ));
    let settings = Settings {
        name: CONTROLLER_NAME,
        workers: args.workers.into(),
        resync: args.resync_period,
        drain_timeout: args.drain_timeout,
        reconcile_timeout: args.reconcile_timeout,
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, store, health.clone());
    tracing::info!(identity = %shard.identity, namespace = %shard.namespace, workers = args.workers, "starting");

    let admin_shutdown = CancellationToken::new();
    let admin = admin::serve(admin_listener, health, prometheus, admin_shutdown.clone());
    let mut admin = std::pin::pin!(admin);
    let drained = tokio::select! {
        result = &mut admin => anyhow::bail!("admin server stopped: {:?}", result.err()),
        drained = controller.run(primary, children, child_versions, reconciler, shutdown) => drained,
    };

    stop_sharding.cancel();
    let _ = follower_task.await;
    let was_leading = leader_task.await.unwrap_or(false);
    ownership.set_owned(Default::default());
    audit.record("owned", &"shutdown", "");
    stop_lease.cancel();
    let _ = lease_task.await;
    if drained {
        // Hand our slice over at once.
        member_lease.release().await;
        if was_leading {
            leader.hand_over().await;
        }
    } else {
        // A reconcile may still be writing: let our Lease expire instead, so that the
        // margin between renew deadline and lease duration covers its last request.
        tracing::warn!("not drained: leaving the Lease to expire instead of handing over");
    }
    members_task.abort();
    admin_shutdown.cancel();
    let _ = admin.await;
    tracing::info!("stopped");
    Ok(())
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
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("cannot read kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await.map_err(|e| anyhow::anyhow!("no Kubernetes configuration found: {e}"))?,
    };
    Ok(Client::try_from(config)?)
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
