//! Applies the published assignment to this replica.
//!
//! On every new assignment: take our buckets from it, re-target the watches at once (a
//! gained bucket is watched whatever still drains), and, once every bucket we lost has
//! drained, acknowledge the generation on our Lease, which lets the leader hand the lost
//! buckets on without waiting for the revocation to age.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::audit::Audit;
use super::lease::MemberLease;
use super::ownership::Ownership;
use super::published::{AssignmentView, decode};
use super::{Replica, ShardConfig};
use crate::bucket;
use sharded_runtime::health::Health;
use sharded_runtime::parts::Buckets;

/// Applies each newly published assignment to this replica.
pub struct Follower {
    config: ShardConfig,
    ownership: Arc<Ownership>,
    lease: Arc<MemberLease>,
    view: Arc<AssignmentView>,
    configmaps: Api<ConfigMap>,
    /// The slice our watches follow.
    slice: watch::Sender<Option<Buckets>>,
    health: Arc<Health>,
    audit: Audit,
    applied: u64,
}

impl Follower {
    /// Follows the assignment for `replica`, acknowledging on `lease`, and sends the buckets
    /// this replica owns to `slice`.
    pub fn new(
        client: Client,
        replica: &Replica,
        lease: Arc<MemberLease>,
        slice: watch::Sender<Option<Buckets>>,
        health: Arc<Health>,
        audit: Audit,
    ) -> Self {
        let Replica { config, ownership, view } = replica.clone();
        let configmaps = Api::namespaced(client, &config.namespace);
        Self { config, ownership, lease, view, configmaps, slice, health, audit, applied: 0 }
    }

    /// Follows the assignment until `stop`.
    pub async fn run(mut self, stop: CancellationToken) {
        let selector = format!("metadata.name={}", self.config.names.assignment_configmap);
        let mut events =
            watcher(self.configmaps.clone(), watcher::Config::default().fields(&selector)).default_backoff().boxed();
        let mut view = self.view.subscribe();
        let mut ownership = self.ownership.subscribe();
        loop {
            let waiting_for_drain = self.step();
            let wake = self.ownership.next_landing().unwrap_or_else(|| Instant::now() + self.config.retry_period);
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm))) => {
                        if let Some((assignment, rv)) = decode(&cm) {
                            self.view.offer(assignment, Some(rv));
                        }
                    }
                    Some(Ok(watcher::Event::Delete(_))) => {
                        tracing::warn!("the assignment ConfigMap was deleted; the leader publishes it again");
                        self.view.gone();
                    }
                    Some(Err(error)) => {
                        sharded_runtime::metrics::count_watch_error("ConfigMap");
                        tracing::warn!(%error, "assignment watch failed; retrying")
                    }
                    _ => {}
                },
                _ = view.changed() => {}
                // Reconciles ending matter only while a lost bucket drains.
                _ = ownership.changed(), if waiting_for_drain => {}
                _ = tokio::time::sleep_until(wake) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Applies the newest assignment; true while lost buckets are still draining.
    fn step(&mut self) -> bool {
        let mode = self.ownership.mode();
        if let Some(published) = self.view.newer_than(self.applied) {
            self.applied = published.assignment.generation;
            if published.assignment.mode != mode {
                tracing::warn!(
                    ours = mode.as_str(),
                    assignment = published.assignment.mode.as_str(),
                    "the assignment computes buckets in another sharding mode than this replica: owning nothing"
                );
            }
            let change = self.ownership.apply(&published.assignment);
            if !change.is_empty() {
                tracing::info!(
                    generation = self.applied,
                    released = change.released.len(),
                    acquired = change.acquired.len(),
                    "ownership changed"
                );
            }
        }
        let owned = self.ownership.owned();
        let next = next_steps(&Facts {
            applied: self.applied,
            watched: self.slice.borrow().as_ref(),
            owned: &owned,
            may_write: self.ownership.may_write(),
            acknowledgeable: self.ownership.acknowledgeable(),
            acknowledged: self.lease.acknowledged(),
        });
        if next.send_slice {
            self.audit.record("owned", &self.applied, &bucket::ranges(&owned));
            self.slice.send_replace(Some(owned));
        }
        self.health.set("assignment", next.ready);
        if let Some(generation) = next.acknowledge {
            self.lease.acknowledge(generation);
        }
        next.waiting_for_drain
    }
}

