//! Watches that stall: open, and silent. A proxy or load balancer can leave a watch's stream
//! open while nothing passes any more, and the process goes on renewing its Lease (writes
//! still work) while it sees nothing of its slice.
//!
//! An idle watch is not silent for long: the API server ends every watch at the
//! `timeoutSeconds` it was asked for, and sends a bookmark two seconds before (the watches
//! ask for bookmarks). So a watch that has delivered nothing, not even its end, for longer
//! than its timeout has stalled; so has one the server has not answered within that time.
//! kube-runtime's watcher would quietly reconnect 5 s past the timeout, and a stalled path
//! would stall the new watch too (a watch that is never answered, it would wait on for
//! ever: over HTTP/2 the shared connection stays busy, so no read timeout fires). [`limited`]
//! fails the watch a little earlier with [`Stalled`], which the watch's owner counts as a
//! fault of its watches ([`super::watch_health`]).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use kube::Client;
use kube::runtime::watcher;
use tokio::time::{Instant, Sleep};

/// How much longer than its timeout a watch may deliver nothing before it counts as stalled:
/// less than kube-runtime's own 5 s, so that the stall is seen before it reconnects.
pub const MARGIN: Duration = Duration::from_secs(3);

/// What a stalled watch fails with; its text is how the watch's owner tells it apart.
#[derive(Debug)]
pub struct Stalled(pub Duration);

/// The start of [`Stalled`]'s message.
pub const STALLED: &str = "the watch stalled";

impl fmt::Display for Stalled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{STALLED}: nothing passed for {:?}, not even a bookmark or the server's end of it", self.0)
    }
}

impl std::error::Error for Stalled {}

/// `client`, whose watches fail with [`Stalled`] once they have waited `watch_timeout` and
/// [`MARGIN`] for an answer, or delivered nothing for that long. Other requests pass as they
/// are. Its watches are to ask for `watch_timeout` ([`watcher_config`]).
pub fn limited(client: Client, watch_timeout: Duration) -> Client {
    let limit = watch_timeout + MARGIN;
    let default_namespace = client.default_namespace().to_string();
    let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
        let client = client.clone();
        let limit = is_watch(request.uri()).then_some(limit);
        async move {
            let sent = client.send(request);
            let response = match limit {
                Some(limit) => tokio::time::timeout(limit, sent)
                    .await
                    .map_err(|_| kube::Error::Service(Box::new(Stalled(limit))))??,
                None => sent.await?,
            };
            Ok::<_, kube::Error>(response.map(|body| Limited::new(body, limit)))
        }
    });
    Client::new(service, default_namespace)
}

/// A watcher's configuration that asks the server to end each watch after `watch_timeout`.
pub fn watcher_config(watch_timeout: Duration) -> watcher::Config {
    watcher::Config::default().timeout(u32::try_from(watch_timeout.as_secs()).unwrap_or(u32::MAX))
}

fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

/// A response body that fails once it has delivered nothing for its limit, if it has one.
struct Limited<B> {
    body: B,
    limit: Option<(Duration, Pin<Box<Sleep>>)>,
    failed: bool,
}

impl<B> Limited<B> {
    fn new(body: B, limit: Option<Duration>) -> Self {
        let limit = limit.map(|limit| (limit, Box::pin(tokio::time::sleep(limit))));
        Self { body, limit, failed: false }
    }
}

impl<B> Body for Limited<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<tower::BoxError>,
{
    type Data = Bytes;
    type Error = tower::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            if let Some((limit, silence)) = self.limit.as_mut() {
                silence.as_mut().reset(Instant::now() + *limit);
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let Some((limit, silence)) = self.limit.as_mut() else { return Poll::Pending };
        ready!(silence.as_mut().poll(cx));
        let limit = *limit;
        self.failed = true;
        Poll::Ready(Some(Err(Box::new(Stalled(limit)))))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.body.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use futures::StreamExt;
    use futures::stream::BoxStream;
    use http_body_util::{BodyExt, StreamBody};

    type Frames = StreamBody<BoxStream<'static, Result<Frame<Bytes>, std::convert::Infallible>>>;

    fn frames(stream: BoxStream<'static, &'static str>) -> Frames {
        StreamBody::new(stream.map(|s| Ok(Frame::data(Bytes::from_static(s.as_bytes())))).boxed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_silent_past_its_limit_fails_once_and_ends() {
        let silent = frames(futures::stream::pending().boxed());
        let mut body = Limited::new(silent, Some(Duration::from_secs(13)));
        let started = Instant::now();
        let error = body.frame().await.expect("a frame").expect_err("stalled");
        assert!(error.to_string().starts_with(STALLED), "{error}");
        assert_eq!(started.elapsed(), Duration::from_secs(13));
        assert!(body.frame().await.is_none(), "ends after the error, so the watcher reconnects");
    }

    #[tokio::test(start_paused = true)]
    async fn each_frame_starts_the_limit_again() {
        let ticks = futures::stream::iter(["a", "b", "c"])
            .then(|s| async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                s
            })
            .boxed();
        let mut body = Limited::new(frames(ticks), Some(Duration::from_secs(13)));
        for _ in 0..3 {
            body.frame().await.expect("a frame").expect("not stalled: 10 s apart, under the limit");
        }
        assert!(body.frame().await.is_none(), "the server's end passes");
    }

    /// A client whose server never answers.
    fn unanswered() -> Client {
        let service = tower::service_fn(|_: http::Request<kube::client::Body>| {
            futures::future::pending::<Result<http::Response<kube::client::Body>, tower::BoxError>>()
        });
        Client::new(service, "default")
    }

    fn get(uri: &str) -> http::Request<kube::client::Body> {
        http::Request::get(uri).body(kube::client::Body::empty()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_the_server_never_answers_fails_at_its_limit() {
        let client = limited(unanswered(), Duration::from_secs(10));
        let started = Instant::now();
        let error = client.send(get("/api/v1/configmaps?watch=true&timeoutSeconds=10")).await.expect_err("stalled");
        assert!(error.to_string().contains(STALLED), "{error}");
        assert_eq!(started.elapsed(), Duration::from_secs(13));
    }

    #[tokio::test(start_paused = true)]
    async fn other_requests_take_as_long_as_they_take() {
        let client = limited(unanswered(), Duration::from_secs(10));
        for uri in ["/api/v1/configmaps?limit=500", "/api/v1/configmaps?watch=false", "/api/v1/namespaces/watch"] {
            let waited = tokio::time::timeout(Duration::from_secs(3600), client.send(get(uri))).await;
            assert!(waited.is_err(), "{uri}: not a watch, not limited");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_without_a_limit_waits_for_ever() {
        let mut body = Limited::new(frames(futures::stream::pending().boxed()), None);
        let waited = tokio::time::timeout(Duration::from_secs(3600), body.frame()).await;
        assert!(waited.is_err(), "no limit: still waiting after an hour");
    }
}
