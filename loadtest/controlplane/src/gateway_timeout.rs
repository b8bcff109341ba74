//! An HTTP proxy in front of the API server that can answer one write (a patch or a delete)
//! with 504 Gateway Timeout at once and deliver it to the server later: the fault of a load
//! balancer or proxy that gives up on a request which still goes through. The client cannot
//! tell such a write from one that failed, so it must count it as in flight until its bound
//! has passed.
//!
//! It can also answer every list and watch of one resource with 504, as a proxy in front of
//! a failing path would: lists that are retried and never complete. And it can freeze the
//! watches of one resource: each delivers nothing more, neither an event nor a bookmark, and
//! is never closed, as a stalled proxy or load balancer leaves a stream.
//!
//! Clients speak plain HTTP to it (kube's client accepts an `http://` server); it forwards
//! each request with a kube client for the bearer token the request carries, so the API
//! server's audit log names the same user as without the proxy. Its own thread and runtime:
//! it must keep running while the test's runtime is busy.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kube::client::Body;

use crate::ControlPlane;

/// The next write to answer with 504: a `method` request whose path contains `path`,
/// delivered `delay` later.
#[derive(Clone)]
struct Armed {
    method: http::Method,
    path: String,
    delay: Duration,
}

#[derive(Default)]
struct State {
    armed: Option<Armed>,
    /// GETs whose path contains this are answered 504.
    failing_reads: Option<String>,
    /// Watches whose path contains this are answered 200 and then deliver nothing.
    frozen_watches: Option<String>,
    /// The writes answered 504, with the status the server gave each once delivered.
    delivered: Vec<(String, u16)>,
    clients: HashMap<String, kube::Client>,
}

