//! The API clients. Work (watches, reconciles, labelling, events) goes through a token
//! bucket, as client-go's `--kube-api-qps` and `--kube-api-burst` do, so that one replica
//! cannot flood the API server. Coordination (Lease renewals, leader election, the member
//! and assignment watches and writes) has a client of its own without it: a burst of work
//! must never make a renewal late. Both keep kube-client's default retry of 429, 503 and
//! 504, with backoff that honours the server's Retry-After.

use std::future::Future;
use std::num::NonZeroU32;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kube::Client;
use kube::client::ClientBuilder;
use tower::{Layer, Service};

pub struct Clients {
    /// Rate-limited.
    pub work: Client,
    /// Not rate-limited: Leases and the assignment only.
    pub coordination: Client,
}

impl Clients {
    pub fn new(config: kube::Config, qps: NonZeroU32, burst: NonZeroU32) -> anyhow::Result<Self> {
        let coordination = ClientBuilder::try_from(config.clone())?.with_layer(&RequestMetrics).build();
        let limiter = Arc::new(RateLimiter::direct(Quota::per_second(qps).allow_burst(burst)));
        let work =
            ClientBuilder::try_from(config)?.with_layer(&RequestMetrics).with_layer(&TokenBucket(limiter)).build();
        Ok(Self { work, coordination })
    }
}

/// `client` with `name=value` added to the query of every request it sends: for a request
/// parameter kube's typed parameters do not have (the alpha `shardSelector`). The requests
/// still go through `client`'s layers (rate limit, metrics).
pub fn with_query(client: Client, name: &str, value: &str) -> Client {
    let default_namespace = client.default_namespace().to_string();
    let pair: String = form_urlencoded::Serializer::new(String::new()).append_pair(name, value).finish();
    let service = tower::service_fn(move |mut request: http::Request<kube::client::Body>| {
        let client = client.clone();
        let uri = request.uri();
        let query = match uri.query() {
            Some(query) => format!("{query}&{pair}"),
            None => pair.clone(),
        };
        let with_query = format!("{}?{query}", uri.path()).parse::<http::uri::PathAndQuery>();
        async move {
            let mut parts = request.uri().clone().into_parts();
            parts.path_and_query = Some(with_query.map_err(|e| kube::Error::Service(e.into()))?);
            *request.uri_mut() = http::Uri::from_parts(parts).map_err(|e| kube::Error::Service(e.into()))?;
            client.send(request).await
        }
    });
    Client::new(service, default_namespace)
}

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
            let wait = self.waiting.get_or_insert_with(|| Box::pin(async move { bucket.until_ready().await }));
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
}
