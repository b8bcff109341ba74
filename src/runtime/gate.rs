//! The right to write, as a reconcile sees it: checked right before every API write, and
//! carrying a fencing token to stamp on the write. Whoever runs the reconcile decides
//! what the right rests on (sharding, in `coordination::gate`); the reconcile itself knows
//! nothing of buckets, leases or assignments.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::controller::Action;
use super::key::ObjectKey;
use crate::error::{Error, Result};

/// On every object we write: the writer's fencing token. The fencing policy in
/// deploy/components/fencing/ refuses an update whose token is lower than the stored one.
pub const FENCE_ANNOTATION: &str = "trafficpolicy.dev/shard-epoch";

pub trait WriteGate: Send + Sync {
    /// Right before a write: the fencing token to stamp on it, or
    /// [`Error::LostOwnership`] when this replica may no longer write.
    fn check(&self, what: &str) -> Result<u64>;
    /// Whether this replica may still write, without a write to follow (nothing recorded).
    fn permitted(&self) -> bool;
    /// How long one write may take, client and server side.
    fn write_bound(&self) -> Duration;
    /// Labels to put on every object written, so that the watches of whoever may write it
    /// next select it (the bucket label, under sharding).
    fn routing_labels(&self) -> Vec<(String, String)>;
    /// A write sent at `sent` was given up unanswered; it may still land for a while.
    fn abandoned(&self, sent: Instant);
}

/// A reconciler whose writes go through a [`WriteGate`].
pub trait GatedReconciler<K>: Send + Sync + 'static {
    fn reconcile(
        &self,
        key: &ObjectKey,
        object: Arc<K>,
        gate: &dyn WriteGate,
    ) -> impl Future<Output = Result<Action>> + Send;
    /// The object is gone from the cache: drop any state kept for it.
    fn forget(&self, key: &ObjectKey);
}

/// Runs one write within the gate's bound; a write that does not answer in time is
/// reported as abandoned, since it may still reach the server.
pub async fn bounded<T>(gate: &dyn WriteGate, write: impl Future<Output = kube::Result<T>>) -> Result<T> {
    let sent = Instant::now();
    let bound = gate.write_bound();
    let mut abandoned = AbandonOnDrop { gate, sent, armed: true };
    let result = tokio::time::timeout(bound, write).await;
    // Only an answer from the server that it is done with the write says the write is over. A
    // transport error after the request was sent says nothing of whether it will still be
    // applied, and neither does a 5xx: a 504 from a proxy, or a 500 from a server whose storage
    // timed out, may come while the write still goes through.
    abandoned.armed = !matches!(result, Ok(Ok(_))) && !matches!(&result, Ok(Err(kube::Error::Api(s))) if s.code < 500);
    match result {
        Ok(result) => Ok(result?),
        Err(_) => Err(Error::Timeout(bound)),
    }
}

/// Reports the write as abandoned if the reconcile is dropped (or times out) before it answers.
struct AbandonOnDrop<'a> {
    gate: &'a dyn WriteGate,
    sent: Instant,
    armed: bool,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.gate.abandoned(self.sent);
        }
    }
}

/// Adds the server-side `timeout` parameter to a mutating request, so the API server
/// gives up on it too instead of applying it late.
pub fn with_server_timeout(mut request: http::Request<Vec<u8>>, bound: Duration) -> http::Request<Vec<u8>> {
    let uri = request.uri().to_string();
    let separator = if uri.contains('?') { '&' } else { '?' };
    let millis = bound.as_millis().max(1);
    if let Ok(uri) = format!("{uri}{separator}timeout={millis}ms").parse() {
        *request.uri_mut() = uri;
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<Instant>>);

    impl WriteGate for Recorder {
        fn check(&self, _: &str) -> Result<u64> {
            Ok(1)
        }
        fn permitted(&self) -> bool {
            true
        }
        fn write_bound(&self) -> Duration {
            Duration::from_secs(5)
        }
        fn routing_labels(&self) -> Vec<(String, String)> {
            Vec::new()
        }
        fn abandoned(&self, sent: Instant) {
            self.0.lock().unwrap().push(sent);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_does_not_answer_in_time_is_abandoned() {
        let gate = Recorder::default();
        let answered = bounded(&gate, async { Ok::<_, kube::Error>(7) }).await.unwrap();
        assert_eq!(answered, 7);
        assert!(gate.0.lock().unwrap().is_empty());
        let refused = kube::core::Status::failure("invalid", "Invalid").with_code(422);
        let refused = bounded(&gate, async { Err::<(), _>(kube::Error::Api(Box::new(refused))) }).await;
        assert!(refused.is_err());
        assert!(gate.0.lock().unwrap().is_empty(), "the server refused it: it will not land");
        let gateway_timeout = kube::core::Status::failure("timeout", "Timeout").with_code(504);
        let gateway_timeout = bounded(&gate, async { Err::<(), _>(kube::Error::Api(Box::new(gateway_timeout))) }).await;
        assert!(gateway_timeout.is_err());
        assert_eq!(gate.0.lock().unwrap().len(), 1, "a 504 may still land");
        gate.0.lock().unwrap().clear();
        let hung = bounded(&gate, std::future::pending::<kube::Result<()>>()).await;
        assert!(matches!(hung, Err(Error::Timeout(_))));
        assert_eq!(gate.0.lock().unwrap().len(), 1);
        // Dropped mid-flight (the whole reconcile timed out): abandoned too.
        let dropped = bounded(&gate, std::future::pending::<kube::Result<()>>());
        drop(tokio::time::timeout(Duration::from_secs(1), dropped).await);
        assert_eq!(gate.0.lock().unwrap().len(), 2);
    }

    #[test]
    fn the_server_side_timeout_is_added_to_the_query() {
        let request = http::Request::patch("/api/v1/namespaces/a/configmaps/b?fieldManager=x").body(vec![]).unwrap();
        let request = with_server_timeout(request, Duration::from_secs(5));
        assert_eq!(request.uri().to_string(), "/api/v1/namespaces/a/configmaps/b?fieldManager=x&timeout=5000ms");
    }
}
