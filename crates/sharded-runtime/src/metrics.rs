//! The runtime's metrics, named after client-go's workqueue and controller-runtime's
//! controller metrics (`workqueue_*`, `controller_runtime_*`) so that existing dashboards and
//! alerts apply, and the cache's and watches' own under the program's prefix
//! ([`set_prefix`]). Recorded through the `metrics` facade: the program installs the
//! exporter, and calls [`describe`].
//!
//! Labels are bounded: the controller name, a result, an error kind, a resource kind. Never an
//! object or a namespace.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

/// The names of the metrics that carry the program's prefix, fixed at the first use.
struct Names {
    prefix: &'static str,
    cached_objects: &'static str,
    cache_synced: &'static str,
    watch_errors: &'static str,
    listed_objects: &'static str,
}

static NAMES: OnceLock<Names> = OnceLock::new();

impl Names {
    fn with_prefix(prefix: &str) -> Self {
        // Made once per process: the `metrics` macros then take the names without copying.
        let name = |suffix: &str| -> &'static str { Box::leak(format!("{prefix}_{suffix}").into_boxed_str()) };
        Self {
            prefix: Box::leak(prefix.into()),
            cached_objects: name("cached_objects"),
            cache_synced: name("cache_synced"),
            watch_errors: name("watch_errors_total"),
            listed_objects: name("listed_objects_total"),
        }
    }
}

/// Names the cache's and the watches' metrics `<prefix>_cached_objects`, `<prefix>_cache_synced`,
/// `<prefix>_watch_errors_total` and `<prefix>_listed_objects_total` (`controller_…` unless
/// set). Call it before anything records; later calls change nothing.
pub fn set_prefix(prefix: &str) {
    let _ = NAMES.set(Names::with_prefix(prefix));
}

/// The prefix set by [`set_prefix`]: for the metrics of other crates built on the runtime.
pub fn prefix() -> &'static str {
    names().prefix
}

fn names() -> &'static Names {
    NAMES.get_or_init(|| Names::with_prefix("controller"))
}

/// Describes every metric of the runtime to the installed recorder.
pub fn describe() {
    let names = names();
    describe_gauge!("workqueue_depth", "Current depth of the work queue, by lane (priority).");
    describe_counter!("workqueue_adds_total", "Keys added to the work queue.");
    describe_histogram!("workqueue_queue_duration_seconds", "Time a key waits in the queue before a worker takes it.");
    describe_histogram!("workqueue_work_duration_seconds", "Time a worker spends on a key.");
    describe_counter!("workqueue_retries_total", "Keys re-queued with backoff after an error.");
    describe_gauge!("workqueue_unfinished_work_seconds", "Seconds of work in progress not yet finished.");
    describe_gauge!("workqueue_longest_running_processor_seconds", "Seconds the longest running worker has been busy.");
    describe_gauge!("workqueue_oldest_item_age_seconds", "Age of the oldest key waiting in the queue.");
    describe_counter!("controller_runtime_reconcile_total", "Reconciles by result.");
    describe_counter!("controller_runtime_reconcile_errors_total", "Reconciles that failed, by error kind.");
    describe_counter!(
        "controller_runtime_terminal_reconcile_errors_total",
        "Reconciles that failed in a way a retry cannot fix (the object's status says why)."
    );
    describe_counter!("controller_runtime_reconcile_panics_total", "Reconciles that panicked (caught and retried).");
    describe_histogram!("controller_runtime_reconcile_time_seconds", "Duration of a reconcile.");
    describe_gauge!("controller_runtime_active_workers", "Workers busy with a reconcile.");
    describe_gauge!("controller_runtime_max_concurrent_reconciles", "Configured worker count.");
    describe_gauge!(names.cached_objects, "Objects held in the cache, by resource.");
    describe_gauge!(names.cache_synced, "1 when the watch of a resource has completed its initial list.");
    describe_counter!(names.watch_errors, "Failed watches and lists, by resource (retried).");
    describe_counter!(
        names.listed_objects,
        "Objects the API server sent in lists (initial lists, handoffs, relists), by resource."
    );
}

/// A watch or list of `resource` failed (it is retried with backoff).
pub fn count_watch_error(resource: &str) {
    counter!(names().watch_errors, "resource" => resource.to_string()).increment(1);
}

/// A list brought one object of `resource`.
pub fn count_listed(resource: &str) {
    counter!(names().listed_objects, "resource" => resource.to_string()).increment(1);
}

/// Keys waiting, per lane: `workqueue_depth{priority="high"|"low"}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueDepth {
    pub high: usize,
    pub low: usize,
}

impl QueueDepth {
    /// The count of one lane: `high` or not.
    pub fn lane(&mut self, high: bool) -> &mut usize {
        if high { &mut self.high } else { &mut self.low }
    }
}

/// The `workqueue_*` family for one queue.
#[derive(Clone)]
pub struct QueueMetrics {
    name: &'static str,
}

impl QueueMetrics {
    /// The work queue metrics of controller `name`.
    pub fn new(name: &'static str) -> Self {
        Self { name }
    }

