//! Whether this process's watches work. A watch that the API server keeps *refusing*
//! (forbidden by RBAC, a selector it rejects, a resource it does not serve) is not a hiccup
//! to retry quietly for ever: whoever hands out work (the sharding layer) reads
//! [`WatchHealth::broken`] and gives the work to someone else.
//!
//! A process that holds no work watches nothing, so a refusal is only cleared by a list that
//! succeeds: a later watch's, or the refused watch's own probe, a list of one object with the
//! same selector, which [`WatchHealth::probe`] runs.
//!
//! A watch that *stalls* (open and silent past its timeout, see [`super::watch_stall`]) is
//! broken at once, until its probe, which also watches for a moment, sees a watch end as
//! the server ends it.
//!
//! A watch that fails without being refused is retried; if its lists still do not complete
//! in time, the controller says so here too ([`WatchHealth::set_unlisted`], from
//! [`super::list_deadline`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use kube::runtime::watcher;

/// Refusals in a row (the watcher retries with backoff, about 0.8 s, then 1.6 s) before a
/// watch counts as broken: one 403 while RBAC is being installed is not enough.
pub const REFUSALS_BEFORE_BROKEN: u32 = 2;

/// A list of one object with the refused watch's selector.
pub type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<(), kube::Error>> + Send + Sync>;

/// The `timeoutSeconds` a watch asks for unless told otherwise: the server ends it then,
/// and a watch silent for longer has stalled.
pub const WATCH_TIMEOUT: Duration = Duration::from_secs(30);

/// kube refuses to build a watch of 295 s or more (the API server's own limit is near), and
/// its watcher reconnects 5 s past the timeout.
pub const MAX_WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// How long a probe may take: a list of one object, then a watch that the server ends
/// after a second.
const PROBE_DEADLINE: Duration = Duration::from_secs(15);

/// Which watches the API server refuses or stall, and whether that makes them broken.
pub struct WatchHealth {
    /// By resource kind: the watches refused (or stalled) since their last successful list.
    refused: Mutex<BTreeMap<String, Refused>>,
    /// Why the watches have not listed the slice in time, while that stands.
    unlisted: Mutex<Option<String>>,
    /// The `timeoutSeconds` each watch asks for.
    watch_timeout: Duration,
    /// Whether a probe is under way (see [`WatchHealth::probe_in_background`]).
    probing: AtomicBool,
}

impl Default for WatchHealth {
    fn default() -> Self {
        Self {
            refused: Mutex::default(),
            unlisted: Mutex::default(),
            watch_timeout: WATCH_TIMEOUT,
            probing: AtomicBool::new(false),
        }
    }
}

struct Refused {
    reason: String,
    times: u32,
    probe: Probe,
}

impl WatchHealth {
    /// No watch refused; watches ask for [`WATCH_TIMEOUT`].
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// No watch refused; watches ask the server to end them after `watch_timeout`, within
    /// 1 s to [`MAX_WATCH_TIMEOUT`] (a stalled watch is noticed that much and
    /// [`watch_stall::MARGIN`](super::watch_stall::MARGIN) later).
    pub fn with_watch_timeout(watch_timeout: Duration) -> Arc<Self> {
        let watch_timeout = watch_timeout.clamp(Duration::from_secs(1), MAX_WATCH_TIMEOUT);
        Arc::new(Self { watch_timeout, ..Self::default() })
    }

    /// The `timeoutSeconds` each watch asks for.
    pub fn watch_timeout(&self) -> Duration {
        self.watch_timeout
    }

    /// A watch of `kind` failed: counted if the server refused it, broken at once if it
    /// stalled, ignored otherwise.
    pub fn failed(&self, kind: &str, error: &watcher::Error, probe: Probe) {
        let (reason, times) = match (refusal(error), stall(error)) {
            (Some(refusal), _) => (format!("the watch of {kind} is refused: {refusal}"), 1),
            (None, Some(stall)) => (format!("the watch of {kind} {stall}"), REFUSALS_BEFORE_BROKEN),
            (None, None) => return,
        };
        let mut refused = self.lock();
        let entry =
            refused.entry(kind.to_string()).or_insert_with(|| Refused { reason: String::new(), times: 0, probe });
        entry.times += times;
        entry.reason = reason;
    }

    /// A watch of `kind` listed: it works.
    pub fn listed(&self, kind: &str) {
        self.lock().remove(kind);
    }

    /// Why the watches do not work, once one has been refused [`REFUSALS_BEFORE_BROKEN`] times.
    pub fn broken(&self) -> Option<String> {
        let refused = self.lock();
        let broken = refused.values().filter(|r| r.times >= REFUSALS_BEFORE_BROKEN).map(|r| r.reason.clone());
        let unlisted = self.unlisted.lock().unwrap_or_else(|p| p.into_inner()).clone();
        broken.chain(unlisted).reduce(|a, b| format!("{a}; {b}"))
    }

    /// Why the watches did not list the slice in time (`None` once that no longer stands).
    pub fn set_unlisted(&self, why: Option<String>) {
        *self.unlisted.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }

