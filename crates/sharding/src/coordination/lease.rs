//! This incarnation's member Lease, and the renewal cycle that gives it the right to write.
//!
//! Every write of the Lease is a compare-and-swap on its resourceVersion, so two processes
//! with one pod name cannot both hold it: the holder is the incarnation, and a newcomer
//! takes the Lease over only once it is released, or after it has seen the holder's
//! renewal unchanged for a lease duration by its own clock (as client-go judges expiry).
//! kube-leader-election is not used here because it renews for any process whose holder
//! name matches and patches without a precondition.
//!
//! A renewal cycle is: renew the Lease, then read the assignment with a quorum read. Only a
//! completed cycle extends the right to write ([`Ownership::confirm`]); see
//! `sharding::slice` for why that makes a revocation safe without waiting for expiry.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::load::LoadReport;
use super::metrics as m;
use super::ownership::Ownership;
use super::published::{AssignmentView, decode};
use super::{READS_SPLIT_RANGES, Replica, ShardConfig};
use sharded_runtime::watch_health::WatchHealth;

/// Renewal cycles in a row that could not read the assignment before a member says it
/// cannot work: it would hold its slice without being able to act on it.
const FAILED_READS_BEFORE_NOT_WORKING: u32 = 3;

/// Why a renewal did not happen.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    #[error("the member lease is held by {0}, which is still renewing it")]
    HeldByOther(String),
    #[error("the member lease changed meanwhile (another process wrote it)")]
    Conflict,
    #[error("renewing the member lease timed out")]
    Timeout,
    #[error(transparent)]
    Api(#[from] kube::Error),
}

/// This incarnation's member Lease: its renewal cycles, acknowledgements and release.
pub struct MemberLease {
    leases: Api<Lease>,
    configmaps: Api<ConfigMap>,
    name: String,
    config: ShardConfig,
    ownership: Arc<Ownership>,
    view: Arc<AssignmentView>,
    /// What we hold per bucket, carried to the leader with every renewal.
    load: Arc<LoadReport>,
    /// The generation to acknowledge on the Lease; a change triggers a renewal at once.
    ack: watch::Sender<u64>,
    /// Another holder's renewal, as first seen.
    foreign: Mutex<ForeignHold>,
    /// Whether the watches of our slice work: refused ones make us give the slice up.
    watch_health: Arc<WatchHealth>,
    /// Renewal cycles in a row whose read of the assignment failed.
    failed_reads: AtomicU32,
}

impl MemberLease {
    /// The Lease of `replica`, carrying `load` and saying when `watch_health` finds the watches
    /// broken.
    pub fn new(client: Client, replica: &Replica, load: Arc<LoadReport>, watch_health: Arc<WatchHealth>) -> Self {
        let Replica { config, ownership, view } = replica.clone();
        Self {
            leases: Api::namespaced(client.clone(), &config.namespace),
            configmaps: Api::namespaced(client, &config.namespace),
            name: config.member_lease_name(),
            config,
            ownership,
            view,
            load,
            ack: watch::channel(0).0,
            foreign: Mutex::default(),
            watch_health,
            failed_reads: AtomicU32::new(0),
        }
    }

    /// Why this replica cannot do its work, if it cannot: advertised on the Lease, where the
    /// leader reads it and gives the slice to others.
    fn not_working(&self) -> Option<String> {
        not_working(self.watch_health.broken(), self.failed_reads.load(Ordering::Relaxed))
    }

