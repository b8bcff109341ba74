//! This replica's part in the sharding protocol, started and stopped as one: its member
//! Lease and renewal cycles, the member table, leader election and the leader's duties, and
//! the follower that applies the published assignment and sends the new slice to the watches.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kube::Client;
use sharded_runtime::health::Health;
use sharded_runtime::parts::SliceWatch;
use sharded_runtime::watch_health::WatchHealth;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::audit::Audit;
use super::follower::Follower;
use super::leader::{Leader, LeaderDuties};
use super::lease::MemberLease;
use super::load::LoadReport;
use super::members::Members;
use super::mode::{self, Requested};
use super::ownership::Ownership;
use super::published::AssignmentView;
use super::{Replica, ShardConfig};

/// Wraps a protocol task's future (a test can make it fail).
pub type TaskWrapper = Box<dyn FnOnce(BoxFuture<'static, ()>) -> BoxFuture<'static, ()> + Send>;

/// What [`Coordination::start`] needs.
pub struct Start<'a> {
    pub config: &'a ShardConfig,
    /// For Leases and the assignment: exempt from any client-side rate limit, since a
    /// throttled renewal costs the whole slice.
    pub client: &'a Client,
    pub mode: Requested,
    /// Readiness: the gates `members` and `assignment`.
    pub health: &'a Arc<Health>,
    pub audit: &'a Audit,
    /// What the leader does beside publishing the assignment.
    pub duties: Arc<dyn LeaderDuties>,
    /// Wraps the follower task, if given.
    pub follower_wrapper: Option<TaskWrapper>,
}

/// This replica's part in the protocol, running: what the controller needs of it, and its tasks.
pub struct Coordination {
    pub ownership: Arc<Ownership>,
    /// The buckets this replica owns, for the watches.
    pub slice: SliceWatch,
    /// This replica's objects per bucket, reported on its Lease (counted by [`LoadReport::keep`]).
    pub load: Arc<LoadReport>,
    /// Refused watches make this replica give its slice up (see [`super::lease`]).
    pub watch_health: Arc<WatchHealth>,
    member_lease: Arc<MemberLease>,
    leader: Arc<Leader>,
    members: Arc<Members>,
    incarnation: String,
    stop_lease: CancellationToken,
    stop_sharding: CancellationToken,
    lease_task: Option<JoinHandle<()>>,
    leader_task: Option<JoinHandle<bool>>,
    follower_task: Option<JoinHandle<()>>,
}

impl Coordination {
    /// Starts every task; the member table's watch goes into `critical`.
    pub async fn start(start: Start<'_>, critical: &mut JoinSet<&'static str>) -> anyhow::Result<Self> {
        let Start { config: shard, client: coordination, health, audit, .. } = start;
        let mode = mode::choose(coordination, &shard.namespace, start.mode).await?;
        if let Some(capacity) = shard.capacity {
            tracing::info!(capacity, "advertising a capacity: the leader gives this replica no more objects");
            super::metrics::set_capacity(capacity);
        }
        let ownership = Ownership::new(&shard.incarnation, mode, shard.renew_deadline, shard.write_bound());
        let members = Arc::new(Members::default());
        let view = Arc::new(AssignmentView::default());
        let load = Arc::new(LoadReport::default());
        // A watch asks the server to end it after two lease durations: one silent longer has
        // stalled, and the replica gives its slice up (sharded_runtime::watch_stall).
        let watch_health = WatchHealth::with_watch_timeout(shard.lease_duration * 2);
        let replica = Replica { config: shard.clone(), ownership: ownership.clone(), view };
        let member_lease =
            Arc::new(MemberLease::new(coordination.clone(), &replica, load.clone(), watch_health.clone()));
        let leader = Arc::new(Leader::new(coordination.clone(), &replica, members.clone(), start.duties));
        let (slice_tx, slice) = tokio::sync::watch::channel(None);
        let follower = Follower::new(
            coordination.clone(),
            &replica,
            member_lease.clone(),
            slice_tx,
            health.clone(),
            audit.clone(),
        );
        critical.spawn({
            let (client, namespace, health) = (coordination.clone(), shard.namespace.clone(), health.clone());
            let (names, watch_timeout) = (shard.names, watch_health.watch_timeout());
            let members = members.clone();
            async move {
                members.watch(client, &namespace, &names, &health, watch_timeout).await;
                "the member lease watch"
            }
        });
        let stop_lease = CancellationToken::new();
        let stop_sharding = CancellationToken::new();
        let lease_task = tokio::spawn({
            let (lease, stop) = (member_lease.clone(), stop_lease.clone());
            async move { lease.keep(stop).await }
        });
        let leader_task = tokio::spawn({
            let (leader, stop) = (leader.clone(), stop_sharding.clone());
            async move { leader.run(stop).await }
        });
        let following: BoxFuture<'static, ()> = Box::pin(follower.run(stop_sharding.clone()));
        let follower_task = tokio::spawn(match start.follower_wrapper {
            Some(wrap) => wrap(following),
            None => following,
        });
        Ok(Self {
            ownership,
            slice,
            load,
            watch_health,
            member_lease,
            leader,
            members,
            incarnation: shard.incarnation.clone(),
            stop_lease,
            stop_sharding,
            lease_task: Some(lease_task),
            leader_task: Some(leader_task),
            follower_task: Some(follower_task),
        })
    }

    /// Waits until one of the protocol's tasks ends (before shutdown, a failure), and says which.
    pub async fn task_ended(&mut self) -> String {
        tokio::select! {
            ended = async { self.lease_task.as_mut().expect("running").await } => {
                self.lease_task = None;
                format!("the lease task ended: {ended:?}")
            }
            ended = async { self.leader_task.as_mut().expect("running").await } => {
                self.leader_task = None;
                format!("the leader task ended: {ended:?}")
            }
            ended = async { self.follower_task.as_mut().expect("running").await } => {
                self.follower_task = None;
                format!("the follower task ended: {ended:?}")
            }
        }
    }

    /// After the controller stopped (`drained`: every reconcile finished): stop following the
    /// assignment, give up every bucket and wait until nothing of them can still land, stop
    /// renewing, then hand the slice over (release the Lease and, if leading, publish the
    /// buckets' new owners). A write that may still land leaves the Lease to expire instead.
    /// True when this replica left as the last of its install (no other member Lease held).
    pub async fn shut_down(self, drained: bool, landing_bound: Duration, audit: &Audit) -> bool {
        self.stop_sharding.cancel();
        if let Some(task) = self.follower_task {
            let _ = task.await;
        }
        let was_leading = match self.leader_task {
            Some(task) => task.await.unwrap_or(false),
            None => false,
        };
        self.ownership.release_all();
        audit.record("owned", &"shutdown", "");
        // Nothing of ours may land after we say we let go: wait out abandoned writes too.
        let drained = drained && self.ownership.drained(landing_bound + Duration::from_millis(100)).await;
        self.stop_lease.cancel();
        if let Some(task) = self.lease_task {
            let _ = task.await;
        }
        if drained {
            self.member_lease.release().await;
            if was_leading {
                self.leader.hand_over().await;
            }
            !self.members.with(|t| t.others_alive(&self.incarnation, tokio::time::Instant::now()))
        } else {
            // The margin between renew deadline and lease duration covers a write still on its way.
            tracing::warn!("not drained: leaving the Lease to expire instead of handing over");
            false
        }
    }
}
