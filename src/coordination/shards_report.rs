//! `traffic-policy-operator shards`: who owns what, read from the cluster as any user would.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PartialObjectMeta};
use kube::{Client, ResourceExt};

use super::published::decode;
use super::{ASSIGNMENT_CONFIGMAP, MEMBER_LEASE_PREFIX};
use crate::api::ApplicationTrafficPolicy;
use crate::sharding::assignment::{Assignment, Slot};
use crate::sharding::bucket::Bucket;
use crate::sharding::membership::pod_of;

/// Prints one line per replica: its lease holder, buckets, policies (and capacity), and the
/// namespaces with policies that fall in its buckets; then the policies no replica has room
/// for, and any namespace too big for a fair share.
pub async fn print(client: Client, namespace: &str) -> anyhow::Result<()> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get_opt(ASSIGNMENT_CONFIGMAP)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no assignment in namespace {namespace:?}: is the operator running there?"))?;
    let (assignment, _) = decode(&cm).ok_or_else(|| anyhow::anyhow!("the assignment is malformed"))?;
    let leases = Api::<Lease>::namespaced(client.clone(), namespace).list(&ListParams::default()).await?;
    // Member Leases only: the leader-election Lease advertises nothing.
    let member_leases: Vec<&Lease> =
        leases.items.iter().filter(|l| l.name_any().starts_with(MEMBER_LEASE_PREFIX)).collect();
    // Pod → the incarnation holding its member Lease ("" once released).
    let holders: BTreeMap<String, String> = member_leases
        .iter()
        .filter_map(|l| {
            let pod = l.name_any().strip_prefix(MEMBER_LEASE_PREFIX)?.to_string();
            Some((pod, l.spec.as_ref()?.holder_identity.clone().unwrap_or_default()))
        })
        .collect();
    let policies = Api::<PartialObjectMeta<ApplicationTrafficPolicy>>::all(client.clone())
        .list_metadata(&Default::default())
        .await?;
    let mut namespaces: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut held: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_namespace: BTreeMap<String, usize> = BTreeMap::new();
    let mut unowned: BTreeSet<String> = BTreeSet::new();
    // Free buckets, while members advertise capacities: what the leader left unplaced.
    let (mut unplaced, mut unplaced_policies) = (BTreeSet::new(), 0);
    let capacities: BTreeMap<String, u64> = member_leases
        .iter()
        .filter_map(|lease| {
            let state = super::members::lease_state(lease, &super::NAMES);
            Some((state.holder.clone()?, state.capability?.capacity?))
        })
        .collect();
    for policy in &policies.items {
        let ns = policy.namespace().unwrap_or_default();
        *per_namespace.entry(ns.clone()).or_default() += 1;
        match &assignment.slots[usize::from(assignment.bucket_of(&ns))] {
            Slot::Owned { member, .. } => {
                *held.entry(member.clone()).or_default() += 1;
                namespaces.entry(member.clone()).or_default().insert(ns);
            }
            Slot::Free if !capacities.is_empty() => {
                unplaced_policies += 1;
                unplaced.insert(ns);
            }
            _ => {
                unowned.insert(ns);
            }
        }
    }
    println!(
        "assignment generation {}, sharding mode {}{}, {} policies",
        assignment.generation,
        assignment.mode.as_str(),
        if assignment.ranges.is_uniform() { "" } else { " (hash ranges split)" },
        policies.items.len()
    );
    println!("{:<36} {:<9} {:>7} {:>8}  NAMESPACES", "REPLICA (INCARNATION)", "LEASE", "BUCKETS", "POLICIES");
    let shares = assignment.shares();
    let members: BTreeSet<&String> = shares.keys().chain(holders.values().filter(|h| !h.is_empty())).collect();
    for member in members {
        let lease = match holders.get(pod_of(member)) {
            Some(holder) if holder == member => "held",
            Some(holder) if holder.is_empty() => "released",
            Some(_) => "replaced",
            None => "none",
        };
        let owned = namespaces.get(member).cloned().unwrap_or_default();
        let list: Vec<&str> = owned.iter().map(String::as_str).collect();
        let (buckets, count) = (shares.get(member).copied().unwrap_or(0), held.get(member).copied().unwrap_or(0));
        let count = match capacities.get(member) {
            Some(capacity) => format!("{count}/{capacity}"),
            None => count.to_string(),
        };
        println!("{member:<36} {lease:<9} {buckets:>7} {count:>8}  {}", list.join(","));
    }
    if !unowned.is_empty() {
        println!(
            "{:<36} {:<9} {:>7} {:>8}  {}",
            "(moving)",
            "",
            "",
            "",
            unowned.into_iter().collect::<Vec<_>>().join(",")
        );
    }
    if !unplaced.is_empty() {
        println!(
            "unplaced: {unplaced_policies} policies in {} namespaces, more than the replicas' capacities hold; nobody \
             reconciles them (docs/runbooks.md, TrafficPolicyUnplacedObjects): {}",
            unplaced.len(),
            unplaced.into_iter().collect::<Vec<_>>().join(",")
        );
    }
    for lease in member_leases {
        let state = super::members::lease_state(lease, &super::NAMES);
        let Some(holder) = state.holder.as_deref().filter(|h| !h.is_empty()) else { continue };
        if let Some(why) = state.why_not_given(assignment.mode.as_str()) {
            println!("replica {holder} gets no buckets: {why}");
        }
    }
    println!("{}", super::admission::bindings_line(&client).await);
    if shares.len() > 1 {
        let fair = policies.items.len() / shares.len();
        for (ns, count) in per_namespace.iter().filter(|(_, n)| **n > fair) {
            println!(
                "namespace {ns} holds {count} policies, more than a fair share ({fair}): it stays whole on one replica"
            );
        }
        for (bucket, count, names) in crowded_buckets(&per_namespace, &assignment, fair) {
            println!(
                "bucket {bucket} holds {count} policies in {names} namespaces, more than a fair share ({fair}): they \
                 stay together; names that differ only at the end share buckets in shard-selector mode, and \
                 --split-hash-ranges splits them (docs/sharding.md, \"Two costs of the server's hash\")"
            );
        }
    }
    Ok(())
}

