//! The controller: watch events through the predicate into the queue, and a bounded pool
//! of workers that reconcile one key at a time.
//!
//! Contract:
//! - a key is reconciled by at most one worker at a time (the queue guarantees it);
//! - success and terminal errors schedule a jittered resync; other errors retry with
//!   per-key exponential backoff, reset on success;
//! - a reconcile that panics is caught, counted, and retried with backoff like an error,
//!   so its key is never left marked as processing;
//! - no reconcile of an object starts until every child watch has listed its part of the
//!   slice: until then what is known of its children is incomplete, and a reconcile would
//!   write children it could have known to be current;
//! - on shutdown no new work is taken, and in-flight reconciles get `drain_timeout`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use futures::future::join_all;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::Resource;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};

use super::backoff::Backoff;
use super::cache::{Cache, Entry};
use super::child_feed::{ChildCommand, ChildFeed};
use super::child_versions::{CHILD_KINDS, ChildVersions};
use super::key::ObjectKey;
use super::list_deadline::ListDeadline;
use super::parts::{Buckets, SliceWatch};
use super::primary_feed::{PrimaryCommand, PrimaryFeed};
use super::queue::{Priority, WorkQueue};
use super::reconciler::{Action, Gatekeeper, Reconciler};
use super::stored::Stored;
use super::watch::{Cached, ChildEvent};
use super::watch_health::WatchHealth;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::metrics::{self, ControllerMetrics, QueueMetrics, ReconcileResult};

/// How a [`Controller`] runs: its name in metrics and logs, workers, resync, and timeouts.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The controller's name in metrics and logs.
    pub name: &'static str,
    pub workers: usize,
    pub resync: Duration,
    pub drain_timeout: Duration,
    pub reconcile_timeout: Duration,
    /// How long the watches may take to list an owned bucket before this process says it
    /// cannot work ([`super::list_deadline`]).
    pub list_deadline: Duration,
    pub backoff: Backoff,
}

/// The buckets whose objects the cache holds a completed list of (`None` before the first).
pub type Listed = tokio::sync::watch::Receiver<Option<Buckets>>;

/// Watch events into a two-lane work queue, and workers that reconcile one key at a time (see the
/// module docs for the contract).
pub struct Controller<S: Stored> {
    settings: Settings,
    queue: Arc<WorkQueue<ObjectKey>>,
    primary_listed: tokio::sync::watch::Sender<Option<Buckets>>,
    /// The buckets each child watch holds a completed list of, by kind; a worker waits until
    /// every kind has listed its object's bucket.
    children_listed: tokio::sync::watch::Sender<BTreeMap<&'static str, Buckets>>,
    cache: Cache<S>,
    metrics: ControllerMetrics,
    health: Arc<Health>,
    watch_health: Arc<WatchHealth>,
}

