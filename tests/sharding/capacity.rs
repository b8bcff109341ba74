//! A fleet whose replicas can hold fewer policies than there are: each holds no more than its
//! capacity, what fits nowhere is counted exactly and shown by `shards`, and it is placed once
//! a replica with room joins.

use std::collections::BTreeMap;
use std::process::Command;

use kube::api::{Api, ListParams};
use traffic_policy_operator::api::ApplicationTrafficPolicy;

use crate::SERIAL;
use crate::common::eventually;
use crate::fleet::{Fleet, PER_NAMESPACE};

/// Each replica's room: seven namespaces of five policies, and two policies that no whole
/// namespace fits in.
const CAPACITY: usize = 7 * PER_NAMESPACE + 2;
const NAMESPACES: usize = 24;

/// The leader's count of unplaced policies (the other replicas report none).
fn unplaced_reported(fleet: &Fleet) -> f64 {
    let reported = fleet.replicas.values().map(|r| r.metric("traffic_policy_unplaced_objects", None));
    reported.fold(0.0, f64::max)
}

/// The policies each replica holds in its policy cache (in label mode the leader also
/// caches namespaces and unlabelled policies, for labelling).
fn held(fleet: &Fleet) -> BTreeMap<String, usize> {
    let policies = Some("resource=\"applicationtrafficpolicy\"");
    let held =
        fleet.replicas.iter().map(|(name, r)| (name.clone(), r.metric("traffic_policy_cached_objects", policies)));
    held.map(|(name, n)| (name, n as usize)).collect()
}

/// The policies of the fleet that no replica has reconciled, as the API server has them.
async fn unreconciled(fleet: &Fleet) -> Option<usize> {
    let policies = Api::<ApplicationTrafficPolicy>::all(fleet.client());
    let list = policies.list(&ListParams::default()).await.ok()?;
    assert_eq!(list.items.len(), fleet.total(), "only this fleet's policies are on the server");
    Some(list.items.iter().filter(|p| !p.is_ready()).count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_over_its_capacity_places_what_fits_and_counts_the_rest() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("capacity", NAMESPACES).await;
    fleet.lease_args.push(format!("--capacity={CAPACITY}"));
    for name in ["r-0", "r-1"] {
        fleet.start(name).await;
    }

    // Settled: the reconciled policies are all the replicas hold, and the leader's count of
    // the rest is exactly what the API server shows unreconciled.
    let unplaced = eventually("the leader counts exactly the policies nobody reconciles", || async {
        let unreconciled = unreconciled(&fleet).await?;
        let held: usize = held(&fleet).values().sum();
        let settled = unreconciled > 0 && held + unreconciled == fleet.total();
        (settled && unplaced_reported(&fleet) == unreconciled as f64).then_some(unreconciled)
    })
    .await;
    let shares = held(&fleet);
    println!(
        "capacity summary: {} policies, room for {CAPACITY} on each of 2 replicas: held {shares:?}, {unplaced} unplaced",
        fleet.total()
    );
    for (replica, held) in &shares {
        assert!(*held <= CAPACITY, "{replica} holds {held}, over its capacity of {CAPACITY}");
    }
    // Namespaces stay whole: each replica is filled to within a namespace of its capacity.
    assert!(fleet.total() - unplaced > 2 * (CAPACITY - PER_NAMESPACE), "room left unused: {shares:?}");

    let shards = Command::new(env!("CARGO_BIN_EXE_traffic-policy-operator"))
        .args(["shards", "--namespace", &fleet.env.namespace, "--kubeconfig"])
        .arg(fleet.env.cp.kubeconfig_path())
        .output()
        .unwrap();
    let shards = String::from_utf8_lossy(&shards.stdout);
    assert!(shards.contains(&format!("unplaced: {unplaced} policies")), "{shards}");
    assert!(shards.contains(&format!("/{CAPACITY}")), "each replica's capacity is shown: {shards}");

    // Room for the rest: a third replica takes it, and nothing is left unplaced.
    fleet.lease_args = vec![format!("--capacity={}", fleet.total())];
    fleet.start("r-2").await;
    assert_eq!(fleet.converged("a replica with room joined").await, fleet.total());
    eventually("the leader reports nothing unplaced", || async { (unplaced_reported(&fleet) == 0.0).then_some(()) })
        .await;
    for (replica, held) in held(&fleet) {
        let capacity = if replica == "r-2" { fleet.total() } else { CAPACITY };
        assert!(held <= capacity, "{replica} holds {held}, over its capacity of {capacity}");
    }
    let verdict = fleet.finish().await;
    assert!(verdict.overlapping.is_empty(), "two processes wrote one object at once: {:?}", verdict.overlapping);
    assert_eq!(verdict.fenced, 0);
}
