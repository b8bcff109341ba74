//! Leader election and the leader's singleton duties.
//!
//! The leader is elected with kube-leader-election's `LeaseLock`. That library can let two
//! candidates believe they won for a moment, so nothing here relies on a single leader:
//! - publishing the assignment is a write with a resourceVersion precondition, so a stale
//!   or second leader's write fails instead of overwriting;
//! - labelling a policy with its bucket writes the same value whoever does it.
//!
//! A leader also stops leading at its renew deadline, by its own clock, and decides that
//! others expired only while its view of the member Leases is current (it sees its own
//! renewals arriving), so a stalled watch cannot make everyone else look dead.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PartialObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use kube_leader_election::{LeaseLock, LeaseLockParams, LeaseLockResult};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::follower::AssignmentView;
use super::members::Members;
use super::ownership::Ownership;
use super::{ASSIGNMENT_CONFIGMAP, LEADER_LEASE, ShardConfig};
use crate::api::ApplicationTrafficPolicy;
use crate::sharding::assignment::{Assignment, plan};
use crate::sharding::bucket::{BUCKET_LABEL, bucket_of, label_value};
use crate::telemetry::metrics as m;

pub struct Leader {
    client: Client,
    lock: LeaseLock,
    config: ShardConfig,
    ownership: Arc<Ownership>,
    members: Arc<Members>,
    view: Arc<AssignmentView>,
    configmaps: Api<ConfigMap>,
}

impl Leader {
    pub fn new(
        client: Client,
        config: &ShardConfig,
        ownership: Arc<Ownership>,
        members: Arc<Members>,
        view: Arc<AssignmentView>,
    ) -> Self {
        let params = LeaseLockParams {
            lease_name: LEADER_LEASE.into(),
            holder_id: config.identity.clone(),
            lease_ttl: config.lease_duration,
        };
        Self {
            lock: LeaseLock::new(client.clone(), &config.namespace, params),
            configmaps: Api::namespaced(client.clone(), &config.namespace),
            client,
            config: config.clone(),
            ownership,
            members,
            view,
        }
    }

    /// Campaigns and leads until `stop`; returns whether we were leading at the end.
    pub async fn run(&self, stop: CancellationToken) -> bool {
        let mut leading_until: Option<Instant> = None;
        let mut next_attempt = Instant::now();
        let mut labeler: Option<tokio::task::JoinHandle<()>> = None;
        let mut last_tick = Instant::now();
        loop {
            let now = Instant::now();
            if now >= next_attempt {
                next_attempt = now + self.config.retry_period;
                // Only a member whose own lease is valid may lead.
                if self.ownership.lease_valid() {
                    match tokio::time::timeout(self.config.renew_deadline, self.lock.try_acquire_or_renew()).await {
                        Ok(Ok(LeaseLockResult::Acquired(_))) => leading_until = Some(now + self.config.renew_deadline),
                        Ok(Ok(_)) => leading_until = None,
                        Ok(Err(error)) => tracing::debug!(%error, "leader election attempt failed"),
                        Err(_) => tracing::debug!("leader election attempt timed out"),
                    }
                }
            }
            let leading = self.leading(leading_until);
            m::set_leader(leading);
            if leading {
                if labeler.is_none() {
                    tracing::info!("became the leader");
                    let (client, namespace) = (self.client.clone(), self.config.watch_namespace.clone());
                    labeler = Some(tokio::spawn(label_unlabeled_policies(client, namespace)));
                }
                self.publish(None, now.saturating_duration_since(last_tick)).await;
            } else if let Some(task) = labeler.take() {
                tracing::info!("no longer the leader");
                task.abort();
            }
            last_tick = now;
            tokio::select! {
                _ = tokio::time::sleep_until(next_attempt) => {}
                _ = self.members.changed().notified() => {}
                _ = self.view.changed().notified() => {}
                _ = stop.cancelled() => {
                    if let Some(task) = labeler.take() {
                        task.abort();
                    }
                    return self.leading(leading_until);
                }
            }
        }
    }

    fn leading(&self, leading_until: Option<Instant>) -> bool {
        leading_until.is_some_and(|t| Instant::now() < t) && self.ownership.lease_valid()
    }

    /// On graceful shutdown, after our member lease is released: give our buckets away
    /// ourselves, then step down, so nobody waits for a new election.
    pub async fn hand_over(&self) {
        self.publish(Some(&self.config.identity), Duration::ZERO).await;
        match tokio::time::timeout(Duration::from_secs(5), self.lock.step_down()).await {
            Ok(Ok(())) => tracing::info!("stepped down as leader"),
            Ok(Err(error)) => tracing::warn!(%error, "stepping down failed"),
            Err(_) => tracing::warn!("stepping down timed out"),
        }
        m::set_leader(false);
    }

