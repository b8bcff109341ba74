//! The published assignment of buckets to member incarnations, and the leader's rule for
//! changing it.
//!
//! A bucket's slot is `Owned { member, epoch }`, `Draining { from, since }` or `Free`.
//! Ownership never passes straight from one incarnation to another: it is revoked first.
//!
//! - `Owned(x)` → `Draining { from: x, since: G }` whenever the ring wants another owner,
//!   whether `x` looks alive or not (revoke before reassign);
//! - `Draining { from: x, since: G }` → `Owned(y)` only once [`Release`] says `x` let go of
//!   it: `x` acknowledged `G`, released its lease after draining, was confirmed silent
//!   since before `G` was written, or `G` has been known for `x`'s lease duration;
//! - `Free` → `Owned(y)`.
//!
//! `epoch` is the generation in which the bucket was given to `member`. It only grows for a
//! bucket, so a write stamped with it can be fenced on the server: a deposed owner's epoch
//! is always lower than its successor's.
//!
//! The ring places buckets by their object counts once the leader has published them (see
//! `sharding::balance`), by bucket count before that.
//!
//! The assignment is one object written with a resourceVersion precondition, so two
//! leaders at once cannot both apply a transition from the same state. Pure: membership
//! and the drain facts are arguments.

use std::collections::{BTreeMap, BTreeSet};

use super::bucket::{self, BUCKETS, Bucket, Mode};
use super::counts::{self, Counts};
use super::hash_ranges::{HashRanges, Ranges};
use super::membership::pod_of;
use super::ring::Ring;

/// A bucket's ownership epoch: the assignment generation that gave it to its owner.
pub type Epoch = u64;

/// The owner named in slots revoked from whoever held them in an assignment that was lost
/// (its ConfigMap deleted before this leader saw it): they move after a lease duration.
pub const UNKNOWN_OWNER: &str = "(previous)";

/// One bucket's entry in the assignment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    Free,
    Owned { member: String, epoch: Epoch },
    Draining { from: String, since: u64 },
}

impl Slot {
    fn member(&self) -> Option<&str> {
        match self {
            Slot::Owned { member, .. } | Slot::Draining { from: member, .. } => Some(member),
            Slot::Free => None,
        }
    }

    /// Who works on the bucket: its owner, if it is owned.
    pub fn owner(&self) -> Option<&str> {
        match self {
            Slot::Owned { member, .. } => Some(member),
            _ => None,
        }
    }
}

/// The published bucket ownership: which member owns each bucket, with fencing epochs, under a
/// generation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Assignment {
    pub generation: u64,
    pub slots: Vec<Slot>,
    /// What a bucket means: every member must compute buckets alike, so one whose mode
    /// differs owns nothing under this assignment.
    pub mode: Mode,
    /// Objects per bucket, which the ring balances by; `None`: by bucket count.
    pub objects: Option<Counts>,
    /// In shard-selector mode, each bucket's range of the server's namespace hash.
    pub ranges: Ranges,
}

/// The `mode` an assignment is written with when its ranges are split: an older version,
/// which would compute uniform ranges, cannot read it and so owns nothing under it.
pub const SPLIT_RANGES_MODE: &str = "shard-selector-split";

impl Default for Assignment {
    fn default() -> Self {
        Self {
            generation: 0,
            slots: vec![Slot::Free; usize::from(BUCKETS)],
            mode: Mode::default(),
            objects: None,
            ranges: Ranges::default(),
        }
    }
}

impl Assignment {
    /// An assignment to publish anew in place of one that was lost, at `generation`: every
    /// bucket revoked from an unknown owner, since whoever held it may still be writing.
    pub fn after_loss(generation: u64, mode: Mode) -> Self {
        let revoked = Slot::Draining { from: UNKNOWN_OWNER.into(), since: generation };
        Self { generation, slots: vec![revoked; usize::from(BUCKETS)], mode, ..Self::default() }
    }

    /// The bucket of `namespace`'s objects under this assignment (in label mode, of those
    /// without a hand-set bucket label).
    pub fn bucket_of(&self, namespace: &str) -> Bucket {
        match self.mode {
            Mode::Labels => bucket::bucket_of(namespace),
            Mode::ShardSelector => self.ranges.bucket_of(namespace),
        }
    }

