//! What this replica may write right now: the pure [`Slice`] behind a lock, with a change
//! signal, and the per-reconcile [`InFlight`] registration that drains count.
//!
//! Every write asks [`InFlight::permit`] just before it is sent, and stamps the epoch it
//! returns. The answer is `None` from the moment the renew deadline of the last confirmed
//! renewal cycle passes, even if no task noticed yet: a replica frozen by SIGSTOP checks
//! the clock when it resumes.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::ObjectMeta;
use tokio::sync::watch;
use tokio::time::Instant;

use super::epoch_floor::{BLOCK, EPOCH_LIMIT};
use super::metrics as m;
use crate::assignment::{Assignment, Epoch};
use crate::bucket::{Bucket, Mode};
use crate::bucket_id::{BucketId, BucketIds};
use crate::slice::{Change, Slice};

/// What this replica may write now, shared by the follower, the Lease and every reconcile.
pub struct Ownership {
    slice: Mutex<Slice>,
    /// Bumped on every change: the owned set, a confirmation, a reconcile ending.
    changed: watch::Sender<u64>,
    write_bound: Duration,
    mode: Mode,
    /// The highest fencing token found stored on an object (in a refusal of our write).
    token_found: AtomicU64,
}

impl Ownership {
    /// Nothing owned yet.
    pub fn new(incarnation: &str, mode: Mode, renew_deadline: Duration, write_bound: Duration) -> Arc<Self> {
        let (changed, _) = watch::channel(0);
        let slice = Mutex::new(Slice::new(incarnation, mode, renew_deadline));
        Arc::new(Self { slice, changed, write_bound, mode, token_found: AtomicU64::new(0) })
    }

    /// How this process computes buckets.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Takes our buckets from an assignment seen on the watch.
    pub fn apply(&self, assignment: &Assignment) -> Change {
        self.update(|slice| slice.apply(assignment))
    }

    /// A renewal cycle that started at `started` read `fresh` with a quorum read.
    pub fn confirm(&self, started: Instant, fresh: &Assignment) -> Change {
        self.update(|slice| slice.confirm(started, fresh))
    }

    /// A lease renewal that started at `started` succeeded, but the assignment could not
    /// be read: we may lead, not write.
    pub fn renewed(&self, started: Instant) {
        self.lock().renewed(started);
        self.notify();
    }

    /// Gives up every bucket (shutdown).
    pub fn release_all(&self) -> Change {
        self.update(Slice::release_all)
    }

    fn update(&self, f: impl FnOnce(&mut Slice) -> Change) -> Change {
        let (change, owned) = {
            let mut slice = self.lock();
            let change = f(&mut slice);
            (change, slice.owned().len())
        };
        m::set_buckets_owned(owned);
        m::count_handoffs(change.released.len(), change.acquired.len());
        self.notify();
        change
    }

    /// Whether our member Lease is ours now (leading needs it).
    pub fn lease_valid(&self) -> bool {
        self.lock().lease_valid(Instant::now())
    }

    /// Whether a renewal cycle has confirmed our right to write, and it has not lapsed.
    pub fn may_write(&self) -> bool {
        self.lock().may_write(Instant::now())
    }

    /// Registers a reconcile of `bucket`; `None` when the bucket is not ours to write.
    pub fn begin(self: &Arc<Self>, bucket: Bucket) -> Option<InFlight> {
        let epoch = self.lock().begin(bucket, Instant::now())?;
        Some(InFlight { ownership: self.clone(), bucket, epoch })
    }

    /// The buckets owned now.
    pub fn owned(&self) -> BTreeSet<Bucket> {
        self.lock().owned()
    }

    /// The generation to acknowledge once everything it took from us has drained.
    pub fn acknowledgeable(&self) -> Option<u64> {
        self.lock().acknowledgeable(Instant::now())
    }

    /// The generation of the assignment applied last.
    pub fn generation(&self) -> u64 {
        self.lock().generation()
    }

    /// The highest generation we know was granted: the assignment's, or a token found on an
    /// object, whichever is higher. The member Lease advertises it, and a leader that knows
    /// less revokes every bucket and grants above it (`assignment::starting_point`). A token
    /// above every generation the leader knows means the floor on the CRD was lost (a
    /// `kubectl replace`, a restore) or another install wrote: either way no epoch of ours
    /// below it can write that object again.
    pub fn seen(&self) -> u64 {
        self.generation().max(self.token_found.load(Ordering::Relaxed))
    }

    /// A write was refused because the object holds fencing token `token`. A token within a
    /// block of the end of the epoch space is not taken as seen: granting above it would leave
    /// no epoch for any later failover, so it stays a conflict of that object alone.
    pub fn found_token(&self, token: u64) {
        if token >= EPOCH_LIMIT - BLOCK {
            tracing::warn!(
                token,
                "an object holds a fencing token at the end of the epoch space; not granting above it"
            );
            return;
        }
        let generation = self.generation();
        let before = self.token_found.fetch_max(token, Ordering::Relaxed);
        // Also a deposed owner's, whose view lags its successor's epoch: the leader judges.
        if token > generation && token > before {
            tracing::info!(
                token,
                generation,
                "an object holds a fencing token above the assignment's generation we follow; telling the leader"
            );
        }
    }

