//! The processes of the model and what the server stores of theirs, kept compact: the
//! operator's own `Slice`, `MemberTable` and `Published` inside.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use traffic_policy_operator::coordination::published::Published;
use traffic_policy_operator::sharding::assignment::{Assignment, Slot, plan};
use traffic_policy_operator::sharding::bucket::{Bucket, Mode};
use traffic_policy_operator::sharding::membership::{Liveness, MemberTable};
use traffic_policy_operator::sharding::slice::Slice;

use crate::clock::Clock;
use crate::protocol::{LEASE, MEMBERS, RENEW_DEADLINE};

/// The bucket of the namespace the model follows, in each mode: in label mode the first one
/// the ring gives to `a` when both members live, in shard-selector mode the first it gives to
/// `b`. So a change of mode moves the namespace to a bucket that another member is wanted for.
pub fn tracked(mode: Mode) -> Bucket {
    static TRACKED: OnceLock<[Bucket; 2]> = OnceLock::new();
    let [labels, shard_selector] = *TRACKED.get_or_init(|| {
        let receivers = MEMBERS.iter().map(|m| m.to_string()).collect();
        let planned = plan(&Assignment::default(), &receivers, &|_: &str, _: u64| false, None).unwrap();
        let first_of = |pod: &str| {
            let owned_by = |s: &Slot| matches!(s, Slot::Owned { member, .. } if member == pod);
            planned.slots.iter().position(owned_by).unwrap() as Bucket
        };
        [first_of(MEMBERS[0]), first_of(MEMBERS[1])]
    });
    match mode {
        Mode::Labels => labels,
        Mode::ShardSelector => shard_selector,
    }
}

/// An assignment as the model keeps it: its generation, its mode and the slot of the tracked
/// namespace's bucket in that mode.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stored {
    pub generation: u64,
    pub mode: Mode,
    pub slot: Slot,
}

impl Stored {
    pub fn of(assignment: &Assignment) -> Self {
        let slot = assignment.slots[usize::from(tracked(assignment.mode))].clone();
        Self { generation: assignment.generation, mode: assignment.mode, slot }
    }

    /// The whole assignment, every other bucket free.
    pub fn full(&self) -> Assignment {
        let mut assignment = Assignment { generation: self.generation, mode: self.mode, ..Assignment::default() };
        assignment.slots[usize::from(tracked(self.mode))] = self.slot.clone();
        assignment
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Run {
    Running,
    /// Frozen (SIGSTOP) until this instant: past the lease boundary, so it wakes up deposed.
    PausedUntil(u64),
    /// Runs and writes, but its renewal cycles fail (they time out, its Lease is unreachable).
    CutOff,
    Crashed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Member {
    pub incarnation: String,
    pub mode: Mode,
    pub run: Run,
    pub clock: Clock,
    pub slice: Slice,
    /// Completed a renewal cycle in this second.
    pub cycled: bool,
}

impl Member {
    pub fn started(incarnation: &str, mode: Mode, clock: Clock) -> Self {
        Self {
            incarnation: incarnation.to_string(),
            mode,
            run: Run::Running,
            clock,
            slice: Slice::new(incarnation, mode, Duration::from_millis(RENEW_DEADLINE)),
            cycled: false,
        }
    }

    /// The tracked namespace's bucket, as this member computes it.
    pub fn bucket(&self) -> Bucket {
        tracked(self.mode)
    }
}

/// A member Lease as the server stores it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    pub holder: String,
    pub mode: Mode,
    pub renewed: u64,
    pub acked: Option<u64>,
    pub seen: u64,
}

/// A leader's view (`coordination::published::Published`), kept compact.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub stored: Stored,
    pub resource_version: Option<String>,
    pub republish: bool,
}

impl View {
    pub fn of(published: Published) -> Self {
        let Published { assignment, resource_version, republish } = published;
        Self { stored: Stored::of(&assignment), resource_version, republish }
    }

    pub fn published(&self) -> Published {
        Published {
            assignment: self.stored.full(),
            resource_version: self.resource_version.clone(),
            republish: self.republish,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Leader {
    pub clock: Clock,
    pub mode: Mode,
    pub view: Option<View>,
    pub table: MemberTable,
    /// When (by the leader's clock) each revoking generation was first known (`Leader::known_since`).
    pub known_since: BTreeMap<u64, u64>,
    pub confirmed_silent: BTreeSet<(String, u64)>,
    /// The last real instant it planned at.
    pub led_at: Option<u64>,
    /// Its last round published: it plans again at once (on its own write's watch event).
    pub published: bool,
}

impl Leader {
    pub fn started(clock: Clock, mode: Mode) -> Self {
        Self {
            clock,
            mode,
            view: None,
            table: MemberTable::default(),
            known_since: BTreeMap::new(),
            confirmed_silent: BTreeSet::new(),
            led_at: None,
            published: false,
        }
    }

    /// What the leader's next plan depends on that changes with time alone: each member's
    /// liveness and silence, and which revocations have aged a lease duration.
    pub fn timed_inputs(&self, real: u64, members: &[Member]) -> (Vec<(Liveness, bool)>, Vec<bool>) {
        let now = self.clock.read(real);
        let members = members.iter().map(|m| &m.incarnation);
        let members = members.map(|m| (self.table.liveness(m, now), self.table.silent(m, now).is_some()));
        let local = self.clock.shows(real);
        let aged = self.known_since.values().map(|known| local - known >= LEASE);
        (members.collect(), aged.collect())
    }
}