    /// Objects per bucket, from objects per namespace.
    pub fn count(&self, namespaces: &BTreeMap<String, u32>) -> Counts {
        let mut counts = Counts::new();
        for (namespace, objects) in namespaces {
            *counts.entry(self.bucket_of(namespace)).or_default() += objects;
        }
        counts
    }

    /// The buckets `member` may work on, with their epochs; none when `member` computes
    /// buckets in another mode than this assignment's.
    pub fn owned_by(&self, member: &str, mode: Mode) -> BTreeMap<Bucket, Epoch> {
        if mode != self.mode {
            return BTreeMap::new();
        }
        (0..BUCKETS)
            .filter_map(|b| match &self.slots[usize::from(b)] {
                Slot::Owned { member: m, epoch } if m == member => Some((b, *epoch)),
                _ => None,
            })
            .collect()
    }

    /// The buckets this assignment gives a member that `before` did not give it: what each
    /// member gains, and lists, in the step from `before` to this one.
    pub fn gained_since<'a>(&'a self, before: &Assignment) -> Vec<(&'a str, Bucket)> {
        (0..BUCKETS)
            .zip(self.slots.iter().zip(&before.slots))
            .filter_map(|(bucket, (now, was))| {
                let owner = now.owner()?;
                (was.owner() != Some(owner)).then_some((owner, bucket))
            })
            .collect()
    }

    /// What each member gains over the successive assignments of `history`: a bucket once
    /// for every step that gives it to a member that did not own it.
    pub fn gains_over(history: &[Assignment]) -> Vec<(&str, Bucket)> {
        history.windows(2).flat_map(|step| step[1].gained_since(&step[0])).collect()
    }

    /// Buckets that nobody in `alive` works on.
    pub fn unowned(&self, alive: &BTreeSet<String>) -> usize {
        self.slots.iter().filter(|slot| !matches!(slot, Slot::Owned { member, .. } if alive.contains(member))).count()
    }

    /// Bucket counts per owner, for status displays.
    pub fn shares(&self) -> BTreeMap<String, usize> {
        let mut shares = BTreeMap::new();
        for slot in &self.slots {
            if let Slot::Owned { member, .. } = slot {
                *shares.entry(member.clone()).or_default() += 1;
            }
        }
        shares
    }

    /// Whether no bucket is owned or draining.
    pub fn is_vacant(&self) -> bool {
        self.slots.iter().all(|slot| *slot == Slot::Free)
    }

    /// The revocations under way: (the member revoked from, the revoking generation).
    pub fn revocations(&self) -> BTreeSet<(String, u64)> {
        let draining = self.slots.iter().filter_map(|slot| match slot {
            Slot::Draining { from, since } => Some((from.clone(), *since)),
            _ => None,
        });
        draining.collect()
    }

    /// The ConfigMap data: `generation`, `mode`, `members` (comma-separated) and `slots`, one
    /// entry per bucket: `index@epoch` when owned, `~index@since` while draining, `-` when free;
    /// `objects` (`bucket:count,…`) once balancing by objects; and `ranges` once they are
    /// split (with the mode [`SPLIT_RANGES_MODE`]).
    pub fn encode(&self) -> BTreeMap<String, String> {
        let mut members: Vec<&str> = self.slots.iter().filter_map(Slot::member).collect();
        members.sort();
        members.dedup();
        let index = |m: &str| members.binary_search(&m).expect("listed");
        let slots: Vec<String> = self
            .slots
            .iter()
            .map(|s| match s {
                Slot::Free => "-".to_string(),
                Slot::Owned { member, epoch } => format!("{}@{epoch}", index(member)),
                Slot::Draining { from, since } => format!("~{}@{since}", index(from)),
            })
            .collect();
        // Ranges are the shard selector's: a label-mode assignment has none to write.
        let split = self.mode == Mode::ShardSelector && !self.ranges.is_uniform();
        let mode = if split { SPLIT_RANGES_MODE } else { self.mode.as_str() };
        let mut data = BTreeMap::from([
            ("generation".to_string(), self.generation.to_string()),
            ("mode".to_string(), mode.to_string()),
            ("members".to_string(), members.join(",")),
            ("slots".to_string(), slots.join(",")),
        ]);
        if let Some(objects) = &self.objects {
            data.insert("objects".to_string(), counts::encode_counts(objects));
        }
        if split {
            data.insert("ranges".to_string(), self.ranges.encode());
        }
        data
    }

    /// Reads an assignment from a ConfigMap's data, as [`Assignment::encode`] wrote it.
    pub fn decode(data: &BTreeMap<String, String>) -> Result<Self, String> {
        let field = |k: &str| data.get(k).ok_or_else(|| format!("assignment has no {k:?}"));
        let generation = field("generation")?.parse().map_err(|e| format!("generation: {e}"))?;
        // Written before modes existed: labels.
        let (mode, ranges) = match data.get("mode") {
            None => (Mode::Labels, Ranges::default()),
            Some(m) if m == SPLIT_RANGES_MODE => {
                let ranges = HashRanges::decode(field("ranges")?).map_err(|e| format!("ranges: {e}"))?;
                (Mode::ShardSelector, Ranges::new(ranges))
            }
            Some(m) => (Mode::parse(m).ok_or_else(|| format!("unknown mode {m:?}"))?, Ranges::default()),
        };
        let members: Vec<&str> = field("members")?.split(',').filter(|m| !m.is_empty()).collect();
        let member = |i: &str| -> Result<String, String> {
            let i: usize = i.parse().map_err(|e| format!("member index {i:?}: {e}"))?;
            members.get(i).map(|m| m.to_string()).ok_or_else(|| format!("member index {i} out of range"))
        };
        let number = |s: &str, n: &str| n.parse::<u64>().map_err(|e| format!("slot {s:?}: {e}"));
        let slots = field("slots")?
            .split(',')
            .map(|s| match s {
                "-" => Ok(Slot::Free),
                // Written before epochs existed: a bare member index, epoch 0.
                s if s.bytes().all(|b| b.is_ascii_digit()) => Ok(Slot::Owned { member: member(s)?, epoch: 0 }),
                s => {
                    let (who, n) = s.split_once('@').ok_or_else(|| format!("bad slot {s:?}"))?;
                    match who.strip_prefix('~') {
                        Some(from) => Ok(Slot::Draining { from: member(from)?, since: number(s, n)? }),
                        None => Ok(Slot::Owned { member: member(who)?, epoch: number(s, n)? }),
                    }
                }
            })
            .collect::<Result<Vec<_>, String>>()?;
        if slots.len() != usize::from(BUCKETS) {
            return Err(format!("assignment has {} slots, expected {BUCKETS}", slots.len()));
        }
        let objects =
            data.get("objects").map(|o| counts::decode_counts(o)).transpose().map_err(|e| format!("objects: {e}"))?;
        Ok(Self { generation, slots, mode, objects, ranges })
    }
}

