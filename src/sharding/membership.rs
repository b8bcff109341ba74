//! Who is alive, judged from lease renewals observed *locally*.
//!
//! A member is alive while its lease's `renewTime` has changed within its
//! `leaseDurationSeconds`, as timed by our own monotonic clock from the moment we saw the
//! change. We never compare a remote timestamp with our clock, so clock offsets between
//! nodes do not matter; only clock rates do. Pure: `now` is an argument.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

/// What one member lease says, as read from the API server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseState {
    /// Empty once the member released its lease (graceful shutdown).
    pub holder: Option<String>,
    /// `spec.renewTime` as written: only compared for change, never with our clock.
    pub renew_marker: Option<String>,
    pub duration: Duration,
    /// The assignment generation the member has applied (see `assignment`).
    pub acked_generation: Option<u64>,
}

#[derive(Clone, Debug)]
struct Observed {
    state: LeaseState,
    last_change: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberStatus {
    Alive,
    /// No renewal seen for a lease duration.
    Expired,
    /// The member gave its lease up.
    Released,
}

#[derive(Default)]
pub struct MemberTable {
    members: BTreeMap<String, Observed>,
}

impl MemberTable {
    pub fn observe(&mut self, member: &str, state: LeaseState, now: Instant) {
        match self.members.get_mut(member) {
            Some(seen) if seen.state.renew_marker == state.renew_marker && seen.state.holder == state.holder => {
                seen.state = state; // an ack or a duration change is not a renewal
            }
            _ => {
                self.members.insert(member.to_string(), Observed { state, last_change: now });
            }
        }
    }

    pub fn remove(&mut self, member: &str) {
        self.members.remove(member);
    }

    pub fn status(&self, member: &str, now: Instant) -> MemberStatus {
        match self.members.get(member) {
            None => MemberStatus::Released,
            Some(seen) if seen.state.holder.as_deref().is_none_or(str::is_empty) => MemberStatus::Released,
            Some(seen) if now.saturating_duration_since(seen.last_change) >= seen.state.duration => {
                MemberStatus::Expired
            }
            Some(_) => MemberStatus::Alive,
        }
    }

    pub fn alive(&self, now: Instant) -> BTreeSet<String> {
        self.members.keys().filter(|m| self.status(m, now) == MemberStatus::Alive).cloned().collect()
    }

    pub fn acked_generation(&self, member: &str) -> Option<u64> {
        self.members.get(member)?.state.acked_generation
    }

    /// How long ago we saw `member`'s lease change. For our own lease this tells whether
    /// our view is current: a stalled watch must not make everyone else look expired.
    pub fn since_last_change(&self, member: &str, now: Instant) -> Option<Duration> {
        Some(now.saturating_duration_since(self.members.get(member)?.last_change))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renew: &str) -> LeaseState {
        LeaseState {
            holder: Some(holder.into()),
            renew_marker: Some(renew.into()),
            duration: Duration::from_secs(15),
            acked_generation: None,
        }
    }

    #[test]
    fn alive_until_no_renewal_is_seen_for_a_lease_duration() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a", "r1"), t0);
        assert_eq!(table.status("a", t0 + Duration::from_secs(14)), MemberStatus::Alive);
        // The same renewal seen again (a relist) does not extend the lease.
        table.observe("a", lease("a", "r1"), t0 + Duration::from_secs(10));
        assert_eq!(table.status("a", t0 + Duration::from_secs(15)), MemberStatus::Expired);
        table.observe("a", lease("a", "r2"), t0 + Duration::from_secs(16));
        assert_eq!(table.status("a", t0 + Duration::from_secs(30)), MemberStatus::Alive);
    }

    #[test]
    fn remote_timestamps_are_never_compared_with_our_clock() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        // A renewTime far in the past or future means nothing; only its change does.
        table.observe("a", lease("a", "1999-01-01T00:00:00Z"), t0);
        table.observe("b", lease("b", "2999-01-01T00:00:00Z"), t0);
        assert_eq!(table.alive(t0 + Duration::from_secs(1)), BTreeSet::from(["a".to_string(), "b".to_string()]));
    }

    #[test]
    fn released_and_removed_members_are_gone_at_once() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a", "r1"), t0);
        table.observe("b", lease("b", "r1"), t0);
        table.observe("a", LeaseState { holder: Some(String::new()), ..lease("a", "r2") }, t0);
        table.remove("b");
        assert_eq!(table.status("a", t0), MemberStatus::Released);
        assert!(table.alive(t0).is_empty());
    }

    #[test]
    fn acks_are_tracked_without_counting_as_renewals() {
        let t0 = Instant::now();
        let mut table = MemberTable::default();
        table.observe("a", lease("a", "r1"), t0);
        table.observe("a", LeaseState { acked_generation: Some(7), ..lease("a", "r1") }, t0 + Duration::from_secs(14));
        assert_eq!(table.acked_generation("a"), Some(7));
        assert_eq!(table.status("a", t0 + Duration::from_secs(15)), MemberStatus::Expired);
    }
}
