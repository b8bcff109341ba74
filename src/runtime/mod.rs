//! The controller runtime, in pipeline order: [`watch`] sources feed a trimmed cache and
//! the [`predicate`], which feeds the [`queue`]; the [`controller`]'s workers take keys
//! from it and call a [`controller::Reconciler`]. Nothing here knows about traffic policies.

pub mod backoff;
pub mod child_versions;
pub mod controller;
pub mod gate;
pub mod key;
pub mod predicate;
pub mod queue;
pub mod watch;

pub use controller::{Action, Controller, Reconciler, Settings};
pub use key::ObjectKey;
