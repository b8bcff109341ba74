//! The API clients. Work (watches, reconciles, labelling, events) may go through a token
//! bucket, as client-go's `--kube-api-qps` and `--kube-api-burst` do. By default the bucket
//! is there only where the API server does not apply API Priority and Fairness: where it
//! does, the server queues and sheds load fairly itself, and a fixed client-side rate would
//! only hold a replica below what the server has room for (SIG API Machinery's advice, which
//! controller-runtime follows since v0.21). Coordination (Lease renewals, leader election,
//! the member and assignment watches and writes) has a client of its own without it: a burst
//! of work must never make a renewal late. Both keep kube-client's default retry of 429, 503
//! and 504, with backoff that honours the server's Retry-After. Both speak HTTP/2 where the
//! API server offers it ([`transport`]): each client's requests share one connection.

mod transport;

use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::path::Path;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kube::Client;
use tower::{Layer, Service};

pub struct Clients {
    /// Rate-limited when a limit applies.
    pub work: Client,
    /// Never rate-limited: Leases and the assignment only.
    pub coordination: Client,
}

impl Clients {
    /// Both clients, offering HTTP/2 if `http2`; with `RateLimit::Auto`, asks the API server
    /// first whether it applies Priority and Fairness. The limit in force is logged and exported.
    pub async fn connect(
        config: kube::Config,
        http2: bool,
        limit: RateLimit,
        burst: NonZeroU32,
    ) -> anyhow::Result<Self> {
        let coordination = transport::builder(&config, http2)?.with_layer(&RequestMetrics).build();
        let qps = match limit {
            RateLimit::PerSecond(qps) => Some(qps),
            RateLimit::Off => None,
            RateLimit::Auto => match server_applies_fairness(&coordination).await {
                Ok(true) => None,
                Ok(false) => Some(RateLimit::FALLBACK),
                Err(error) => {
                    tracing::warn!(%error, "cannot tell whether the API server applies Priority and Fairness");
                    Some(RateLimit::FALLBACK)
                }
            },
        };
        match (qps, limit) {
            (Some(qps), _) => tracing::info!(qps, burst, requested = %limit, "client-side rate limit on"),
            (None, RateLimit::Off) => tracing::info!("client-side rate limit off, as asked"),
            (None, _) => tracing::info!("client-side rate limit off: the API server applies Priority and Fairness"),
        }
        crate::telemetry::metrics::set_client_rate_limit(qps.map_or(0, NonZeroU32::get));
        let work = transport::builder(&config, http2)?.with_layer(&RequestMetrics);
        let work = match qps {
            Some(qps) => {
                let limiter = Arc::new(RateLimiter::direct(Quota::per_second(qps).allow_burst(burst)));
                work.with_layer(&TokenBucket(limiter)).build()
            }
            None => work.build(),
        };
        Ok(Self { work, coordination })
    }
}

/// `--kube-api-qps`: requests per second, `off`, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateLimit {
    /// Off where the API server applies Priority and Fairness, [`RateLimit::FALLBACK`] otherwise.
    Auto,
    Off,
    PerSecond(NonZeroU32),
}

impl RateLimit {
    /// The limit `auto` sets where the server does not apply Priority and Fairness.
    pub const FALLBACK: NonZeroU32 = NonZeroU32::new(500).unwrap();
}

impl FromStr for RateLimit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            // -1 is client-go's and controller-runtime's way to say off.
            "off" | "-1" => Ok(Self::Off),
            number => number
                .parse()
                .map(Self::PerSecond)
                .map_err(|_| format!("{s:?}: expected requests per second (at least 1), `off` (or -1) or `auto`")),
        }
    }
}

impl fmt::Display for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Off => f.write_str("off"),
            Self::PerSecond(qps) => write!(f, "{qps}"),
        }
    }
}

/// Whether the API server applies Priority and Fairness: it then names, in every response,
/// the FlowSchema that classified the request. (`/version` needs no permission beyond being
/// authenticated.) A proxy in between that drops the header makes this say no, and the
/// fallback limit then applies.
async fn server_applies_fairness(client: &Client) -> anyhow::Result<bool> {
    let request = http::Request::get("/version").body(kube::client::Body::from(Vec::new()))?;
    let response = client.send(request).await?;
    anyhow::ensure!(response.status().is_success(), "GET /version answered {}", response.status());
    Ok(names_a_flow_schema(response.headers()))
}

