//! The assignment protocol, model-checked exhaustively with stateright on the operator's own
//! decision functions: the leader's `starting_point`, `next_assignment` and `may_reassign`,
//! the view's `Published::after_read`, the member's `Slice` and the leader's `MemberTable`.
//! Only the plumbing between them (who reads what when, a server that stores the assignment
//! with a resourceVersion precondition and accepts writes) is written here.
//!
//! Time is in ticks of one second: lease duration 4 and renew deadline 3, as the suites run;
//! a write lands within the margin between them of being sent, or never. Every running
//! process acts at least once a tick (a tick waits for them), in any order with the others.
//! Two members; one bucket, the first the ring gives to member `a`; one leader, or two at
//! once. One fault in the first ticks: a member crashes or pauses past its lease duration,
//! or the assignment is deleted, or an older copy of it is restored, or the operator is
//! reinstalled (its namespace with the assignment and every Lease deleted, every process
//! started again; only the generation floor on the CRD survives).
//!
//! Properties:
//! - no write the server accepted came from a member after the bucket was granted to another
//!   (judged with the fencing policy off: the timing layer on its own);
//! - tokens never go backwards: every grant of the bucket carries a higher epoch than the last;
//! - the bucket is owned by a running member at the horizon, when the last fault came early
//!   enough to recover from.
//!
//! A broken decision (a revoked bucket given away at once) must make the checker fail, with
//! the trace.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use stateright::{Checker, HasDiscoveries, Model, Property};
use tokio::time::Instant;
use traffic_policy_operator::coordination::published::Published;
use traffic_policy_operator::sharding::assignment::{
    Assignment, DrainFacts, Slot, may_reassign, next_assignment, plan, starting_point, track_revocations,
};
use traffic_policy_operator::sharding::bucket::{Bucket, Mode};
use traffic_policy_operator::sharding::membership::{Capability, LeaseState, Liveness, MemberTable, pod_of};
use traffic_policy_operator::sharding::slice::Slice;

const LEASE: u64 = 4;
const RENEW_DEADLINE: u64 = 3;
/// How long after it was sent a write may land: twice the write bound, which is 45 % of
/// the margin (`ShardConfig::landing_bound`); here the whole margin, since clocks keep time.
const LANDING_BOUND: u64 = LEASE - RENEW_DEADLINE;
const HORIZON: u64 = 9;
/// Faults come in the ticks before this one.
const FAULTS_UNTIL: u64 = 2;
const MEMBERS: [&str; 2] = ["a_1", "b_1"];
const MODE: Mode = Mode::Labels;
/// Generations reserved per write of the floor, as `coordination::epoch_floor` does.
const FLOOR_BLOCK: u64 = 1000;

fn at(tick: u64) -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now) + Duration::from_secs(tick)
}

/// The bucket the model follows: the first one the ring gives to `a` when both members live.
fn tracked() -> Bucket {
    static TRACKED: OnceLock<Bucket> = OnceLock::new();
    *TRACKED.get_or_init(|| {
        let receivers = MEMBERS.iter().map(|m| m.to_string()).collect();
        let planned = plan(&Assignment::default(), &receivers, &|_: &str, _: u64| false, None).unwrap();
        let owned_by_a = |s: &Slot| matches!(s, Slot::Owned { member, .. } if member == MEMBERS[0]);
        planned.slots.iter().position(owned_by_a).unwrap() as Bucket
    })
}

/// An assignment as the model keeps it: its generation and the tracked bucket's slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Stored {
    generation: u64,
    slot: Slot,
}

impl Stored {
    fn of(assignment: &Assignment) -> Self {
        Self { generation: assignment.generation, slot: assignment.slots[usize::from(tracked())].clone() }
    }

