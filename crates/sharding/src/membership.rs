//! Who is alive, judged from member Lease renewals observed *locally*.
//!
//! Each pod has one member Lease; its holder is the pod's current *incarnation*
//! (`<pod>_<nonce>`, new for every process), so two processes with one pod name never
//! share a holder. A member is judged by our own monotonic clock from the moment we saw
//! its `renewTime` change; a remote timestamp is never compared with our clock, so clock
//! offsets do not matter, only rates do.
//!
//! A member moves through [`Liveness`]: first sight, a left-over Lease, or a deleted Lease
//! is only [`Liveness::MayBeAlive`] (it is never given buckets, and never taken for dead
//! before its lease would have expired); a renewal seen after that makes it
//! [`Liveness::Renewing`]. Pure: `now` is an argument.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::counts::Report;

/// A process's identity: its pod name and a nonce of its own.
pub fn incarnation(pod: &str, nonce: &str) -> String {
    format!("{pod}_{nonce}")
}

/// The pod an incarnation runs as (pod names never contain `_`).
pub fn pod_of(incarnation: &str) -> &str {
    incarnation.rsplit_once('_').map_or(incarnation, |(pod, _)| pod)
}

/// What one member Lease says, as read from the API server.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct LeaseState {
    /// The incarnation holding it; empty once released (graceful shutdown).
    pub holder: Option<String>,
    /// `spec.renewTime` as written: only compared for change, never with our clock.
    pub renew_marker: Option<String>,
    pub duration: Duration,
    /// The assignment generation the holder has applied and drained.
    pub acked_generation: Option<u64>,
    /// The newest assignment generation the holder has seen.
    pub seen_generation: Option<u64>,
    /// The Lease object's uid: a holder change on the same object is a takeover or a
    /// release; on a new object (deleted and created again) it says nothing.
    pub uid: Option<String>,
    /// What the holder holds, per bucket (see `sharding::balance`).
    pub load: Option<Report>,
    /// What the holder says it can do; `None` from a version that did not say.
    pub capability: Option<Capability>,
}

/// What a member advertises on its Lease: a leader gives buckets only to members that
/// compute buckets as it does and can watch and write them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Capability {
    /// Its sharding mode, as `Mode::as_str` spells it.
    pub mode: String,
    pub version: String,
    /// Why it cannot do its work (watches refused, renewal cycles that never complete);
    /// `None` while it works.
    pub not_working: Option<String>,
    /// How many objects it can hold; `None`: no bound.
    pub capacity: Option<u64>,
    /// Whether it reads hash ranges the leader split (see `sharding::hash_ranges`).
    pub reads_split_ranges: bool,
}

impl LeaseState {
    fn holder(&self) -> Option<&str> {
        self.holder.as_deref().filter(|h| !h.is_empty())
    }

    /// Why its holder may not be given buckets of an assignment in `mode`; `None` if it may.
    pub fn why_not_given(&self, mode: &str) -> Option<String> {
        match &self.capability {
            None => Some("it does not advertise its sharding mode (an older version)".into()),
            Some(c) if c.mode != mode => Some(format!("it shards in {} mode, the fleet in {mode}", c.mode)),
            Some(c) => c.not_working.clone(),
        }
    }

    fn can_work_in(&self, mode: &str) -> bool {
        self.why_not_given(mode).is_none()
    }
}

/// What the renewals seen here say of a member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Seen renewing within its lease duration: may be given buckets.
    Renewing,
    /// Not seen renewing yet (first sight, a left-over Lease) or its Lease was deleted:
    /// given nothing, and not taken for dead before its lease would have expired.
    MayBeAlive,
    /// No renewal seen for a lease duration, or its Lease now names another incarnation.
    Expired,
    /// It let go: it emptied its Lease's holder itself after draining (graceful shutdown),
    /// or its successor took the same Lease over after seeing it expire.
    Released,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Observed {
    state: LeaseState,
    last_change: Instant,
    /// Renewals seen since the current holder was first seen.
    renewals: u32,
    deleted: bool,
    /// Incarnations seen letting go of this Lease, newest last (a few are kept).
    released_by: VecDeque<String>,
}

/// How many releasing incarnations a member entry remembers.
const RELEASES_KEPT: usize = 4;

/// Every member Lease seen, with its renewals as this process observed them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemberTable {
    /// By pod name.
    members: BTreeMap<String, Observed>,
}