fn names_a_flow_schema(headers: &http::HeaderMap) -> bool {
    headers.contains_key("x-kubernetes-pf-flowschema-uid")
}

pub use crate::runtime::client::with_query;

/// The configuration from `kubeconfig`, or from the in-cluster config or default kubeconfig.
pub async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Config> {
    match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("cannot read kubeconfig {}: {e}", path.display()))?;
            Ok(kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?)
        }
        None => kube::Config::infer().await.map_err(|e| anyhow::anyhow!("no Kubernetes configuration found: {e}")),
    }
}

/// A tower layer that takes a token from the bucket before each request. (tower's own
/// `RateLimitLayer` counts requests per fixed window, with no burst.)
#[derive(Clone)]
struct TokenBucket(Arc<DefaultDirectRateLimiter>);

impl<S> Layer<S> for TokenBucket {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited { inner, bucket: self.0.clone(), waiting: None, has_token: false }
    }
}

/// Waits for its token in `poll_ready`, so a request is sent only once it may be.
pub struct Limited<S> {
    inner: S,
    bucket: Arc<DefaultDirectRateLimiter>,
    waiting: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    has_token: bool,
}

impl<S: Service<R>, R> Service<R> for Limited<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if !self.has_token {
            let bucket = self.bucket.clone();
            let wait = self.waiting.get_or_insert_with(|| {
                Box::pin(async move {
                    let started = std::time::Instant::now();
                    bucket.until_ready().await;
                    crate::telemetry::metrics::rate_limiter_waited(started.elapsed());
                })
            });
            ready!(wait.as_mut().poll(cx));
            self.waiting = None;
            self.has_token = true;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.has_token = false;
        self.inner.call(request)
    }
}

/// A tower layer that counts every request by method and status code and times it until
/// the response headers arrive, as client-go's `rest_client_requests_total` and
/// `rest_client_request_duration_seconds` do.
#[derive(Clone)]
struct RequestMetrics;

impl<S> Layer<S> for RequestMetrics {
    type Service = Measured<S>;

    fn layer(&self, inner: S) -> Measured<S> {
        Measured { inner }
    }
}

#[derive(Clone)]
pub struct Measured<S> {
    inner: S,
}

impl<S, B, R> Service<http::Request<B>> for Measured<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.method().clone();
        let started = std::time::Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            let status = response.as_ref().ok().map(|r| r.status().as_u16());
            crate::telemetry::metrics::api_request(method.as_str(), status, started.elapsed());
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::ServiceExt;

    #[tokio::test]
    async fn requests_beyond_the_burst_wait_for_tokens() {
        let bucket = Arc::new(RateLimiter::direct(
            Quota::per_second(NonZeroU32::new(20).unwrap()).allow_burst(NonZeroU32::new(5).unwrap()),
        ));
        let mut service = TokenBucket(bucket).layer(tower::service_fn(|n: u32| async move { Ok::<_, ()>(n) }));
        let started = std::time::Instant::now();
        for n in 0..9 {
            service.ready().await.unwrap().call(n).await.unwrap();
        }
        // Five at once, then four more at 20 per second: at least 150 ms (the first of them may
        // be nearly due). A lower bound only: a slow machine cannot make it fail.
        assert!(started.elapsed() >= Duration::from_millis(150), "{:?}", started.elapsed());
    }

    #[test]
    fn the_rate_limit_flag_reads_a_number_off_or_auto() {
        assert_eq!("auto".parse(), Ok(RateLimit::Auto));
        assert_eq!("off".parse(), Ok(RateLimit::Off));
        assert_eq!("40".parse(), Ok(RateLimit::PerSecond(NonZeroU32::new(40).unwrap())));
        assert_eq!("-1".parse(), Ok(RateLimit::Off), "as client-go reads it");
        for bad in ["0", "-2", "fast", ""] {
            let error = bad.parse::<RateLimit>().unwrap_err();
            assert!(error.contains("expected requests per second"), "{bad}: {error}");
        }
        assert_eq!(RateLimit::PerSecond(NonZeroU32::new(40).unwrap()).to_string(), "40");
    }

    #[test]
    fn priority_and_fairness_shows_in_the_flow_schema_header() {
        let mut headers = http::HeaderMap::new();
        assert!(!names_a_flow_schema(&headers));
        headers.insert("X-Kubernetes-PF-FlowSchema-UID", "f602d14c".parse().unwrap());
        assert!(names_a_flow_schema(&headers), "header names are case-insensitive");
    }
}
