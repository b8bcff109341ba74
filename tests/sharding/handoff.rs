//! A handoff lists only what it moves (docs/sharding.md, "Watching in parts"): each replica's
//! lists bring exactly the policies of the buckets it gained, never its whole slice again.
//! Counted by each replica's `traffic_policy_listed_objects_total`; what each gained comes
//! from every assignment the leader published meanwhile, read from a watch (a bucket may
//! pass through a replica that stays on the way to its final owner).

use std::collections::BTreeMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ConfigMap;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::coordination::published::record_published;
use traffic_policy_operator::sharding::assignment::Assignment;
use traffic_policy_operator::sharding::membership::pod_of;

use crate::SERIAL;
use crate::common::{eventually, expected_mode};
use crate::fleet::{Fleet, PER_NAMESPACE};

/// Once the assignment has settled and every cache holds its share: per replica, the
/// policies its lists brought so far; and how many assignments were recorded by then.
async fn settled(fleet: &Fleet, recorded: &Mutex<Vec<Assignment>>, what: &str) -> (BTreeMap<String, f64>, usize) {
    fleet.balanced().await;
    let total = fleet.total() as f64;
    let configmaps = fleet.env.api::<ConfigMap>();
    eventually(&format!("the replicas' caches hold every policy once after {what}"), || async {
        let published = configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await.ok()??;
        let generation = Assignment::decode(&published.data?).ok()?.generation;
        let recorded = recorded.lock().unwrap().iter().rposition(|a| a.generation == generation)? + 1;
        let mut listed = BTreeMap::new();
        let mut cached = Vec::new();
        for (name, r) in &fleet.replicas {
            let policies = r.metric("traffic_policy_listed_objects_total", Some("ApplicationTrafficPolicy"));
            listed.insert(name.clone(), policies);
            cached.push(r.metric("traffic_policy_cached_objects", None));
        }
        // The gauge is updated every few seconds: a replica that shows none has not counted yet,
        // and one that shows what it held before the handoff makes the sum differ.
        let all_counted = cached.iter().all(|c| *c > 0.0);
        (all_counted && cached.iter().sum::<f64>() == total).then_some((listed, recorded))
    })
    .await
}

/// Per replica: (policies listed, policies of the buckets it gained in each step of
/// `history`) between two settled moments.
fn listed_and_gained(
    fleet: &Fleet,
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    history: &[Assignment],
) -> Vec<(String, f64, f64)> {
    let mode = expected_mode();
    let per_bucket = |bucket: u16| {
        let namespaces = fleet.namespaces.iter().filter(|ns| mode.bucket_of(ns) == bucket).count();
        (namespaces * PER_NAMESPACE) as f64
    };
    let mut gained: BTreeMap<&str, f64> = BTreeMap::new();
    for (member, bucket) in Assignment::gains_over(history) {
        *gained.entry(pod_of(member)).or_default() += per_bucket(bucket);
    }
    after
        .iter()
        .map(|(name, listed)| {
            let listed = listed - before.get(name).copied().unwrap_or_default();
            (name.clone(), listed, gained.get(name.as_str()).copied().unwrap_or_default())
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
    let (recorded, recorder) = record_published(fleet.env.api::<ConfigMap>(), ASSIGNMENT_CONFIGMAP);
    let (two, at_two) = settled(&fleet, &recorded, "two replicas").await;
    fleet.start("r-2").await;
    let (three, at_three) = settled(&fleet, &recorded, "scaling to 3").await;
    fleet.terminate("r-2");
    let (back, at_back) = settled(&fleet, &recorded, "scaling back to 2").await;
    recorder.abort();
    let history = recorded.lock().unwrap().clone();

    let mut summary = Vec::new();
    let steps = [("2 → 3", &two, &three, at_two, at_three), ("3 → 2", &three, &back, at_three, at_back)];
    for (what, before, after, from, to) in steps {
        // From the last assignment before the step to the one it settled at.
        let moved = listed_and_gained(&fleet, before, after, &history[from - 1..to]);
        for (name, listed, gained) in &moved {
            assert_eq!(listed, gained, "{what}: {name} listed other policies than those it gained: {moved:?}");
        }
        let listed: f64 = moved.iter().map(|(_, listed, _)| listed).sum();
        assert!(listed > 0.0, "{what}: nothing moved");
        let each: Vec<String> = moved.iter().map(|(name, listed, _)| format!("{name} {listed}")).collect();
        summary.push(format!(
            "{what}: {listed} policies listed in {} assignments, each by the replica that gained it ({})",
            to - from,
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
