//! The side effects of the sharding protocol, on a real API server (the decisions they carry
//! out are the pure modules beside this one):
//! - [`lease`]: this incarnation's member Lease: renewal cycles (renew, then read the
//!   assignment with a quorum read), acknowledgements, release;
//! - [`members`]: a watch of every member Lease into the local membership table;
//! - [`leader`]: leader election, and the leader's duties: publishing the assignment,
//!   collecting abandoned Leases, and what the program adds ([`leader::LeaderDuties`]);
//! - [`namespace_labels`]: in label mode, bucket labels on namespaces, for an admission
//!   policy that labels new objects;
//! - [`epoch_floor`]: generations reserved on a CustomResourceDefinition, so that epochs
//!   never restart;
//! - [`install`]: the installs that may run, recorded on the same CRD, so that two installs
//!   never watch one namespace;
//! - [`published`]: the newest published assignment this replica has read;
//! - [`follower`]: applying the published assignment to this replica (re-target the
//!   watches at once, drain what was lost, acknowledge);
//! - [`ownership`]: what this replica may write right now, with the fencing epoch;
//! - [`sharded`]: the gatekeeper that puts each reconcile behind that check;
//! - [`load`]: this replica's count of objects per bucket, reported on its member Lease;
//! - [`census`]: the leader's own count of every bucket's objects, when members have
//!   capacities;
//! - [`mode`]: the start-up choice of shard selector or labels;
//! - [`tasks`]: all of it started and stopped as one ([`Coordination`]);
//! - [`audit`]: an optional log of reconciles and writes, for tests of the protocol;
//! - [`metrics`]: the protocol's metrics.
//!
//! Every object, label and annotation it uses is named by the program, through [`Names`]
//! (see [`names!`](crate::names)).

pub mod audit;
pub mod census;
pub mod epoch_floor;
pub mod follower;
pub mod install;
pub mod leader;
pub mod lease;
pub mod load;
pub mod members;
pub mod metrics;
pub mod mode;
pub mod namespace_labels;
pub mod ownership;
pub mod published;
pub mod sharded;
pub mod tasks;

use std::time::Duration;

use crate::balance::Balance;
pub use tasks::Coordination;

/// The value of [`Names::ranges_annotation`] on the Lease of a member that reads split ranges.
pub const READS_SPLIT_RANGES: &str = "split";

/// What the failing fencing check says when it refuses a write (the program's admission
/// policy must say it): `refused a write with shard epoch`, best followed by `E over the
/// stored N`, so that a stored token above every generation reaches the leader.
pub const FENCED_MESSAGE: &str = "refused a write with shard epoch";

/// The names of the coordination objects, labels and annotations, made from the program's
/// name and its annotation domain by [`names!`](crate::names).
#[derive(Clone, Copy, Debug)]
pub struct Names {
    /// The program's name: the prefix of its coordination objects, and the leader metric's label.
    pub program: &'static str,
    /// Member Leases are this prefix plus the pod name.
    pub member_lease_prefix: &'static str,
    pub leader_lease: &'static str,
    /// The ConfigMap holding the published assignment.
    pub assignment_configmap: &'static str,
    /// In label mode: the label holding an object's bucket (see `crate::bucket`).
    pub bucket_label: &'static str,
    /// Set by the leader, with the bucket label, on an object it labels from its backlog (the
    /// list of unlabelled objects, as after a preload) rather than from a watch event: nobody
    /// waits on it, so the replica that sees it appear queues it behind real changes.
    pub backlog_annotation: &'static str,
    /// On every object the program writes: the writer's fencing token, which the fencing
    /// policy compares with the stored one.
    pub fence_annotation: &'static str,
    /// On a member Lease: the assignment generation its holder has applied and drained.
    pub ack_annotation: &'static str,
    /// On a member Lease: the newest assignment generation its holder has seen (written with
    /// every renewal), a floor for the generation of an assignment that must be published anew.
    pub seen_annotation: &'static str,
    /// On a member Lease: its holder's objects per bucket (`generation/bucket:count,…`), which
    /// the leader balances slices by.
    pub load_annotation: &'static str,
    /// On a member Lease: its holder's sharding mode (a leader gives buckets only to members
    /// of its own mode), its version, and, while it cannot do its work, why.
    pub mode_annotation: &'static str,
    pub version_annotation: &'static str,
    pub not_working_annotation: &'static str,
    /// On a member Lease: how many objects its holder can hold (a leader gives it no more).
    pub capacity_annotation: &'static str,
    /// On a member Lease: [`READS_SPLIT_RANGES`] from a holder that reads split hash ranges
    /// (a leader splits them only while every member does).
    pub ranges_annotation: &'static str,
    /// On the CustomResourceDefinition that keeps the generation floor.
    pub floor_annotation: &'static str,
    /// On the same CustomResourceDefinition: the installs that may run, and what each watches.
    pub install_annotation: &'static str,
}

/// The [`Names`] of a program: `names!("my-operator", "example.com")` names the Leases
/// `my-operator-member-<pod>` and `my-operator-leader`, the assignment ConfigMap
/// `my-operator-assignment`, and the labels and annotations `example.com/bucket`,
/// `example.com/shard-epoch` and so on. A constant expression.
#[macro_export]
macro_rules! names {
    ($program:literal, $domain:literal) => {
        $crate::coordination::Names {
            program: $program,
            member_lease_prefix: concat!($program, "-member-"),
            leader_lease: concat!($program, "-leader"),
            assignment_configmap: concat!($program, "-assignment"),
            bucket_label: concat!($domain, "/bucket"),
            backlog_annotation: concat!($domain, "/labelled-from-backlog"),
            fence_annotation: concat!($domain, "/shard-epoch"),
            ack_annotation: concat!($domain, "/applied-assignment"),
            seen_annotation: concat!($domain, "/seen-assignment"),
            load_annotation: concat!($domain, "/bucket-objects"),
            mode_annotation: concat!($domain, "/shard-mode"),
            version_annotation: concat!($domain, "/version"),
            not_working_annotation: concat!($domain, "/not-working"),
            capacity_annotation: concat!($domain, "/capacity"),
            ranges_annotation: concat!($domain, "/hash-ranges"),
            floor_annotation: concat!($domain, "/reserved-generation"),
            install_annotation: concat!($domain, "/installs"),
        }
    };
}

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
    /// When the leader balances slices by their objects.
    pub balance: Balance,
    /// The CustomResourceDefinition (of the sharded objects) that keeps the generation floor.
    pub floor_object: String,
    /// The coordination objects' names.
    pub names: Names,
    /// The program's version, on its member Lease.
    pub version: String,
    /// How many objects this replica can hold, on its member Lease; `None`: no bound.
    pub capacity: Option<u64>,
    /// Whether, as the leader in shard-selector mode, this replica splits crowded hash ranges
    /// (see `sharding::hash_ranges`).
    pub split_ranges: bool,
    /// Where the program's watches look (`None`: every namespace): what the leader counts
    /// when members advertise capacities.
    pub watch_namespace: Option<String>,
}

impl ShardConfig {
    /// This replica's member Lease.
    pub fn member_lease_name(&self) -> String {
        format!("{}{}", self.names.member_lease_prefix, self.identity)
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
