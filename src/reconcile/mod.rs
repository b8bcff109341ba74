//! The traffic-policy reconcile.
pub mod desired;
pub mod status;
