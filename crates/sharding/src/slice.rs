//! What one replica may work on, and when it may say it let go: the pure state behind
//! the program's ownership tracking, with time passed in.
//!
//! The rules, each a method here:
//! - A bucket may be written only while it is `Owned` by us in the newest assignment we
//!   know, *and* we are within `renew_deadline` of the start of a renewal cycle: a lease
//!   renewal followed by a quorum read of the assignment ([`Slice::confirm`]). So a
//!   revocation written at `t` is either read by our next cycle, or our right to write
//!   ends by `t + renew_deadline` (see docs/sharding.md).
//! - A bucket we lose is *undrained* until no reconcile of it runs and no write of it can
//!   still land: a write abandoned unanswered may land until its bound has passed.
//! - We acknowledge a generation only when nothing is undrained.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::assignment::{Assignment, Epoch};
use super::bucket::{Bucket, Mode};
use super::bucket_id::BucketIds;

/// What applying an assignment changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub released: BTreeSet<Bucket>,
    pub acquired: BTreeSet<Bucket>,
}

impl Change {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.released.is_empty() && self.acquired.is_empty()
    }
}

/// What one replica may write now: its buckets with their epochs, its lease, its reconciles in
/// flight.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    me: String,
    /// How this process computes buckets; an assignment of another mode gives it nothing.
    mode: Mode,
    renew_deadline: Duration,
    /// The generation of the assignment `owned` was taken from.
    generation: u64,
    /// How buckets are named here; `owned` and everything below are by [`BucketIds`].
    ids: BucketIds,
    owned: BTreeMap<Bucket, Epoch>,
    /// Writes are allowed until then: the deadline of the last confirmed renewal cycle.
    valid_until: Option<Instant>,
    /// Our lease is ours until then (the renew deadline of the last renewal), whether or
    /// not the assignment could be read: leading needs this, writing needs `valid_until`.
    lease_until: Option<Instant>,
    in_flight: BTreeMap<Bucket, usize>,
    /// Released buckets not yet drained.
    undrained: BTreeSet<Bucket>,
    /// Per bucket, until when an abandoned write may still land.
    landing: BTreeMap<Bucket, Instant>,
    /// Shutting down: nothing is taken (back) from an assignment any more.
    leaving: bool,
}

impl Slice {
    /// Incarnation `me`'s slice, empty.
    pub fn new(me: &str, mode: Mode, renew_deadline: Duration) -> Self {
        Self {
            me: me.to_string(),
            mode,
            renew_deadline,
            generation: 0,
            ids: BucketIds::new(mode),
            owned: BTreeMap::new(),
            valid_until: None,
            lease_until: None,
            in_flight: BTreeMap::new(),
            undrained: BTreeSet::new(),
            landing: BTreeMap::new(),
            leaving: false,
        }
    }

    /// Takes our buckets from `assignment`, unless we know a newer one.
    pub fn apply(&mut self, assignment: &Assignment) -> Change {
        if assignment.generation < self.generation || self.leaving {
            return Change::default();
        }
        self.generation = assignment.generation;
        if assignment.mode == self.mode {
            self.ids.adopt(&assignment.ranges);
        }
        let owned = assignment.owned_by(&self.me, self.mode);
        self.replace(owned.into_iter().map(|(bucket, epoch)| (self.ids.id(bucket), epoch)).collect())
    }

    /// How buckets are named now, in `owned` and by the runtime.
    pub fn ids(&self) -> &BucketIds {
        &self.ids
    }

    /// A renewal cycle that started at `started` completed: the lease write succeeded and
    /// the quorum read that followed it returned `fresh`.
    pub fn confirm(&mut self, started: Instant, fresh: &Assignment) -> Change {
        let change = self.apply(fresh);
        self.renewed(started);
        if self.leaving {
            return change;
        }
        let until = started + self.renew_deadline;
        if self.valid_until.is_none_or(|t| t < until) {
            self.valid_until = Some(until);
        }
        change
    }

    /// A lease renewal that started at `started` succeeded (the assignment read may not).
    pub fn renewed(&mut self, started: Instant) {
        let until = started + self.renew_deadline;
        if self.lease_until.is_none_or(|t| t < until) {
            self.lease_until = Some(until);
        }
    }

    /// Gives every bucket up for good (shutdown): later assignments give nothing back.
    pub fn release_all(&mut self) -> Change {
        self.leaving = true;
        self.replace(BTreeMap::new())
    }

    fn replace(&mut self, owned: BTreeMap<Bucket, Epoch>) -> Change {
        let released: BTreeSet<Bucket> = self.owned.keys().filter(|b| !owned.contains_key(b)).copied().collect();
        let acquired: BTreeSet<Bucket> = owned.keys().filter(|b| !self.owned.contains_key(b)).copied().collect();
        self.undrained.extend(&released);
        // A bucket given back while draining is ours again, in-flight work included.
        self.undrained.retain(|b| !owned.contains_key(b));
        self.owned = owned;
        Change { released, acquired }
    }