/// Whether a draining member has let go of its buckets: the leader's answer for
/// `Draining { from, since }`.
pub trait Release {
    fn let_go(&self, from: &str, since: u64) -> bool;
}

impl<F: Fn(&str, u64) -> bool> Release for F {
    fn let_go(&self, from: &str, since: u64) -> bool {
        self(from, since)
    }
}

/// The objects each member can hold, by incarnation, as it advertises; a member not listed
/// can hold any number.
pub type Capacities = BTreeMap<String, u64>;

/// Who the ring wants for each bucket: incarnations of `receivers`, balanced by `objects`
/// (by bucket count without them). The ring places pods, not incarnations, so a restarted
/// pod gets its old slice back.
pub fn desired(receivers: &BTreeSet<String>, objects: Option<&Counts>) -> Vec<Option<String>> {
    desired_within(receivers, objects, &Capacities::new())
}

/// [`desired`], with no member given more objects than its capacity: a bucket that fits
/// under nobody's is wanted by nobody.
pub fn desired_within(
    receivers: &BTreeSet<String>,
    objects: Option<&Counts>,
    capacities: &Capacities,
) -> Vec<Option<String>> {
    let by_pod: BTreeMap<&str, &str> = receivers.iter().map(|m| (pod_of(m), m.as_str())).collect();
    let ring = Ring::new(&by_pod.keys().copied().collect::<Vec<_>>());
    let capacity: Vec<u64> = ring
        .members()
        .iter()
        .map(|pod| capacities.get(by_pod[pod.as_str()]).map_or(u64::MAX, |c| counts::capacity_weight(*c)))
        .collect();
    let owners = ring.assign_within(&counts::weights(objects), &capacity);
    owners.into_iter().map(|owner| owner.map(|i| by_pod[ring.members()[i].as_str()].to_string())).collect()
}

