//! Balancing slices by objects, not only by buckets.
//!
//! Namespaces differ in size by orders of magnitude, so equal bucket counts can leave one
//! replica with far more objects than another. So each replica reports, on its member
//! Lease, how many objects it holds per bucket ([`Report`]); the leader publishes per-bucket
//! object counts in the assignment, and the ring bounds each member's load by them
//! (`Ring::assign_weighted`). Pure: reports and the assignment are arguments.
//!
//! Hysteresis, so that counts that drift do not move buckets all the time: the published
//! counts change only when
//! - the assignment is settled (nothing draining or free) and every owner has reported
//!   counts for it: a report of an older generation lacks what is still being listed;
//! - the total has held still ([`Steadiness`]): while objects are created in bulk, reports
//!   counted seconds apart disagree by thousands, and balancing by them would chase noise;
//! - the largest replica holds more than the mean by a margin: the larger of
//!   [`Balance::tolerance`] × the mean and [`Balance::min_excess`];
//! - balancing by the current counts would cut the largest replica's load by at least that
//!   margin again. A bucket bigger than a fair share (one large namespace) cannot be split:
//!   it stays on one replica, which holds nothing else once balanced, and [`oversized`]
//!   reports it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::assignment::{Assignment, Slot, desired};
use super::bucket::{BUCKETS, Bucket};
use super::counts::{Counts, Report};

/// When the leader rebalances by objects.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balance {
    /// The largest replica may hold this fraction more than the mean.
    pub tolerance: f64,
    /// ... or this many objects more, whichever is larger: small fleets are not worth
    /// moving buckets for.
    pub min_excess: u64,
}

impl Default for Balance {
    fn default() -> Self {
        Self { tolerance: 0.05, min_excess: 200 }
    }
}

/// How long the observed total must hold within 1 % before it is balanced by: two report
/// intervals, so that every replica has counted at least once meanwhile.
pub const STEADY_FOR: Duration = Duration::from_secs(10);

/// Whether the observed total of objects has held within 1 % for [`STEADY_FOR`].
#[derive(Debug, Default)]
pub struct Steadiness {
    /// The total it is held against, and since when.
    anchor: Option<(u64, Instant)>,
}

impl Steadiness {
    /// Takes the total seen at `now`; true once it has held still long enough.
    pub fn observe(&mut self, total: u64, now: Instant) -> bool {
        match self.anchor {
            Some((anchor, since)) if total.abs_diff(anchor) * 100 <= anchor => now - since >= STEADY_FOR,
            _ => {
                self.anchor = Some((total, now));
                false
            }
        }
    }
}

/// The objects in every bucket of a settled `current`, from its owners' reports; `None`
/// while something is moving or an owner's report is not of this generation.
pub fn observed(current: &Assignment, reports: &BTreeMap<String, Report>) -> Option<Counts> {
    let mut counts = Counts::new();
    for (bucket, slot) in (0..BUCKETS).zip(&current.slots) {
        let Slot::Owned { member, .. } = slot else { return None };
        let report = reports.get(member).filter(|r| r.generation == current.generation)?;
        if let Some(n) = report.counts.get(&bucket).filter(|n| **n > 0) {
            counts.insert(bucket, *n);
        }
    }
    Some(counts)
}

/// Objects held by each of `members` when buckets go to `owners`.
pub fn loads<'a>(
    members: &'a BTreeSet<String>,
    owners: impl IntoIterator<Item = Option<&'a str>>,
    counts: &Counts,
) -> BTreeMap<&'a str, u64> {
    let mut loads: BTreeMap<&str, u64> = members.iter().map(|m| (m.as_str(), 0)).collect();
    for (bucket, owner) in (0..BUCKETS).zip(owners) {
        if let Some(load) = owner.and_then(|o| loads.get_mut(o)) {
            *load += counts.get(&bucket).map_or(0, |n| u64::from(*n));
        }
    }
    loads
}

/// The largest load over the mean (1.0 when perfectly even, or when there is nothing).
pub fn imbalance(loads: &BTreeMap<&str, u64>) -> f64 {
    let total: u64 = loads.values().sum();
    let largest = loads.values().max().copied().unwrap_or(0);
    if total == 0 { 1.0 } else { largest as f64 * loads.len() as f64 / total as f64 }
}

/// The counts to publish instead of `current`'s, when balancing by them would even out
/// `receivers`' loads enough to be worth the moves (see the module's rules).
pub fn rebalance(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    observed: &Counts,
    balance: Balance,
) -> Option<Counts> {
    if receivers.len() < 2 || current.objects.as_ref() == Some(observed) {
        return None;
    }
    let mean = observed.values().map(|n| u64::from(*n)).sum::<u64>() as f64 / receivers.len() as f64;
    let excess = |loads: &BTreeMap<&str, u64>| loads.values().max().map_or(0.0, |m| *m as f64 - mean);
    let margin = (balance.tolerance * mean).max(balance.min_excess as f64);
    let now = excess(&loads(receivers, current.slots.iter().map(Slot::owner), observed));
    if now <= margin {
        return None;
    }
    let wanted = desired(receivers, Some(observed));
    let then = excess(&loads(receivers, wanted.iter().map(Option::as_deref), observed));
    (now - then >= margin).then(|| observed.clone())
}