    /// Plans the next assignment from the members we see and publishes it.
    async fn publish(&self, leaving: Option<&str>, elapsed: Duration) {
        let now = Instant::now();
        let me = &self.config.identity;
        let (mut alive, acked, view_current) = self.members.with(|table| {
            let alive = table.alive(now);
            let acked: BTreeMap<String, u64> =
                alive.iter().filter_map(|m| Some((m.clone(), table.acked_generation(m)?))).collect();
            let current = table.since_last_change(me, now).is_some_and(|d| d < self.config.renew_deadline);
            (alive, acked, current)
        });
        if !view_current || !self.members.synced() {
            tracing::debug!("member view is incomplete or stale; not judging anyone expired");
            return;
        }
        if let Some(member) = leaving {
            alive.remove(member);
        }
        m::set_members_alive(alive.len());
        let (current, resource_version) = match self.view.get() {
            Some((assignment, rv)) => (assignment, Some(rv)),
            None => (Assignment::default(), None),
        };
        m::record_unowned(current.unowned(&alive), elapsed);
        let Some(next) = plan(&current, &alive, |member| acked.get(member).copied()) else {
            return;
        };
        self.write(&next, resource_version, &alive).await;
    }

    async fn write(&self, next: &Assignment, resource_version: Option<String>, alive: &BTreeSet<String>) {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(ASSIGNMENT_CONFIGMAP.into()),
                namespace: Some(self.config.namespace.clone()),
                resource_version: resource_version.clone(),
                ..Default::default()
            },
            data: Some(next.encode()),
            ..Default::default()
        };
        let result = match resource_version {
            Some(_) => match self.configmaps.replace(ASSIGNMENT_CONFIGMAP, &PostParams::default(), &cm).await {
                // Deleted by someone: publish it again, keeping the generation count.
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    let mut cm = cm;
                    cm.metadata.resource_version = None;
                    self.configmaps.create(&PostParams::default(), &cm).await
                }
                other => other,
            },
            None => self.configmaps.create(&PostParams::default(), &cm).await,
        };
        match result {
            Ok(written) => {
                tracing::info!(generation = next.generation, unowned = next.unowned(alive), "published assignment");
                self.view.offer(next.clone(), written.resource_version().unwrap_or_default());
            }
            // Someone wrote first (a newer view, or another leader): re-plan from the watch.
            Err(kube::Error::Api(s)) if s.code == 409 => tracing::debug!("assignment changed meanwhile; re-planning"),
            Err(error) => tracing::warn!(%error, "publishing the assignment failed"),
        }
    }
}

/// Labels every policy that has no bucket label yet. Runs while leading; the selector
/// makes the API server send only unlabelled policies, so this costs nothing at rest.
async fn label_unlabeled_policies(client: Client, namespace: Option<String>) {
    let api: Api<PartialObjectMeta<ApplicationTrafficPolicy>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let config = watcher::Config::default().labels(&format!("!{BUCKET_LABEL}"));
    let events = watcher(api, config).default_backoff();
    // Labels are independent writes: several in flight, so a burst of new policies is not
    // held up behind one request at a time. Failures are retried every second.
    let retry: Mutex<BTreeSet<(String, String)>> = Mutex::default();
    let label_all = events.for_each_concurrent(LABEL_CONCURRENCY, |event| async {
        match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                let key = (p.namespace().unwrap_or_default(), p.name_any());
                if !label(&client, &key).await {
                    retry.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
                }
            }
            Err(error) => tracing::warn!(%error, "unlabelled-policy watch failed; retrying"),
            _ => {}
        }
    });
    let retry_failed = async {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let keys = std::mem::take(&mut *retry.lock().unwrap_or_else(|e| e.into_inner()));
            for key in keys {
                if !label(&client, &key).await {
                    retry.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
                }
            }
        }
    };
    tokio::select! {
        () = label_all => {}
        () = retry_failed => {}
    }
}

/// Label patches in flight at once while leading.
const LABEL_CONCURRENCY: usize = 16;

/// True when labelled (or gone).
async fn label(client: &Client, (namespace, name): &(String, String)) -> bool {
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    let patch = serde_json::json!({ "metadata": { "labels": { BUCKET_LABEL: label_value(bucket_of(namespace)) } } });
    match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {
            m::count_bucket_label();
            true
        }
        Err(kube::Error::Api(s)) if s.code == 404 => true,
        Err(error) => {
            tracing::warn!(%error, policy = %format!("{namespace}/{name}"), "labelling failed; retrying");
            false
        }
    }
}
