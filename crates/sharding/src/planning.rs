//! The leader's planning step, as one pure function: from what the leader has read (where it
//! starts, its own mode, the receivers, the ranges it wants, the counts and capacities, and
//! whether each draining member let go), the next assignment to publish. The leader
//! (`coordination::leader`) gathers those inputs and writes the result; the model checker
//! (tests/model) calls this same function, so it checks the leader's decisions, not a copy.
//!
//! The order of the decisions is the protocol:
//! 1. a change of mode revokes every bucket of the old mode, and frees each once its owner
//!    let go, before any bucket is given in the new one;
//! 2. a change of hash ranges does the same for the buckets whose ranges change;
//! 3. then buckets move towards the ring's placement, revoking before reassigning, within the
//!    members' capacities.

use std::collections::{BTreeMap, BTreeSet};

use super::assignment::{Assignment, Capacities, Release, Slot, next_assignment, vacate, vacate_buckets};
use super::bucket::Mode;
use super::capacity;
use super::counts::Counts;
use super::hash_ranges::Ranges;

/// Everything one planning step depends on.
pub struct Inputs<'a, R: Release> {
    /// Where the leader starts (`assignment::starting_point`).
    pub current: Assignment,
    /// Whether the ConfigMap must be written anew (`assignment::must_republish`).
    pub republish: bool,
    /// This process's sharding mode.
    pub mode: Mode,
    /// The members that may be given buckets.
    pub receivers: &'a BTreeSet<String>,
    /// The hash ranges wanted (uniform unless split ranges are on and every receiver reads them).
    pub ranges: Ranges,
    /// The leader's own count of each namespace's objects, once it has one.
    pub census: Option<&'a BTreeMap<String, u32>>,
    /// What each receiver can hold, for those that advertise a capacity.
    pub capacities: &'a Capacities,
    /// New object counts to balance by, when the owners' reports say it is worth the moves.
    pub rebalanced: Option<Counts>,
    /// Whether a draining member let go of the buckets a generation revoked.
    pub release: &'a R,
}

/// A planning step: what to publish, and why.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// The published assignment is of another mode: its buckets are being revoked.
    VacateMode { from: Mode, next: Option<Assignment> },
    /// The hash ranges change: the changed buckets that are not yet free are being revoked.
    VacateRanges { buckets: usize, next: Option<Assignment> },
    /// Members advertise capacities and nothing has been counted yet: nothing is planned.
    Uncounted,
    /// A step towards the placement.
    Place {
        next: Option<Assignment>,
        /// New hash ranges published with this step: how many buckets changed, and whether
        /// they are split.
        new_ranges: Option<(usize, bool)>,
        /// The buckets that nobody has room for, and their objects.
        unplaced_buckets: usize,
        unplaced_objects: u64,
        /// The buckets nobody alive owns, beside the unplaced ones.
        unowned: usize,
    },
}

impl Plan {
    /// The assignment to publish, if any.
    pub fn into_next(self) -> Option<Assignment> {
        match self {
            Plan::VacateMode { next, .. } | Plan::VacateRanges { next, .. } | Plan::Place { next, .. } => next,
            Plan::Uncounted => None,
        }
    }
}

/// The leader's next step; see the module's documentation for the order of decisions.
pub fn plan<R: Release>(inputs: Inputs<'_, R>) -> Plan {
    let Inputs { mut current, republish, mode, receivers, ranges, census, capacities, rebalanced, release } = inputs;
    if current.mode != mode && current.generation > 0 {
        // A bucket of one mode holds other namespaces than the same bucket of the other.
        if !current.is_vacant() {
            return Plan::VacateMode { from: current.mode, next: vacate(&current, release) };
        }
        current = Assignment { mode, objects: None, ranges: Ranges::default(), ..current };
    }
    let mut new_ranges = None;
    if ranges != current.ranges {
        let changed = current.ranges.changed(&ranges);
        if changed.iter().any(|b| current.slots[usize::from(*b)] != Slot::Free) {
            // Namespaces move between the changed buckets.
            return Plan::VacateRanges { buckets: changed.len(), next: vacate_buckets(&current, &changed, release) };
        }
        new_ranges = Some((changed.len(), !ranges.is_uniform()));
        current = Assignment { ranges, ..current };
        // Placed by the count under the new ranges at once, not by bucket count meanwhile.
        current.objects = census.map(|namespaces| current.count(namespaces));
    }
    let counted = census.map(|namespaces| current.count(namespaces));
    let Some(placement) = capacity::place(&current, receivers, capacities, counted.as_ref(), rebalanced) else {
        return Plan::Uncounted;
    };
    let (unplaced_buckets, unplaced_objects) = (placement.unplaced.len(), placement.unplaced_objects());
    let unowned = current.unowned(receivers).saturating_sub(unplaced_buckets);
    let wanted = placement.wanted;
    let next = next_assignment(&current, receivers, wanted, release, republish)
        // New ranges are published even when no bucket has a receiver to go to.
        .or_else(|| new_ranges.map(|_| Assignment { generation: current.generation + 1, ..current.clone() }));
    Plan::Place { next, new_ranges, unplaced_buckets, unplaced_objects, unowned }
}

#[cfg(test)]
mod tests;