pub struct GatewayTimeoutProxy {
    port: u16,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl GatewayTimeoutProxy {
    /// Listens on a free loopback port and forwards to `cp`'s API server.
    pub fn start(cp: &'static ControlPlane) -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = state.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let mut stopped = stopped;
                loop {
                    let (stream, _) = tokio::select! {
                        accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                        _ = &mut stopped => return,
                    };
                    let state = shared.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |request| forward(cp, state.clone(), request));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        Ok(Self { port, state, stop: Some(stop) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Answers the next PATCH whose path contains `path` with 504 at once, and delivers it to
    /// the API server `delay` later.
    pub fn time_out_next_write(&self, path: &str, delay: Duration) {
        self.arm(http::Method::PATCH, path, delay);
    }

    /// Answers the next DELETE whose path contains `path` with 504 at once, and delivers it
    /// to the API server `delay` later.
    pub fn time_out_next_delete(&self, path: &str, delay: Duration) {
        self.arm(http::Method::DELETE, path, delay);
    }

    fn arm(&self, method: http::Method, path: &str, delay: Duration) {
        self.state.lock().unwrap().armed = Some(Armed { method, path: path.into(), delay });
    }

    /// Answers every GET (list or watch) whose path contains `path` with 504, until called with `None`.
    pub fn time_out_reads(&self, path: Option<&str>) {
        self.state.lock().unwrap().failing_reads = path.map(str::to_string);
    }

    /// Freezes every watch whose path contains `path`, open or to come: it delivers nothing
    /// more and never ends. A watch frozen stays frozen; new ones pass once called with `None`.
    pub fn freeze_watches(&self, path: Option<&str>) {
        self.state.lock().unwrap().frozen_watches = path.map(str::to_string);
    }

    /// Whether a write is still to be answered with 504.
    pub fn armed(&self) -> bool {
        self.state.lock().unwrap().armed.is_some()
    }

    /// The writes answered 504 and delivered since, with the server's status for each.
    pub fn delivered(&self) -> Vec<(String, u16)> {
        self.state.lock().unwrap().delivered.clone()
    }
}

impl Drop for GatewayTimeoutProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

type Answer = Response<Either<Full<Bytes>, Relay>>;

/// The server's answer, passed on; a watch's stops (for good) once its path is frozen, and
/// one frozen from the start (no `body`) never delivers anything.
struct Relay {
    body: Option<Body>,
    /// For a watch, its path.
    watch: Option<String>,
    state: Arc<Mutex<State>>,
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = kube::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, kube::Error>>> {
        let frozen = self.state.lock().unwrap().frozen_watches.clone();
        if self.watch.as_ref().zip(frozen).is_some_and(|(path, frozen)| path.contains(&frozen)) {
            self.body = None;
        }
        match self.body.as_mut() {
            // Never woken: a stalled stream.
            None => std::task::Poll::Pending,
            Some(body) => std::pin::Pin::new(body).poll_frame(cx),
        }
    }
}

async fn forward(
    cp: &'static ControlPlane,
    state: Arc<Mutex<State>>,
    request: Request<Incoming>,
) -> Result<Answer, Infallible> {
    let answer = |code: StatusCode, message: &str| {
        let status = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": message, "reason": "Timeout", "code": code.as_u16()
        });
        let mut response = Response::new(Either::Left(Full::new(Bytes::from(status.to_string()))));
        *response.status_mut() = code;
        response.headers_mut().insert(http::header::CONTENT_TYPE, "application/json".parse().unwrap());
        Ok(response)
    };
    let token = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let Some(token) = token else { return answer(StatusCode::UNAUTHORIZED, "the proxy forwards bearer tokens only") };
    let cached = state.lock().unwrap().clients.get(&token).cloned();
    let client = match cached {
        Some(client) => client,
        None => match cp.client_for_token(&token, "proxied").await {
            Ok(client) => state.lock().unwrap().clients.entry(token).or_insert(client).clone(),
            Err(error) => return answer(StatusCode::BAD_GATEWAY, &error.to_string()),
        },
    };
    let (parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST, "the request body could not be read");
    };
    let mut upstream = Request::builder().method(parts.method.clone()).uri(parts.uri.clone());
    for (name, value) in &parts.headers {
        if ![http::header::HOST, http::header::AUTHORIZATION, http::header::CONNECTION].contains(name) {
            upstream = upstream.header(name, value);
        }
    }
    let upstream = upstream.body(Body::from(body.to_vec())).expect("a request rebuilt from a valid one");
    let path = parts.uri.path().to_string();
    let time_out = {
        let mut state = state.lock().unwrap();
        let hit = state.armed.as_ref().is_some_and(|a| parts.method == a.method && path.contains(&a.path));
        if hit { state.armed.take() } else { None }
    };
    let failing = state.lock().unwrap().failing_reads.clone();
    if failing.is_some_and(|failing| parts.method == http::Method::GET && path.contains(&failing)) {
        return answer(StatusCode::GATEWAY_TIMEOUT, "the proxy timed out");
    }
    let frozen = state.lock().unwrap().frozen_watches.clone();
    let watch = parts.uri.query().is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let watch = watch.then(|| path.clone());
    if frozen.is_some_and(|frozen| watch.as_ref().is_some_and(|w| w.contains(&frozen))) {
        let mut response = Response::new(Either::Right(Relay { body: None, watch, state }));
        response.headers_mut().insert(http::header::CONTENT_TYPE, "application/json".parse().unwrap());
        return Ok(response);
    }
    if let Some(armed) = time_out {
        tokio::spawn(async move {
            tokio::time::sleep(armed.delay).await;
            let code = match client.send(upstream).await {
                Ok(response) => response.status().as_u16(),
                Err(kube::Error::Api(status)) => status.code,
                Err(_) => 0,
            };
            state.lock().unwrap().delivered.push((path, code));
        });
        return answer(StatusCode::GATEWAY_TIMEOUT, "the proxy timed out (the write goes on)");
    }
    match client.send(upstream).await {
        Ok(response) => Ok(response.map(|body| Either::Right(Relay { body: Some(body), watch, state }))),
        Err(error) => answer(StatusCode::BAD_GATEWAY, &error.to_string()),
    }
}
