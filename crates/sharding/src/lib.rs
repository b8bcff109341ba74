//! Sharding decisions, pure and clock-free (`now` is passed in), tested without a cluster:
//! - [`bucket`]: namespace → bucket in either mode, and the label selector of a set of them;
//! - [`shard_range`]: buckets as hash ranges for the API server's shard selector;
//! - [`ring`]: buckets → members by consistent hashing with bounded loads;
//! - [`counts`]: objects per bucket, as replicas report them and the ring weighs them;
//! - [`balance`]: when to balance slices by their objects rather than their buckets;
//! - [`membership`]: incarnations, and which members are alive, from locally observed
//!   lease renewals;
//! - [`assignment`]: the published bucket ownership, with fencing epochs, and the leader's
//!   safe transitions (revoke before reassign);
//! - [`mod@slice`]: what this replica may write right now, and when it may say it let go.
//!
//! The side effects of the protocol (leases, the leader, applying an assignment) are the
//! program's: traffic-policy-operator's `coordination` module runs them. Nothing here names
//! a Kubernetes object, label or annotation.

pub mod assignment;
pub mod balance;
pub mod bucket;
pub mod counts;
pub mod membership;
pub mod ring;
pub mod shard_range;
pub mod slice;
