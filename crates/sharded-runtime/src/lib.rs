//! A Kubernetes controller runtime for a controller that owns a changing slice of the
//! namespaces (buckets of them), in pipeline order: [`watch`] sources of the slice's
//! [`parts`] feed a [`cache`] of compact copies ([`stored`]), which judges each event with
//! the [`predicate`] and feeds the [`queue`]; the [`controller`]'s workers take keys from it,
//! ask a [`reconciler::Gatekeeper`] for the object's [`gate::WriteGate`] (sharding is one),
//! and call a [`reconciler::Reconciler`] that writes through it. What each watch event means
//! to the controller is decided by two state machines, [`primary_feed`] and [`child_feed`],
//! which return commands and are table-tested without a watch. Beside them: [`error`],
//! [`health`] (readiness gates), [`metrics`], [`client`] and [`retries`] (per-key backoff for
//! work outside the queue). Which buckets are this process's, and what
//! the gate rests on, come from outside: the runtime knows no Lease and no business object.
//!
//! Why not kube-runtime's `Controller` (`for_stream`, `owns_stream`, `graceful_shutdown_on`)?
//! Its watches and backoff are used here; its reflector store and controller are not. The
//! store keys each object by a copy of its name, namespace, resourceVersion and uid, where
//! [`cache`] shares one small key with the queue, keeps objects in whatever form their
//! reconcile needs (see [`stored::Stored`]), and is the predicate's memory. And a sharded
//! controller needs what its controller lacks:
//! - two priority lanes, so a real edit goes before a relist's or a handoff's backlog;
//! - watches of a changing slice in parts, so that a handoff lists only what it moves, and
//!   no reconcile of an object until the child watches have listed its part of the slice
//!   (what makes "write only what changed" safe across handoffs);
//! - the write gate, checked per write, that the sharding ties to a confirmed Lease.
//!
//! And it costs less: the repository's `loadtest compare` runs kube-runtime's `Controller`
//! with this runtime's trimming, generation predicate and metadata-only child watches, and
//! the same reconcile, beside the operator built on this runtime; docs/benchmarks.md has the
//! ratios of CPU-seconds, peak RSS and time.

pub mod backoff;
pub mod cache;
pub mod child_feed;
pub mod child_versions;
pub mod client;
pub mod controller;
pub mod error;
pub mod gate;
pub mod health;
pub mod key;
pub mod list_deadline;
pub mod metrics;
pub mod pacer;
pub mod parts;
pub mod predicate;
pub mod primary_feed;
pub mod queue;
pub mod reconciler;
pub mod retries;
pub mod stored;
pub mod watch;
pub mod watch_health;
pub mod watch_stall;

pub use controller::{Controller, Listed, Settings};
pub use gate::WriteGate;
pub use key::ObjectKey;
pub use queue::Priority;
pub use reconciler::{Action, Gatekeeper, Reconciler};