/// Buckets of several namespaces that together hold more than `fair` policies: (bucket,
/// policies, namespaces). Unless the leader splits their ranges, these keep the slices uneven.
fn crowded_buckets(
    per_namespace: &BTreeMap<String, usize>,
    assignment: &Assignment,
    fair: usize,
) -> Vec<(Bucket, usize, usize)> {
    let mut buckets: BTreeMap<Bucket, (usize, usize)> = BTreeMap::new();
    for (ns, count) in per_namespace {
        let (policies, names) = buckets.entry(assignment.bucket_of(ns)).or_default();
        *policies += count;
        *names += 1;
    }
    buckets
        .into_iter()
        .filter(|(_, (policies, names))| *names > 1 && *policies > fair)
        .map(|(b, (p, n))| (b, p, n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sharding::bucket::Mode;
    use crate::sharding::hash_ranges::{HashRanges, Ranges, by_hash};

    #[test]
    fn names_that_crowd_a_bucket_are_found_in_uniform_shard_selector_ranges_only() {
        let teams: BTreeMap<String, usize> = (1..=200).map(|i| (format!("team-{i}"), 100)).collect();
        let fair = 20_000 / 3;
        let in_mode = |mode| Assignment { mode, ..Assignment::default() };
        let crowded = crowded_buckets(&teams, &in_mode(Mode::ShardSelector), fair);
        assert!(!crowded.is_empty(), "team-1 … team-200 share a few buckets");
        assert!(crowded.iter().all(|(_, policies, names)| *policies > fair && *names > 1));
        assert_eq!(crowded_buckets(&teams, &in_mode(Mode::Labels), fair), vec![], "xxh3 spreads them");
        let by_namespace = teams.iter().map(|(ns, n)| (ns.clone(), *n as u32)).collect();
        let split = HashRanges::uniform().split(&by_hash(&by_namespace));
        let split = Assignment { ranges: Ranges::new(split), ..in_mode(Mode::ShardSelector) };
        assert_eq!(crowded_buckets(&teams, &split, fair), vec![], "split ranges keep them apart");
        let one_big = BTreeMap::from([("big".to_string(), 15_000), ("small".to_string(), 5_000)]);
        let crowded = crowded_buckets(&one_big, &in_mode(Mode::ShardSelector), 10_000);
        assert_eq!(crowded, vec![], "one namespace is reported as such");
    }
}
