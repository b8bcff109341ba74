//! The manager: builds the client, telemetry, watches and controller, and runs them until
//! SIGTERM or SIGINT, then drains. If a critical task fails, the process exits non-zero.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{reflector, watcher};
use tokio_util::sync::CancellationToken;

use crate::api::ApplicationTrafficPolicy;
use crate::cli::RunArgs;
use crate::reconcile::TrafficPolicyReconciler;
use crate::reconcile::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::runtime::backoff::Backoff;
use crate::runtime::child_versions::ChildVersions;
use crate::runtime::{Controller, Settings, watch};
use crate::telemetry::{admin, logging, metrics};

pub const CONTROLLER_NAME: &str = "applicationtrafficpolicy";

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    logging::init(args.log_format, &args.log_level)?;
    let prometheus = metrics::install()?;
    let admin_listener = admin::bind(args.admin_addr).await?;
    let client = client(&args).await?;
    let health = Arc::new(admin::Health::default());
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    tokio::spawn(metrics::upkeep(prometheus.clone()));

    let (store, writer) = reflector::store();
    let primary = watch::primary(
        api::<ApplicationTrafficPolicy>(&client, &args),
        watcher::Config::default().any_semantic(),
        writer,
    );
    let owned = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let owner_kind = "ApplicationTrafficPolicy";
    let children = vec![
        watch::children(
            api::<PartialObjectMeta<NetworkPolicy>>(&client, &args),
            owned.clone(),
            "NetworkPolicy",
            owner_kind,
        )
        .boxed(),
        watch::children(api::<PartialObjectMeta<ConfigMap>>(&client, &args), owned, "ConfigMap", owner_kind).boxed(),
    ];
    let child_versions = Arc::new(ChildVersions::default());
    let reporter = Reporter { controller: "traffic-policy-operator".into(), instance: Some(args.pod_name.clone()) };
    let reconciler =
        Arc::new(TrafficPolicyReconciler::new(client.clone(), Recorder::new(client, reporter), child_versions.clone()));
    let settings = Settings {
        name: CONTROLLER_NAME,
        workers: args.workers.into(),
        resync: args.resync_period,
        drain_timeout: args.drain_timeout,
        reconcile_timeout: args.reconcile_timeout,
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, store, health.clone());
    tracing::info!(workers = args.workers, "starting");

    let admin_shutdown = CancellationToken::new();
    let admin = admin::serve(admin_listener, health, prometheus, admin_shutdown.clone());
    let mut admin = std::pin::pin!(admin);
    tokio::select! {
        result = &mut admin => anyhow::bail!("admin server stopped: {:?}", result.err()),
        () = controller.run(primary, children, child_versions, reconciler, shutdown) => {}
    }
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

async fn client(args: &RunArgs) -> anyhow::Result<Client> {
    let config = match &args.kubeconfig {
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