    /// Runs renewal cycles every retry period (and at once for a new acknowledgement) until `stop`.
    pub async fn keep(&self, stop: CancellationToken) {
        let mut ack = self.ack.subscribe();
        let mut said: Option<String> = None;
        m::set_working(true);
        loop {
            let not_working = self.not_working();
            if not_working != said {
                match &not_working {
                    Some(why) => tracing::error!(%why, "cannot do this replica's work: giving the slice up"),
                    None => tracing::info!("working again: the leader may give this replica buckets"),
                }
                m::set_working(not_working.is_none());
                said = not_working;
            }
            self.cycle().await;
            // A refused or stalled watch is probed again (a list of one object and a short
            // watch), on a task of its own so that it never delays a renewal: a replica that gave
            // its slice up watches nothing, so nothing else would tell it that the fault ended.
            if self.watch_health.broken().is_some() {
                self.watch_health.probe_in_background();
            }
            // "Held" means a renewal cycle confirmed our right to write: a replica whose renewals land
            // but whose cycles never complete in time shows 0 here, and the lease alert fires.
            m::set_lease_held(self.ownership.may_write());
            tokio::select! {
                _ = tokio::time::sleep(self.config.retry_period) => {}
                _ = ack.changed() => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    async fn cycle(&self) {
        let started = Instant::now();
        match tokio::time::timeout(self.config.renew_deadline, self.renew()).await.unwrap_or(Err(RenewError::Timeout)) {
            Ok(()) => m::count_lease_renewal("renewed"),
            Err(error @ RenewError::HeldByOther(_)) => {
                m::count_lease_renewal("held_by_other");
                tracing::warn!(%error, incarnation = %self.config.incarnation, "waiting for the member lease");
                return;
            }
            Err(error) => {
                m::count_lease_renewal("failed");
                tracing::warn!(%error, "renewing the member lease failed");
                return;
            }
        }
        // The quorum read that completes the cycle: only now may the deadline move.
        let read = tokio::time::timeout(
            self.config.renew_deadline,
            self.configmaps.get_opt(self.config.names.assignment_configmap),
        )
        .await;
        match read {
            Ok(Ok(_)) => self.failed_reads.store(0, Ordering::Relaxed),
            _ => drop(self.failed_reads.fetch_add(1, Ordering::Relaxed)),
        }
        match read {
            Ok(Ok(Some(cm))) => match decode(&cm) {
                Some((assignment, rv)) => {
                    self.ownership.confirm(started, &assignment);
                    self.view.offer(assignment, Some(rv));
                }
                None => self.ownership.renewed(started),
            },
            Ok(Ok(None)) => {
                self.view.gone();
                self.ownership.renewed(started);
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "reading the assignment failed");
                self.ownership.renewed(started);
            }
            Err(_) => {
                tracing::warn!("reading the assignment timed out");
                self.ownership.renewed(started);
            }
        }
    }

    /// One compare-and-swap write of the Lease: renew it, or take it if it is free.
    async fn renew(&self) -> Result<(), RenewError> {
        let me = &self.config.incarnation;
        let Some(mut lease) = self.leases.get_opt(&self.name).await? else {
            let lease =
                Lease { metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() }, spec: None };
            return self.write(lease, true).await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        match holder {
            Some(h) if &h == me => {}
            None => {}
            Some(other) => {
                let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64);
                if !self.expired(&other, spec.renew_time.clone(), duration) {
                    return Err(RenewError::HeldByOther(other));
                }
                tracing::warn!(previous = %other, "taking over a member lease that expired");
            }
        }
        lease.metadata.managed_fields = None;
        self.write(lease, false).await
    }

    /// Whether `holder` has not renewed for `duration`, as we have seen it.
    fn expired(&self, holder: &str, renew_time: Option<MicroTime>, duration: Duration) -> bool {
        let mut foreign = self.foreign.lock().unwrap_or_else(|p| p.into_inner());
        foreign.expired(holder, renew_time, duration, Instant::now())
    }

    async fn write(&self, mut lease: Lease, create: bool) -> Result<(), RenewError> {
        let me = &self.config.incarnation;
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(me) {
            spec.holder_identity = Some(me.clone());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(self.config.lease_duration.as_secs() as i32);
        let names = &self.config.names;
        let annotations = lease.metadata.annotations.get_or_insert_with(BTreeMap::new);
        let ack = *self.ack.borrow();
        if ack > 0 {
            annotations.insert(names.ack_annotation.into(), ack.to_string());
        }
        let seen = self.ownership.seen();
        if seen > 0 {
            annotations.insert(names.seen_annotation.into(), seen.to_string());
        }
        annotations.insert(names.mode_annotation.into(), self.ownership.mode().as_str().into());
        annotations.insert(names.version_annotation.into(), self.config.version.clone());
        annotations.insert(names.ranges_annotation.into(), READS_SPLIT_RANGES.into());
        match self.config.capacity {
            Some(capacity) => annotations.insert(names.capacity_annotation.into(), capacity.to_string()),
            None => annotations.remove(names.capacity_annotation),
        };
        match self.not_working() {
            Some(why) => annotations.insert(names.not_working_annotation.into(), why),
            None => annotations.remove(names.not_working_annotation),
        };
        // Never a previous incarnation's report under our name.
        match self.load.latest() {
            Some(load) => annotations.insert(names.load_annotation.into(), load),
            None => annotations.remove(names.load_annotation),
        };
        let result = if create {
            self.leases.create(&PostParams::default(), &lease).await
        } else {
            self.leases.replace(&self.name, &PostParams::default(), &lease).await
        };
        match result {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(RenewError::Conflict),
            Err(e) => Err(e.into()),
        }
    }

    /// Records on the Lease, with the next renewal (started at once), that every bucket not
    /// ours in `generation` has drained.
    pub fn acknowledge(&self, generation: u64) {
        self.ack.send_if_modified(|g| std::mem::replace(g, generation) != generation);
    }

    /// The generation to acknowledge on the Lease.
    pub fn acknowledged(&self) -> u64 {
        *self.ack.borrow()
    }

    /// Gives the Lease up (holder emptied), so the others take over at once instead of
    /// waiting for expiry. Only while we hold it: a compare-and-swap like every write.
    pub async fn release(&self) {
        let release = async {
            let mut lease = self.leases.get(&self.name).await?;
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(&self.config.incarnation) {
                return Ok::<_, kube::Error>(false);
            }
            spec.holder_identity = Some(String::new());
            lease.metadata.managed_fields = None;
            self.leases.replace(&lease.name_any(), &PostParams::default(), &lease).await?;
            Ok(true)
        };
        match tokio::time::timeout(Duration::from_secs(5), release).await {
            Ok(Ok(true)) => tracing::info!(lease = %self.name, "member lease released"),
            Ok(Ok(false)) => tracing::warn!("the member lease is no longer ours; nothing to release"),
            Ok(Err(error)) => tracing::warn!(%error, "releasing the member lease failed; others wait for it to expire"),
            Err(_) => tracing::warn!("releasing the member lease timed out; others wait for it to expire"),
        }
        m::set_lease_held(false);
    }
}

/// Another incarnation's hold on our member Lease as this process has seen it: the holder, its
/// renewTime, and when we first saw that pair. Judged by our own clock alone (clocks of two
/// machines are never compared): the hold has expired once one renewal has stood for a whole
/// lease duration here.
#[derive(Default)]
pub(super) struct ForeignHold(Option<(String, Option<MicroTime>, Instant)>);

impl ForeignHold {
    pub(super) fn expired(
        &mut self,
        holder: &str,
        renew_time: Option<MicroTime>,
        duration: Duration,
        now: Instant,
    ) -> bool {
        match &self.0 {
            Some((h, t, since)) if h == holder && *t == renew_time => now.saturating_duration_since(*since) >= duration,
            _ => {
                self.0 = Some((holder.to_string(), renew_time, now));
                false
            }
        }
    }
}

/// Why a replica whose watches are `broken` (if they are), and whose last `failed_reads`
/// renewal cycles could not read the assignment, cannot do its work.
fn not_working(broken: Option<String>, failed_reads: u32) -> Option<String> {
    let cycles = (failed_reads >= FAILED_READS_BEFORE_NOT_WORKING)
        .then(|| format!("the last {failed_reads} renewal cycles could not read the assignment"));
    match (broken, cycles) {
        (Some(watches), Some(cycles)) => Some(format!("{watches}; {cycles}")),
        (watches, cycles) => watches.or(cycles),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_not_working_with_refused_watches_or_unread_assignments() {
        assert_eq!(not_working(None, 0), None);
        assert_eq!(not_working(None, FAILED_READS_BEFORE_NOT_WORKING - 1), None, "a read or two may fail");
        let cycles = "the last 3 renewal cycles could not read the assignment";
        assert_eq!(not_working(None, 3).as_deref(), Some(cycles));
        let refused = "the NetworkPolicy watch is refused".to_string();
        assert_eq!(not_working(Some(refused.clone()), 0), Some(refused.clone()));
        assert_eq!(not_working(Some(refused.clone()), 3), Some(format!("{refused}; {cycles}")), "both reasons");
    }

    fn renewal(second: i64) -> Option<MicroTime> {
        Some(MicroTime(k8s_openapi::jiff::Timestamp::from_second(second).unwrap()))
    }

    #[test]
    fn a_foreign_hold_expires_only_after_one_renewal_stood_a_whole_duration_here() {
        let (mut hold, t0, lease) = (ForeignHold::default(), Instant::now(), Duration::from_secs(15));
        let at = |seconds| t0 + Duration::from_secs(seconds);
        assert!(!hold.expired("old_1", renewal(100), lease, at(0)), "first sight: never expired");
        assert!(!hold.expired("old_1", renewal(100), lease, at(14)));
        assert!(hold.expired("old_1", renewal(100), lease, at(15)), "one renewal stood 15 s here");
        assert!(!hold.expired("old_1", renewal(101), lease, at(16)), "it renewed: the count starts again");
        assert!(!hold.expired("old_1", renewal(101), lease, at(30)));
        assert!(!hold.expired("old_2", renewal(101), lease, at(31)), "another holder starts again");
        assert!(hold.expired("old_2", renewal(101), lease, at(46)));
    }

    #[test]
    fn a_renew_time_far_in_the_past_is_not_taken_for_expired() {
        // The holder's clock may be wrong: only what this process saw counts.
        let (mut hold, t0, lease) = (ForeignHold::default(), Instant::now(), Duration::from_secs(15));
        assert!(!hold.expired("old_1", renewal(0), lease, t0));
        assert!(!hold.expired("old_1", renewal(0), lease, t0 + Duration::from_secs(1)));
    }
}
