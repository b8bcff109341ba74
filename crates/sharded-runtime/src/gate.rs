//! The right to write, as a reconcile sees it: checked right before every API write, and
//! carrying a fencing token that the gate stamps on the write. Whoever runs the reconcile
//! decides what the right rests on, how the token is stamped and how the API server's
//! refusal of a stale token reads (a sharding layer, say); the reconcile
//! itself knows nothing of buckets, leases, assignments or fencing annotations.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::core::Status;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// Leave to send one write.
#[derive(Clone, Copy, Debug)]
pub struct Permit {
    /// The fencing token to stamp on the write.
    pub token: u64,
    /// When the write counts as sent: read *before* the check said yes, so that the write's
    /// bound, and the window in which it may still land, run from before that answer.
    pub sent: Instant,
}

/// What a reconcile writes through: it says before each write whether the write may go, with which
/// token, and how long it may take.
pub trait WriteGate: Send + Sync {
    /// Right before a write: its [`Permit`], or [`Error::LostOwnership`] when this replica
    /// may no longer write.
    fn check(&self, what: &str) -> Result<Permit>;
    /// Whether this replica may still write, without a write to follow (nothing recorded).
    fn permitted(&self) -> bool;
    /// How long one write may take, client and server side.
    fn write_bound(&self) -> Duration;
    /// Labels to put on every object written, so that the watches of whoever may write it
    /// next select it (the bucket label, under sharding).
    fn routing_labels(&self) -> Vec<(String, String)>;
    /// A write sent at `sent` was given up unanswered; it may still land for a while.
    fn abandoned(&self, sent: Instant);
    /// Puts `permit`'s fencing token on an object about to be written.
    fn stamp(&self, permit: &Permit, annotations: &mut BTreeMap<String, String>);
    /// Whether the API server's refusal says the object holds a newer writer's token.
    fn is_fenced(&self, refusal: &Status) -> bool;
}

/// Runs one write, permitted by `permit`, within the gate's bound from the permit's send
/// time; a write that does not answer in time is reported as abandoned, since it may still
/// reach the server. A write whose bound passed before it could be sent (the process was
/// paused after the check) is not sent at all. A refusal the gate reads as fenced is
/// [`Error::Fenced`].
pub async fn bounded<T>(
    gate: &dyn WriteGate,
    permit: &Permit,
    write: impl Future<Output = kube::Result<T>>,
) -> Result<T> {
    let bound = gate.write_bound();
    let deadline = permit.sent + bound;
    if Instant::now() >= deadline {
        return Err(Error::Timeout(bound));
    }
    let mut abandoned = AbandonOnDrop { gate, sent: permit.sent, armed: true };
    let result = tokio::time::timeout_at(deadline, write).await;
    // Only an answer from the server that it is done with the write says the write is over. A
    // transport error after the request was sent says nothing of whether it will still be
    // applied, and neither does a 5xx: a 504 from a proxy, or a 500 from a server whose storage
    // timed out, may come while the write still goes through.
    abandoned.armed = !matches!(result, Ok(Ok(_))) && !matches!(&result, Ok(Err(kube::Error::Api(s))) if s.code < 500);
    match result {
        Ok(Err(kube::Error::Api(refusal))) if gate.is_fenced(&refusal) => Err(Error::Fenced(refusal.message)),
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
        fn check(&self, _: &str) -> Result<Permit> {
            Ok(Permit { token: 1, sent: Instant::now() })
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
        fn stamp(&self, _: &Permit, _: &mut BTreeMap<String, String>) {}
        fn is_fenced(&self, refusal: &Status) -> bool {
            refusal.reason == "Fenced"
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_does_not_answer_in_time_is_abandoned() {
        let gate = Recorder::default();
        let permit = gate.check("x").unwrap();
        let answered = bounded(&gate, &permit, async { Ok::<_, kube::Error>(7) }).await.unwrap();
        assert_eq!(answered, 7);
        assert!(gate.0.lock().unwrap().is_empty());
        let refused = kube::core::Status::failure("invalid", "Invalid").with_code(422);
        let refused = bounded(&gate, &permit, async { Err::<(), _>(kube::Error::Api(Box::new(refused))) }).await;
        assert!(refused.is_err());
        assert!(gate.0.lock().unwrap().is_empty(), "the server refused it: it will not land");
        let gateway_timeout = kube::core::Status::failure("timeout", "Timeout").with_code(504);
        let gateway_timeout =
            bounded(&gate, &permit, async { Err::<(), _>(kube::Error::Api(Box::new(gateway_timeout))) }).await;
        assert!(gateway_timeout.is_err());
        assert_eq!(gate.0.lock().unwrap().len(), 1, "a 504 may still land");
        let stale = kube::core::Status::failure("token 3 < 4", "Fenced").with_code(403);
        let stale = bounded(&gate, &permit, async { Err::<(), _>(kube::Error::Api(Box::new(stale))) }).await;
        assert!(matches!(stale, Err(Error::Fenced(message)) if message == "token 3 < 4"), "the gate reads the refusal");
        gate.0.lock().unwrap().clear();
        let hung = bounded(&gate, &gate.check("x").unwrap(), std::future::pending::<kube::Result<()>>()).await;
        assert!(matches!(hung, Err(Error::Timeout(_))));
        assert_eq!(gate.0.lock().unwrap().len(), 1);
        // Dropped mid-flight (the whole reconcile timed out): abandoned too.
        let permit = gate.check("x").unwrap();
        let dropped = bounded(&gate, &permit, std::future::pending::<kube::Result<()>>());
        drop(tokio::time::timeout(Duration::from_secs(1), dropped).await);
        assert_eq!(*gate.0.lock().unwrap().last().unwrap(), permit.sent, "abandoned as of the permit's send time");
        assert_eq!(gate.0.lock().unwrap().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn the_bound_runs_from_before_the_check_and_a_late_write_is_not_sent() {
        let gate = Recorder::default();
        let permit = gate.check("x").unwrap();
        // Paused for most of the bound between the check and the send: the rest is all it gets.
        tokio::time::advance(Duration::from_secs(4)).await;
        let hung = bounded(&gate, &permit, std::future::pending::<kube::Result<()>>()).await;
        assert!(matches!(hung, Err(Error::Timeout(_))));
        assert_eq!(Instant::now() - permit.sent, Duration::from_secs(5), "timed out at the permit's bound");
        gate.0.lock().unwrap().clear();
        // Paused past the bound: never sent, so nothing may land.
        let sent = std::sync::atomic::AtomicBool::new(false);
        let late = bounded(&gate, &permit, async {
            sent.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, kube::Error>(())
        });
        assert!(matches!(late.await, Err(Error::Timeout(_))));
        assert!(!sent.load(std::sync::atomic::Ordering::SeqCst), "the write was not sent");
        assert!(gate.0.lock().unwrap().is_empty(), "nothing sent, nothing abandoned");
    }

    #[test]
    fn the_server_side_timeout_is_added_to_the_query() {
        let request = http::Request::patch("/api/v1/namespaces/a/configmaps/b?fieldManager=x").body(vec![]).unwrap();
        let request = with_server_timeout(request, Duration::from_secs(5));
        assert_eq!(request.uri().to_string(), "/api/v1/namespaces/a/configmaps/b?fieldManager=x&timeout=5000ms");
    }
}