impl MemberTable {
    /// Records the Lease of `pod` as seen at `now`.
    pub fn observe(&mut self, pod: &str, state: LeaseState, now: Instant) {
        let Some(seen) = self.members.get_mut(pod) else {
            let observed =
                Observed { state, last_change: now, renewals: 0, deleted: false, released_by: VecDeque::new() };
            self.members.insert(pod.to_string(), observed);
            return;
        };
        let was_deleted = std::mem::take(&mut seen.deleted);
        if seen.state.holder() != state.holder() {
            // Emptied, or taken over on the same object (a successor takes a Lease only after
            // seeing it unrenewed for its duration): the old holder has let go.
            let same_object = seen.state.uid.is_some() && seen.state.uid == state.uid && !was_deleted;
            if let Some(old) = seen.state.holder().filter(|_| state.holder().is_none() || same_object) {
                seen.released_by.push_back(old.to_string());
                if seen.released_by.len() > RELEASES_KEPT {
                    seen.released_by.pop_front();
                }
            }
            seen.renewals = 0;
            seen.last_change = now;
        } else if seen.state.renew_marker != state.renew_marker {
            seen.renewals += 1;
            seen.last_change = now;
        }
        // An acknowledgement alone is not a renewal; it is recorded all the same.
        seen.state = state;
    }

    /// The Lease was deleted: what we knew stands until it would have expired.
    pub fn deleted(&mut self, pod: &str) {
        if let Some(seen) = self.members.get_mut(pod) {
            seen.deleted = true;
        }
    }

    /// How `incarnation` looks from here at `now`. `me` always counts as renewing while
    /// our own lease is valid, which the caller checks.
    pub fn liveness(&self, incarnation: &str, now: Instant) -> Liveness {
        let Some(seen) = self.members.get(pod_of(incarnation)) else { return Liveness::MayBeAlive };
        if seen.released_by.iter().any(|r| r == incarnation) && seen.state.holder() != Some(incarnation) {
            return Liveness::Released;
        }
        if seen.state.holder() != Some(incarnation) {
            // Another incarnation took the Lease over (after seeing it expire) or nobody holds it.
            return if seen.state.holder().is_some() || seen.deleted {
                self.expired_or_unknown(seen, now)
            } else {
                Liveness::Expired
            };
        }
        if now.saturating_duration_since(seen.last_change) >= seen.state.duration {
            return Liveness::Expired;
        }
        if seen.deleted || seen.renewals == 0 { Liveness::MayBeAlive } else { Liveness::Renewing }
    }

    fn expired_or_unknown(&self, seen: &Observed, now: Instant) -> Liveness {
        if now.saturating_duration_since(seen.last_change) >= seen.state.duration {
            Liveness::Expired
        } else {
            Liveness::MayBeAlive
        }
    }

    /// The incarnations that may be given buckets of an assignment in `mode`: seen renewing
    /// and advertising that they work in `mode`; plus `me` when given, unless our own Lease
    /// (as last seen) says we cannot.
    pub fn receivers(&self, me: Option<&str>, mode: &str, now: Instant) -> BTreeSet<String> {
        let mut receivers: BTreeSet<String> = self
            .members
            .values()
            .filter(|seen| seen.state.can_work_in(mode))
            .filter_map(|seen| seen.state.holder())
            .filter(|holder| self.liveness(holder, now) == Liveness::Renewing)
            .map(str::to_string)
            .collect();
        if let Some(me) = me {
            receivers.retain(|m| pod_of(m) != pod_of(me));
            let mine = self.members.get(pod_of(me)).map(|seen| &seen.state).filter(|s| s.holder() == Some(me));
            if mine.is_none_or(|state| state.can_work_in(mode)) {
                receivers.insert(me.to_string());
            }
        }
        receivers
    }

    /// The members that renew but may not be given buckets in `mode`, with why: for the
    /// `shards` command and the leader's log.
    pub fn idle(&self, mode: &str, now: Instant) -> BTreeMap<String, String> {
        let idle = self.members.values().filter_map(|seen| {
            let holder = seen.state.holder().filter(|h| self.liveness(h, now) == Liveness::Renewing)?;
            Some((holder.to_string(), seen.state.why_not_given(mode)?))
        });
        idle.collect()
    }

    /// Whether another pod holds a member Lease, as last seen (alive or not: a stale view
    /// cannot tell).
    pub fn has_others(&self, me: &str) -> bool {
        self.members.iter().any(|(pod, seen)| pod != pod_of(me) && !seen.deleted && seen.state.holder().is_some())
    }

