//! The published assignment of buckets to members, and the leader's rule for changing it.
//!
//! A bucket's slot is `Owned(member)`, `Draining { from, since }` or `Free`. Ownership only
//! ever passes through a state in which nobody owns the bucket:
//!
//! - `Owned(x)` → `Draining { from: x, since: G }` when the ring wants another owner and
//!   `x` is alive; `x` stops the bucket, drains it, and acknowledges generation `G`;
//! - `Draining { from: x, since: G }` → `Owned(y)` once `x` acknowledged `G` or more, or
//!   `x` is no longer alive (its lease expired, which means it has fail-stopped, or it
//!   released its lease after draining);
//! - `Owned(x)` → `Owned(y)` directly only when `x` is not alive.
//!
//! The assignment is one object written with a resourceVersion precondition, so two
//! leaders at once cannot both apply a transition from the same state. Pure: membership
//! is an argument.

use std::collections::{BTreeMap, BTreeSet};

use super::bucket::{BUCKETS, Bucket};
use super::ring::Ring;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    Free,
    Owned(String),
    Draining { from: String, since: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub generation: u64,
    pub slots: Vec<Slot>,
}

impl Default for Assignment {
    fn default() -> Self {
        Self { generation: 0, slots: vec![Slot::Free; usize::from(BUCKETS)] }
    }
}

impl Assignment {
    /// The buckets `member` may work on.
    pub fn owned_by(&self, member: &str) -> BTreeSet<Bucket> {
        (0..BUCKETS).filter(|&b| matches!(&self.slots[usize::from(b)], Slot::Owned(m) if m == member)).collect()
    }

    /// Buckets that nobody alive works on.
    pub fn unowned(&self, alive: &BTreeSet<String>) -> usize {
        self.slots.iter().filter(|slot| !matches!(slot, Slot::Owned(m) if alive.contains(m))).count()
    }

    /// Bucket counts per owner, for status displays.
    pub fn shares(&self) -> BTreeMap<String, usize> {
        let mut shares = BTreeMap::new();
        for slot in &self.slots {
            if let Slot::Owned(m) = slot {
                *shares.entry(m.clone()).or_default() += 1;
            }
        }
        shares
    }

    /// The ConfigMap data: `generation`, `members` (comma-separated) and `slots`, one entry
    /// per bucket: a member index, `~index@since` while draining, or `-` when free.
    pub fn encode(&self) -> BTreeMap<String, String> {
        let mut members: Vec<&str> = self
            .slots
            .iter()
            .filter_map(|s| match s {
                Slot::Owned(m) | Slot::Draining { from: m, .. } => Some(m.as_str()),
                Slot::Free => None,
            })
            .collect();
        members.sort();
        members.dedup();
        let index = |m: &str| members.binary_search(&m).expect("listed");
        let slots: Vec<String> = self
            .slots
            .iter()
            .map(|s| match s {
                Slot::Free => "-".to_string(),
                Slot::Owned(m) => index(m).to_string(),
                Slot::Draining { from, since } => format!("~{}@{since}", index(from)),
            })
            .collect();
        BTreeMap::from([
            ("generation".to_string(), self.generation.to_string()),
            ("members".to_string(), members.join(",")),
            ("slots".to_string(), slots.join(",")),
        ])
    }

    pub fn decode(data: &BTreeMap<String, String>) -> Result<Self, String> {
        let field = |k: &str| data.get(k).ok_or_else(|| format!("assignment has no {k:?}"));
        let generation = field("generation")?.parse().map_err(|e| format!("generation: {e}"))?;
        let members: Vec<&str> = field("members")?.split(',').filter(|m| !m.is_empty()).collect();
        let member = |i: &str| -> Result<String, String> {
            let i: usize = i.parse().map_err(|e| format!("member index {i:?}: {e}"))?;
            members.get(i).map(|m| m.to_string()).ok_or_else(|| format!("member index {i} out of range"))
        };
        let slots = field("slots")?
            .split(',')
            .map(|s| match s {
                "-" => Ok(Slot::Free),
                s if s.starts_with('~') => {
                    let (from, since) = s[1..].split_once('@').ok_or_else(|| format!("bad slot {s:?}"))?;
                    Ok(Slot::Draining { from: member(from)?, since: since.parse().map_err(|e| format!("{s:?}: {e}"))? })
                }
                s => Ok(Slot::Owned(member(s)?)),
            })
            .collect::<Result<Vec<_>, String>>()?;
        if slots.len() != usize::from(BUCKETS) {
            return Err(format!("assignment has {} slots, expected {BUCKETS}", slots.len()));
        }
        Ok(Self { generation, slots })
    }
}

