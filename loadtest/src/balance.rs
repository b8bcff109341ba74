//! How evenly the replicas' slices hold the policies once the leader has settled, read from
//! the API server: the published assignment, the member Leases' reports, and the policies
//! the run created.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::coordination::members::lease_state;
use traffic_policy_operator::coordination::published::decode;
use traffic_policy_operator::coordination::{ASSIGNMENT_CONFIGMAP, MEMBER_LEASE_PREFIX, NAMES};
use traffic_policy_operator::sharding::assignment::{Assignment, Slot, desired};
use traffic_policy_operator::sharding::balance::{self, Balance};
use traffic_policy_operator::sharding::hash_ranges::by_hash;

use crate::args::{Args, Sharding};

/// The target of docs/benchmarks.md: the largest replica holds at most this × the mean.
pub const TARGET: f64 = 1.1;

/// Waits until the assignment is one the leader would not change (settled, every owner's
/// report current and true to what the run created, no rebalance due), then reports each
/// replica's policies and the largest over the mean.
pub async fn settle(
    client: &Client,
    args: &Args,
    namespace: &str,
    deadline: Duration,
) -> anyhow::Result<serde_json::Value> {
    // The replicas get the tool's environment, so they balance by the same rule.
    let rule = Balance {
        min_excess: std::env::var("TPO_REBALANCE_MIN_OBJECTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(Balance::default().min_excess),
        ..Balance::default()
    };
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let leases = Api::<Lease>::namespaced(client.clone(), namespace);
    let created = created_per_namespace(args);
    let started = Instant::now();
    let mut last = String::from("no assignment yet");
    loop {
        let split = args.split_hash_ranges && args.sharding == Sharding::ShardSelector;
        if let Some(settled) = check(&configmaps, &leases, &created, rule, split, &mut last).await? {
            let seconds = started.elapsed().as_secs_f64();
            let (assignment, loads) = settled;
            let imbalance = balance::imbalance(&loads.iter().map(|(m, n)| (m.as_str(), *n)).collect());
            // What the same replicas would hold by bucket count alone (the first assignment).
            let owners: BTreeSet<String> = loads.keys().cloned().collect();
            let by_buckets = desired(&owners, None);
            let counts = assignment.count(&created);
            let by_buckets =
                balance::imbalance(&balance::loads(&owners, by_buckets.iter().map(Option::as_deref), &counts));
            return Ok(json!({
                "settled_seconds": seconds,
                "generation": assignment.generation,
                "by_objects": assignment.objects.is_some(),
                "hash_ranges_split": !assignment.ranges.is_uniform(),
                "policies_per_replica": loads.values().collect::<Vec<_>>(),
                "largest_over_mean": imbalance,
                "by_bucket_count_largest_over_mean": by_buckets,
            }));
        }
        anyhow::ensure!(started.elapsed() < deadline, "the slices did not settle within {deadline:?}: {last}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The settled assignment and each owner's true policy count, or why not yet (in `last`).
async fn check(
    configmaps: &Api<ConfigMap>,
    leases: &Api<Lease>,
    created: &BTreeMap<String, u32>,
    rule: Balance,
    split: bool,
    last: &mut String,
) -> anyhow::Result<Option<(Assignment, BTreeMap<String, u64>)>> {
    let Some((assignment, _)) = configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await?.as_ref().and_then(decode) else {
        return Ok(None);
    };
    if split && *assignment.ranges != assignment.ranges.split(&by_hash(created)) {
        *last = format!("generation {}: hash ranges still to split", assignment.generation);
        return Ok(None);
    }
    let reports: BTreeMap<_, _> = leases
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|l| l.name_any().starts_with(MEMBER_LEASE_PREFIX))
        .filter_map(|l| {
            let state = lease_state(l, &NAMES);
            Some((state.holder?, state.load?))
        })
        .collect();
    let Some(observed) = balance::observed(&assignment, &reports) else {
        *last = format!("generation {}: buckets moving, or reports not current", assignment.generation);
        return Ok(None);
    };
    if observed != assignment.count(created) {
        *last = format!("generation {}: the reports do not count every policy yet", assignment.generation);
        return Ok(None);
    }
    let owners: BTreeSet<String> = assignment.slots.iter().filter_map(Slot::owner).map(str::to_string).collect();
    if balance::rebalance(&assignment, &owners, &observed, rule).is_some() {
        *last = format!("generation {}: a rebalance is due", assignment.generation);
        return Ok(None);
    }
    let loads = balance::loads(&owners, assignment.slots.iter().map(Slot::owner), &observed);
    let loads = loads.into_iter().map(|(m, n)| (m.to_string(), n)).collect();
    Ok(Some((assignment, loads)))
}

/// The run's policies per namespace.
pub fn created_per_namespace(args: &Args) -> BTreeMap<String, u32> {
    let mut counts = BTreeMap::new();
    for i in 0..args.objects {
        *counts.entry(args.namespace_of(i)).or_default() += 1;
    }
    counts
}