/// Who the ring wants for each bucket, and the counts it placed them by.
#[derive(Clone, Debug, PartialEq)]
pub struct Wanted {
    /// The counts to publish with the plan (`None`: by bucket count).
    pub objects: Option<Counts>,
    /// The member wanted for each bucket; `None` where nobody has room.
    pub owners: Vec<Option<String>>,
}

impl Wanted {
    /// Placed by `rebalanced`, or by the counts `current` was published with.
    pub fn of(
        current: &Assignment,
        receivers: &BTreeSet<String>,
        capacities: &Capacities,
        rebalanced: Option<Counts>,
    ) -> Self {
        let objects = rebalanced.or_else(|| current.objects.clone());
        let owners = desired_within(receivers, objects.as_ref(), capacities);
        Self { objects, owners }
    }

    /// The buckets, with their objects, that no member has room for: what stays unplaced while
    /// the fleet's capacities hold less than the objects. None without receivers.
    pub fn unplaced(&self, receivers: &BTreeSet<String>) -> Counts {
        let (Some(objects), false) = (&self.objects, receivers.is_empty()) else { return Counts::new() };
        (0..BUCKETS)
            .filter(|b| self.owners[usize::from(*b)].is_none())
            .map(|b| (b, objects.get(&b).copied().unwrap_or(0)))
            .collect()
    }
}

/// The next assignment, or `None` when nothing can change yet.
///
/// `receivers` are the members that may be given buckets (seen renewing); `release` says
/// whether a draining member has let go; `rebalanced` are new object counts to balance by
/// (`None` keeps the published ones).
pub fn plan(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    release: &impl Release,
    rebalanced: Option<Counts>,
) -> Option<Assignment> {
    plan_within(current, receivers, &Capacities::new(), release, rebalanced)
}

/// [`plan`] within the members' `capacities`: a bucket that no member has room for is
/// revoked from its owner and, once released, left free.
pub fn plan_within(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    capacities: &Capacities,
    release: &impl Release,
    rebalanced: Option<Counts>,
) -> Option<Assignment> {
    plan_towards(current, receivers, Wanted::of(current, receivers, capacities, rebalanced), release)
}

/// The step from `current` towards the owners `wanted`, revoking before reassigning.
pub fn plan_towards(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    wanted: Wanted,
    release: &impl Release,
) -> Option<Assignment> {
    let Wanted { objects, owners } = wanted;
    let next = current.generation + 1;
    let give = |want: Option<&str>| want.map_or(Slot::Free, |m| Slot::Owned { member: m.to_string(), epoch: next });
    let slots: Vec<Slot> = current
        .slots
        .iter()
        .zip(owners.iter().map(Option::as_deref))
        .map(|(slot, want)| match slot {
            Slot::Owned { member, .. } if want == Some(member.as_str()) => slot.clone(),
            // Nobody to give it to: leave it where it is.
            Slot::Owned { .. } if want.is_none() && receivers.is_empty() => slot.clone(),
            // Another member wants it, or nobody has room for it.
            Slot::Owned { member, .. } => Slot::Draining { from: member.clone(), since: next },
            // Back to the member that is draining it: nobody else had it meanwhile.
            Slot::Draining { from, .. } if want == Some(from.as_str()) => give(want),
            // To its new owner, or freed when nobody has room for it.
            Slot::Draining { from, since } if release.let_go(from, *since) => give(want),
            Slot::Draining { .. } => slot.clone(),
            Slot::Free => give(want),
        })
        .collect();
    (slots != current.slots || objects != current.objects).then_some(Assignment {
        generation: next,
        slots,
        mode: current.mode,
        objects,
        ranges: current.ranges.clone(),
    })
}

/// Where the leader plans from: the newest assignment it knows (`None`: none read yet);
/// whether the ConfigMap must be written anew (deleted, or an older copy stored over it);
/// the generation floor reserved on the CRD (read only then); and the highest generation
/// any member has seen (or found as a token on an object). Generations are fencing epochs
/// and never go back: published anew, an assignment starts above the reservation. If a
/// member saw a newer generation than we know, what it gave to whom is lost, and everything
/// is revoked from an unknown owner before anything is granted. That is compared before the
/// reservation raises the generation: a reservation says nothing of who holds what.
pub fn starting_point(known: Option<Assignment>, republish: bool, reserved: u64, seen: u64, mode: Mode) -> Assignment {
    let mut current = known.unwrap_or_else(|| Assignment { mode, ..Assignment::default() });
    if current.generation < seen {
        return Assignment::after_loss((seen + 1).max(reserved), mode);
    }
    if republish {
        current.generation = current.generation.max(reserved);
    }
    current
}

