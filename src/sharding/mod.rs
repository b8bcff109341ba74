//! Sharding decisions, pure and clock-free (`now` is passed in), tested without a cluster:
//! - [`bucket`]: namespace → bucket, and the label and selectors that carry it;
//! - [`ring`]: buckets → members by consistent hashing with bounded loads;
//! - [`membership`]: which members are alive, from locally observed lease renewals;
//! - [`assignment`]: the published bucket ownership and the leader's safe transitions.
//!
//! The side effects of the protocol (leases, the leader, applying an assignment) live in
//! `shard`.

pub mod assignment;
pub mod bucket;
pub mod membership;
pub mod ring;
