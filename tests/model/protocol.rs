//! The model: two members, one or two leaders, the API server that stores the assignment
//! and the member Leases and accepts writes, and the faults. Only this plumbing is written
//! here; every decision is the operator's own function.

use std::collections::BTreeMap;
use std::time::Duration;

use stateright::{Model, Property};
use traffic_policy_operator::coordination::published::Published;
use traffic_policy_operator::sharding::assignment::{
    Assignment, Capacities, DrainFacts, Slot, may_reassign, must_republish, starting_point, track_revocations,
};
use traffic_policy_operator::sharding::bucket::Mode;
use traffic_policy_operator::sharding::hash_ranges::Ranges;
use traffic_policy_operator::sharding::membership::{Capability, LeaseState, Liveness, pod_of};
use traffic_policy_operator::sharding::planning::{self, Inputs};

use crate::clock::{Clock, SECOND, last_instant};
use crate::processes::{Leader, Lease, Member, Run, Stored, View, tracked};

pub const LEASE: u64 = 4 * SECOND;
pub const RENEW_DEADLINE: u64 = 3 * SECOND;
pub const HORIZON: u64 = 9 * SECOND;
/// Faults come before this instant: until a second after the first owner can have confirmed
/// its grant (a member is given buckets once seen renewing twice, and reads them at its next
/// renewal), so that the owner itself crashes, pauses or is cut off after writing.
const FAULTS_UNTIL: u64 = 3 * SECOND;
pub const MEMBERS: [&str; 2] = ["a_1", "b_1"];
pub const MODE: Mode = Mode::Labels;
/// Generations reserved per write of the floor, as `coordination::epoch_floor` does.
const FLOOR_BLOCK: u64 = 1000;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Write {
    member: usize,
    writer: String,
    epoch: u64,
    sent: u64,
    /// The last real instant it may land: its bound by the writer's clock (the client's
    /// timeout, and the server's, which the model runs at the writer's rate).
    lands_by: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Real time, in milliseconds.
    pub now: u64,
    pub members: Vec<Member>,
    leases: BTreeMap<String, Lease>,
    leaders: Vec<Leader>,
    /// The assignment ConfigMap: (resourceVersion, content).
    pub stored: Option<(u64, Stored)>,
    versions: u64,
    /// A copy saved for a restore.
    backup: Option<Stored>,
    floor: u64,
    writes: Vec<Write>,
    /// The latest grant of the bucket the server stored: (member, epoch).
    granted: Option<(String, u64)>,
    faults: u8,
    last_fault: u64,
    pub violation: Option<String>,
    token_went_back: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Real time moves on to the next whole second: every process has acted in this one.
    Tick,
    /// Real time moves on to an instant within the second at which a decision changes.
    Advance(u64),
    /// A member's renewal cycle: its Lease, then a read of the assignment.
    Renew(usize),
    Write(usize),
    /// The leader's round: read the member Leases and the assignment, plan, publish.
    Lead(usize),
    Crash(usize),
    Pause(usize),
    CutOff(usize),
    /// A member's pod is replaced by one in the other mode, a new incarnation, as a rolling
    /// update does: the old one drained (nothing of it in flight) and released its Lease.
    RemodeMember(usize),
    /// The leader restarts in the other mode.
    RemodeLeader(usize),
    DeleteAssignment,
    SaveCopy,
    RestoreCopy,
    Reinstall,
}

/// The faults one model injects (one of them, once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Faults {
    /// A member crashes, or pauses past its lease duration.
    Members,
    /// The assignment is deleted, or an older copy restored over it.
    Assignment,
    /// The operator is uninstalled and installed again.
    Reinstall,
    /// A member's renewals fail from some instant on while its writes still land.
    CutOff,
    /// A rolling update to the other sharding mode, once an assignment is published: each
    /// member restarts in it, `b` before `a` (a StatefulSet replaces the highest ordinal
    /// first), and the leader at any point of that order, each at any of the first seconds.
    /// (A member killed instead is the `Members` fault.)
    ModeChange,
}

pub struct Protocol {
    pub leaders: usize,
    pub faults: Faults,
    /// The rule for giving a revoked bucket away: `may_reassign`, or a broken one.
    pub release: fn(u64, DrainFacts) -> bool,
    /// Whether a leader publishing anew starts above the floor reserved on the CRD.
    pub floor: bool,
    /// How long after it was sent (by the writer's clock) a write may land.
    pub landing_bound: u64,
    /// Clocks run fast or slow by this much (see `clocks`). Zero: clocks keep real time, and
    /// processes act at whole seconds only.
    pub drift_ppm: i64,
    /// Whether a leader of one mode reads an assignment of the other as of that mode (true),
    /// or as of its own, as a leader that ignored the mode would (broken).
    pub modes_kept: bool,
}

