//! A handoff lists only what it moves (docs/sharding.md, "Watching in parts"): each replica's
//! lists bring exactly the policies of the buckets it gained, never its whole slice again.
//! Counted by each replica's `traffic_policy_listed_objects_total`; what each gained comes
//! from the published assignments before and after.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::ConfigMap;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::sharding::assignment::{Assignment, Slot};
use traffic_policy_operator::sharding::membership::pod_of;

use crate::SERIAL;
use crate::common::{eventually, expected_mode};
use crate::fleet::{Fleet, PER_NAMESPACE};

/// One replica at a settled moment.
#[derive(Debug)]
struct Held {
    /// Policies its lists brought so far.
    listed: f64,
    /// Policies it caches.
    cached: f64,
    buckets: BTreeSet<u16>,
}

/// Every replica, once the assignment has settled and every cache holds its share.
async fn settled(fleet: &Fleet, what: &str) -> BTreeMap<String, Held> {
    fleet.balanced().await;
    let total = fleet.total() as f64;
    let configmaps = fleet.env.api::<ConfigMap>();
    eventually(&format!("the replicas' caches hold every policy once after {what}"), || async {
        let published = configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await.ok()??;
        let assignment = Assignment::decode(&published.data?).ok()?;
        let held: BTreeMap<String, Held> = fleet
            .replicas
            .iter()
            .map(|(name, r)| {
                let buckets = (0..)
                    .zip(&assignment.slots)
                    .filter(|(_, slot)| matches!(slot, Slot::Owned { member, .. } if pod_of(member) == name))
                    .map(|(b, _)| b)
                    .collect();
                let listed = r.metric("traffic_policy_listed_objects_total", Some("ApplicationTrafficPolicy"));
                (name.clone(), Held { listed, cached: r.metric("traffic_policy_cached_objects", None), buckets })
            })
            .collect();
        // The gauge is updated every few seconds: a replica that shows none has not counted yet,
        // and one that shows what it held before the handoff makes the sum differ.
        let all_counted = held.values().all(|h| h.cached > 0.0);
        (all_counted && held.values().map(|h| h.cached).sum::<f64>() == total).then_some(held)
    })
    .await
}

/// Per replica: (policies listed, policies in the buckets it gained) from `before` to `after`.
fn listed_and_gained(
    fleet: &Fleet,
    before: &BTreeMap<String, Held>,
    after: &BTreeMap<String, Held>,
) -> Vec<(String, f64, f64)> {
    let mode = expected_mode();
    let per_bucket = |bucket: u16| {
        let namespaces = fleet.namespaces.iter().filter(|ns| mode.bucket_of(ns) == bucket).count();
        (namespaces * PER_NAMESPACE) as f64
    };
    after
        .iter()
        .map(|(name, now)| {
            let (listed_before, buckets_before) =
                before.get(name).map_or((0.0, BTreeSet::new()), |h| (h.listed, h.buckets.clone()));
            let gained = now.buckets.difference(&buckets_before).map(|b| per_bucket(*b)).sum();
            (name.clone(), now.listed - listed_before, gained)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_lists_only_the_policies_it_moves() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("handoff", 40).await;
    for name in ["r-0", "r-1"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    let two = settled(&fleet, "two replicas").await;
    fleet.start("r-2").await;
    let three = settled(&fleet, "scaling to 3").await;
    fleet.terminate("r-2");
    let back = settled(&fleet, "scaling back to 2").await;

    let mut summary = Vec::new();
    for (what, before, after) in [("2 → 3", &two, &three), ("3 → 2", &three, &back)] {
        let moved = listed_and_gained(&fleet, before, after);
        for (name, listed, gained) in &moved {
            assert_eq!(
                listed, gained,
                "{what}: {name} listed other policies than those it gained: {before:?} → {after:?}"
            );
        }
        let listed: f64 = moved.iter().map(|(_, listed, _)| listed).sum();
        assert!(listed > 0.0, "{what}: nothing moved");
        let each: Vec<String> = moved.iter().map(|(name, listed, _)| format!("{name} {listed}")).collect();
        summary.push(format!(
            "{what}: {listed} policies listed, each by the replica that gained it ({})",
            each.join(", ")
        ));
    }
    fleet.converged("the handoffs").await;
    let total = fleet.total();
    let verdict = fleet.finish().await;
    println!(
        "handoff summary: {}; {total} policies in all; {} writes seen by the server, {} overlapping",
        summary.join("; "),
        verdict.writes,
        verdict.overlapping.len()
    );
}