/// Whether the leader must write the assignment anew: the ConfigMap was lost or holds an
/// older copy (`republish`), or a member saw a generation above the `known` one. Then the
/// revocation [`starting_point`] starts from is written before anything is granted, so
/// every member stops before its buckets go to anyone (a revocation's clock runs from its
/// write, see [`may_reassign`]).
pub fn must_republish(republish: bool, known: u64, seen: u64) -> bool {
    republish || seen > known
}

/// The leader's next assignment from `current`: the moves [`plan`] makes, or, when the
/// ConfigMap must be written anew and nothing moves, what we know under a new generation.
pub fn next_assignment(
    current: &Assignment,
    receivers: &BTreeSet<String>,
    wanted: Wanted,
    release: &impl Release,
    republish: bool,
) -> Option<Assignment> {
    plan_towards(current, receivers, wanted, release).or_else(|| {
        (republish && current.generation > 0)
            .then(|| Assignment { generation: current.generation + 1, ..current.clone() })
    })
}

/// A step of a change of mode: every bucket still owned is revoked, and each revoked one is
/// freed once its owner has let go; `None` when nothing can change yet. The new mode starts
/// from an assignment in which every bucket is free ([`Assignment::is_vacant`]).
pub fn vacate(current: &Assignment, release: &impl Release) -> Option<Assignment> {
    vacate_buckets(current, &(0..BUCKETS).collect(), release)
}

/// [`vacate`] for `buckets` only: a step of a change of their ranges, which starts once
/// every one of them is free.
pub fn vacate_buckets(current: &Assignment, buckets: &BTreeSet<Bucket>, release: &impl Release) -> Option<Assignment> {
    let next = current.generation + 1;
    let slots: Vec<Slot> = (0..BUCKETS)
        .zip(&current.slots)
        .map(|(bucket, slot)| match slot {
            _ if !buckets.contains(&bucket) => slot.clone(),
            Slot::Owned { member, .. } => Slot::Draining { from: member.clone(), since: next },
            Slot::Draining { from, since } if release.let_go(from, *since) => Slot::Free,
            other => other.clone(),
        })
        .collect();
    (slots != current.slots).then(|| Assignment { generation: next, slots, ..current.clone() })
}

/// Keeps `known_since` (when the leader first knew each revoking generation, by its own
/// clock) to the revocations under way in `current`, starting the clock of new ones.
pub fn track_revocations<T: Copy>(known_since: &mut BTreeMap<u64, T>, current: &Assignment, now: T) {
    let draining: BTreeSet<u64> = current.revocations().into_iter().map(|(_, since)| since).collect();
    known_since.retain(|generation, _| draining.contains(generation));
    for since in draining {
        known_since.entry(since).or_insert(now);
    }
}

/// The facts the leader has about one draining member, for [`may_reassign`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrainFacts {
    /// The highest generation the member acknowledged (on its own lease).
    pub acked: Option<u64>,
    /// The member emptied its lease's holder itself, after draining (graceful shutdown).
    pub released: bool,
    /// A quorum read of the member's lease, made after the revoking generation was known
    /// to be written, found the renewal the leader had already seen for a lease duration.
    pub confirmed_silent: bool,
    /// How long the leader has known the revoking generation, by its own clock.
    pub revoked_for: std::time::Duration,
    /// The member's lease duration.
    pub lease_duration: std::time::Duration,
}

/// Whether the buckets that `Draining { since }` revoked from a member may be given away.
///
/// A member acts on a bucket only within `renew_deadline` of the start of a renewal whose
/// following quorum read of the assignment still gave it the bucket, and each of its
/// writes is bounded by `lease_duration − renew_deadline`. So once the revocation has
/// been written, the member either reads it in its next renewal cycle, or stops by the
/// deadline of an earlier one: after a lease duration nothing of it can land.
pub fn may_reassign(since: u64, facts: DrainFacts) -> bool {
    facts.acked.is_some_and(|g| g >= since)
        || facts.released
        || facts.confirmed_silent
        || facts.revoked_for >= facts.lease_duration
}

#[cfg(test)]
pub(crate) mod tests;
