//! traffic-policy-operator: turns `ApplicationTrafficPolicy` objects into NetworkPolicies
//! and gateway rate-limit ConfigMaps.
//!
//! The pipeline, one module per stage:
//! - [`api`]: the custom resource types and their schema;
//! - [`runtime`] (the `sharded-runtime` crate): watch → compact cache → generation predicate →
//!   work queue → workers, each reconcile writing through a gate;
//! - [`sharding`] (the `sharding` crate): pure sharding decisions: buckets, the ring,
//!   membership, assignment;
//! - [`coordination`]: the sharding protocol's side effects: leases, leader, ownership, handoff;
//! - [`reconcile`]: the traffic-policy logic, desired objects from the spec (pure), then
//!   apply, status and events;
//! - [`telemetry`]: metrics, logs, and the admin server (`/livez`, `/readyz`, `/metrics`);
//! - [`client`]: the API clients: work (rate-limited where the server lacks Priority and
//!   Fairness, or when asked), and never-limited coordination;
//! - [`cli`]: flags and environment; [`manager`] wires these together, `main.rs` starts it.

pub mod api;
pub mod cli;
pub mod client;
pub mod coordination;
pub mod manager;
pub mod reconcile;
pub mod telemetry;
pub mod test_faults;

pub use sharded_runtime as runtime;
pub use sharded_runtime::error;
pub use sharding;