impl Protocol {
    /// Writes may land within the whole margin between lease duration and renew deadline.
    pub fn correct(leaders: usize, faults: Faults) -> Self {
        let landing_bound = LEASE - RENEW_DEADLINE;
        Self { leaders, faults, release: may_reassign, floor: true, landing_bound, drift_ppm: 0, modes_kept: true }
    }

    /// The clocks of the members and then the leaders. With drift, two worlds: members slow
    /// and leaders fast (a member's right and its writes last longest while the leader's
    /// lease duration passes soonest: the worst case for safety), and the other way round.
    fn clocks(&self) -> Vec<Vec<Clock>> {
        let world = |member: i64| {
            let members = MEMBERS.iter().map(move |_| Clock { drift_ppm: member });
            members.chain((0..self.leaders).map(move |_| Clock { drift_ppm: -member })).collect()
        };
        if self.drift_ppm == 0 { vec![world(0)] } else { vec![world(-self.drift_ppm), world(self.drift_ppm)] }
    }

    fn lease_state(lease: &Lease) -> LeaseState {
        let mode = lease.mode.as_str().into();
        LeaseState {
            holder: Some(lease.holder.clone()),
            renew_marker: Some(lease.renewed.to_string()),
            duration: Duration::from_millis(LEASE),
            acked_generation: lease.acked,
            seen_generation: Some(lease.seen),
            uid: Some(format!("uid-{}", pod_of(&lease.holder))),
            load: None,
            capability: Some(Capability {
                mode,
                version: "model".into(),
                not_working: None,
                capacity: None,
                reads_split_ranges: true,
            }),
        }
    }

