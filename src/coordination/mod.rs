//! The operator's part of the sharding protocol. The protocol itself runs in the `sharding`
//! crate's `coordination` (re-exported here); the operator adds:
//! - [`NAMES`]: its Leases, ConfigMap, labels and annotations, under `trafficpolicy.dev`;
//! - [`labeller`]: in label mode, the leader's bucket labels on policies that came without one;
//! - [`shards_report`]: the `shards` command's report;
//! - [`capacity`]: how many policies a replica can hold, from `--capacity` or its memory limit;
//! - [`admission`]: whether the fencing and operator-reach policies are in force for it.
//!
//! docs/sharding.md describes the protocol and why no two replicas write one object at once.

pub mod admission;
pub mod capacity;
pub mod labeller;
pub mod shards_report;

pub use crate::sharding::coordination::{
    Coordination, FENCED_MESSAGE, Names, Replica, ShardConfig, audit, epoch_floor, follower, install, leader, lease,
    load, members, metrics, mode, namespace_labels, ownership, published, sharded, tasks, validate_timings,
};

pub const NAMES: Names = crate::sharding::names!("traffic-policy-operator", "trafficpolicy.dev");

/// In label mode: the label holding an object's bucket (see `sharding::bucket`).
pub const BUCKET_LABEL: &str = NAMES.bucket_label;
/// Set by the leader on a policy it labels from its backlog (see [`Names::backlog_annotation`]).
pub const BACKLOG_ANNOTATION: &str = NAMES.backlog_annotation;
/// On every object the operator writes: the writer's fencing token. The fencing policy in
/// deploy/components/fencing/ refuses an update whose token is lower than the stored one.
pub const FENCE_ANNOTATION: &str = NAMES.fence_annotation;
pub const MEMBER_LEASE_PREFIX: &str = NAMES.member_lease_prefix;
pub const LEADER_LEASE: &str = NAMES.leader_lease;
pub const ASSIGNMENT_CONFIGMAP: &str = NAMES.assignment_configmap;
pub const MODE_ANNOTATION: &str = NAMES.mode_annotation;
pub const NOT_WORKING_ANNOTATION: &str = NAMES.not_working_annotation;
