//! The admin HTTP server: `/livez`, `/readyz` and `/metrics` on one small listener.
//!
//! Readiness is built from parts: each component that must have done its first real work
//! (synced a watch, applied an assignment) is a named gate that it opens. `/readyz` is 200
//! once every gate is open and the process is not shutting down; otherwise it names what
//! it waits for. `/livez` fails once a critical task has ended.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

/// Readiness and liveness inputs, shared with every component.
#[derive(Default)]
pub struct Health {
    waiting: Mutex<BTreeSet<&'static str>>,
    shutting_down: AtomicBool,
    failed: Mutex<Option<String>>,
}

impl Health {
    /// Health that is ready once each of `gates` is opened with [`Health::ready`].
    pub fn with_gates(gates: &[&'static str]) -> Arc<Self> {
        Arc::new(Self { waiting: Mutex::new(gates.iter().copied().collect()), ..Default::default() })
    }

    pub fn ready(&self, gate: &'static str) {
        self.set(gate, true);
    }

    /// Opens or closes `gate`: for a condition that can stop holding (a lapsed lease).
    pub fn set(&self, gate: &'static str, ready: bool) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if ready {
            waiting.remove(gate);
        } else {
            waiting.insert(gate);
        }
    }

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// A critical task ended: the process is no longer live.
    pub fn fail(&self, what: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(what);
    }

    /// What readiness still waits for; empty when ready.
    pub fn waiting_for(&self) -> Vec<&'static str> {
        let mut waiting: Vec<&'static str> =
            self.waiting.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        if self.shutting_down.load(Ordering::Relaxed) {
            waiting.push("shutdown");
        }
        waiting
    }

    pub fn is_ready(&self) -> bool {
        self.waiting_for().is_empty()
    }

    pub fn failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[derive(Clone)]
struct AdminState {
    health: Arc<Health>,
    metrics: PrometheusHandle,
}

/// Binds early, so that a taken address fails the start with a clear error.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("admin server: cannot listen on {addr}: {e}"))
}

/// Serves until `shutdown` is cancelled.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    metrics: PrometheusHandle,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(|State(s): State<AdminState>| async move { s.metrics.render() }))
        .with_state(AdminState { health, metrics });
    tracing::info!(addr = %listener.local_addr()?, "admin server listening");
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await?;
    Ok(())
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, String) {
    match s.health.waiting_for() {
        waiting if waiting.is_empty() => (StatusCode::OK, "ok".into()),
        waiting => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: waiting for {}", waiting.join(", "))),
    }
}

async fn livez(State(s): State<AdminState>) -> (StatusCode, String) {
    match s.health.failure() {
        None => (StatusCode::OK, "ok".into()),
        Some(what) => (StatusCode::SERVICE_UNAVAILABLE, format!("failed: {what}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_gate_is_open_and_not_shutting_down() {
        let health = Health::with_gates(&["members", "assignment"]);
        assert_eq!(health.waiting_for(), ["assignment", "members"]);
        health.ready("members");
        health.ready("assignment");
        assert!(health.is_ready());
        health.set_shutting_down();
        assert_eq!(health.waiting_for(), ["shutdown"]);
        assert!(health.failure().is_none());
        health.fail("the lease task ended".into());
        assert_eq!(health.failure().as_deref(), Some("the lease task ended"));
    }
}
