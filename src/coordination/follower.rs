//! Applies the published assignment to this replica.
//!
//! On every new assignment: take our buckets from it, re-target the watches at once (a
//! gained bucket is watched whatever still drains), and, once every bucket we lost has
//! drained, acknowledge the generation on our Lease, which lets the leader hand the lost
//! buckets on without waiting for the revocation to age.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease::MemberLease;
use super::ownership::Ownership;
use super::published::{AssignmentView, decode};
use super::{ASSIGNMENT_CONFIGMAP, Replica, ShardConfig};
use crate::runtime::parts::{Buckets, SliceSelector};
use crate::sharding::bucket::{self, Bucket, Mode};
use crate::sharding::shard_range;
use crate::telemetry::admin::Health;
use crate::telemetry::audit::Audit;

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

/// What our watches ask the API server for, to see `owned`.
pub fn slice_selector(mode: Mode, owned: &BTreeSet<Bucket>) -> Option<SliceSelector> {
    match mode {
        Mode::Labels => bucket::selector(super::BUCKET_LABEL, owned).map(SliceSelector::Labels),
        Mode::ShardSelector => shard_range::selector(owned).map(SliceSelector::Shards),
    }
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

    pub async fn run(mut self, stop: CancellationToken) {
        let selector = format!("metadata.name={ASSIGNMENT_CONFIGMAP}");
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
                        crate::telemetry::metrics::count_watch_error("ConfigMap");
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
        // Nothing is watched before the first assignment: until then we do not know our slice.
        if self.applied > 0 && self.slice.borrow().as_ref() != Some(&owned) {
            self.audit.record("owned", &self.applied, &bucket::ranges(&owned));
            self.slice.send_replace(Some(owned));
        }
        // Ready only while we may write what the assignment gives us: closed again by a lapse.
        self.health.set("assignment", self.applied > 0 && self.ownership.may_write());
        match self.ownership.acknowledgeable() {
            Some(generation) => {
                if generation > self.lease.acknowledged() {
                    self.lease.acknowledge(generation);
                }
                false
            }
            None => self.applied > 0,
        }
    }
}
