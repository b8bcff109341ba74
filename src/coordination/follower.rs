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
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease::MemberLease;
use super::ownership::Ownership;
use super::{ASSIGNMENT_CONFIGMAP, ShardConfig};
use crate::runtime::parts::Buckets;
use crate::runtime::watch::SliceSelector;
use crate::sharding::assignment::Assignment;
use crate::sharding::bucket::{self, Bucket, Mode};
use crate::sharding::shard_range;
use crate::telemetry::admin::Health;
use crate::telemetry::audit::Audit;

/// The newest assignment this replica knows.
#[derive(Clone, Debug)]
pub struct Published {
    pub assignment: Assignment,
    /// `None` once the ConfigMap was seen deleted: the next write creates it.
    pub resource_version: Option<String>,
}

/// The newest assignment, shared by the follower and the lease (which read it) and the
/// leader (which writes it). It never goes back to an older generation.
pub struct AssignmentView {
    current: watch::Sender<Option<Published>>,
}

impl Default for AssignmentView {
    fn default() -> Self {
        Self { current: watch::channel(None).0 }
    }
}

impl AssignmentView {
    pub fn get(&self) -> Option<Published> {
        self.current.borrow().clone()
    }

    /// The newest assignment if its generation is above `generation` (cloned only then).
    pub fn newer_than(&self, generation: u64) -> Option<Published> {
        self.current.borrow().as_ref().filter(|p| p.assignment.generation > generation).cloned()
    }

    /// Keeps the newer of what we have and `assignment`.
    pub fn offer(&self, assignment: Assignment, resource_version: Option<String>) {
        self.current.send_if_modified(|current| {
            let newer = current.as_ref().is_none_or(|p| {
                assignment.generation > p.assignment.generation
                    || (assignment.generation == p.assignment.generation && p.resource_version != resource_version)
            });
            if newer {
                *current = Some(Published { assignment, resource_version });
            }
            newer
        });
    }

    /// The ConfigMap is gone: keep its content (and its generation, which must not go
    /// back), and create it anew at the next write.
    pub fn gone(&self) {
        self.current.send_if_modified(|current| match current {
            Some(p) if p.resource_version.is_some() => {
                p.resource_version = None;
                true
            }
            _ => false,
        });
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Published>> {
        self.current.subscribe()
    }
}

/// Records every assignment published in `configmaps` from now on, in order, until the
/// returned task is stopped (for tools and tests that follow the leader's steps).
pub fn record_published(
    configmaps: Api<ConfigMap>,
) -> (Arc<std::sync::Mutex<Vec<Assignment>>>, tokio::task::JoinHandle<()>) {
    let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let task = tokio::spawn({
        let recorded = recorded.clone();
        published(configmaps).for_each(move |assignment| {
            recorded.lock().unwrap_or_else(|p| p.into_inner()).push(assignment);
            std::future::ready(())
        })
    });
    (recorded, task)
}

/// Every assignment published in `configmaps` from now on, newer generations only (for tools
/// and tests that follow the leader's steps).
pub fn published(configmaps: Api<ConfigMap>) -> impl futures::Stream<Item = Assignment> + Send {
    let config = watcher::Config::default().fields(&format!("metadata.name={ASSIGNMENT_CONFIGMAP}"));
    let mut last = 0;
    watcher(configmaps, config).default_backoff().applied_objects().filter_map(move |event| {
        let newer = event.ok().as_ref().and_then(decode).map(|(a, _)| a).filter(|a| a.generation > last);
        if let Some(assignment) = &newer {
            last = assignment.generation;
        }
        std::future::ready(newer)
    })
}

pub fn decode(cm: &ConfigMap) -> Option<(Assignment, String)> {
    let data = cm.data.as_ref()?;
    match Assignment::decode(data) {
        Ok(assignment) => Some((assignment, cm.resource_version().unwrap_or_default())),
        Err(error) => {
            tracing::error!(%error, "the published assignment is malformed; keeping the previous one");
            None
        }
    }
}

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
        Mode::Labels => bucket::selector(owned).map(SliceSelector::Labels),
        Mode::ShardSelector => shard_range::selector(owned).map(SliceSelector::Shards),
    }
}

impl Follower {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        config: &ShardConfig,
        ownership: Arc<Ownership>,
        lease: Arc<MemberLease>,
        view: Arc<AssignmentView>,
        slice: watch::Sender<Option<Buckets>>,
        health: Arc<Health>,
        audit: Audit,
    ) -> Self {
        let configmaps = Api::namespaced(client, &config.namespace);
        Self { config: config.clone(), ownership, lease, view, configmaps, slice, health, audit, applied: 0 }
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
