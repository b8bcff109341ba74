//! This replica's part in the sharding protocol, started and stopped as one: its member
//! Lease and renewal cycles, the member table, leader election and the leader's duties, and
//! the follower that applies the published assignment and sends the new slice to the watches.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::client::Clients;
use crate::coordination::follower::Follower;
use crate::coordination::leader::Leader;
use crate::coordination::lease::MemberLease;
use crate::coordination::load::LoadReport;
use crate::coordination::members::Members;
use crate::coordination::ownership::Ownership;
use crate::coordination::published::AssignmentView;
use crate::coordination::{Replica, ShardConfig};
use crate::runtime::health::Health;
use crate::runtime::parts::SliceWatch;
use crate::runtime::watch_health::WatchHealth;
use crate::telemetry::audit::Audit;

pub(super) struct Coordination {
    pub ownership: Arc<Ownership>,
    /// The buckets this replica owns, for the watches.
    pub slice: SliceWatch,
    /// This replica's policies per bucket, reported on its Lease.
    pub load: Arc<LoadReport>,
    /// Refused watches make this replica give its slice up (see `coordination::lease`).
    pub watch_health: Arc<WatchHealth>,
    member_lease: Arc<MemberLease>,
    leader: Arc<Leader>,
    stop_lease: CancellationToken,
    stop_sharding: CancellationToken,
    lease_task: Option<JoinHandle<()>>,
    leader_task: Option<JoinHandle<bool>>,
    follower_task: Option<JoinHandle<()>>,
}

impl Coordination {
    /// Starts every task; the member table's watch goes into `critical`.
    pub async fn start(
        args: &RunArgs,
        shard: &ShardConfig,
        clients: &Clients,
        health: &Arc<Health>,
        audit: &Audit,
        critical: &mut JoinSet<&'static str>,
    ) -> anyhow::Result<Self> {
        // Leases and the assignment go through the never-limited client; labelling is work.
        let coordination = &clients.coordination;
        let mode = crate::coordination::mode::choose(coordination, &shard.namespace, args.shard_mode).await?;
        let ownership = Ownership::new(&shard.incarnation, mode, shard.renew_deadline, shard.write_bound());
        let members = Arc::new(Members::default());
        let view = Arc::new(AssignmentView::default());
        let load = Arc::new(LoadReport::default());
        let watch_health = WatchHealth::new();
        let replica = Replica { config: shard.clone(), ownership: ownership.clone(), view };
        let member_lease =
            Arc::new(MemberLease::new(coordination.clone(), &replica, load.clone(), watch_health.clone()));
        let leader = Arc::new(Leader::new(coordination.clone(), clients.work.clone(), &replica, members.clone()));
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
            async move {
                members.watch(client, &namespace, &health).await;
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
        let follower_task = tokio::spawn(args.test_faults.clone().follower(follower.run(stop_sharding.clone())));
        Ok(Self {
            ownership,
            slice,
            load,
            watch_health,
            member_lease,
            leader,
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
    pub async fn shut_down(self, drained: bool, landing_bound: Duration, audit: &Audit) {
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
        } else {
            // The margin between renew deadline and lease duration covers a write still on its way.
            tracing::warn!("not drained: leaving the Lease to expire instead of handing over");
        }
    }
}
