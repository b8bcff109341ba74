//! Sharding for controllers built on `sharded_runtime`. The decisions are pure and
//! clock-free (`now` is passed in), tested without a cluster:
//! - [`bucket`]: namespace → bucket in either mode, and the label selector of a set of them;
//! - [`shard_range`]: buckets as hash ranges for the API server's shard selector;
//! - [`hash_ranges`]: ranges split where the namespaces are, for names the uniform ones crowd;
//! - [`bucket_id`]: how a process names buckets to its runtime, so that a changed range is a new bucket;
//! - [`ring`]: buckets → members by consistent hashing with bounded loads;
//! - [`counts`]: objects per bucket, as replicas report them and the ring weighs them;
//! - [`balance`]: when to balance slices by their objects rather than their buckets;
//! - [`capacity`]: slices within what each member can hold;
//! - [`membership`]: incarnations, and which members are alive, from locally observed
//!   lease renewals;
//! - [`assignment`]: the published bucket ownership, with fencing epochs, and the leader's
//!   safe transitions (revoke before reassign);
//! - [`planning`]: the leader's planning step as one function (a change of mode, a change of
//!   ranges, then the placement), which the leader and the model checker both call;
//! - [`mod@slice`]: what this replica may write right now, and when it may say it let go.
//!
//!
//! [`coordination`] carries them out on a real API server: member Leases, the leader, the
//! published assignment, the follower that applies it, and the gatekeeper a
//! `sharded_runtime` controller writes through. The pure modules name no Kubernetes object,
//! and the coordination names only what the program passes in ([`coordination::Names`]).

pub mod assignment;
pub mod balance;
pub mod bucket;
pub mod bucket_id;
pub mod capacity;
pub mod coordination;
pub mod counts;
pub mod hash_ranges;
pub mod membership;
pub mod planning;
pub mod ring;
pub mod shard_range;
pub mod slice;
