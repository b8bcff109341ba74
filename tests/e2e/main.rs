//! End-to-end tests: the real operator binary against the real control plane.
//! One test process shares one control plane; each test has its own namespace and
//! its own operator process scoped to it.

mod bucket_labels;
mod clash;
mod gateway;
mod lifecycle;
mod metrics;
mod mode;
mod priority;
mod reach;
mod restart;
#[path = "../common/mod.rs"]
mod support;
mod throttling;
mod tokens;
mod validation;
