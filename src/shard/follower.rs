//! Applies the published assignment to this replica.
//!
//! On every new assignment (and whenever the lease's validity changes): set the owned
//! buckets, wait for in-flight reconciles of released buckets to finish, re-target the
//! watches, and acknowledge the generation on our Lease, which is what lets the leader
//! hand released buckets to their next owner.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease::MemberLease;
use super::ownership::Ownership;
use super::{ASSIGNMENT_CONFIGMAP, ShardConfig};
use crate::sharding::assignment::Assignment;
use crate::sharding::bucket;
use crate::telemetry::audit::Audit;

/// The newest assignment this replica knows, with its resourceVersion, shared by the
/// follower (which reads it from the watch) and the leader (which writes it).
#[derive(Default)]
pub struct AssignmentView {
    state: Mutex<Option<(Assignment, String)>>,
    changed: Notify,
}

impl AssignmentView {
    pub fn get(&self) -> Option<(Assignment, String)> {
        self.lock().clone()
    }

    /// Keeps the newer of what we have and `assignment`.
    pub fn offer(&self, assignment: Assignment, resource_version: String) {
        let mut state = self.lock();
        if state.as_ref().is_none_or(|(current, _)| assignment.generation >= current.generation) {
            *state = Some((assignment, resource_version));
            drop(state);
            self.changed.notify_waiters();
        }
    }

    pub fn changed(&self) -> &Notify {
        &self.changed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Assignment, String)>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
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
    selector: watch::Sender<Option<String>>,
    /// Whether a selector was published yet; the first one is sent even if empty.
    published: bool,
    /// Released buckets whose in-flight reconciles have not been seen to finish.
    undrained: BTreeSet<crate::sharding::bucket::Bucket>,
    acked: Option<u64>,
    audit: Audit,
}

impl Follower {
    pub fn new(
        client: Client,
        config: &ShardConfig,
        ownership: Arc<Ownership>,
        lease: Arc<MemberLease>,
        view: Arc<AssignmentView>,
        selector: watch::Sender<Option<String>>,
        audit: Audit,
    ) -> Self {
        let configmaps = Api::namespaced(client, &config.namespace);
        Self {
            config: config.clone(),
            ownership,
            lease,
            view,
            configmaps,
            selector,
            published: false,
            undrained: BTreeSet::new(),
            acked: None,
            audit,
        }
    }

    pub async fn run(mut self, stop: CancellationToken) {
        let selector = format!("metadata.name={ASSIGNMENT_CONFIGMAP}");
        let mut events =
            watcher(self.configmaps.clone(), watcher::Config::default().fields(&selector)).default_backoff().boxed();
        loop {
            // Wake at the renew deadline to fail-stop on time; once past it, a renewal wakes us.
            let later = Instant::now() + self.config.retry_period;
            let wake_at = self.ownership.valid_until().filter(|t| *t > Instant::now()).unwrap_or(later);
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm))) => {
                        if let Some((assignment, rv)) = decode(&cm) {
                            self.view.offer(assignment, rv);
                        }
                    }
                    Some(Err(error)) => tracing::warn!(%error, "assignment watch failed; retrying"),
                    _ => {}
                },
                _ = self.view.changed().notified() => {}
                _ = self.ownership.changed().notified() => {}
                _ = tokio::time::sleep_until(wake_at) => {}
                _ = tokio::time::sleep(self.config.retry_period) => {}
                _ = stop.cancelled() => return,
            }
            let after_lapse = self.ownership.take_needs_fresh_assignment();
            if after_lapse && !self.read_fresh().await {
                // Without a fresh read, own nothing and try again.
                self.ownership.require_fresh_assignment();
                continue;
            }
            self.apply(after_lapse).await;
        }
    }

    /// After a lapse, a quorum read: the watch may still hold an older assignment. True
    /// when the view now holds what the API server has.
    async fn read_fresh(&self) -> bool {
        match self.configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await {
            Ok(Some(cm)) => match decode(&cm) {
                Some((assignment, rv)) => {
                    self.view.offer(assignment, rv);
                    true
                }
                None => false,
            },
            Ok(None) => false,
            Err(error) => {
                tracing::warn!(%error, "reading the assignment failed");
                false
            }
        }
    }

    async fn apply(&mut self, after_lapse: bool) {
        let assignment = self.view.get().map(|(a, _)| a);
        let valid = self.ownership.lease_valid();
        let owned = match (&assignment, valid) {
            (Some(a), true) => a.owned_by(&self.config.identity),
            _ => BTreeSet::new(),
        };
        let (released, acquired) = self.ownership.set_owned(owned.clone());
        self.undrained.extend(released.iter().copied());
        if !released.is_empty() || !acquired.is_empty() || !self.published || after_lapse {
            let generation = assignment.as_ref().map_or(0, |a| a.generation);
            self.audit.record("owned", &generation, &bucket::ranges(&owned));
            tracing::info!(
                released = released.len(),
                acquired = acquired.len(),
                owned = owned.len(),
                "ownership changed"
            );
        }
        // Buckets we gave up may not be acknowledged while a reconcile of theirs still runs,
        // however long that takes: the acknowledgement is what lets another replica start.
        let undrained: BTreeSet<_> = self.undrained.difference(&owned).copied().collect();
        if !undrained.is_empty() && !self.ownership.drained(&undrained, self.config.drain_timeout).await {
            tracing::warn!("in-flight reconciles of released buckets are still running; not acknowledging yet");
            self.undrained = undrained;
            return;
        }
        self.undrained.clear();
        let selector = bucket::selector(&owned);
        let first = !std::mem::replace(&mut self.published, true);
        self.selector.send_if_modified(|current| {
            let changed = first || *current != selector;
            *current = selector;
            changed
        });
        if let Some(assignment) = assignment
            && valid
            && self.acked != Some(assignment.generation)
        {
            match self.lease.acknowledge(assignment.generation).await {
                Ok(()) => self.acked = Some(assignment.generation),
                Err(error) => tracing::warn!(%error, "acknowledging the assignment failed; retrying"),
            }
        }
    }
}