    /// A key was added; the queue is now `depth` deep.
    pub fn added(&self, depth: QueueDepth) {
        counter!("workqueue_adds_total", "name" => self.name, "controller" => self.name).increment(1);
        self.set_depth(depth);
    }

    /// A worker took a key that waited `waited`; the queue is now `depth` deep.
    pub fn handed_out(&self, waited: Duration, depth: QueueDepth) {
        histogram!("workqueue_queue_duration_seconds", "name" => self.name, "controller" => self.name).record(waited);
        self.set_depth(depth);
    }

    /// A worker finished a key after `took`.
    pub fn work_done(&self, took: Duration) {
        histogram!("workqueue_work_duration_seconds", "name" => self.name, "controller" => self.name).record(took);
    }

    /// A key was queued again with backoff.
    pub fn retry(&self) {
        counter!("workqueue_retries_total", "name" => self.name, "controller" => self.name).increment(1);
    }

    /// How long each busy worker has been at its key, and the queue's depth.
    pub fn set_running(&self, running: &[Duration], depth: QueueDepth) {
        let unfinished: f64 = running.iter().map(Duration::as_secs_f64).sum();
        let longest = running.iter().max().copied().unwrap_or_default();
        gauge!("workqueue_unfinished_work_seconds", "name" => self.name, "controller" => self.name).set(unfinished);
        gauge!("workqueue_longest_running_processor_seconds", "name" => self.name, "controller" => self.name)
            .set(longest.as_secs_f64());
        self.set_depth(depth);
    }

    /// The age of the oldest key waiting.
    pub fn set_oldest_item_age(&self, age: Duration) {
        gauge!("workqueue_oldest_item_age_seconds", "name" => self.name, "controller" => self.name)
            .set(age.as_secs_f64());
    }

    /// Per lane: `high` holds changes and retries, `low` the initial list's backlog and
    /// resyncs, so an alert on `high` does not fire on a restart's backlog.
    pub fn set_depth(&self, depth: QueueDepth) {
        for (priority, keys) in [("high", depth.high), ("low", depth.low)] {
            gauge!("workqueue_depth", "name" => self.name, "controller" => self.name, "priority" => priority)
                .set(keys as f64);
        }
    }
}

/// The `controller_runtime_*` family for one controller.
#[derive(Clone)]
pub struct ControllerMetrics {
    name: &'static str,
}

/// How a reconcile ended, as controller-runtime labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconcileResult {
    Success,
    Error,
    RequeueAfter,
    /// The object belongs to another replica's slice.
    Skipped,
}

impl ReconcileResult {
    /// The value of the `result` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Error => "error",
            Self::RequeueAfter => "requeue_after",
            Self::Skipped => "skipped",
        }
    }
}

impl ControllerMetrics {
    /// The controller metrics of controller `name`, which runs `workers` workers.
    pub fn new(name: &'static str, workers: usize) -> Self {
        gauge!("controller_runtime_max_concurrent_reconciles", "controller" => name).set(workers as f64);
        gauge!("controller_runtime_active_workers", "controller" => name).set(0.0);
        // Zero series exist from the start, so rate() and absent() behave.
        for result in
            [ReconcileResult::Success, ReconcileResult::Error, ReconcileResult::RequeueAfter, ReconcileResult::Skipped]
        {
            counter!("controller_runtime_reconcile_total", "controller" => name, "result" => result.label())
                .absolute(0);
        }
        counter!("controller_runtime_reconcile_panics_total", "controller" => name).absolute(0);
        counter!("controller_runtime_terminal_reconcile_errors_total", "controller" => name).absolute(0);
        Self { name }
    }

    /// A reconcile ended with `result` after `took` (and an error of `error_kind`).
    pub fn reconciled(&self, result: ReconcileResult, took: Duration, error_kind: Option<&'static str>) {
        counter!("controller_runtime_reconcile_total", "controller" => self.name, "result" => result.label())
            .increment(1);
        histogram!("controller_runtime_reconcile_time_seconds", "controller" => self.name).record(took);
        if let Some(kind) = error_kind {
            counter!("controller_runtime_reconcile_errors_total", "controller" => self.name, "kind" => kind)
                .increment(1);
        }
    }

    /// A reconcile error that retries cannot fix (controller-runtime's `TerminalError`).
    pub fn terminal_error(&self) {
        counter!("controller_runtime_terminal_reconcile_errors_total", "controller" => self.name).increment(1);
    }

    /// A reconcile panicked.
    pub fn panicked(&self) {
        counter!("controller_runtime_reconcile_panics_total", "controller" => self.name).increment(1);
    }

    /// Workers busy now changed by `delta`.
    pub fn active_workers(&self, delta: f64) {
        gauge!("controller_runtime_active_workers", "controller" => self.name).increment(delta);
    }
}

/// Cache gauges, labelled by resource (a fixed set).
pub fn set_cached_objects(resource: &'static str, count: usize) {
    gauge!(names().cached_objects, "resource" => resource).set(count as f64);
}

/// Whether the cache of `resource` holds a completed list.
pub fn set_cache_synced(resource: &'static str, synced: bool) {
    gauge!(names().cache_synced, "resource" => resource).set(if synced { 1.0 } else { 0.0 });
}
