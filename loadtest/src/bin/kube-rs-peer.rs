//! The ApplicationTrafficPolicy reconcile on a plain kube-rs `Controller` with default
//! settings: the comparison peer of the load test. It reuses the operator's pure desired
//! state, applies the children and patches status, and nothing else (no sharding, no
//! trimming, no queue of its own).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use traffic_policy_operator::api::ApplicationTrafficPolicy;

async fn reconcile(policy: Arc<ApplicationTrafficPolicy>, client: Arc<Client>) -> Result<Action, kube::Error> {
    loadtest::writes::converge(&client, &policy, "kube-rs-peer").await?;
    Ok(Action::requeue(Duration::from_secs(3600)))
}

fn error_policy(_: Arc<ApplicationTrafficPolicy>, _: &kube::Error, _: Arc<Client>) -> Action {
    Action::requeue(Duration::from_secs(5))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let kubeconfig = std::env::args().skip_while(|a| a != "--kubeconfig").nth(1);
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = Client::try_from(config)?;
    Controller::new(Api::<ApplicationTrafficPolicy>::all(client.clone()), watcher::Config::default())
        .owns(Api::<NetworkPolicy>::all(client.clone()), watcher::Config::default())
        .owns(Api::<ConfigMap>::all(client.clone()), watcher::Config::default())
        .shutdown_on_signal()
        .run(reconcile, error_policy, Arc::new(client))
        .for_each(|_| async {})
        .await;
    Ok(())
}