/// Buckets that hold more than a fair share of `counts` among `members`: no balancing can
/// split them.
pub fn oversized(counts: &Counts, members: usize) -> Vec<(Bucket, u32)> {
    let total: u64 = counts.values().map(|n| u64::from(*n)).sum();
    let fair = total / members.max(1) as u64;
    counts.iter().filter(|(_, n)| members > 1 && u64::from(**n) > fair).map(|(b, n)| (*b, *n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::plan;
    use crate::assignment::tests::{always, never, set};

    /// Zipf-sized namespaces (s = 1): the i-th largest holds total / (i × H(n)).
    fn zipf_counts(namespaces: usize, total: f64) -> Counts {
        let harmonic: f64 = (1..=namespaces).map(|i| 1.0 / i as f64).sum();
        let mut counts = Counts::new();
        for i in 1..=namespaces {
            let bucket = crate::bucket::bucket_of(&format!("load-{i}-ns"));
            *counts.entry(bucket).or_default() += (total / (i as f64 * harmonic)).round() as u32;
        }
        counts
    }

    /// Every member's report of what it owns in `a`, from the true `counts`.
    fn reports(a: &Assignment, counts: &Counts) -> BTreeMap<String, Report> {
        let mut reports: BTreeMap<String, Report> = BTreeMap::new();
        for (bucket, slot) in (0..BUCKETS).zip(&a.slots) {
            if let Slot::Owned { member, .. } = slot {
                let report =
                    reports.entry(member.clone()).or_insert(Report { generation: a.generation, ..Default::default() });
                if let Some(n) = counts.get(&bucket) {
                    report.counts.insert(bucket, *n);
                }
            }
        }
        reports
    }

    #[test]
    fn nothing_is_observed_while_buckets_move_or_reports_are_stale() {
        let members = set(&["a", "b", "c"]);
        let a = plan(&Assignment::default(), &members, &never, None).unwrap();
        let counts = zipf_counts(200, 20_000.0);
        let fresh = reports(&a, &counts);
        assert_eq!(observed(&a, &fresh), Some(counts.clone()));
        let mut stale = fresh.clone();
        stale.get_mut("b").unwrap().generation -= 1;
        assert_eq!(observed(&a, &stale), None, "b counted for an older slice");
        let mut moving = a.clone();
        moving.slots[0] = Slot::Draining { from: "a".into(), since: 2 };
        assert_eq!(observed(&moving, &fresh), None);
    }

    #[test]
    fn zipf_sized_namespaces_end_within_ten_percent_of_the_mean() {
        let members = set(&["pod-0_x", "pod-1_y", "pod-2_z"]);
        let counts = zipf_counts(200, 20_000.0);
        let by_buckets = plan(&Assignment::default(), &members, &never, None).unwrap();
        let before = imbalance(&loads(&members, by_buckets.slots.iter().map(Slot::owner), &counts));
        let objects = rebalance(&by_buckets, &members, &counts, Balance::default()).expect("worth rebalancing");
        let draining = plan(&by_buckets, &members, &never, Some(objects)).unwrap();
        let settled = plan(&draining, &members, &always, None).unwrap();
        let after = imbalance(&loads(&members, settled.slots.iter().map(Slot::owner), &counts));
        assert!(after <= 1.1, "largest / mean {after:.3} (by bucket count: {before:.3})");
        assert!(after < before);
        assert_eq!(rebalance(&settled, &members, &counts, Balance::default()), None, "settled: nothing more to do");
    }

    #[test]
    fn drifting_counts_move_nothing_until_the_excess_is_worth_it() {
        let members = set(&["a", "b", "c"]);
        let counts = zipf_counts(200, 20_000.0);
        let first = plan(&Assignment::default(), &members, &never, None).unwrap();
        let objects = rebalance(&first, &members, &counts, Balance::default()).unwrap();
        let settled = plan(&plan(&first, &members, &never, Some(objects)).unwrap(), &members, &always, None).unwrap();
        // Every bucket grows by a few percent, unevenly: still within tolerance.
        let drifted: Counts = counts.iter().map(|(b, n)| (*b, n + n * u32::from(*b % 4) / 100)).collect();
        assert_eq!(rebalance(&settled, &members, &drifted, Balance::default()), None);
    }

    #[test]
    fn one_namespace_bigger_than_a_share_stays_whole_and_is_reported() {
        let members = set(&["a", "b", "c"]);
        let mut counts = Counts::from([(5, 9_000)]);
        counts.extend((100..400).map(|b| (b, 10)));
        assert_eq!(oversized(&counts, 3), vec![(5, 9_000)]);
        let first = plan(&Assignment::default(), &members, &never, None).unwrap();
        let objects = rebalance(&first, &members, &counts, Balance::default());
        let settled = match objects {
            Some(objects) => {
                plan(&plan(&first, &members, &never, Some(objects)).unwrap(), &members, &always, None).unwrap()
            }
            None => first,
        };
        let loads = loads(&members, settled.slots.iter().map(Slot::owner), &counts);
        assert_eq!(*loads.values().max().unwrap(), 9_000, "its replica holds it and nothing more");
        assert_eq!(rebalance(&settled, &members, &counts, Balance::default()), None, "no churn over it");
    }

    #[test]
    fn counts_must_hold_still_before_they_are_balanced_by() {
        let t0 = Instant::now();
        let mut steadiness = Steadiness::default();
        assert!(!steadiness.observe(1_000, t0), "first sight");
        assert!(!steadiness.observe(1_005, t0 + STEADY_FOR - Duration::from_millis(1)));
        assert!(steadiness.observe(1_010, t0 + STEADY_FOR), "within 1 % for long enough");
        assert!(!steadiness.observe(1_200, t0 + STEADY_FOR * 2), "growing: wait again");
        assert!(steadiness.observe(1_200, t0 + STEADY_FOR * 3));
    }

    #[test]
    fn small_fleets_are_not_worth_moving_for() {
        let members = set(&["a", "b"]);
        let counts = Counts::from([(1, 150), (2, 10)]);
        let first = plan(&Assignment::default(), &members, &never, None).unwrap();
        assert_eq!(rebalance(&first, &members, &counts, Balance::default()), None);
    }
}
