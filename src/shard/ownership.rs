//! What this replica may work on right now: the buckets the published assignment gives
//! it, and only while its own lease is valid by its local clock.
//!
//! Reconciles ask [`Ownership::begin`] before starting and [`Ownership::owns`] before every
//! write. Both fail from the moment the renew deadline passes (fail-stop), even if no task
//! noticed yet: a replica frozen by SIGSTOP checks the clock when it resumes. A lapse also
//! clears the owned set, so after a late renewal nothing is owned until a fresh assignment
//! is applied. In-flight reconciles are counted per bucket so a moved bucket can be
//! drained before it is released.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sharding::bucket::Bucket;
use crate::telemetry::metrics as m;

pub struct Ownership {
    state: Mutex<State>,
    changed: Notify,
    renew_deadline: Duration,
}

#[derive(Default)]
struct State {
    owned: BTreeSet<Bucket>,
    /// Start of the last successful renewal of our lease.
    last_renewal: Option<Instant>,
    /// Set by a lapse: the owned set must come from a freshly read assignment.
    needs_fresh_assignment: bool,
    in_flight: BTreeMap<Bucket, usize>,
}

impl State {
    fn valid_at(&self, now: Instant, deadline: Duration) -> bool {
        self.last_renewal.is_some_and(|t| now.saturating_duration_since(t) < deadline)
    }
}

impl Ownership {
    pub fn new(renew_deadline: Duration) -> Arc<Self> {
        Arc::new(Self { state: Mutex::new(State::default()), changed: Notify::new(), renew_deadline })
    }

    pub fn owns(&self, bucket: Bucket) -> bool {
        let state = self.lock();
        state.valid_at(Instant::now(), self.renew_deadline) && state.owned.contains(&bucket)
    }

    pub fn lease_valid(&self) -> bool {
        self.lock().valid_at(Instant::now(), self.renew_deadline)
    }

    /// When the lease stops being valid unless renewed again.
    pub fn valid_until(&self) -> Option<Instant> {
        self.lock().last_renewal.map(|t| t + self.renew_deadline)
    }

    /// Registers a reconcile of `bucket`; `None` when the bucket is not ours.
    pub fn begin(self: &Arc<Self>, bucket: Bucket) -> Option<InFlight> {
        let mut state = self.lock();
        if !(state.valid_at(Instant::now(), self.renew_deadline) && state.owned.contains(&bucket)) {
            return None;
        }
        *state.in_flight.entry(bucket).or_default() += 1;
        Some(InFlight { ownership: self.clone(), bucket })
    }

    /// Records a successful renewal that started at `started`. If the deadline passed before
    /// it *completed* (now), the replica fail-stopped meanwhile, and the leader may have
    /// moved its buckets: everything owned is dropped, to be re-read from the assignment.
    pub fn renewed(&self, started: Instant) {
        let mut state = self.lock();
        if !state.valid_at(Instant::now(), self.renew_deadline) && state.last_renewal.is_some() {
            tracing::warn!("lease lapsed past the renew deadline: dropped every bucket (fail-stop)");
            state.owned.clear();
            state.needs_fresh_assignment = true;
        }
        if state.last_renewal.is_none_or(|t| t < started) {
            state.last_renewal = Some(started);
        }
        m::set_lease_held(true);
        drop(state);
        self.changed.notify_waiters();
    }

    /// True once after a lapse: the caller must apply a freshly read assignment.
    pub fn take_needs_fresh_assignment(&self) -> bool {
        std::mem::take(&mut self.lock().needs_fresh_assignment)
    }

    /// The fresh read failed: own nothing, and ask again.
    pub fn require_fresh_assignment(&self) {
        let mut state = self.lock();
        state.owned.clear();
        state.needs_fresh_assignment = true;
    }

    /// Replaces the owned set; returns (released, acquired).
    pub fn set_owned(&self, owned: BTreeSet<Bucket>) -> (BTreeSet<Bucket>, BTreeSet<Bucket>) {
        let mut state = self.lock();
        let released: BTreeSet<Bucket> = state.owned.difference(&owned).copied().collect();
        let acquired: BTreeSet<Bucket> = owned.difference(&state.owned).copied().collect();
        state.owned = owned;
        m::set_buckets_owned(state.owned.len());
        m::count_handoffs(released.len(), acquired.len());
        (released, acquired)
    }

    pub fn owned(&self) -> BTreeSet<Bucket> {
        self.lock().owned.clone()
    }

    /// Waits until no reconcile of `buckets` is in flight, or `timeout` passes.
    pub async fn drained(&self, buckets: &BTreeSet<Bucket>, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if buckets.iter().all(|b| !self.lock().in_flight.contains_key(b)) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Notified on renewals and when reconciles finish.
    pub fn changed(&self) -> &Notify {
        &self.changed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A reconcile in flight for a bucket; dropping it lets a drain proceed.
pub struct InFlight {
    ownership: Arc<Ownership>,
    pub bucket: Bucket,
}

impl InFlight {
    /// Whether the bucket is still ours; checked before every write.
    pub fn still_owned(&self) -> bool {
        self.ownership.owns(self.bucket)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.ownership.lock();
        if let Some(count) = state.in_flight.get_mut(&self.bucket) {
            *count -= 1;
            if *count == 0 {
                state.in_flight.remove(&self.bucket);
            }
        }
        drop(state);
        self.ownership.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn ownership_ends_at_the_renew_deadline_without_anyone_noticing() {
        let o = Ownership::new(Duration::from_secs(10));
        o.renewed(Instant::now());
        o.set_owned(BTreeSet::from([1, 2]));
        assert!(o.owns(1) && !o.owns(3));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(o.owns(1));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!o.owns(1), "fail-stop at the deadline");
        assert!(o.begin(1).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_renewal_does_not_revive_old_buckets() {
        let o = Ownership::new(Duration::from_secs(10));
        o.renewed(Instant::now());
        o.set_owned(BTreeSet::from([1]));
        tokio::time::advance(Duration::from_secs(30)).await; // frozen
        o.renewed(Instant::now());
        assert!(o.lease_valid());
        assert!(!o.owns(1), "must wait for a fresh assignment");
        assert!(o.take_needs_fresh_assignment());
        assert!(!o.take_needs_fresh_assignment());
    }

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_in_flight_reconciles() {
        let o = Ownership::new(Duration::from_secs(10));
        o.renewed(Instant::now());
        o.set_owned(BTreeSet::from([1, 2]));
        let in_flight = o.begin(1).unwrap();
        let (released, _) = o.set_owned(BTreeSet::from([2]));
        assert!(!in_flight.still_owned());
        assert!(!o.drained(&released, Duration::from_millis(50)).await);
        drop(in_flight);
        assert!(o.drained(&released, Duration::from_millis(50)).await);
    }
}