impl<S> Controller<S>
where
    S: Stored,
    S::Object: Resource<DynamicType = ()> + Send + Sync + 'static,
{
    /// Reports to `watch_health` when the watches do not list the slice in time.
    pub fn new(settings: Settings, cache: Cache<S>, health: Arc<Health>, watch_health: Arc<WatchHealth>) -> Self {
        let queue = Arc::new(WorkQueue::new(settings.backoff, QueueMetrics::new(settings.name)));
        let metrics = ControllerMetrics::new(settings.name, settings.workers);
        metrics::set_cache_synced(settings.name, false);
        let children_listed = tokio::sync::watch::Sender::new(BTreeMap::new());
        let primary_listed = tokio::sync::watch::Sender::new(None);
        Self { settings, queue, primary_listed, children_listed, cache, metrics, health, watch_health }
    }

    /// What the cache holds: the buckets of the primary watch's completed lists.
    pub fn listed(&self) -> Listed {
        self.primary_listed.subscribe()
    }

    /// Runs until `shutdown`, then drains; returns whether every in-flight reconcile finished.
    /// `primary` must be the stream that feeds `cache`.
    /// Each reconcile writes through the gate `gatekeeper` gives it.
    #[allow(clippy::too_many_arguments)]
    pub async fn run<R: Reconciler<S>, G: Gatekeeper>(
        self,
        primary: impl Stream<Item = Cached<S::Object>> + Send + 'static,
        children: Vec<BoxStream<'static, ChildEvent>>,
        slice: SliceWatch,
        child_versions: Arc<ChildVersions>,
        reconciler: Arc<R>,
        gatekeeper: Arc<G>,
        shutdown: CancellationToken,
    ) -> bool {
        let child_kinds = children.len();
        assert!(child_kinds <= CHILD_KINDS, "ChildVersions has room for {CHILD_KINDS} kinds of children");
        let this = Arc::new(self);
        let mut background = vec![
            tokio::spawn(this.clone().feed_primary(primary, reconciler.clone())),
            tokio::spawn(this.clone().update_gauges()),
            tokio::spawn(this.clone().keep_list_deadline(slice.clone(), child_kinds)),
        ];
        for stream in children {
            background.push(tokio::spawn(this.clone().feed_children(stream, child_versions.clone())));
        }
        let workers: Vec<_> = (0..this.settings.workers)
            .map(|_| {
                let slice = slice.clone();
                // An object no longer cached, or whose bucket is not in the slice (any more),
                // has nothing to wait for: the worker finds it gone, or the write gate skips it.
                let children_listed = move |bucket: Option<u16>, listed: &BTreeMap<_, Buckets>| {
                    let Some(bucket) = bucket else { return true };
                    let listed = every_child_kind_listed(listed, child_kinds, bucket);
                    listed || !slice.borrow().as_ref().is_some_and(|owned| owned.contains(&bucket))
                };
                let (reconciler, gatekeeper) = (reconciler.clone(), gatekeeper.clone());
                tokio::spawn(this.clone().work(reconciler, gatekeeper, children_listed, shutdown.clone()))
            })
            .collect();

        shutdown.cancelled().await;
        this.health.set_shutting_down();
        this.queue.shut_down();
        let in_flight = this.queue.in_flight();
        tracing::info!(in_flight, "shutting down: draining in-flight reconciles");
        let drained = tokio::time::timeout(this.settings.drain_timeout, join_all(workers)).await.is_ok();
        if !drained {
            tracing::warn!(timeout = ?this.settings.drain_timeout, "drain deadline passed; abandoning reconciles");
        }
        background.iter().for_each(|task| task.abort());
        drained
    }

    /// Feeds the queue, and tells `reconciler` to forget an object once the cache lets go of
    /// it ([`PrimaryFeed`] has the rules).
    async fn feed_primary<R: Reconciler<S>>(
        self: Arc<Self>,
        primary: impl Stream<Item = Cached<S::Object>> + Send,
        reconciler: Arc<R>,
    ) {
        let mut feed = PrimaryFeed::default();
        let mut primary = std::pin::pin!(primary);
        while let Some(cached) = primary.next().await {
            for command in feed.on(cached) {
                match command {
                    PrimaryCommand::Forget(key) => reconciler.forget(&key),
                    PrimaryCommand::Enqueue(key, lane) => self.queue.add(key, lane),
                    PrimaryCommand::Unlisted(buckets) => {
                        self.primary_listed.send_modify(|listed| listed_without(listed, &buckets));
                    }
                    PrimaryCommand::Listed(buckets) => {
                        self.primary_listed.send_modify(|listed| listed.get_or_insert_default().extend(buckets));
                        self.health.ready(self.settings.name);
                        metrics::set_cache_synced(self.settings.name, true);
                    }
                }
            }
        }
    }

    async fn feed_children(
        self: Arc<Self>,
        mut children: BoxStream<'static, ChildEvent>,
        versions: Arc<ChildVersions>,
    ) {
        let mut feed = ChildFeed::default();
        while let Some(event) = children.next().await {
            for command in feed.on(event, &versions) {
                match command {
                    ChildCommand::Requeue(owner) => self.queue.add(owner, Priority::High),
                    ChildCommand::Unlisted { kind, buckets } => self.children_listed.send_modify(|listed| {
                        listed.entry(kind).or_default().retain(|b| !buckets.contains(b));
                    }),
                    ChildCommand::Listed { kind, buckets } => {
                        self.children_listed.send_modify(|listed| listed.entry(kind).or_default().extend(buckets));
                        self.health.ready(kind);
                    }
                }
            }
        }
    }

    /// Checks every second that each owned bucket is listed by every watch within the deadline.
    async fn keep_list_deadline(self: Arc<Self>, slice: SliceWatch, child_kinds: usize) {
        let mut deadline = ListDeadline::new(self.settings.list_deadline);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let owned = slice.borrow().clone().unwrap_or_default();
            let unlisted: Buckets = {
                let primary = self.primary_listed.borrow();
                let children = self.children_listed.borrow();
                let listed = |bucket: &u16| {
                    primary.as_ref().is_some_and(|p| p.contains(bucket))
                        && every_child_kind_listed(&children, child_kinds, *bucket)
                };
                owned.iter().filter(|b| !listed(b)).copied().collect()
            };
            self.watch_health.set_unlisted(deadline.observe(Instant::now(), &unlisted, owned.len()));
        }
    }

    async fn update_gauges(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            self.queue.update_time_gauges();
            metrics::set_cached_objects(self.settings.name, self.cache.len());
        }
    }

    async fn work<R: Reconciler<S>, G: Gatekeeper>(
        self: Arc<Self>,
        reconciler: Arc<R>,
        gatekeeper: Arc<G>,
        children_listed: impl Fn(Option<u16>, &BTreeMap<&'static str, Buckets>) -> bool,
        shutdown: CancellationToken,
    ) {
        let mut listed = self.children_listed.subscribe();
        while let Some((key, lane)) = self.queue.get().await {
            let bucket = self.cache.entry(&key).and_then(|entry| entry.bucket);
            tokio::select! {
                // The sender lives as long as `self`, so this cannot fail.
                _ = listed.wait_for(|listed| children_listed(bucket, listed)) => {}
                // A list that never completes must not hold up the drain.
                _ = shutdown.cancelled() => {
                    self.queue.done(&key);
                    return;
                }
            }
            self.metrics.active_workers(1.0);
            self.process(&key, lane, reconciler.as_ref(), gatekeeper.as_ref()).await;
            self.queue.done(&key);
            self.metrics.active_workers(-1.0);
        }
    }

    async fn process<R: Reconciler<S>, G: Gatekeeper>(
        &self,
        key: &ObjectKey,
        lane: Priority,
        reconciler: &R,
        gatekeeper: &G,
    ) {
        let Some(Entry { object, bucket }) = self.cache.entry(key) else {
            self.queue.forget(key);
            return;
        };
        let Some(gate) = gatekeeper.admit(key, bucket) else {
            self.finish(key, Ok(Action::Skip), Duration::ZERO);
            return;
        };
        let span = tracing::info_span!(
            "reconcile",
            controller = self.settings.name,
            object = %key,
            generation = object.generation(),
            result = field::Empty,
            duration_ms = field::Empty,
        );
        let started = Instant::now();
        let timeout = self.settings.reconcile_timeout;
        let reconcile =
            AssertUnwindSafe(reconciler.reconcile(key, object, &gate, lane)).catch_unwind().instrument(span.clone());
        let outcome = match tokio::time::timeout(timeout, reconcile).await {
            Ok(Ok(outcome)) => {
                gatekeeper.finished(gate, &outcome);
                outcome
            }
            Ok(Err(panic)) => {
                self.metrics.panicked();
                Err(Error::panicked(panic.as_ref()))
            }
            Err(_) => Err(Error::Timeout(timeout)),
        };
        let took = started.elapsed();
        span.record("duration_ms", took.as_millis() as u64);
        let _entered = span.enter();
        self.finish(key, outcome, took);
    }

    /// Schedules what comes after a reconcile of `key` that returned `outcome`, and counts it.
    fn finish(&self, key: &ObjectKey, outcome: Result<Action>, took: Duration) {
        match outcome {
            Ok(action) => {
                self.queue.forget(key);
                let (result, delay) = match action {
                    Action::Done => (ReconcileResult::Success, Some(jittered(self.settings.resync))),
                    Action::RequeueAfter(delay) => (ReconcileResult::RequeueAfter, Some(delay)),
                    // Not ours now; look again later, in case it becomes ours without a relist
                    // (a lease lapse that ends with the same slice). Gone from the cache, it is
                    // dropped then.
                    Action::Skip => (ReconcileResult::Skipped, Some(NOT_OURS_RETRY)),
                };
                if let Some(delay) = delay {
                    self.queue.add_after(key.clone(), delay, Priority::Low);
                }
                self.metrics.reconciled(result, took, None);
                tracing::Span::current().record("result", result.label());
                tracing::debug!("reconciled");
            }
            // Not a failure of the object's: looked at again once the earlier write can no
            // longer land, without growing its backoff.
            Err(Error::EarlierWriteLanding(wait)) => {
                self.queue.add_after(key.clone(), wait, Priority::High);
                self.metrics.reconciled(ReconcileResult::RequeueAfter, took, None);
                tracing::Span::current().record("result", "earlier_write_landing");
                tracing::debug!(?wait, "an earlier write may still land; looking again after it");
            }
            Err(error) if error.is_terminal() => {
                self.queue.forget(key);
                let next = if error.keeps_resync() { jittered(self.settings.resync) } else { NOT_OURS_RETRY };
                self.queue.add_after(key.clone(), next, Priority::Low);
                self.metrics.reconciled(ReconcileResult::Error, took, Some(error.kind()));
                self.metrics.terminal_error();
                tracing::Span::current().record("result", error.kind());
                tracing::info!(%error, "not retrying until the spec changes");
            }
            Err(error) => {
                let retry_in = self.queue.add_rate_limited(key.clone());
                self.metrics.reconciled(ReconcileResult::Error, took, Some(error.kind()));
                tracing::Span::current().record("result", error.kind());
                tracing::warn!(%error, ?retry_in, "reconcile failed; retrying with backoff");
            }
        }
    }
}

/// Whether each of the `child_kinds` child watches has a completed list of `bucket`.
fn every_child_kind_listed(listed: &BTreeMap<&'static str, Buckets>, child_kinds: usize, bucket: u16) -> bool {
    listed.len() == child_kinds && listed.values().all(|b| b.contains(&bucket))
}

/// `listed` without `buckets` (being listed again, or out of the slice).
fn listed_without(listed: &mut Option<Buckets>, buckets: &Buckets) {
    if let Some(listed) = listed {
        listed.retain(|b| !buckets.contains(b));
    }
}

/// When to look again at an object that was not ours to reconcile.
const NOT_OURS_RETRY: Duration = Duration::from_secs(5);

/// `period` plus up to 10% so that resyncs of objects created together spread out.
fn jittered(period: Duration) -> Duration {
    period.mul_f64(1.0 + rand::random::<f64>() * 0.1)
}

#[cfg(test)]
mod tests;
