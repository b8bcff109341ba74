//! The admin HTTP server: `/livez`, `/readyz` and `/metrics` on one small listener.
//!
//! `/readyz` is 200 only once every watch has completed its initial list and the
//! process is not shutting down.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

/// Readiness inputs, shared with the runtime.
#[derive(Default)]
pub struct Health {
    synced: AtomicBool,
    shutting_down: AtomicBool,
}

impl Health {
    pub fn set_synced(&self, synced: bool) {
        self.synced.store(synced, Ordering::Relaxed);
    }

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.synced.load(Ordering::Relaxed) && !self.shutting_down.load(Ordering::Relaxed)
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
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(|State(s): State<AdminState>| async move { s.metrics.render() }))
        .with_state(AdminState { health, metrics });
    tracing::info!(addr = %listener.local_addr()?, "admin server listening");
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await?;
    Ok(())
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    if s.health.is_ready() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready") }
}
