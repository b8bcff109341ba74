//! Watches the member Leases into a [`MemberTable`], timing renewals by our own clock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Names, READS_SPLIT_RANGES};
use crate::counts::Report;
use crate::membership::{Capability, LeaseState, MemberTable};
use sharded_runtime::health::Health;
use sharded_runtime::watch_stall;

/// The member table, kept by a watch of the member Leases.
pub struct Members {
    table: Mutex<MemberTable>,
    changed: watch::Sender<u64>,
    /// Set once the first list is complete: before that, absent members are unknown.
    synced: AtomicBool,
}

impl Default for Members {
    fn default() -> Self {
        Self { table: Mutex::default(), changed: watch::channel(0).0, synced: AtomicBool::new(false) }
    }
}

impl Members {
    /// Runs the watch until the stream ends (it retries with backoff, so: never). Each watch
    /// asks the server to end it after `watch_timeout`, and one silent longer fails and starts
    /// again (`sharded_runtime::watch_stall`): a stalled watch recovers once its path does.
    pub async fn watch(
        &self,
        client: Client,
        namespace: &str,
        names: &Names,
        health: &Health,
        watch_timeout: Duration,
    ) {
        let leases = Api::<Lease>::namespaced(watch_stall::limited(client, watch_timeout), namespace);
        let config = watch_stall::watcher_config(watch_timeout);
        let mut events = watcher(leases, config).default_backoff().boxed();
        while let Some(event) = events.next().await {
            let now = Instant::now();
            match event {
                Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                    if let Some(pod) = lease.name_any().strip_prefix(names.member_lease_prefix) {
                        self.lock().observe(pod, lease_state(&lease, names), now);
                    }
                }
                Ok(watcher::Event::Delete(lease)) => {
                    if let Some(pod) = lease.name_any().strip_prefix(names.member_lease_prefix) {
                        self.lock().deleted(pod);
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    self.synced.store(true, Ordering::Release);
                    health.ready("members");
                }
                Ok(watcher::Event::Init) => {}
                Err(error) => {
                    sharded_runtime::metrics::count_watch_error("Lease");
                    tracing::warn!(%error, "member lease watch failed; retrying")
                }
            }
            self.changed.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Runs `f` on the table.
    pub fn with<T>(&self, f: impl FnOnce(&MemberTable) -> T) -> T {
        f(&self.lock())
    }

    /// Changes with every event of the watch.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Whether the watch has listed every member Lease.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemberTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the membership needs of a member Lease.
pub fn lease_state(lease: &Lease, names: &Names) -> LeaseState {
    let spec = lease.spec.clone().unwrap_or_default();
    let annotations = lease.annotations();
    let capability = annotations.get(names.mode_annotation).map(|mode| Capability {
        mode: mode.clone(),
        version: annotations.get(names.version_annotation).cloned().unwrap_or_default(),
        not_working: annotations.get(names.not_working_annotation).cloned(),
        // Malformed: no bound, as from a version that advertised none.
        capacity: annotations.get(names.capacity_annotation).and_then(|c| c.parse().ok()),
        reads_split_ranges: annotations.get(names.ranges_annotation).is_some_and(|r| r == READS_SPLIT_RANGES),
    });
    LeaseState {
        holder: spec.holder_identity,
        // Compared for change only; the serialized form is as good as any.
        renew_marker: spec.renew_time.map(|t| serde_json::to_string(&t).unwrap_or_default()),
        duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64),
        acked_generation: lease.annotations().get(names.ack_annotation).and_then(|g| g.parse().ok()),
        seen_generation: lease.annotations().get(names.seen_annotation).and_then(|g| g.parse().ok()),
        uid: lease.uid(),
        // A malformed report only costs balancing by objects: treated as none.
        load: lease.annotations().get(names.load_annotation).and_then(|r| Report::decode(r).ok()),
        capability,
    }
}
