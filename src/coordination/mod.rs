//! The side effects of the sharding protocol (the decisions are pure, in `sharding`):
//! - [`lease`]: this incarnation's member Lease: renewal cycles (renew, then read the
//!   assignment with a quorum read), acknowledgements, release;
//! - [`members`]: a watch of every member Lease into the local membership table;
//! - [`leader`]: leader election, and the leader's duties: publishing the assignment and,
//!   in label mode, bucket labels ([`namespace_labels`] on namespaces, for the
//!   admission policy of deploy/components/bucket-labels; [`labeller`] on each policy that came without one);
//! - [`epoch_floor`]: generations reserved on the CRD, so that epochs never restart;
//! - [`published`]: the newest published assignment this replica has read;
//! - [`follower`]: applying the published assignment to this replica (re-target the
//!   watches at once, drain what was lost, acknowledge);
//! - [`ownership`]: what this replica may write right now, with the fencing epoch;
//! - [`sharded`]: the wrapper that puts a reconcile behind that check;
//! - [`load`]: this replica's count of policies per bucket, reported on its member Lease;
//! - [`mode`]: the start-up choice of shard selector or labels;
//! - [`shards_report`]: the `shards` command's report.
//!
//! docs/sharding.md describes the protocol and why no two replicas write one object at once.

pub mod epoch_floor;
pub mod follower;
pub mod labeller;
pub mod leader;
pub mod lease;
pub mod load;
pub mod members;
pub mod mode;
pub mod namespace_labels;
pub mod ownership;
pub mod published;
pub mod sharded;
pub mod shards_report;

use std::time::Duration;

use crate::sharding::balance::Balance;

/// In label mode: the label holding an object's bucket (see `sharding::bucket`).
pub const BUCKET_LABEL: &str = "trafficpolicy.dev/bucket";
/// Set by the leader, with the bucket label, on a policy it labels from its backlog (the list
/// of unlabelled policies, as after a preload) rather than from a watch event: nobody waits
/// on it, so the replica that sees it appear queues it behind real changes.
pub const BACKLOG_ANNOTATION: &str = "trafficpolicy.dev/labelled-from-backlog";

/// Names of the coordination objects in the operator's namespace.
pub const MEMBER_LEASE_PREFIX: &str = "traffic-policy-operator-member-";
pub const LEADER_LEASE: &str = "traffic-policy-operator-leader";
pub const ASSIGNMENT_CONFIGMAP: &str = "traffic-policy-operator-assignment";
/// On a member Lease: the assignment generation its holder has applied and drained.
pub const ACK_ANNOTATION: &str = "trafficpolicy.dev/applied-assignment";
/// On a member Lease: the newest assignment generation its holder has seen (written with every
/// renewal), a floor for the generation of an assignment that must be published anew.
pub const SEEN_ANNOTATION: &str = "trafficpolicy.dev/seen-assignment";
/// On a member Lease: its holder's policies per bucket (`generation/bucket:count,…`), which
/// the leader balances slices by.
pub const LOAD_ANNOTATION: &str = "trafficpolicy.dev/bucket-objects";
/// On a member Lease: its holder's sharding mode (a leader gives buckets only to members
/// of its own mode), its version, and, while it cannot do its work, why.
pub const MODE_ANNOTATION: &str = "trafficpolicy.dev/shard-mode";
pub const VERSION_ANNOTATION: &str = "trafficpolicy.dev/version";
pub const NOT_WORKING_ANNOTATION: &str = "trafficpolicy.dev/not-working";

/// What this replica's protocol tasks (lease, leader, follower) share: who it is, what it may
/// write, and the newest assignment it has read.
#[derive(Clone)]
pub struct Replica {
    pub config: ShardConfig,
    pub ownership: std::sync::Arc<ownership::Ownership>,
    pub view: std::sync::Arc<published::AssignmentView>,
}

/// Who we are and the lease timings, validated by the CLI.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// The pod name: it names the member Lease and the event reporter.
    pub identity: String,
    /// This process: the pod name plus a nonce, the holder of our Leases.
    pub incarnation: String,
    pub namespace: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    pub drain_timeout: Duration,
    /// Limits the leader's labelling to one namespace (the operator's `--watch-namespace`).
    pub watch_namespace: Option<String>,
    /// When the leader balances slices by their policies.
    pub balance: Balance,
    /// The cluster-scoped object (our CRD) that keeps the generation floor.
    pub floor_object: String,
}

impl ShardConfig {
    pub fn member_lease_name(&self) -> String {
        format!("{MEMBER_LEASE_PREFIX}{}", self.identity)
    }

    /// How long one write may take, on the client and (the `timeout` parameter) on the API
    /// server: 45 % of the margin between lease duration and renew deadline. A request the
    /// server received just before the client gave up may still land a bound later, so an
    /// unanswered write may land up to twice the bound after it was sent ([`Self::landing_bound`]);
    /// the last tenth of the margin is left for clock rates (docs/sharding.md, "The margin").
    pub fn write_bound(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline) * 9 / 20
    }

    /// How long after it was sent an unanswered write may still land.
    pub fn landing_bound(&self) -> Duration {
        self.write_bound() * 2
    }
}

/// client-go's rule: LeaseDuration > RenewDeadline > 1.2 × RetryPeriod.
pub fn validate_timings(
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
) -> Result<(), String> {
    if lease_duration <= renew_deadline {
        return Err(format!(
            "--lease-duration ({lease_duration:?}) must be longer than --renew-deadline ({renew_deadline:?})"
        ));
    }
    if renew_deadline.as_secs_f64() <= 1.2 * retry_period.as_secs_f64() {
        return Err(format!(
            "--renew-deadline ({renew_deadline:?}) must be longer than 1.2 × --retry-period ({retry_period:?})"
        ));
    }
    if lease_duration.as_secs() < 1 || lease_duration.subsec_nanos() != 0 {
        return Err(format!("--lease-duration ({lease_duration:?}) must be a whole number of seconds, at least 1"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_follow_client_go_rules() {
        let s = Duration::from_secs;
        assert!(validate_timings(s(15), s(10), s(2)).is_ok());
        assert!(validate_timings(s(4), s(3), Duration::from_millis(500)).is_ok());
        assert!(validate_timings(s(10), s(10), s(2)).unwrap_err().contains("--lease-duration"));
        assert!(validate_timings(s(15), s(2), s(2)).unwrap_err().contains("1.2 × --retry-period"));
        assert!(validate_timings(Duration::from_millis(4500), s(3), s(1)).unwrap_err().contains("whole number"));
    }
}