/// What the follower knows after applying the newest assignment to [`Ownership`].
struct Facts<'a> {
    /// The generation applied; 0 before the first assignment.
    applied: u64,
    /// The slice the watches follow.
    watched: Option<&'a Buckets>,
    owned: &'a Buckets,
    may_write: bool,
    /// The newest generation whose lost buckets have drained, if every one has.
    acknowledgeable: Option<u64>,
    /// The generation on our Lease.
    acknowledged: u64,
}

/// What the follower does about them.
#[derive(Debug, PartialEq, Eq)]
struct Steps {
    /// Send the owned buckets to the watches.
    send_slice: bool,
    /// The `assignment` readiness gate.
    ready: bool,
    /// Acknowledge this generation on our Lease.
    acknowledge: Option<u64>,
    /// Lost buckets still drain: wake when reconciles end.
    waiting_for_drain: bool,
}

fn next_steps(facts: &Facts) -> Steps {
    let assigned = facts.applied > 0;
    Steps {
        // Nothing is watched before the first assignment: until then we do not know our slice.
        send_slice: assigned && facts.watched != Some(facts.owned),
        // Ready only while we may write what the assignment gives us: closed again by a lapse.
        ready: assigned && facts.may_write,
        acknowledge: facts.acknowledgeable.filter(|generation| *generation > facts.acknowledged),
        waiting_for_drain: assigned && facts.acknowledgeable.is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts<'a>(applied: u64, watched: Option<&'a Buckets>, owned: &'a Buckets) -> Facts<'a> {
        Facts { applied, watched, owned, may_write: true, acknowledgeable: Some(applied), acknowledged: 0 }
    }

    #[test]
    fn nothing_is_watched_or_ready_before_the_first_assignment() {
        let none = Buckets::new();
        let steps = next_steps(&Facts { acknowledgeable: None, ..facts(0, None, &none) });
        let idle = Steps { send_slice: false, ready: false, acknowledge: None, waiting_for_drain: false };
        assert_eq!(steps, idle);
    }

    #[test]
    fn a_new_slice_goes_to_the_watches_once() {
        let (old, new) = (Buckets::from([1, 2]), Buckets::from([2, 3]));
        assert!(next_steps(&facts(4, None, &new)).send_slice, "the first slice");
        assert!(next_steps(&facts(5, Some(&old), &new)).send_slice, "a changed slice");
        assert!(!next_steps(&facts(5, Some(&new), &new)).send_slice, "the slice already watched");
        let empty = Buckets::new();
        assert!(next_steps(&facts(6, None, &empty)).send_slice, "an empty slice is a slice: watch nothing");
    }

    #[test]
    fn readiness_follows_the_right_to_write() {
        let owned = Buckets::from([1]);
        assert!(next_steps(&facts(3, Some(&owned), &owned)).ready);
        let lapsed = Facts { may_write: false, ..facts(3, Some(&owned), &owned) };
        assert!(!next_steps(&lapsed).ready, "a lapsed lease closes the gate again");
    }

    #[test]
    fn a_generation_is_acknowledged_once_its_lost_buckets_drained() {
        let owned = Buckets::from([1]);
        let draining = Facts { acknowledgeable: None, acknowledged: 6, ..facts(7, Some(&owned), &owned) };
        assert_eq!(next_steps(&draining).acknowledge, None);
        assert!(next_steps(&draining).waiting_for_drain, "wakes when a reconcile ends");
        let drained = Facts { acknowledgeable: Some(7), acknowledged: 6, ..facts(7, Some(&owned), &owned) };
        assert_eq!(next_steps(&drained).acknowledge, Some(7));
        assert!(!next_steps(&drained).waiting_for_drain);
        let done = Facts { acknowledgeable: Some(7), acknowledged: 7, ..facts(7, Some(&owned), &owned) };
        assert_eq!(next_steps(&done).acknowledge, None, "already on the Lease");
    }
}
