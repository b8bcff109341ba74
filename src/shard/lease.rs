//! This replica's own Lease, through kube-leader-election's `LeaseLock`.
//!
//! Only this replica ever writes its member Lease, so the lock is never contended and the
//! library's unconditional patches are safe here. Safety never rests on the library: the
//! renewal's start time goes to [`Ownership::renewed`], and ownership ends by the local
//! clock at the renew deadline whether or not a renewal is still hanging.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube_leader_election::{LeaseLock, LeaseLockParams, LeaseLockResult};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::ownership::Ownership;
use super::{ACK_ANNOTATION, ShardConfig};
use crate::telemetry::metrics as m;

pub struct MemberLease {
    lock: LeaseLock,
    leases: Api<Lease>,
    name: String,
    config: ShardConfig,
    ownership: Arc<Ownership>,
}

impl MemberLease {
    pub fn new(client: Client, config: &ShardConfig, ownership: Arc<Ownership>) -> Self {
        let name = config.member_lease_name();
        let params = LeaseLockParams {
            lease_name: name.clone(),
            holder_id: config.identity.clone(),
            lease_ttl: config.lease_duration,
        };
        Self {
            lock: LeaseLock::new(client.clone(), &config.namespace, params),
            leases: Api::namespaced(client, &config.namespace),
            name,
            config: config.clone(),
            ownership,
        }
    }

    /// Renews every retry period until `stop`.
    pub async fn keep(&self, stop: CancellationToken) {
        loop {
            let started = Instant::now();
            match tokio::time::timeout(self.config.renew_deadline, self.lock.try_acquire_or_renew()).await {
                Ok(Ok(LeaseLockResult::Acquired(_))) => self.ownership.renewed(started),
                Ok(Ok(_)) => tracing::error!(lease = %self.name, "member lease is held by someone else"),
                Ok(Err(error)) => tracing::warn!(%error, "renewing the member lease failed"),
                Err(_) => tracing::warn!("renewing the member lease timed out"),
            }
            m::set_lease_held(self.ownership.lease_valid());
            tokio::select! {
                _ = tokio::time::sleep(self.config.retry_period) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Records on the Lease that every bucket not owned in `generation` is drained.
    pub async fn acknowledge(&self, generation: u64) -> kube::Result<()> {
        let patch = serde_json::json!({ "metadata": { "annotations": { ACK_ANNOTATION: generation.to_string() } } });
        let params = PatchParams::default();
        let patch = Patch::Merge(&patch);
        let call = self.leases.patch(&self.name, &params, &patch);
        match tokio::time::timeout(self.config.renew_deadline, call).await {
            Ok(result) => result.map(|_| ()),
            Err(_) => Err(kube::Error::Service("acknowledging the assignment timed out".into())),
        }
    }

    /// Gives the Lease up, so the others take over at once instead of waiting for expiry.
    pub async fn release(&self) {
        match tokio::time::timeout(Duration::from_secs(5), self.lock.step_down()).await {
            Ok(Ok(())) => tracing::info!(lease = %self.name, "member lease released"),
            Ok(Err(error)) => tracing::warn!(%error, "releasing the member lease failed; others wait for it to expire"),
            Err(_) => tracing::warn!("releasing the member lease timed out; others wait for it to expire"),
        }
        m::set_lease_held(false);
    }
}
