//! The ApplicationTrafficPolicy reconcile on kube-runtime's `Controller`: the comparison peer
//! of the load test. It reuses the operator's pure desired state, applies the children and
//! patches status, and nothing else (no sharding).
//!
//! Plain (the default): `Controller::new` and `owns` with default settings, as a first
//! kube-rs controller is written: full objects cached, every event reconciled.
//!
//! `--trimmed`: what the operator's runtime does besides its own queue and workers, on
//! kube-runtime's: the policy cache trimmed of managed fields and last-applied, only spec changes
//! (generation) reconciled, and children watched as metadata only with the operator's label
//! selector (`for_stream`, `owns_stream`). Comparing the operator with this peer isolates
//! what the operator's queue, predicate and controller buy over kube-runtime's.
//!
//! `--concurrency N`: at most N reconciles at once, as a user tunes kube-runtime for many
//! objects; its default runs every queued reconcile at once.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::controller::{Action, Config, Controller};
use kube::runtime::{WatchStreamExt, predicates, reflector, watcher};
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::desired::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use traffic_policy_operator::runtime::stored::trim;

async fn reconcile(policy: Arc<ApplicationTrafficPolicy>, client: Arc<Client>) -> Result<Action, kube::Error> {
    loadtest::writes::converge(&client, &policy, "kube-rs-peer").await?;
    Ok(Action::requeue(Duration::from_secs(3600)))
}

fn error_policy(_: Arc<ApplicationTrafficPolicy>, _: &kube::Error, _: Arc<Client>) -> Action {
    Action::requeue(Duration::from_secs(5))
}

fn plain(client: &Client) -> Controller<ApplicationTrafficPolicy> {
    Controller::new(Api::<ApplicationTrafficPolicy>::all(client.clone()), watcher::Config::default())
        .owns(Api::<NetworkPolicy>::all(client.clone()), watcher::Config::default())
        .owns(Api::<ConfigMap>::all(client.clone()), watcher::Config::default())
}

fn trimmed(client: &Client) -> Controller<ApplicationTrafficPolicy> {
    let (reader, writer) = reflector::store();
    let policies = watcher(Api::<ApplicationTrafficPolicy>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default());
    let children = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let network_policies = watcher(Api::<PartialObjectMeta<NetworkPolicy>>::all(client.clone()), children.clone())
        .default_backoff()
        .modify(trim)
        .touched_objects();
    let config_maps = watcher(Api::<PartialObjectMeta<ConfigMap>>::all(client.clone()), children)
        .default_backoff()
        .modify(trim)
        .touched_objects();
    Controller::for_stream(policies, reader).owns_stream(network_policies).owns_stream(config_maps)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flag_value = |flag: &str| std::env::args().skip_while(|a| a != flag).nth(1);
    let kubeconfig = flag_value("--kubeconfig");
    let concurrency: u16 = flag_value("--concurrency").map(|n| n.parse()).transpose()?.unwrap_or(0);
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = Client::try_from(config)?;
    let controller = if std::env::args().any(|a| a == "--trimmed") { trimmed(&client) } else { plain(&client) };
    let controller = controller.with_config(Config::default().concurrency(concurrency));
    controller.shutdown_on_signal().run(reconcile, error_policy, Arc::new(client)).for_each(|_| async {}).await;
    Ok(())
}