    /// Runs [`WatchHealth::probe`] on a task of its own, unless one is under way: a probe
    /// watches for a moment, longer than a renewal may wait.
    pub fn probe_in_background(self: &Arc<Self>) {
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        // Cleared when the task ends, however it ends.
        struct Probing(Arc<WatchHealth>);
        impl Drop for Probing {
            fn drop(&mut self) {
                self.0.probing.store(false, Ordering::Release);
            }
        }
        let probing = Probing(self.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(PROBE_DEADLINE, probing.0.probe()).await;
        });
    }

    /// Lists (and watches for a moment) with each refused or stalled watch's selector; a kind
    /// whose probe succeeds works again.
    pub async fn probe(&self) {
        let probes: Vec<(String, Probe)> = self.lock().iter().map(|(k, r)| (k.clone(), r.probe.clone())).collect();
        for (kind, probe) in probes {
            match probe().await {
                Ok(()) => {
                    tracing::info!(%kind, "the refused watch's list succeeds now");
                    self.listed(&kind);
                }
                Err(error) => tracing::debug!(%kind, %error, "the refused watch's list still fails"),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Refused>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a stalled watch said ([`super::watch_stall::Stalled`]), found in the error's text:
/// the watcher wraps it in its own errors.
fn stall(error: &watcher::Error) -> Option<String> {
    let text = error.to_string();
    let at = text.find(super::watch_stall::STALLED)?;
    Some(text[at + "the watch ".len()..].to_string())
}

/// What the API server said, if it refused the request for good: a client error other than
/// the ones a retry cures (410 Gone relists, 429 and 408 wait).
fn refusal(error: &watcher::Error) -> Option<String> {
    let status = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.as_ref(),
        watcher::Error::WatchError(s) => s.as_ref(),
        _ => return None,
    };
    let refused = (400..500).contains(&status.code) && ![408, 410, 429].contains(&status.code);
    refused.then(|| format!("{} {}", status.code, status.message))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kube::core::Status;

    use super::*;

    fn answer(code: u16) -> watcher::Error {
        let status = Status { code, message: format!("answer {code}"), ..Default::default() };
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(status)))
    }

    fn probe(works: Arc<AtomicBool>) -> Probe {
        Arc::new(move || -> BoxFuture<'static, Result<(), kube::Error>> {
            let works = works.load(Ordering::SeqCst);
            Box::pin(async move {
                match works {
                    true => Ok(()),
                    false => Err(kube::Error::Api(Box::new(Status { code: 403, ..Default::default() }))),
                }
            })
        })
    }

    #[tokio::test]
    async fn refusals_in_a_row_break_a_watch_until_a_list_succeeds() {
        let health = WatchHealth::default();
        let works = Arc::new(AtomicBool::new(false));
        health.failed("Secret", &answer(403), probe(works.clone()));
        assert_eq!(health.broken(), None, "one refusal is not enough");
        health.failed("Secret", &answer(403), probe(works.clone()));
        let reason = health.broken().expect("broken after two");
        assert!(reason.contains("Secret") && reason.contains("403"), "{reason}");

        health.probe().await;
        assert!(health.broken().is_some(), "the probe is refused too");
        works.store(true, Ordering::SeqCst);
        health.probe().await;
        assert_eq!(health.broken(), None, "the probe's list succeeded");

        health.failed("ConfigMap", &answer(400), probe(works.clone()));
        health.failed("ConfigMap", &answer(400), probe(works));
        assert!(health.broken().is_some());
        health.listed("ConfigMap");
        assert_eq!(health.broken(), None);
    }

    #[tokio::test]
    async fn a_stalled_watch_is_broken_at_once_until_its_probe_succeeds() {
        let health = WatchHealth::default();
        // As the watcher reports it: the body's error, read from the events stream.
        let stalled = super::super::watch_stall::Stalled(std::time::Duration::from_secs(33));
        let read = kube::Error::ReadEvents(std::io::Error::other(kube::Error::Service(Box::new(stalled))));
        let works = Arc::new(AtomicBool::new(false));
        health.failed("NetworkPolicy", &watcher::Error::WatchFailed(read), probe(works.clone()));
        let reason = health.broken().expect("broken after one stall");
        assert!(reason.starts_with("the watch of NetworkPolicy stalled: nothing passed for 33s"), "{reason}");
        health.probe().await;
        assert!(health.broken().is_some(), "the probe fails too");
        works.store(true, Ordering::SeqCst);
        health.probe().await;
        assert_eq!(health.broken(), None, "the probe's watch ended as the server ends it");
    }

    #[test]
    fn a_watch_timeout_is_kept_within_what_kube_builds() {
        let s = Duration::from_secs;
        assert_eq!(WatchHealth::with_watch_timeout(s(30)).watch_timeout(), s(30));
        assert_eq!(WatchHealth::with_watch_timeout(s(300)).watch_timeout(), MAX_WATCH_TIMEOUT);
        assert_eq!(WatchHealth::with_watch_timeout(Duration::ZERO).watch_timeout(), s(1));
    }

    #[test]
    fn what_a_retry_cures_is_not_a_refusal() {
        let health = WatchHealth::default();
        for code in [410, 429, 408, 500, 503, 504] {
            health.failed("X", &answer(code), probe(Arc::default()));
            health.failed("X", &answer(code), probe(Arc::default()));
        }
        health.failed("X", &watcher::Error::NoResourceVersion, probe(Arc::default()));
        assert_eq!(health.broken(), None);
    }
}
