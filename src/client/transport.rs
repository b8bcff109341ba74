//! The clients' transport: kube-client's default stack, with HTTP/2 offered to the API server.
//!
//! kube 4 speaks HTTP/1.1 only (kube-rs/kube#1823 is open), so every request in flight holds a
//! connection of its own: at 32 workers a replica kept about 80, each with its TLS session and
//! read buffers. Over HTTP/2, client-go's default, all of a client's requests and watches share
//! one connection. A server that does not offer HTTP/2 answers in HTTP/1.1 through the same
//! ALPN negotiation, and this behaves as kube's own stack does.

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ClientBuilder, ConfigExt, DynBody};
use tower::retry::{Policy, RetryLayer};
use tower::util::BoxService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

/// A client's service stack, as kube's `ClientBuilder::try_from` builds it.
pub type Stack = BoxService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// What `ClientBuilder::try_from(config)` builds (TLS as the kubeconfig says, base URI, kube's
/// retry of 429, 503 and 504 but for writes answered 503 or 504 ([`WritesMayLand`]), authentication, extra headers, and the connect and write
/// timeouts), with `h2` offered before `http/1.1` if `http2`. Left out: kube's tracing span
/// per request and its error log per failed response (the request metrics layer counts and
/// times every request, by status), and the expiry of client certificates that an exec
/// plugin hands out, which kube does not expose (a client is built once a process).
pub fn builder(config: &kube::Config, http2: bool) -> anyhow::Result<ClientBuilder<Stack>> {
    if config.proxy_url.is_some() {
        // A proxy (kubeconfig `proxy-url`, or `HTTPS_PROXY` with a kubeconfig): kube's own stack,
        // which refuses it with a clear error, as this build enables none of kube's proxy support.
        return Ok(ClientBuilder::try_from(config.clone())?);
    }
    let https = HttpsConnectorBuilder::new().with_tls_config(config.rustls_client_config()?).https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => https.with_server_name_resolver(FixedServerNameResolver::new(name.clone().try_into()?)),
        None => https,
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // ALPN: `h2` first, then `http/1.1`.
    let https = if http2 {
        https.enable_all_versions().wrap_connector(http)
    } else {
        https.enable_http1().wrap_connector(http)
    };
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        // As client-go (kubernetes#87615): with every request on one connection, a connection
        // that died silently must be noticed by pings, not by TCP's retransmission timeout.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .http2_keep_alive_timeout(Duration::from_secs(15))
        .http2_keep_alive_while_idle(true)
        // As Go's HTTP/2 transport: the connection's window never stops the other streams
        // when one watch's reader falls behind; each stream keeps hyper's 2 MiB window.
        .http2_initial_connection_window_size(1 << 30)
        .build::<_, Body>(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| RetryLayer::new(WritesMayLand(RetryPolicy::server_retry()))))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(client)
        .map_response(|response| response.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>));
    Ok(ClientBuilder::new(BoxService::new(service), config.default_namespace.clone()))
}

/// kube's retry policy, except that a write answered 503 or 504 is not sent again: it may
/// still be applied (a proxy's timeout, a server whose storage was slow), and its writer
/// keeps it registered as in flight from its own send time until its bound has passed
/// (`runtime::gate::bounded`). A resend here would be invisible to that window. A 429 is
/// resent: the API server's flow control refuses a request before it does anything with it.
#[derive(Clone)]
pub struct WritesMayLand(RetryPolicy);

impl<Res> Policy<Request<Body>, Response<Res>, BoxError> for WritesMayLand {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        request: &mut Request<Body>,
        result: &mut Result<Response<Res>, BoxError>,
    ) -> Option<Self::Future> {
        let write = !matches!(*request.method(), Method::GET | Method::HEAD);
        let may_land = matches!(result, Ok(r) if matches!(r.status(), StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT));
        if write && may_land {
            return None;
        }
        self.0.retry(request, result)
    }

    fn clone_request(&mut self, request: &Request<Body>) -> Option<Request<Body>> {
        Policy::<Request<Body>, Response<Res>, BoxError>::clone_request(&mut self.0, request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(method: Method, status: StatusCode) -> bool {
        let mut policy = WritesMayLand(RetryPolicy::server_retry());
        let mut request = Request::builder().method(method).uri("/api").body(Body::from(Vec::new())).unwrap();
        let mut result: Result<Response<()>, BoxError> = Ok(Response::builder().status(status).body(()).unwrap());
        policy.retry(&mut request, &mut result).is_none()
    }

    #[tokio::test]
    async fn a_write_that_may_still_land_is_not_resent() {
        assert!(answered(Method::PATCH, StatusCode::GATEWAY_TIMEOUT), "a 504 write goes back to its writer");
        assert!(answered(Method::POST, StatusCode::SERVICE_UNAVAILABLE));
        assert!(!answered(Method::PATCH, StatusCode::TOO_MANY_REQUESTS), "flow control refused it: resent");
        assert!(!answered(Method::GET, StatusCode::GATEWAY_TIMEOUT), "a read is resent");
        assert!(answered(Method::GET, StatusCode::OK));
    }

    #[test]
    fn a_proxy_is_refused_as_kube_refuses_it() {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        config.proxy_url = Some("http://proxy.example:3128".parse().unwrap());
        let error = builder(&config, true).err().expect("no proxy support in this build");
        assert!(error.to_string().contains("proxy"), "{error}");
    }
}
