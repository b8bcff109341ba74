//! The admin HTTP servers: `/livez` and `/readyz` on the health-probe address, `/metrics`
//! on the metrics address (plain HTTP, or HTTPS when given a certificate), as kubebuilder's
//! `--health-probe-bind-address` and `--metrics-bind-address` split them: a NetworkPolicy
//! or a TLS requirement for scrapers then leaves the kubelet's probes alone.
//!
//! Readiness is built from parts ([`Health`]): `/readyz` is 200 once every gate is open and
//! the process is not shutting down; otherwise it names what it waits for. `/livez` fails
//! once a critical task has ended.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum_server::tls_rustls::RustlsConfig;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use super::metrics_auth::MetricsAuth;

/// How often the metrics certificate's files are checked for a change.
const RELOAD_CHECK: Duration = Duration::from_secs(10);

pub use crate::runtime::health::Health;

/// Where the admin servers listen, bound early so that a taken address fails the start
/// with a clear error.
pub struct Listeners {
    probes: tokio::net::TcpListener,
    metrics: tokio::net::TcpListener,
    metrics_tls: Option<(RustlsConfig, PathBuf, PathBuf)>,
}

/// A certificate and key (PEM files) to serve `/metrics` over HTTPS with.
pub struct TlsFiles<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
}

impl Listeners {
    pub async fn bind(probes: SocketAddr, metrics: SocketAddr, tls: Option<TlsFiles<'_>>) -> anyhow::Result<Self> {
        let metrics_tls = match tls {
            Some(files) => {
                // kube's client brings rustls with ring; the server uses the same provider.
                let _ = rustls::crypto::ring::default_provider().install_default();
                let config = RustlsConfig::from_pem_file(files.cert, files.key).await.map_err(|e| {
                    anyhow::anyhow!(
                        "metrics TLS: cannot load {} and {}: {e}",
                        files.cert.display(),
                        files.key.display()
                    )
                })?;
                Some((config, files.cert.to_path_buf(), files.key.to_path_buf()))
            }
            None => None,
        };
        Ok(Self { probes: bind(probes, "health-probe").await?, metrics: bind(metrics, "metrics").await?, metrics_tls })
    }
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("{what} server: cannot listen on {addr}: {e}"))
}

/// Serves probes and metrics until `shutdown` is cancelled; an error if either server fails.
/// With `auth`, `/metrics` answers only scrapers whose token may read it.
pub async fn serve(
    listeners: Listeners,
    health: Arc<Health>,
    metrics: PrometheusHandle,
    auth: Option<MetricsAuth>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let probes = Router::new().route("/livez", get(livez)).route("/readyz", get(readyz)).with_state(health);
    let mut metrics = Router::new().route("/metrics", get(|| async move { super::metrics::render(&metrics) }));
    if let Some(auth) = auth {
        metrics = metrics.route_layer(axum::middleware::from_fn_with_state(auth, super::metrics_auth::require));
    }
    tracing::info!(addr = %listeners.probes.local_addr()?, "health-probe server listening");
    let probes = axum::serve(listeners.probes, probes).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let metrics_addr = listeners.metrics.local_addr()?;
    let metrics = async move {
        match listeners.metrics_tls {
            Some((tls, cert, key)) => {
                tracing::info!(addr = %metrics_addr, "metrics server listening (HTTPS)");
                tokio::spawn(reload_on_change(tls.clone(), cert, key, shutdown.clone()));
                let handle = axum_server::Handle::new();
                tokio::spawn({
                    let handle = handle.clone();
                    async move {
                        shutdown.cancelled().await;
                        handle.graceful_shutdown(Some(Duration::from_secs(1)));
                    }
                });
                axum_server::from_tcp_rustls(listeners.metrics.into_std()?, tls)?
                    .handle(handle)
                    .serve(metrics.into_make_service())
                    .await
            }
            None => {
                tracing::info!(addr = %metrics_addr, "metrics server listening");
                axum::serve(listeners.metrics, metrics).with_graceful_shutdown(shutdown.cancelled_owned()).await
            }
        }
    };
    tokio::try_join!(async { probes.await.map_err(anyhow::Error::from) }, async {
        metrics.await.map_err(anyhow::Error::from)
    })?;
    Ok(())
}

/// Reloads the certificate when either file changes on disk, as a renewed Secret or a
/// cert-manager rotation changes it. Polled every 10 s: two `stat` calls do not warrant a
/// file-watching crate, and a mounted Secret changes by symlink swaps that notify-style
/// watches of the file itself miss.
async fn reload_on_change(tls: RustlsConfig, cert: PathBuf, key: PathBuf, shutdown: CancellationToken) {
    let stamp = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut loaded = (stamp(&cert), stamp(&key));
    let mut tick = tokio::time::interval(RELOAD_CHECK);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let now = (stamp(&cert), stamp(&key));
        if now == loaded {
            continue;
        }
        match tls.reload_from_pem_file(&cert, &key).await {
            Ok(()) => {
                tracing::info!(cert = %cert.display(), "metrics TLS: certificate reloaded");
                loaded = now;
            }
            // A half-written pair: keep serving the old one and try again at the next tick.
            Err(error) => tracing::warn!(%error, cert = %cert.display(), "metrics TLS: cannot reload yet"),
        }
    }
}

async fn readyz(State(health): State<Arc<Health>>) -> (StatusCode, String) {
    match health.waiting_for() {
        waiting if waiting.is_empty() => (StatusCode::OK, "ok".into()),
        waiting => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: waiting for {}", waiting.join(", "))),
    }
}

async fn livez(State(health): State<Arc<Health>>) -> (StatusCode, String) {
    match health.failure() {
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