    /// The whole assignment, every other bucket free.
    fn full(&self) -> Assignment {
        let mut assignment = Assignment { generation: self.generation, mode: MODE, ..Assignment::default() };
        assignment.slots[usize::from(tracked())] = self.slot.clone();
        assignment
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Run {
    Running,
    /// Frozen (SIGSTOP) until this tick: past the lease boundary, so it wakes up deposed.
    PausedUntil(u64),
    Crashed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Member {
    run: Run,
    slice: Slice,
    /// Completed a renewal cycle in this tick.
    cycled: bool,
}

/// A member Lease as the server stores it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Lease {
    holder: String,
    renewed: u64,
    acked: Option<u64>,
    seen: u64,
}

/// A leader's view (`coordination::published::Published`), kept compact.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct View {
    stored: Stored,
    resource_version: Option<String>,
    republish: bool,
}

impl View {
    fn of(published: Published) -> Self {
        let Published { assignment, resource_version, republish } = published;
        Self { stored: Stored::of(&assignment), resource_version, republish }
    }

    fn published(&self) -> Published {
        Published {
            assignment: self.stored.full(),
            resource_version: self.resource_version.clone(),
            republish: self.republish,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Leader {
    view: Option<View>,
    table: MemberTable,
    /// When each revoking generation was first known (`Leader::known_since`).
    known_since: BTreeMap<u64, u64>,
    confirmed_silent: BTreeSet<(String, u64)>,
    acted: bool,
}

impl Member {
    fn started(incarnation: &str) -> Self {
        Self {
            run: Run::Running,
            slice: Slice::new(incarnation, MODE, Duration::from_secs(RENEW_DEADLINE)),
            cycled: false,
        }
    }
}

impl Leader {
    fn started() -> Self {
        Self {
            view: None,
            table: MemberTable::default(),
            known_since: BTreeMap::new(),
            confirmed_silent: BTreeSet::new(),
            acted: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Write {
    member: usize,
    epoch: u64,
    sent: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    now: u64,
    members: Vec<Member>,
    leases: BTreeMap<String, Lease>,
    leaders: Vec<Leader>,
    /// The assignment ConfigMap: (resourceVersion, content).
    stored: Option<(u64, Stored)>,
    versions: u64,
    /// A copy saved for a restore.
    backup: Option<Stored>,
    floor: u64,
    writes: Vec<Write>,
    /// The latest grant of the bucket the server stored: (member, epoch).
    granted: Option<(String, u64)>,
    faults: u8,
    last_fault: u64,
    violation: Option<String>,
    token_went_back: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    /// A member's renewal cycle: its Lease, then a read of the assignment.
    Renew(usize),
    Write(usize),
    Land(usize),
    Lose(usize),
    /// The leader's round: read the member Leases and the assignment, plan, publish.
    Lead(usize),
    Crash(usize),
    Pause(usize),
    DeleteAssignment,
    SaveCopy,
    RestoreCopy,
    Reinstall,
}

/// The faults one model injects (one of them, once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Faults {
    /// A member crashes, or pauses past its lease duration.
    Members,
    /// The assignment is deleted, or an older copy restored over it.
    Assignment,
    /// The operator is uninstalled and installed again.
    Reinstall,
}

struct Protocol {
    leaders: usize,
    faults: Faults,
    /// The rule for giving a revoked bucket away: `may_reassign`, or a broken one.
    release: fn(u64, DrainFacts) -> bool,
    /// Whether a leader publishing anew starts above the floor reserved on the CRD.
    floor: bool,
}

impl Protocol {
    fn correct(leaders: usize, faults: Faults) -> Self {
        Self { leaders, faults, release: may_reassign, floor: true }
    }

    fn lease_state(lease: &Lease) -> LeaseState {
        LeaseState {
            holder: Some(lease.holder.clone()),
            renew_marker: Some(lease.renewed.to_string()),
            duration: Duration::from_secs(LEASE),
            acked_generation: lease.acked,
            seen_generation: Some(lease.seen),
            uid: Some(format!("uid-{}", pod_of(&lease.holder))),
            load: None,
            capability: Some(Capability { mode: MODE.as_str().into(), version: "model".into(), not_working: None }),
        }
    }

    fn publish(&self, state: &mut State, l: usize) {
        let now = state.now;
        let leader = &mut state.leaders[l];
        let (known, version, republish) = match &leader.view {
            Some(v) => (Some(v.stored.full()), v.resource_version.clone(), v.republish),
            None => (None, None, true),
        };
        let reserved = if republish && self.floor { state.floor } else { 0 };
        let current = starting_point(known, republish, reserved, leader.table.highest_generation(), MODE);
        track_revocations(&mut leader.known_since, &current, now);
        // Leader::confirm_silent: a quorum read of the member's Lease.
        if let Slot::Draining { from, since } = &current.slots[usize::from(tracked())]
            && let Some(marker) = leader.table.silent(from, at(now))
            && let Some(lease) = state.leases.get(pod_of(from))
            && lease.holder == *from
            && lease.renewed.to_string() == marker
        {
            leader.confirmed_silent.insert((from.clone(), *since));
        }
        let receivers = leader.table.receivers(None, MODE.as_str(), at(now));
        let release = |from: &str, since: u64| {
            let facts = DrainFacts {
                acked: leader.table.acked_generation(from),
                released: leader.table.liveness(from, at(now)) == Liveness::Released,
                confirmed_silent: leader.confirmed_silent.contains(&(from.to_string(), since)),
                revoked_for: Duration::from_secs(now - leader.known_since.get(&since).copied().unwrap_or(now)),
                lease_duration: Duration::from_secs(LEASE),
            };
            (self.release)(since, facts)
        };
        let Some(next) = next_assignment(&current, &receivers, &release, None, republish) else { return };
        let next = Stored::of(&next);
        // The untracked buckets are free in the model: publish only what moves the tracked one.
        if !republish && next.slot == Stored::of(&current).slot {
            return;
        }
        // EpochFloor::reserve, then the write with its precondition.
        if next.generation > state.floor {
            state.floor = next.generation + FLOOR_BLOCK;
        }
        let stored_version = state.stored.as_ref().map(|(v, _)| v.to_string());
        if stored_version != version {
            return;
        }
        state.versions += 1;
        let overwrote_copy = republish && version.is_some();
        state.stored = Some((state.versions, next.clone()));
        if let Slot::Owned { member, epoch } = &next.slot
            && state.granted.as_ref().is_none_or(|(m, e)| m != member || e != epoch)
        {
            if state.granted.as_ref().is_some_and(|(_, last)| epoch <= last) {
                state.token_went_back = true;
            }
            state.granted = Some((member.clone(), *epoch));
        }
        if overwrote_copy {
            leader.known_since.values_mut().for_each(|t| *t = now);
        }
        leader.known_since.insert(next.generation, now);
        leader.view = Some(View { stored: next, resource_version: Some(state.versions.to_string()), republish: false });
    }

    fn fault(state: &mut State) {
        state.faults += 1;
        state.last_fault = state.now;
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            members: MEMBERS.iter().map(|m| Member::started(m)).collect(),
            leases: BTreeMap::new(),
            leaders: vec![Leader::started(); self.leaders],
            stored: None,
            versions: 0,
            backup: None,
            floor: 0,
            writes: Vec::new(),
            granted: None,
            faults: 0,
            last_fault: 0,
            violation: None,
            token_went_back: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let running = |m: &Member| m.run == Run::Running;
        let everyone_acted =
            state.members.iter().all(|m| !running(m) || m.cycled) && state.leaders.iter().all(|l| l.acted);
        if state.now < HORIZON && everyone_acted {
            actions.push(Action::Tick);
        }
        for (i, member) in state.members.iter().enumerate() {
            if running(member) {
                if !member.cycled {
                    actions.push(Action::Renew(i));
                }
                let writing = state.writes.iter().any(|w| w.member == i);
                if !writing && member.slice.permit(tracked(), at(state.now)).is_some() {
                    actions.push(Action::Write(i));
                }
            }
        }
        for (k, write) in state.writes.iter().enumerate() {
            if state.now <= write.sent + LANDING_BOUND {
                actions.push(Action::Land(k));
            } else {
                actions.push(Action::Lose(k));
            }
        }
        for (l, leader) in state.leaders.iter().enumerate() {
            if !leader.acted {
                actions.push(Action::Lead(l));
            }
        }
        if state.faults > 0 || state.now >= FAULTS_UNTIL {
            return;
        }
        match self.faults {
            Faults::Members => {
                for (i, member) in state.members.iter().enumerate() {
                    if running(member) {
                        actions.push(Action::Crash(i));
                        actions.push(Action::Pause(i));
                    }
                }
            }
            Faults::Assignment => {
                if state.stored.is_some() {
                    actions.push(Action::DeleteAssignment);
                    if state.backup.is_none() {
                        actions.push(Action::SaveCopy);
                    }
                }
                if state.backup.as_ref().is_some_and(|copy| state.stored.as_ref().is_some_and(|(_, s)| s != copy)) {
                    actions.push(Action::RestoreCopy);
                }
            }
            // An uninstall stops every process gracefully: nothing of theirs is in flight.
            Faults::Reinstall => {
                if state.stored.is_some() && state.writes.is_empty() {
                    actions.push(Action::Reinstall);
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        let now = state.now;
        match action {
            Action::Tick => {
                state.now += 1;
                for member in state.members.iter_mut().filter(|m| m.run == Run::PausedUntil(state.now)) {
                    // The fault lasted until now: recovery is counted from here.
                    member.run = Run::Running;
                    state.last_fault = state.now;
                }
                state.members.iter_mut().for_each(|m| m.cycled = false);
                state.leaders.iter_mut().for_each(|l| l.acted = false);
            }
            Action::Renew(i) => {
                let member = &mut state.members[i];
                let holder = MEMBERS[i].to_string();
                let acked = member.slice.acknowledgeable(at(now));
                let seen = member.slice.generation();
                state.leases.insert(pod_of(&holder).to_string(), Lease { holder, renewed: now, acked, seen });
                match &state.stored {
                    Some((_, stored)) => drop(member.slice.confirm(at(now), &stored.full())),
                    None => member.slice.renewed(at(now)),
                }
                member.cycled = true;
            }
            Action::Write(i) => {
                let member = &mut state.members[i];
                let epoch = member.slice.begin(tracked(), at(now))?;
                member.slice.end(tracked());
                // Registered as in flight until its bound, answered or not (conservative).
                member.slice.abandoned(tracked(), at(now + LANDING_BOUND));
                state.writes.push(Write { member: i, epoch, sent: now });
            }
            Action::Land(k) => {
                // Accepted whatever its token: the timing layer is judged on its own.
                let write = state.writes.remove(k);
                let writer = MEMBERS[write.member];
                if let Some((owner, epoch)) = &state.granted
                    && owner != writer
                    && state.violation.is_none()
                {
                    state.violation = Some(format!(
                        "at tick {now}, a write of {writer} (epoch {}, sent at {}) landed after the bucket was granted \
                         to {owner} (epoch {epoch})",
                        write.epoch, write.sent
                    ));
                }
            }
            Action::Lose(k) => {
                state.writes.remove(k);
            }
            Action::Lead(l) => {
                let leader = &mut state.leaders[l];
                for (pod, lease) in &state.leases {
                    leader.table.observe(pod, Self::lease_state(lease), at(now));
                }
                match &state.stored {
                    Some((version, stored)) => {
                        let known = leader.view.as_ref().map(View::published);
                        let read = Published::after_read(known.as_ref(), stored.full(), Some(version.to_string()));
                        if let Some(read) = read {
                            leader.view = Some(View::of(read));
                        }
                    }
                    None => {
                        if let Some(view) = leader.view.as_mut() {
                            view.resource_version = None;
                            view.republish = true;
                        }
                    }
                }
                self.publish(&mut state, l);
                state.leaders[l].acted = true;
            }
            Action::Crash(i) => {
                state.members[i].run = Run::Crashed;
                Self::fault(&mut state);
            }
            Action::Pause(i) => {
                state.members[i].run = Run::PausedUntil(now + LEASE + 1);
                Self::fault(&mut state);
            }
            Action::DeleteAssignment => {
                state.stored = None;
                Self::fault(&mut state);
            }
            Action::SaveCopy => state.backup = state.stored.as_ref().map(|(_, s)| s.clone()),
            Action::RestoreCopy => {
                state.versions += 1;
                state.stored = Some((state.versions, state.backup.clone()?));
                Self::fault(&mut state);
            }
            Action::Reinstall => {
                // The operator's namespace goes with the assignment and the Leases; the new
                // install's processes know nothing. The CRD, its floor and the children stay.
                state.stored = None;
                state.leases.clear();
                state.members = MEMBERS.iter().map(|m| Member::started(m)).collect();
                state.leaders = vec![Leader::started(); self.leaders];
                // The new install's first grant is a new grant, even to a namesake of the last owner.
                state.granted = state.granted.take().map(|(_, epoch)| ("(the previous install)".to_string(), epoch));
                Self::fault(&mut state);
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no accepted write after the bucket was granted to another", |_, s: &State| {
                s.violation.is_none()
            }),
            Property::always("tokens never go backwards", |_, s: &State| !s.token_went_back),
            Property::always("the bucket is owned by a running member at the horizon", |_, s: &State| {
                let recovered = s.faults == 0 || s.last_fault + LEASE + 5 <= HORIZON;
                s.now < HORIZON || !recovered || owned_by_a_running_member(s)
            }),
        ]
    }
}

fn owned_by_a_running_member(state: &State) -> bool {
    let Some((_, stored)) = &state.stored else { return false };
    let Slot::Owned { member, .. } = &stored.slot else { return false };
    MEMBERS.iter().position(|m| m == member).is_some_and(|i| state.members[i].run == Run::Running)
}

/// Breadth first, so a search cut at `limit` states has covered every interleaving up to
/// some depth; `TPO_MODEL_STATE_LIMIT` overrides the limit (0: none).
fn check(protocol: Protocol, limit: usize) -> impl Checker<Protocol> {
    let limit = std::env::var("TPO_MODEL_STATE_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(limit);
    let limit = if limit == 0 { usize::MAX } else { limit };
    let checker = protocol.checker().threads(2).target_state_count(limit);
    checker.finish_when(HasDiscoveries::AnyFailures).spawn_bfs().join()
}

fn keeps_every_property(name: &str, protocol: Protocol) {
    // Two leaders double the interleavings: their search is cut at 2 million states.
    let limit = if protocol.leaders > 1 { 2_000_000 } else { 0 };
    let checker = check(protocol, limit);
    println!(
        "{name}: {} states, {} unique, depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
}

#[test]
fn members_crashing_or_pausing_under_one_leader() {
    keeps_every_property("crash or pause, one leader", Protocol::correct(1, Faults::Members));
}

#[test]
fn members_crashing_or_pausing_under_two_leaders_at_once() {
    keeps_every_property("crash or pause, two leaders", Protocol::correct(2, Faults::Members));
}

#[test]
fn the_assignment_deleted_or_rolled_back() {
    keeps_every_property("deleted or restored assignment", Protocol::correct(1, Faults::Assignment));
}

#[test]
fn a_reinstall_of_the_operator() {
    keeps_every_property("reinstall", Protocol::correct(1, Faults::Reinstall));
}

#[test]
fn a_reinstall_without_the_generation_floor_fails_with_a_trace() {
    let broken = Protocol { floor: false, ..Protocol::correct(1, Faults::Reinstall) };
    let checker = check(broken, 0);
    let trace = checker.discovery("tokens never go backwards").expect("without the floor, epochs start again");
    println!("counterexample in {} steps: {:?}", trace.clone().into_actions().len(), trace.into_actions());
}

#[test]
fn a_bucket_given_away_without_waiting_for_its_owner_fails_with_a_trace() {
    let broken = Protocol { release: |_, _| true, ..Protocol::correct(1, Faults::Members) };
    let checker = check(broken, 0);
    let trace = checker
        .discovery("no accepted write after the bucket was granted to another")
        .expect("reassigning without waiting for the revoked owner must let a late write land");
    let steps: Vec<Action> = trace.clone().into_actions();
    let last = trace.last_state();
    println!("counterexample in {} steps: {steps:?}\n{}", steps.len(), last.violation.as_deref().unwrap_or_default());
    assert!(last.violation.is_some());
}