    /// Whether a member of another pod than `me` holds its Lease and may be alive: when none
    /// does, `me` is the last of its install to leave.
    pub fn others_alive(&self, me: &str, now: Instant) -> bool {
        let others = self.members.iter().filter(|(pod, _)| pod.as_str() != pod_of(me));
        let holders = others.filter_map(|(_, seen)| seen.state.holder());
        holders.map(|h| self.liveness(h, now)).any(|l| matches!(l, Liveness::Renewing | Liveness::MayBeAlive))
    }

    /// The generation `incarnation` acknowledged, read from its own Lease.
    pub fn acked_generation(&self, incarnation: &str) -> Option<u64> {
        let seen = self.members.get(pod_of(incarnation))?;
        (seen.state.holder() == Some(incarnation)).then_some(seen.state.acked_generation).flatten()
    }

    /// Whether any member advertises a capacity.
    pub fn any_capacity(&self) -> bool {
        self.members.values().any(|m| m.state.capability.as_ref().is_some_and(|c| c.capacity.is_some()))
    }

    /// Whether every one of `members` reads split hash ranges.
    pub fn all_read_split_ranges(&self, members: &BTreeSet<String>) -> bool {
        let reading = self.members.values().filter(|m| {
            m.state.holder().is_some_and(|h| members.contains(h))
                && m.state.capability.as_ref().is_some_and(|c| c.reads_split_ranges)
        });
        reading.count() == members.len()
    }

    /// The capacities that `members` advertise, by incarnation; those without one are left out.
    pub fn capacities(&self, members: &BTreeSet<String>) -> crate::assignment::Capacities {
        let advertised = self.members.values().filter_map(|m| {
            let holder = m.state.holder()?;
            let capacity = m.state.capability.as_ref()?.capacity?;
            members.contains(holder).then(|| (holder.to_string(), capacity))
        });
        advertised.collect()
    }

    /// Each holder's latest report of what it holds, by incarnation.
    pub fn load_reports(&self) -> BTreeMap<String, Report> {
        let reports =
            self.members.values().filter_map(|m| Some((m.state.holder()?.to_string(), m.state.load.clone()?)));
        reports.collect()
    }

    /// The highest generation any member has seen or acknowledged: a floor for a new
    /// assignment's generation, which must never go back (it is every bucket's fencing epoch).
    pub fn highest_generation(&self) -> u64 {
        let generations = self.members.values().flat_map(|m| [m.state.acked_generation, m.state.seen_generation]);
        generations.flatten().max().unwrap_or(0)
    }

    /// The renewal `incarnation` was last seen making and when it was first seen, if it
    /// still holds its Lease and has not renewed for its lease duration.
    pub fn silent(&self, incarnation: &str, now: Instant) -> Option<String> {
        let seen = self.members.get(pod_of(incarnation))?;
        let quiet = now.saturating_duration_since(seen.last_change) >= seen.state.duration;
        (seen.state.holder() == Some(incarnation) && quiet).then(|| seen.state.renew_marker.clone().unwrap_or_default())
    }

    /// The lease duration `incarnation`'s Lease states.
    pub fn lease_duration(&self, incarnation: &str) -> Option<Duration> {
        Some(self.members.get(pod_of(incarnation))?.state.duration)
    }

    /// How long ago we saw `pod`'s Lease change. For our own Lease this tells whether our
    /// view is current: a stalled watch must not make everyone else look expired.
    pub fn since_last_change(&self, pod: &str, now: Instant) -> Option<Duration> {
        Some(now.saturating_duration_since(self.members.get(pod)?.last_change))
    }

