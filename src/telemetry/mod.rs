//! Telemetry: metrics, logs and the admin HTTP server (health and `/metrics`).

pub mod admin;
pub mod logging;
pub mod metrics;
pub mod metrics_auth;