    /// The generation of the assignment we follow, what it gives us and how buckets are
    /// named under it, read together.
    pub fn owned_at(&self) -> (u64, BTreeSet<BucketId>, BucketIds) {
        let slice = self.lock();
        (slice.generation(), slice.owned(), slice.ids().clone())
    }

    /// How buckets are named now.
    pub fn ids(&self) -> BucketIds {
        self.lock().ids().clone()
    }

    /// The ID of an object's bucket now (see [`BucketIds::of_meta`]).
    pub fn id_of_meta(&self, meta: &ObjectMeta, bucket_label: &str) -> Option<BucketId> {
        self.lock().ids().of_meta(meta, bucket_label)
    }

    /// The ID of the bucket of `namespace`'s objects now.
    pub fn id_of_namespace(&self, namespace: &str) -> BucketId {
        self.lock().ids().of_namespace(namespace)
    }

    /// When an abandoned write's bound passes next: a drain may complete then.
    pub fn next_landing(&self) -> Option<Instant> {
        self.lock().next_landing()
    }

    /// Waits until every released bucket has drained, or `timeout` passes.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut changed = self.subscribe();
        loop {
            let now = Instant::now();
            if self.lock().drain(now) {
                return true;
            }
            let wake = self.next_landing().map_or(deadline, |t| t.min(deadline));
            if now >= deadline || tokio::time::timeout_at(wake, changed.changed()).await.is_ok_and(|r| r.is_err()) {
                return self.lock().drain(Instant::now());
            }
        }
    }

    /// Changes with every assignment applied, renewal and reconcile that ends.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slice> {
        self.slice.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A reconcile in flight for a bucket; dropping it lets a drain proceed.
pub struct InFlight {
    ownership: Arc<Ownership>,
    pub bucket: Bucket,
    pub epoch: Epoch,
}

impl InFlight {
    /// The epoch to stamp on a write about to be sent, while the bucket is still ours at
    /// the epoch this reconcile started with.
    pub fn permit(&self) -> Option<Epoch> {
        self.ownership.lock().permit(self.bucket, Instant::now()).filter(|e| *e == self.epoch)
    }

    /// How long until a write of this bucket that was given up unanswered can no longer
    /// land, if one still may (see [`Slice::landing`]).
    pub fn landing_in(&self) -> Option<Duration> {
        let now = Instant::now();
        let until = self.ownership.lock().landing(self.bucket, now)?;
        Some(until + Duration::from_millis(1) - now)
    }

    /// The longest one write may take (client and server side).
    pub fn write_bound(&self) -> Duration {
        self.ownership.write_bound
    }

    /// A write of this bucket was refused because the object holds fencing token `token`.
    pub fn found_token(&self, token: u64) {
        self.ownership.found_token(token);
    }

    /// A write sent at `sent` was given up unanswered: the server may have received it just
    /// before we gave up and still apply it a write bound later.
    pub fn abandoned(&self, sent: Instant) {
        self.ownership.lock().abandoned(self.bucket, sent + self.ownership.write_bound * 2);
        self.ownership.notify();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.ownership.lock().end(self.bucket);
        self.ownership.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::Slot;

    fn mine(generation: u64, buckets: &[Bucket]) -> Assignment {
        let mut a = Assignment { generation, ..Default::default() };
        for b in buckets {
            a.slots[usize::from(*b)] = Slot::Owned { member: "me_1".into(), epoch: generation };
        }
        a
    }

    #[tokio::test(start_paused = true)]
    async fn writes_end_at_the_deadline_without_anyone_noticing() {
        let o = Ownership::new("me_1", Mode::Labels, Duration::from_secs(10), Duration::from_secs(5));
        o.confirm(Instant::now(), &mine(1, &[1, 2]));
        let in_flight = o.begin(1).unwrap();
        assert_eq!(in_flight.permit(), Some(1));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(in_flight.permit(), None, "fail-stop at the deadline");
        assert!(o.begin(2).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_reconciles_and_abandoned_writes() {
        let o = Ownership::new("me_1", Mode::Labels, Duration::from_secs(10), Duration::from_secs(5));
        o.confirm(Instant::now(), &mine(1, &[1, 2]));
        let in_flight = o.begin(1).unwrap();
        o.apply(&mine(2, &[2]));
        assert_eq!(in_flight.permit(), None, "a lost bucket stops at once");
        assert!(!o.drained(Duration::from_millis(50)).await);
        in_flight.abandoned(Instant::now());
        drop(in_flight);
        assert!(!o.drained(Duration::from_secs(1)).await, "the abandoned write may still land");
        assert!(!o.drained(Duration::from_secs(5)).await, "for up to twice the write bound");
        assert!(o.drained(Duration::from_secs(5)).await);
        assert_eq!(o.acknowledgeable(), Some(2));
    }
}