    /// Whether our member Lease is ours at `now`.
    pub fn lease_valid(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|t| now < t)
    }

    /// Whether a confirmed renewal cycle lets us write at `now`.
    pub fn may_write(&self, now: Instant) -> bool {
        self.valid_until.is_some_and(|t| now < t)
    }

    /// The epoch to stamp on a write of `bucket`, while we may write it.
    pub fn permit(&self, bucket: Bucket, now: Instant) -> Option<Epoch> {
        if !self.may_write(now) {
            return None;
        }
        self.owned.get(&bucket).copied()
    }

    /// Registers a reconcile of `bucket`; its epoch, or `None` when it is not ours.
    pub fn begin(&mut self, bucket: Bucket, now: Instant) -> Option<Epoch> {
        let epoch = self.permit(bucket, now)?;
        *self.in_flight.entry(bucket).or_default() += 1;
        Some(epoch)
    }

    /// A reconcile of `bucket` that [`Slice::begin`] admitted ended.
    pub fn end(&mut self, bucket: Bucket) {
        if let Some(count) = self.in_flight.get_mut(&bucket) {
            *count -= 1;
            if *count == 0 {
                self.in_flight.remove(&bucket);
            }
        }
    }

    /// A write of `bucket` was given up unanswered: it may still land until `until`.
    pub fn abandoned(&mut self, bucket: Bucket, until: Instant) {
        let at = self.landing.entry(bucket).or_insert(until);
        *at = (*at).max(until);
    }

    /// Until when a write of `bucket` given up unanswered may still land, if that is not past
    /// at `now`. A newer write of the bucket waits until then: sent before, it could be
    /// overtaken by the late one, and the object go back (same epoch, so no fence refuses it).
    pub fn landing(&self, bucket: Bucket, now: Instant) -> Option<Instant> {
        self.landing.get(&bucket).copied().filter(|until| now <= *until)
    }

    /// Drops from the undrained set what has drained by `now`; true when nothing is left. A
    /// write may land up to its bound, inclusive, so it has drained only once that has passed
    /// (the model checker found an acknowledgement at the very instant a write could land).
    pub fn drain(&mut self, now: Instant) -> bool {
        self.landing.retain(|_, until| *until >= now);
        let (in_flight, landing) = (&self.in_flight, &self.landing);
        self.undrained.retain(|b| in_flight.contains_key(b) || landing.contains_key(b));
        self.undrained.is_empty()
    }

    /// When the next abandoned write's bound has passed (just after it), if one is pending.
    pub fn next_landing(&self) -> Option<Instant> {
        self.landing.values().min().map(|until| *until + Duration::from_millis(1))
    }

    /// The generation to acknowledge: everything it took from us has drained.
    pub fn acknowledgeable(&mut self, now: Instant) -> Option<u64> {
        (self.drain(now) && self.generation > 0).then_some(self.generation)
    }

    /// The buckets owned now.
    pub fn owned(&self) -> BTreeSet<Bucket> {
        self.owned.keys().copied().collect()
    }

    /// The generation of the assignment applied last.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::Slot;
    use crate::hash_ranges::{HashRanges, Ranges, by_hash};

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn assignment(generation: u64, mine: &[(Bucket, Epoch)]) -> Assignment {
        let mut a = Assignment { generation, ..Default::default() };
        for (b, e) in mine {
            a.slots[usize::from(*b)] = Slot::Owned { member: "me_1".into(), epoch: *e };
        }
        a
    }

    #[test]
    fn writes_need_a_confirmed_cycle_and_end_at_its_deadline() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.apply(&assignment(1, &[(1, 1)]));
        assert_eq!(slice.permit(1, t0), None, "no renewal cycle yet");
        slice.confirm(t0, &assignment(1, &[(1, 1)]));
        assert_eq!(slice.permit(1, t0 + S(9)), Some(1));
        assert_eq!(slice.permit(1, t0 + S(10)), None, "fail-stop at the deadline, noticed or not");
        assert_eq!(slice.permit(2, t0), None);
    }

    #[test]
    fn a_revocation_read_in_a_cycle_ends_the_right_at_once() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1), (2, 1)]));
        let change = slice.confirm(t0 + S(2), &assignment(2, &[(2, 1)]));
        assert_eq!(change.released, BTreeSet::from([1]));
        assert_eq!(slice.permit(1, t0 + S(2)), None);
        assert_eq!(slice.permit(2, t0 + S(11)), Some(1), "the deadline moved with the cycle");
    }

    #[test]
    fn older_assignments_are_ignored() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(5, &[]));
        assert!(slice.apply(&assignment(4, &[(1, 4)])).is_empty(), "a stale watch event");
        assert_eq!(slice.permit(1, t0), None);
    }

    #[test]
    fn drained_only_when_no_reconcile_runs_and_no_abandoned_write_can_land() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1)]));
        assert_eq!(slice.begin(1, t0), Some(1));
        slice.apply(&assignment(2, &[]));
        assert_eq!(slice.acknowledgeable(t0), None, "a reconcile of bucket 1 still runs");
        slice.abandoned(1, t0 + S(5));
        slice.end(1);
        assert_eq!(slice.acknowledgeable(t0 + S(4)), None, "an abandoned write may still land");
        assert_eq!(slice.acknowledgeable(t0 + S(5)), None, "up to its bound, inclusive");
        assert_eq!(slice.acknowledgeable(t0 + S(5) + Duration::from_millis(1)), Some(2));
    }

    #[test]
    fn a_newer_write_waits_until_an_abandoned_one_can_no_longer_land() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1), (2, 1)]));
        assert_eq!(slice.landing(1, t0), None, "nothing abandoned");
        slice.abandoned(1, t0 + S(5));
        slice.abandoned(1, t0 + S(3));
        let cases = [
            (1, t0, Some(t0 + S(5)), "the latest bound of the bucket's abandoned writes"),
            (1, t0 + S(5), Some(t0 + S(5)), "up to its bound, inclusive"),
            (1, t0 + S(5) + Duration::from_millis(1), None, "past it"),
            (2, t0, None, "another bucket writes on"),
        ];
        for (bucket, at, expected, case) in cases {
            assert_eq!(slice.landing(bucket, at), expected, "{case}");
        }
        assert_eq!(slice.permit(1, t0), Some(1), "the bucket stays ours meanwhile");
    }

    #[test]
    fn a_bucket_given_back_while_draining_is_ours_again() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1)]));
        slice.begin(1, t0);
        slice.apply(&assignment(2, &[]));
        slice.apply(&assignment(3, &[(1, 3)]));
        assert_eq!(slice.acknowledgeable(t0), Some(3));
        assert_eq!(slice.permit(1, t0), Some(3), "with its new epoch");
    }

    #[test]
    fn after_release_all_nothing_is_taken_back() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1)]));
        slice.begin(1, t0);
        slice.abandoned(1, t0 + S(5));
        slice.end(1);
        slice.release_all();
        assert!(slice.confirm(t0 + S(1), &assignment(1, &[(1, 1)])).is_empty(), "a renewal cycle during shutdown");
        assert_eq!(slice.permit(1, t0 + S(1)), None);
        assert!(!slice.drain(t0 + S(1)), "the abandoned write still counts");
        assert!(slice.drain(t0 + S(5) + Duration::from_millis(1)));
    }

    #[test]
    fn a_lapse_keeps_the_slice_but_refuses_writes_until_a_cycle_confirms_it() {
        let t0 = Instant::now();
        let mut slice = Slice::new("me_1", Mode::Labels, S(10));
        slice.confirm(t0, &assignment(1, &[(1, 1)]));
        assert!(!slice.lease_valid(t0 + S(30)));
        slice.renewed(t0 + S(29));
        assert!(slice.lease_valid(t0 + S(30)), "renewed, but the assignment could not be read");
        assert_eq!(slice.permit(1, t0 + S(30)), None, "so no writes");
        assert_eq!(slice.owned(), BTreeSet::from([1]), "watches and caches stay");
        let change = slice.confirm(t0 + S(30), &assignment(1, &[(1, 1)]));
        assert!(change.is_empty());
        assert_eq!(slice.permit(1, t0 + S(31)), Some(1));
    }

    /// A replica that missed the revocation before a change of ranges, and reads an
    /// assignment that gives it the changed bucket again, lets go of the old range.
    #[test]
    fn a_bucket_whose_range_changed_unseen_is_lost_and_gained() {
        let t0 = Instant::now();
        let namespaces = (1..=20).map(|n| (format!("team-{n}"), 100)).collect();
        let split = Ranges::new(HashRanges::uniform().split(&by_hash(&namespaces)));
        let changed = *HashRanges::uniform().changed(&split).first().expect("a split");
        let unchanged = (0..1024).find(|b| !HashRanges::uniform().changed(&split).contains(b)).expect("most");
        let mut slice = Slice::new("me_1", Mode::ShardSelector, S(10));
        let with_mode = |a: Assignment| Assignment { mode: Mode::ShardSelector, ..a };
        slice.confirm(t0, &with_mode(assignment(1, &[(changed, 1), (unchanged, 1)])));
        slice.begin(changed, t0);
        let after = Assignment { ranges: split, ..with_mode(assignment(5, &[(changed, 5), (unchanged, 1)])) };
        let change = slice.confirm(t0 + S(1), &after);
        let new_id = slice.ids().id(changed);
        assert_ne!(new_id, changed);
        assert_eq!(change, Change { released: BTreeSet::from([changed]), acquired: BTreeSet::from([new_id]) });
        assert_eq!(slice.permit(changed, t0 + S(1)), None, "nothing cached under the old range may be written");
        assert_eq!(slice.permit(new_id, t0 + S(1)), Some(5));
        assert_eq!(slice.permit(unchanged, t0 + S(1)), Some(1), "an unchanged bucket stays as it was");
        assert!(!slice.drain(t0 + S(1)), "the reconcile under the old range still drains");
    }
}