    fn publish(&self, state: &mut State, l: usize) {
        let leader = &mut state.leaders[l];
        let local = leader.clock.shows(state.now);
        let now = leader.clock.read(state.now);
        let (known, version, republish) = match &leader.view {
            Some(v) => (Some(v.stored.full()), v.resource_version.clone(), v.republish),
            None => (None, None, true),
        };
        let seen = leader.table.highest_generation();
        let copy_stored = republish;
        let republish = must_republish(republish, known.as_ref().map_or(0, |k| k.generation), seen);
        let reserved = if republish && self.floor { state.floor } else { 0 };
        let mode = leader.mode;
        let mut current = starting_point(known, republish, reserved, seen, mode);
        if !self.modes_kept {
            current = Assignment { mode, ..current };
        }
        track_revocations(&mut leader.known_since, &current, local);
        // Leader::confirm_silent: a quorum read of the member's Lease.
        if let Slot::Draining { from, since } = &current.slots[usize::from(tracked(current.mode))]
            && let Some(marker) = leader.table.silent(from, now)
            && let Some(lease) = state.leases.get(pod_of(from))
            && lease.holder == *from
            && lease.renewed.to_string() == marker
        {
            leader.confirmed_silent.insert((from.clone(), *since));
        }
        let receivers = leader.table.receivers(None, mode.as_str(), now);
        let release = |from: &str, since: u64| {
            let facts = DrainFacts {
                acked: leader.table.acked_generation(from),
                released: leader.table.liveness(from, now) == Liveness::Released,
                confirmed_silent: leader.confirmed_silent.contains(&(from.to_string(), since)),
                revoked_for: Duration::from_millis(local - leader.known_since.get(&since).copied().unwrap_or(local)),
                lease_duration: Duration::from_millis(LEASE),
            };
            (self.release)(since, facts)
        };
        let stored_before = Stored::of(&current);
        let plan = planning::plan(Inputs {
            current,
            republish,
            mode,
            receivers: &receivers,
            ranges: Ranges::default(),
            census: None,
            capacities: &Capacities::new(),
            rebalanced: None,
            release: &release,
        });
        let Some(next) = plan.into_next() else { return };
        let next = Stored::of(&next);
        // The untracked buckets are free in the model: publish only what moves the tracked one.
        if !republish && (next.mode, &next.slot) == (stored_before.mode, &stored_before.slot) {
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
        let overwrote_copy = copy_stored && version.is_some();
        state.stored = Some((state.versions, next.clone()));
        if let Slot::Owned { member, epoch } = &next.slot
            && state.granted.as_ref().is_none_or(|(m, e)| m != member || e != epoch)
        {
            if state.granted.as_ref().is_some_and(|(_, last)| epoch <= last) {
                state.token_went_back = true;
            }
            state.granted = Some((member.clone(), *epoch));
            for write in &state.writes {
                judge(&mut state.violation, state.now, write, member, *epoch);
            }
        }
        if overwrote_copy {
            leader.known_since.values_mut().for_each(|t| *t = local);
        }
        leader.known_since.insert(next.generation, local);
        leader.view = Some(View { stored: next, resource_version: Some(state.versions.to_string()), republish: false });
        leader.published = true;
    }

    /// The next instant within this second at which some process's decision changes with
    /// its clock alone: a member's right to write ends, a write's bound passes, a leader
    /// sees a member expire or a revocation age. Only with drifting clocks: otherwise every
    /// deadline falls on a whole second.
    fn next_event(&self, state: &State) -> Option<u64> {
        if self.drift_ppm == 0 || state.now >= HORIZON {
            return None;
        }
        let (now, end) = (state.now, state.now - state.now % SECOND + SECOND - 1);
        let rights =
            state.members.iter().filter(|m| matches!(m.run, Run::Running | Run::CutOff)).filter_map(|m| {
                last_instant(now, end, |real| m.slice.permit(m.bucket(), m.clock.read(real)).is_some())
            });
        let leaders = state.leaders.iter().filter_map(|l| {
            let inputs = l.timed_inputs(now, &state.members);
            last_instant(now, end, |real| l.timed_inputs(real, &state.members) == inputs).map(|last| last + 1)
        });
        rights.chain(leaders).filter(|t| *t > now && *t <= end).min()
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
        let start = |clocks: Vec<Clock>| State {
            now: 0,
            members: MEMBERS.iter().zip(&clocks).map(|(m, c)| Member::started(m, MODE, *c)).collect(),
            leases: BTreeMap::new(),
            leaders: clocks[MEMBERS.len()..].iter().map(|c| Leader::started(*c, MODE)).collect(),
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
        };
        self.clocks().into_iter().map(start).collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let renews = |m: &Member| matches!(m.run, Run::Running | Run::CutOff);
        let second = state.now - state.now % SECOND;
        let everyone_acted = state.members.iter().all(|m| !renews(m) || m.cycled)
            && state.leaders.iter().all(|l| l.led_at.is_some_and(|t| t >= second));
        match self.next_event(state) {
            Some(instant) => actions.push(Action::Advance(instant)),
            None if state.now < HORIZON && everyone_acted => actions.push(Action::Tick),
            None => {}
        }
        // Within a second, a member writes only at the end of its right, the latest it can.
        // Renewals stay on whole seconds: a leader that leads just after sees the renewal
        // at once, the worst case.
        let whole_second = state.now.is_multiple_of(SECOND);
        let may_write = |m: &Member, real: u64| m.slice.permit(m.bucket(), m.clock.read(real)).is_some();
        for (i, member) in state.members.iter().enumerate() {
            if renews(member) {
                if !member.cycled && whole_second {
                    actions.push(Action::Renew(i));
                }
                let writing = state.writes.iter().any(|w| w.member == i && w.sent == state.now);
                let right_ends = !may_write(member, state.now + 1);
                if !writing && may_write(member, state.now) && (whole_second || right_ends) {
                    actions.push(Action::Write(i));
                }
            }
        }
        for (l, leader) in state.leaders.iter().enumerate() {
            if leader.led_at != Some(state.now) || leader.published {
                actions.push(Action::Lead(l));
            }
        }
        if state.now >= FAULTS_UNTIL || !state.now.is_multiple_of(SECOND) {
            return;
        }
        if self.faults == Faults::ModeChange {
            // Every process may change once; together they are the one fault.
            if state.stored.is_none() {
                return;
            }
            let drained = |i: usize| state.writes.iter().all(|w| w.member != i);
            let next = state.members.iter().rposition(|m| m.mode == MODE);
            actions.extend(next.filter(|i| drained(*i)).map(Action::RemodeMember));
            let leaders = state.leaders.iter().enumerate().filter(|(_, l)| l.mode == MODE);
            actions.extend(leaders.map(|(l, _)| Action::RemodeLeader(l)));
            return;
        }
        if state.faults > 0 {
            return;
        }
        let running = state.members.iter().enumerate().filter(|(_, m)| m.run == Run::Running);
        match self.faults {
            Faults::Members => {
                for (i, _) in running {
                    actions.push(Action::Crash(i));
                    actions.push(Action::Pause(i));
                }
            }
            Faults::CutOff => actions.extend(running.map(|(i, _)| Action::CutOff(i))),
            Faults::ModeChange => {}
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
                state.now = now - now % SECOND + SECOND;
                state.writes.retain(|w| w.lands_by >= state.now);
                for member in state.members.iter_mut() {
                    if let Run::PausedUntil(until) = member.run
                        && until <= state.now
                    {
                        // The fault lasted until now: recovery is counted from here.
                        member.run = Run::Running;
                        state.last_fault = state.now;
                    }
                    member.cycled = false;
                }
            }
            Action::Advance(instant) => {
                state.now = instant;
                state.writes.retain(|w| w.lands_by >= instant);
            }
            Action::Renew(i) => {
                let member = &mut state.members[i];
                member.cycled = true;
                if member.run == Run::CutOff {
                    return Some(state);
                }
                let started = member.clock.read(now);
                let holder = member.incarnation.clone();
                // A new incarnation takes its pod's Lease over only once the old holder's
                // renewal has stood for a lease duration (sooner than `lease::ForeignHold`,
                // which counts from its own first sight: the worst case).
                let pod = pod_of(&holder).to_string();
                let held = |l: &Lease| !l.holder.is_empty() && l.holder != holder && now - l.renewed < LEASE;
                if state.leases.get(&pod).is_some_and(held) {
                    return Some(state);
                }
                let acked = member.slice.acknowledgeable(started);
                let seen = member.slice.generation();
                let lease = Lease { holder, mode: member.mode, renewed: now, acked, seen };
                state.leases.insert(pod, lease);
                match &state.stored {
                    Some((_, stored)) => drop(member.slice.confirm(started, &stored.full())),
                    None => member.slice.renewed(started),
                }
            }
            Action::Write(i) => {
                let member = &mut state.members[i];
                let sent = member.clock.shows(now);
                let bucket = member.bucket();
                let epoch = member.slice.begin(bucket, member.clock.read(now))?;
                member.slice.end(bucket);
                // Registered as in flight until its bound, answered or not (conservative).
                let bound = sent + self.landing_bound;
                member.slice.abandoned(bucket, crate::clock::at(bound));
                let lands_by = member.clock.last_showing(bound);
                let write = Write { member: i, writer: member.incarnation.clone(), epoch, sent: now, lands_by };
                if let Some((owner, granted)) = &state.granted {
                    judge(&mut state.violation, now, &write, owner, *granted);
                }
                state.writes.push(write);
            }
            Action::Lead(l) => {
                let leader = &mut state.leaders[l];
                leader.published = false;
                let local = leader.clock.read(now);
                for (pod, lease) in &state.leases {
                    leader.table.observe(pod, Self::lease_state(lease), local);
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
                state.leaders[l].led_at = Some(now);
            }
            Action::Crash(i) => {
                state.members[i].run = Run::Crashed;
                Self::fault(&mut state);
            }
            Action::Pause(i) => {
                state.members[i].run = Run::PausedUntil(now + LEASE + SECOND);
                Self::fault(&mut state);
            }
            Action::CutOff(i) => {
                state.members[i].run = Run::CutOff;
                Self::fault(&mut state);
            }
            Action::RemodeMember(i) => {
                let old = &state.members[i];
                let pod = pod_of(&old.incarnation).to_string();
                state.members[i] = Member::started(&format!("{pod}_2"), other(old.mode), old.clock);
                // Lease::release: the holder emptied, so the successor takes it over at once.
                if let Some(lease) = state.leases.get_mut(&pod) {
                    lease.holder = String::new();
                }
                Self::fault(&mut state);
            }
            Action::RemodeLeader(l) => {
                let old = &state.leaders[l];
                state.leaders[l] = Leader::started(old.clock, other(old.mode));
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
                for (i, member) in state.members.iter_mut().enumerate() {
                    *member = Member::started(MEMBERS[i], member.mode, member.clock);
                }
                for leader in state.leaders.iter_mut() {
                    *leader = Leader::started(leader.clock, leader.mode);
                }
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
                // A rolling update that stopped half way leaves no member of the leader's mode.
                let one_mode = s.members.iter().all(|m| s.leaders.iter().all(|l| l.mode == m.mode));
                let recovered = s.faults == 0 || (one_mode && s.last_fault + LEASE + 5 * SECOND <= HORIZON);
                s.now < HORIZON || !recovered || owned_by_a_running_member(s)
            }),
        ]
    }
}

/// A write that may still land at `now` or later, from another member than the bucket's
/// owner since `now`: accepted whatever its token, since the timing layer is judged on its
/// own. Judging when the grant or the write happens covers the write landing at the last
/// instant of its bound, the worst case, without modelling every instant it could land at.
fn judge(violation: &mut Option<String>, now: u64, write: &Write, owner: &str, epoch: u64) {
    let writer = &write.writer;
    if writer == owner || write.lands_by < now || violation.is_some() {
        return;
    }
    *violation = Some(format!(
        "a write of {writer} (epoch {}, sent at {} ms) may land until {} ms, and the bucket was granted to {owner} \
         (epoch {epoch}) at {now} ms",
        write.epoch, write.sent, write.lands_by
    ));
}

fn owned_by_a_running_member(state: &State) -> bool {
    let Some((_, stored)) = &state.stored else { return false };
    let Slot::Owned { member, .. } = &stored.slot else { return false };
    state.members.iter().any(|m| m.incarnation == *member && m.mode == stored.mode && m.run == Run::Running)
}

fn other(mode: Mode) -> Mode {
    match mode {
        Mode::Labels => Mode::ShardSelector,
        Mode::ShardSelector => Mode::Labels,
    }
}
