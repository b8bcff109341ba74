//! The controller runtime.
pub mod backoff;
pub mod key;
pub mod predicate;
pub mod queue;