    /// Pods whose Lease has not changed for `after`: left behind by pods that are gone.
    pub fn abandoned(&self, after: Duration, now: Instant) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, seen)| !seen.deleted && now.saturating_duration_since(seen.last_change) >= after)
            .map(|(pod, _)| pod.clone())
            .collect()
    }

    /// The renewal last seen on `pod`'s Lease.
    pub fn renew_marker(&self, pod: &str) -> Option<String> {
        self.members.get(pod)?.state.renew_marker.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn lease(holder: &str, renew: &str) -> LeaseState {
        LeaseState {
            holder: Some(holder.into()),
            renew_marker: Some(renew.into()),
            duration: S(15),
            acked_generation: None,
            seen_generation: None,
            uid: Some("uid-1".into()),
            load: None,
            capability: Some(Capability {
                mode: MODE.into(),
                version: "1".into(),
                not_working: None,
                capacity: None,
                reads_split_ranges: false,
            }),
        }
    }

    const MODE: &str = "labels";

    #[test]
    fn others_are_members_of_other_pods_holding_a_lease_as_last_seen() {
        let (mut table, t0) = (MemberTable::default(), Instant::now());
        table.observe("a", lease("a_1", "r1"), t0);
        assert!(!table.has_others("a_1"), "alone");
        table.observe("b", lease("b_1", "r1"), t0);
        assert!(table.has_others("a_1"), "b holds its Lease, however long ago it was seen renewing");
        table.observe("b", LeaseState { holder: Some(String::new()), ..lease("", "r2") }, t0 + S(1));
        assert!(!table.has_others("a_1"), "b released its Lease");
        table.observe("c", lease("c_1", "r1"), t0);
        table.deleted("c");
        assert!(!table.has_others("a_1"), "c's Lease is deleted");
    }

    #[test]
    fn incarnations_name_their_pod() {
        assert_eq!(pod_of(&incarnation("my-controller-0", "3f9a")), "my-controller-0");
        assert_eq!(pod_of("no-nonce"), "no-nonce");
    }

    #[test]
    fn liveness_over_time() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        assert_eq!(table.liveness("a_1", t0), Liveness::MayBeAlive, "first sight is not a renewal");
        assert!(table.receivers(None, MODE, t0).is_empty(), "a ghost gets nothing");
        table.observe("a", lease("a_1", "r1"), t0 + S(5));
        assert_eq!(table.liveness("a_1", t0 + S(5)), Liveness::MayBeAlive, "a relist is not a renewal");
        table.observe("a", lease("a_1", "r2"), t0 + S(6));
        assert_eq!(table.liveness("a_1", t0 + S(6)), Liveness::Renewing);
        assert_eq!(table.receivers(None, MODE, t0 + S(6)), BTreeSet::from(["a_1".to_string()]));
        assert_eq!(table.liveness("a_1", t0 + S(21)), Liveness::Expired, "no renewal for a lease duration");
        assert_eq!(table.silent("a_1", t0 + S(21)).as_deref(), Some("r2"));
        assert_eq!(table.silent("a_1", t0 + S(20)), None);
    }

    #[test]
    fn ranges_are_split_only_while_every_receiver_reads_them() {
        let t0 = Instant::now();
        let reading = |holder: &str, reads: bool| {
            let mut state = lease(holder, "r1");
            state.capability.as_mut().expect("advertised").reads_split_ranges = reads;
            state
        };
        let mut table = MemberTable::default();
        table.observe("a", reading("a_1", true), t0);
        table.observe("b", reading("b_1", true), t0);
        let both = BTreeSet::from(["a_1".to_string(), "b_1".to_string()]);
        assert!(table.all_read_split_ranges(&both));
        table.observe("b", reading("b_1", false), t0 + S(1));
        assert!(!table.all_read_split_ranges(&both), "b is of a version before split ranges");
        assert!(table.all_read_split_ranges(&BTreeSet::from(["a_1".to_string()])), "a receiver set without b");
        table.observe("b", reading("b_2", true), t0 + S(2));
        assert!(!table.all_read_split_ranges(&both), "b_1 is not b's holder any more: nobody says it reads them");
    }

    #[test]
    fn remote_timestamps_are_never_compared_with_our_clock() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "1999-01-01T00:00:00Z"), t0);
        table.observe("a", lease("a_1", "1999-01-01T00:00:01Z"), t0);
        table.observe("b", lease("b_1", "2999-01-01T00:00:00Z"), t0);
        table.observe("b", lease("b_1", "2999-01-01T00:00:01Z"), t0);
        assert_eq!(table.receivers(None, MODE, t0 + S(1)).len(), 2);
    }

    #[test]
    fn a_deleted_lease_is_unknown_until_it_would_have_expired() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        table.observe("a", lease("a_1", "r2"), t0 + S(1));
        table.deleted("a");
        assert_eq!(table.liveness("a_1", t0 + S(2)), Liveness::MayBeAlive, "never 'gone at once'");
        assert!(table.receivers(None, MODE, t0 + S(2)).is_empty(), "but given nothing more");
        assert_eq!(table.liveness("a_1", t0 + S(16)), Liveness::Expired);
    }

    #[test]
    fn a_new_incarnation_supersedes_the_old_and_releases_are_remembered() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        table.observe("a", lease("a_1", "r2"), t0 + S(1));
        table.observe("a", LeaseState { holder: Some(String::new()), ..lease("a_1", "r3") }, t0 + S(2));
        assert_eq!(table.liveness("a_1", t0 + S(2)), Liveness::Released);
        table.observe("a", lease("a_2", "r4"), t0 + S(3));
        assert_eq!(table.liveness("a_1", t0 + S(3)), Liveness::Released, "still known as released");
        assert_eq!(table.liveness("a_2", t0 + S(3)), Liveness::MayBeAlive);
        table.observe("a", lease("a_3", "r5"), t0 + S(4));
        assert_eq!(table.liveness("a_2", t0 + S(4)), Liveness::Released, "taken over on the same Lease");
        // Deleted and created again by another incarnation: that says nothing of the old one.
        table.deleted("a");
        table.observe("a", LeaseState { uid: Some("uid-2".into()), ..lease("a_4", "r6") }, t0 + S(5));
        assert_eq!(table.liveness("a_3", t0 + S(5)), Liveness::MayBeAlive, "unknown until it would have expired");
        assert_eq!(table.liveness("a_3", t0 + S(20)), Liveness::Expired);
    }

    #[test]
    fn acknowledgements_belong_to_the_holder_and_are_not_renewals() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        table.observe("a", LeaseState { acked_generation: Some(7), ..lease("a_1", "r1") }, t0 + S(14));
        assert_eq!(table.acked_generation("a_1"), Some(7));
        assert_eq!(table.acked_generation("a_0"), None, "not another incarnation's");
        assert_eq!(table.highest_generation(), 7);
        table.observe("b", LeaseState { seen_generation: Some(9), ..lease("b_1", "r1") }, t0);
        assert_eq!(table.highest_generation(), 9, "seen counts too: a live owner may hold epoch 9");
        assert_eq!(table.liveness("a_1", t0 + S(15)), Liveness::Expired);
    }

    #[test]
    fn load_reports_are_the_holders() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        let report = Report { generation: 3, counts: [(1, 2)].into() };
        table.observe("a", LeaseState { load: Some(report.clone()), ..lease("a_1", "r1") }, t0);
        table.observe(
            "b",
            LeaseState { holder: Some(String::new()), load: Some(report.clone()), ..lease("", "r1") },
            t0,
        );
        assert_eq!(
            table.load_reports(),
            BTreeMap::from([("a_1".to_string(), report)]),
            "a released lease reports nothing"
        );
    }

    #[test]
    fn me_is_a_receiver_and_replaces_my_pods_other_incarnations() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        table.observe("a", lease("a_1", "r2"), t0);
        assert_eq!(table.receivers(Some("a_2"), MODE, t0), BTreeSet::from(["a_2".to_string()]));
    }

    #[test]
    fn only_members_that_work_in_the_fleets_mode_receive_buckets() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        let with = |holder: &str, renew: &str, capability: Option<Capability>| LeaseState {
            capability,
            ..lease(holder, renew)
        };
        let works_in = |mode: &str| {
            Some(Capability {
                mode: mode.into(),
                version: "1".into(),
                not_working: None,
                capacity: None,
                reads_split_ranges: false,
            })
        };
        let broken =
            Some(Capability { not_working: Some("the watch of X is refused: 403".into()), ..works_in(MODE).unwrap() });
        for (pod, capability) in
            [("a", works_in(MODE)), ("b", works_in("shard-selector")), ("c", broken.clone()), ("d", None)]
        {
            table.observe(pod, with(&format!("{pod}_1"), "r1", capability.clone()), t0);
            table.observe(pod, with(&format!("{pod}_1"), "r2", capability), t0);
        }
        assert_eq!(table.receivers(None, MODE, t0), BTreeSet::from(["a_1".to_string()]));
        assert_eq!(table.receivers(None, "shard-selector", t0), BTreeSet::from(["b_1".to_string()]));
        let idle = table.idle(MODE, t0);
        assert_eq!(idle.keys().cloned().collect::<Vec<_>>(), ["b_1", "c_1", "d_1"]);
        assert!(idle["b_1"].contains("shard-selector mode"), "{idle:?}");
        assert!(idle["c_1"].contains("403"), "{idle:?}");
        // Our own Lease, once it says we cannot work, keeps us out too.
        assert!(!table.receivers(Some("c_1"), MODE, t0).contains("c_1"));
        assert!(table.receivers(Some("e_1"), MODE, t0).contains("e_1"), "not yet seen: we count ourselves in");
    }

    #[test]
    fn abandoned_leases_are_found_for_garbage_collection() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a_1", "r1"), t0);
        table.observe("b", lease("b_1", "r1"), t0 + S(100));
        assert_eq!(table.abandoned(S(150), t0 + S(200)), vec!["a".to_string()]);
    }
}
