//! A fleet splitting its hash ranges (`--split-hash-ranges`), as namespaces whose names
//! differ only at the end (`ranges-team-1` … `ranges-team-12`) appear: the server's hash puts
//! them into a few of the uniform ranges, and the leader splits those where the namespaces
//! are, revoking the buckets whose ranges change before it publishes the new ranges. Policies
//! change all along; the server judges every write.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use traffic_policy_operator::sharding::assignment::Assignment;
use traffic_policy_operator::sharding::bucket::Mode;
use traffic_policy_operator::sharding::hash_ranges::by_hash;

use crate::SERIAL;
use crate::common::{eventually_within, expected_mode};
use crate::fleet::{Fleet, PER_NAMESPACE, create_policies};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_hash_ranges_keep_crowding_names_apart_and_never_overlap() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("ranges", 10).await;
    fleet.lease_args.push("--split-hash-ranges=true".into());
    for name in ["r-0", "r-1"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    let before = fleet.assignment().await;
    let teams: Vec<String> = (1..=12).map(|i| format!("ranges-team-{i}")).collect();
    let shared = teams.iter().map(|ns| before.bucket_of(ns)).collect::<BTreeSet<_>>().len();
    if expected_mode() == Mode::ShardSelector {
        assert!(shared < teams.len() / 2, "the case this test is about: {shared} buckets for {} names", teams.len());
    }
    for ns in &teams {
        create_policies(&fleet.client(), ns, "ranges", PER_NAMESPACE).await;
        fleet.namespaces.push(ns.clone());
    }
    let (stop_churn, churner) = fleet.churn();
    let per_namespace: BTreeMap<String, u32> =
        fleet.namespaces.iter().map(|ns| (ns.clone(), PER_NAMESPACE as u32)).collect();
    // The leader counts every 30 s, then revokes the buckets to change before it splits them.
    let after = eventually_within(Duration::from_secs(120), "the leader splits the crowded ranges", || async {
        let assignment = fleet.assignment().await;
        let split = *assignment.ranges == assignment.ranges.split(&by_hash(&per_namespace));
        let owned = assignment.slots.iter().all(|s| s.owner().is_some());
        let settled = match expected_mode() {
            Mode::ShardSelector => split && !assignment.ranges.is_uniform(),
            // Buckets are labels there: the flag has nothing to split.
            Mode::Labels => assignment.ranges.is_uniform(),
        };
        (settled && owned).then_some(assignment)
    })
    .await;
    fleet.converged("the split").await;
    // A replica that starts under split ranges reads them from its first assignment.
    fleet.terminate("r-1");
    fleet.start("r-1").await;
    fleet.balanced().await;
    fleet.change_every_policy().await;
    stop_churn.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = churner.await.unwrap();
    fleet.converged("the restart under split ranges").await;
    let apart = teams.iter().map(|ns| after.bucket_of(ns)).collect::<BTreeSet<_>>().len();
    let changed = before.ranges.changed(&after.ranges).len();
    let held =
        |assignment: &Assignment| fleet.namespaces.iter().map(|ns| assignment.bucket_of(ns)).collect::<BTreeSet<_>>();
    let splits = held(&after).len() - held(&before).len();
    if expected_mode() == Mode::ShardSelector {
        assert_eq!(apart, teams.len(), "each namespace in a bucket of its own");
        assert!((1..=3 * splits).contains(&changed), "{changed} buckets changed for {splits} splits");
    }
    let verdict = fleet.finish().await;
    assert_eq!(verdict.fenced, 0, "a write was refused: some process wrote after another had taken the object");
    println!(
        "sharding summary: {} names in {shared} buckets split into {apart} by changing {changed} of 1024, under \
         {changes} spec changes: {} writes seen by the server, {} overlapping, {} fenced",
        teams.len(),
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
}
