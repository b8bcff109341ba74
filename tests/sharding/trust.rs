//! What operations teams do outside the protocol's own steps: restore an older copy of the
//! assignment, uninstall and install again elsewhere. Fencing tokens must keep growing and
//! every policy must keep converging, judged from the API server.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::sharding::assignment::Assignment;

use crate::SERIAL;
use crate::fleet::{Fleet, PER_NAMESPACE};

fn generation(cm: &ConfigMap) -> u64 {
    Assignment::decode(cm.data.as_ref().unwrap()).unwrap().generation
}

/// The fencing tokens on the fleet's rate-limit ConfigMaps (the children a rate change
/// rewrites), lowest and highest.
async fn tokens(client: &Client, namespaces: &[String]) -> (u64, u64) {
    let mut all = Vec::new();
    for ns in namespaces {
        let cms = Api::<ConfigMap>::namespaced(client.clone(), ns).list(&ListParams::default()).await.unwrap();
        let tokens = cms.items.iter().filter_map(|cm| cm.annotations().get("trafficpolicy.dev/shard-epoch"));
        all.extend(tokens.map(|token| token.parse::<u64>().unwrap()));
    }
    assert_eq!(all.len(), namespaces.len() * PER_NAMESPACE, "every policy has its ConfigMap");
    (*all.iter().min().unwrap(), *all.iter().max().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_older_assignment_counts_as_lost_and_failover_goes_on() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("restore", 12).await;
    fleet.start("r-0").await;
    fleet.start("r-1").await;
    fleet.converged("the initial creation").await;
    fleet.balanced().await;
    let configmaps = fleet.env.api::<ConfigMap>();
    let saved = configmaps.get(ASSIGNMENT_CONFIGMAP).await.unwrap();
    // The assignment moves on: a third replica joins.
    fleet.start("r-2").await;
    fleet.balanced().await;
    let before_restore = generation(&configmaps.get(ASSIGNMENT_CONFIGMAP).await.unwrap());

    // A backup restore, or a GitOps tool re-applying what it saw: the older copy's content
    // replaces the current one. Then a replica dies.
    let mut current = configmaps.get(ASSIGNMENT_CONFIGMAP).await.unwrap();
    current.data = saved.data.clone();
    configmaps.replace(ASSIGNMENT_CONFIGMAP, &PostParams::default(), &current).await.unwrap();
    fleet.kill("r-1");
    fleet.change_every_policy().await;
    fleet.converged("an older assignment was restored and a replica was killed").await;
    let shares = fleet.balanced().await;
    let after = generation(&configmaps.get(ASSIGNMENT_CONFIGMAP).await.unwrap());
    assert!(after > before_restore, "published again above generation {before_restore}: {after}");
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: restored assignment (generation {} over {before_restore}, then {after}) and a kill: \
         {shares:?}, {} writes seen by the server, {} overlapping, {} fenced",
        generation(&saved),
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reinstall_starts_its_epochs_above_every_token_in_the_cluster() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("reinstall", 6).await;
    fleet.start("r-0").await;
    fleet.start("r-1").await;
    fleet.converged("the initial creation").await;
    // Handoffs raise the epochs of the first install; the children take them with a change.
    for _ in 0..3 {
        fleet.terminate("r-1");
        fleet.start("r-1").await;
        fleet.balanced().await;
    }
    fleet.change_every_policy().await;
    fleet.converged("the first install's changes").await;
    let (_, mut highest) = tokens(&fleet.client(), &fleet.namespaces).await;

    // Into another namespace, then into the same one after deleting it.
    for (namespace, how) in [("op-reinstall-b", "into another namespace"), ("op-reinstall-b", "after deleting it")] {
        fleet.reinstall(namespace).await;
        fleet.start("r-0").await;
        fleet.start("r-1").await;
        fleet.change_every_policy().await;
        fleet.converged(&format!("a reinstall {how}")).await;
        let (lowest, now) = tokens(&fleet.client(), &fleet.namespaces).await;
        assert!(
            lowest > highest,
            "a child written after the reinstall {how} holds token {lowest}, not above {highest}"
        );
        highest = now;
    }
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: two reinstalls, every child above the previous install's tokens: {} writes seen by the \
         server, {} overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert_eq!(verdict.fenced, 0, "a write of the new install was fenced");
}