/// The next assignment, or `None` when nothing can change yet.
///
/// `alive` are the members the leader currently sees alive; `acked` gives the generation
/// each has acknowledged.
pub fn plan(current: &Assignment, alive: &BTreeSet<String>, acked: impl Fn(&str) -> Option<u64>) -> Option<Assignment> {
    let members: Vec<&String> = alive.iter().collect();
    let ring = Ring::new(&members);
    let desired = ring.assign_names();
    let next_generation = current.generation + 1;
    let give = |want: Option<&str>| want.map_or(Slot::Free, |m| Slot::Owned(m.to_string()));
    let slots: Vec<Slot> = current
        .slots
        .iter()
        .zip(desired)
        .map(|(slot, want)| match slot {
            Slot::Owned(x) if want == Some(x.as_str()) => slot.clone(),
            Slot::Owned(x) if !alive.contains(x) => give(want),
            Slot::Owned(x) => Slot::Draining { from: x.clone(), since: next_generation },
            // Handing it back to the member still draining it is safe: nobody else has it.
            Slot::Draining { from, .. } if want == Some(from.as_str()) => give(want),
            Slot::Draining { from, since } if !alive.contains(from) || acked(from).is_some_and(|g| g >= *since) => {
                give(want)
            }
            Slot::Draining { .. } => slot.clone(),
            Slot::Free => give(want),
        })
        .collect();
    (slots != current.slots).then_some(Assignment { generation: next_generation, slots })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(members: &[&str]) -> BTreeSet<String> {
        members.iter().map(|m| m.to_string()).collect()
    }

    #[test]
    fn first_assignment_gives_everything_out() {
        let a = plan(&Assignment::default(), &set(&["a", "b", "c"]), |_| None).unwrap();
        assert_eq!(a.generation, 1);
        let shares = a.shares();
        assert_eq!(shares.values().sum::<usize>(), usize::from(BUCKETS));
        assert_eq!(shares.len(), 3);
        assert_eq!(plan(&a, &set(&["a", "b", "c"]), |_| None), None, "stable once settled");
    }

    #[test]
    fn a_live_owner_drains_before_anyone_else_gets_its_buckets() {
        let settled = plan(&Assignment::default(), &set(&["a", "b"]), |_| None).unwrap();
        let grown = set(&["a", "b", "c"]);
        let draining = plan(&settled, &grown, |_| None).unwrap();
        assert!(draining.owned_by("c").is_empty(), "c gets nothing until the old owners acknowledge");
        let moving = draining.slots.iter().filter(|s| matches!(s, Slot::Draining { .. })).count();
        assert!(moving > 0);
        // Nothing changes until the acknowledgements arrive.
        assert_eq!(plan(&draining, &grown, |_| Some(settled.generation)), None);
        let done = plan(&draining, &grown, |_| Some(draining.generation)).unwrap();
        assert_eq!(done.unowned(&grown), 0);
        // c's share is what the ring gives it; bounded loads may also shift a few between a and b.
        assert_eq!(
            done.owned_by("c").len(),
            Ring::new(&["a", "b", "c"]).assign().iter().filter(|o| **o == Some(2)).count()
        );
        assert!(done.owned_by("c").len() <= moving);
    }

    #[test]
    fn a_dead_owners_buckets_move_at_once() {
        let settled = plan(&Assignment::default(), &set(&["a", "b", "c"]), |_| None).unwrap();
        let lost = settled.owned_by("c");
        let next = plan(&settled, &set(&["a", "b"]), |_| None).unwrap();
        assert!(next.owned_by("c").is_empty());
        // No drain step for a dead member's buckets (live members' cascaded moves still drain).
        let (a, b) = (next.owned_by("a"), next.owned_by("b"));
        assert!(lost.iter().all(|bucket| a.contains(bucket) || b.contains(bucket)));
    }

    #[test]
    fn encoding_round_trips() {
        let mut a = plan(&Assignment::default(), &set(&["pod-0", "pod-1"]), |_| None).unwrap();
        a.slots[5] = Slot::Draining { from: "pod-1".into(), since: 9 };
        a.slots[6] = Slot::Free;
        assert_eq!(Assignment::decode(&a.encode()).unwrap(), a);
        assert!(Assignment::decode(&BTreeMap::new()).unwrap_err().contains("generation"));
    }

    proptest! {
        /// Over any sequence of membership views and acknowledgements, a bucket never goes
        /// from one owner to another alive owner without a drained step in between.
        #[test]
        fn ownership_never_jumps_between_live_members(
            steps in prop::collection::vec((prop::collection::btree_set(0usize..5, 0..5), any::<bool>()), 1..12)
        ) {
            let names = ["a", "b", "c", "d", "e"];
            let mut current = Assignment::default();
            for (alive_idx, ack) in steps {
                let alive: BTreeSet<String> = alive_idx.iter().map(|&i| names[i].to_string()).collect();
                let generation = current.generation;
                if let Some(next) = plan(&current, &alive, |_| ack.then_some(generation)) {
                    for (before, after) in current.slots.iter().zip(&next.slots) {
                        if let (Slot::Owned(x), Slot::Owned(y)) = (before, after) {
                            prop_assert!(x == y || !alive.contains(x), "{x} -> {y} while {x} is alive");
                        }
                        if let (Slot::Draining { from, since }, Slot::Owned(y)) = (before, after) {
                            prop_assert!(from == y || !alive.contains(from) || (ack && generation >= *since));
                        }
                    }
                    prop_assert_eq!(next.generation, current.generation + 1);
                    current = next;
                }
            }
        }
    }
}
