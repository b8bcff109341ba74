//! Slices within the members' capacities: what the leader places by when a member advertises
//! how many objects it can hold.
//!
//! The ring keeps every member under its capacity (`Ring::assign_within`), but only with
//! true counts of every bucket, including those nobody holds. Those come from the leader's
//! own count (`coordination::census`): the leader places nothing by capacity before its first
//! count, and publishes a new count when
//! - none is published yet;
//! - a member would hold more than its capacity by the new count;
//! - the total moved by more than 1 % (objects created or deleted: room freed or taken).
//!
//! Between those, the replicas' reports balance as before (`sharding::balance`). What no
//! member has room for stays free: nobody reconciles it, and the leader reports it.

use std::collections::{BTreeMap, BTreeSet};

use super::assignment::{Assignment, Capacities, Slot, Wanted};
use super::balance::loads;
use super::counts::{Counts, Report};

/// What the leader plans by.
#[derive(Debug, PartialEq)]
pub struct Placement {
    /// The owners to plan towards, and the counts to publish with them.
    pub wanted: Wanted,
    /// The buckets, with their objects, that no member has room for.
    pub unplaced: Counts,
}

impl Placement {
    /// The objects no member has room for.
    pub fn unplaced_objects(&self) -> u64 {
        self.unplaced.values().map(|n| u64::from(*n)).sum()
    }
}

/// What to plan by: `rebalanced` as the replicas' reports gave it when nobody has a
/// capacity; `None` while capacities must be honoured and nothing has been counted yet.
/// The ring is built once here, and the plan goes towards its owners.
pub fn place(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    capacities: &Capacities,
    census: Option<&Counts>,
    rebalanced: Option<Counts>,
) -> Option<Placement> {
    if capacities.is_empty() {
        return Some(Placement {
            wanted: Wanted::of(current, receivers, capacities, rebalanced),
            unplaced: Counts::new(),
        });
    }
    let census = census?;
    let total = |counts: &Counts| counts.values().map(|n| u64::from(*n)).sum::<u64>();
    let recount = match &current.objects {
        None => true,
        Some(published) => {
            let held = loads(receivers, current.slots.iter().map(Slot::owner), census);
            let over = held.iter().any(|(member, load)| capacities.get(*member).is_some_and(|c| load > c));
            over || total(published).abs_diff(total(census)) * 100 > total(published)
        }
    };
    let rebalanced =
        if recount && current.objects.as_ref() != Some(census) { Some(census.clone()) } else { rebalanced };
    // Counted at least once by now: `recount` holds while nothing is published.
    let wanted = Wanted::of(current, receivers, capacities, rebalanced);
    Some(Placement { unplaced: wanted.unplaced(receivers), wanted })
}

/// Whether a member reports holding more objects than its capacity: objects created since
/// the last count went to it, and the leader should count again rather than wait.
pub fn reported_over(reports: &BTreeMap<String, Report>, capacities: &Capacities) -> bool {
    let held = |report: &Report| report.counts.values().map(|n| u64::from(*n)).sum::<u64>();
    reports.iter().any(|(member, report)| capacities.get(member).is_some_and(|c| held(report) > *c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::plan_towards;
    use crate::assignment::tests::{never, set};
    use crate::bucket::BUCKETS;

    fn even(per_bucket: u32) -> Counts {
        (0..BUCKETS).map(|b| (b, per_bucket)).collect()
    }

    #[test]
    fn without_capacities_the_reports_decide() {
        let members = set(&["a", "b"]);
        let current = Assignment::default();
        let reported = Some(even(1));
        let placement = place(&current, &members, &Capacities::new(), None, reported.clone()).unwrap();
        assert_eq!(placement.wanted.objects, reported);
        assert_eq!(placement.unplaced, Counts::new());
    }

    #[test]
    fn a_member_over_its_capacity_by_its_own_report_asks_for_a_count() {
        let report = |n: u32| Report { generation: 3, counts: Counts::from([(1, n), (9, 10)]) };
        let capacities = Capacities::from([("a".into(), 100)]);
        let reports = |n: u32| BTreeMap::from([("a".to_string(), report(n)), ("b".to_string(), report(500))]);
        assert!(!reported_over(&reports(90), &capacities), "at its capacity; b has none");
        assert!(reported_over(&reports(91), &capacities));
    }

    #[test]
    fn with_capacities_nothing_is_placed_before_a_count() {
        let capacities = Capacities::from([("a".into(), 100)]);
        assert_eq!(place(&Assignment::default(), &set(&["a", "b"]), &capacities, None, None), None);
    }

    #[test]
    fn a_count_is_published_when_needed_and_only_then() {
        let members = set(&["a", "b"]);
        let capacities = Capacities::from([("a".into(), 4000), ("b".into(), 4000)]);
        let census = even(5); // 5,120 objects, room for 8,000
        let first = place(&Assignment::default(), &members, &capacities, Some(&census), None).unwrap();
        assert_eq!(first.wanted.objects.as_ref(), Some(&census), "nothing published yet");
        assert_eq!(first.unplaced_objects(), 0);
        let settled = plan_towards(&Assignment::default(), &members, first.wanted, &never).unwrap();
        let same = place(&settled, &members, &capacities, Some(&census), None).unwrap();
        assert_eq!(same.wanted.objects.as_ref(), Some(&census), "the published count holds");
        assert_eq!(plan_towards(&settled, &members, same.wanted, &never), None, "and nothing moves");
        // 0.5 % more: within the hysteresis, and under both capacities.
        let drift: Counts = census.iter().map(|(b, n)| (*b, if *b < 26 { n + 1 } else { *n })).collect();
        let drifted = place(&settled, &members, &capacities, Some(&drift), None).unwrap();
        assert_eq!(drifted.wanted.objects.as_ref(), Some(&census), "the published count holds");
        // Twice the objects: more than the fleet holds, and a member would hold too many.
        let grown = even(10);
        let placement = place(&settled, &members, &capacities, Some(&grown), None).unwrap();
        assert_eq!(placement.wanted.objects.as_ref(), Some(&grown));
        assert_eq!(placement.unplaced_objects(), 10240 - 8000, "exactly what is over the fleet's room");
    }
}
