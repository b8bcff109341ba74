//! A de-duplicating work queue with two priorities, delayed adds and per-key backoff,
//! after client-go's workqueue.
//!
//! Contract:
//! - a key is queued at most once; adding a queued key only raises its priority;
//! - a key being processed is never handed out again until [`WorkQueue::done`]; adds that
//!   arrive meanwhile are kept and queued on `done`, so no change is lost;
//! - `High` keys (real changes) are served before `Low` ones (initial list, resync), so a
//!   user's edit is not stuck behind a relist flood;
//! - after [`WorkQueue::shut_down`], `get` returns `None`: no new work is taken.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::backoff::Backoff;
use crate::metrics::{QueueDepth, QueueMetrics};

/// A lane of the queue: high keys are handed out before low ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    Low,
    High,
}

/// A deduplicating two-lane work queue with per-key backoff; a key is processed by one worker at a
/// time.
pub struct WorkQueue<K> {
    state: Mutex<State<K>>,
    notify: Notify,
    backoff: Backoff,
    metrics: QueueMetrics,
}

struct State<K> {
    high: VecDeque<K>,
    low: VecDeque<K>,
    /// Keys waiting in `high` or `low`, with their current priority and when they were added.
    /// A deque entry whose priority differs from this record is stale and skipped.
    queued: HashMap<K, (Priority, Instant)>,
    /// How many of `queued` are in each lane.
    depth: QueueDepth,
    /// Keys handed to a worker, with the time they were handed out.
    processing: HashMap<K, Instant>,
    /// Adds that arrived while the key was processing.
    dirty: HashMap<K, Priority>,
    /// Delayed adds; an entry whose time differs from `delayed_at` is stale.
    delayed: BinaryHeap<Reverse<(Instant, u64, K)>>,
    delayed_at: HashMap<K, (Instant, Priority)>,
    sequence: u64,
    failures: HashMap<K, u32>,
    shutting_down: bool,
}

impl<K: Clone + Eq + Hash + Ord> WorkQueue<K> {
    /// An empty queue whose retries follow `backoff`.
    pub fn new(backoff: Backoff, metrics: QueueMetrics) -> Self {
        Self {
            state: Mutex::new(State {
                high: VecDeque::new(),
                low: VecDeque::new(),
                queued: HashMap::new(),
                depth: QueueDepth::default(),
                processing: HashMap::new(),
                dirty: HashMap::new(),
                delayed: BinaryHeap::new(),
                delayed_at: HashMap::new(),
                sequence: 0,
                failures: HashMap::new(),
                shutting_down: false,
            }),
            notify: Notify::new(),
            backoff,
            metrics,
        }
    }

    /// Queues `key` in lane `priority`. A key already queued moves up to a higher lane; one
    /// being processed is queued again once done.
    pub fn add(&self, key: K, priority: Priority) {
        let mut state = self.lock();
        if state.shutting_down {
            return;
        }
        if self.enqueue(&mut state, key, priority) {
            drop(state);
            self.notify.notify_one();
        }
    }

    /// Queues `key` after `delay`; an earlier pending delayed add of the same key wins.
    pub fn add_after(&self, key: K, delay: Duration, priority: Priority) {
        if delay.is_zero() {
            return self.add(key, priority);
        }
        let at = Instant::now() + delay;
        let mut state = self.lock();
        if state.shutting_down || state.delayed_at.get(&key).is_some_and(|(t, _)| *t <= at) {
            return;
        }
        state.sequence += 1;
        let sequence = state.sequence;
        state.delayed_at.insert(key.clone(), (at, priority));
        state.delayed.push(Reverse((at, sequence, key)));
        drop(state);
        // A waiting worker may need to shorten its sleep.
        self.notify.notify_one();
    }

    /// Queues `key` again after its next backoff delay, and counts a retry.
    pub fn add_rate_limited(&self, key: K) -> Duration {
        let failures = {
            let mut state = self.lock();
            let failures = state.failures.entry(key.clone()).or_insert(0);
            *failures += 1;
            *failures
        };
        let delay = self.backoff.delay(failures);
        self.metrics.retry();
        self.add_after(key, delay, Priority::High);
        delay
    }

    /// Resets the backoff of `key` after a success.
    pub fn forget(&self, key: &K) {
        self.lock().failures.remove(key);
    }

    /// Waits for the next key, with the lane it was taken from; `None` once shut down.
    pub async fn get(&self) -> Option<(K, Priority)> {
        loop {
            let notified = self.notify.notified();
            let next_delayed = {
                let mut state = self.lock();
                if state.shutting_down {
                    return None;
                }
                self.promote_due(&mut state);
                if let Some(key) = Self::pop(&mut state) {
                    let (priority, added) = state.queued.remove(&key).expect("popped keys are queued");
                    *state.depth.lane(priority == Priority::High) -= 1;
                    state.processing.insert(key.clone(), Instant::now());
                    self.metrics.handed_out(added.elapsed(), state.depth);
                    if !state.queued.is_empty() {
                        // Let another idle worker look too.
                        self.notify.notify_one();
                    }
                    return Some((key, priority));
                }
                state.delayed.peek().map(|Reverse((at, _, _))| *at)
            };
            match next_delayed {
                Some(at) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Marks `key` finished; queues it again if it changed meanwhile.
    pub fn done(&self, key: &K) {
        let mut state = self.lock();
        if let Some(started) = state.processing.remove(key) {
            self.metrics.work_done(started.elapsed());
        }
        if let Some(priority) = state.dirty.remove(key)
            && !state.shutting_down
            && self.enqueue(&mut state, key.clone(), priority)
        {
            drop(state);
            self.notify.notify_one();
        }
    }

    /// Stops handing out work; workers drain what they hold.
    pub fn shut_down(&self) {
        self.lock().shutting_down = true;
        self.notify.notify_waiters();
    }

    /// Keys waiting in either lane.
    pub fn len(&self) -> usize {
        self.lock().queued.len()
    }

    /// Whether no key waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys being processed now.
    pub fn in_flight(&self) -> usize {
        self.lock().processing.len()
    }

    /// Refreshes the gauges that depend on the clock (unfinished work, longest running).
    pub fn update_time_gauges(&self) {
        let state = self.lock();
        let now = Instant::now();
        let running: Vec<Duration> = state.processing.values().map(|started| now - *started).collect();
        self.metrics.set_running(&running, state.depth);
        let oldest = state.queued.values().map(|(_, added)| now - *added).max().unwrap_or_default();
        self.metrics.set_oldest_item_age(oldest);
    }

    /// Returns true when the key went into a deque (a worker may need waking).
    fn enqueue(&self, state: &mut State<K>, key: K, priority: Priority) -> bool {
        if state.processing.contains_key(&key) {
            let dirty = state.dirty.entry(key).or_insert(priority);
            *dirty = (*dirty).max(priority);
            return false;
        }
        match state.queued.get_mut(&key) {
            Some((queued_priority, _)) if *queued_priority >= priority => false,
            Some((queued_priority, _)) => {
                *state.depth.lane(*queued_priority == Priority::High) -= 1;
                *queued_priority = priority;
                *state.depth.lane(priority == Priority::High) += 1;
                state.high.push_back(key);
                self.metrics.set_depth(state.depth);
                true
            }
            None => {
                state.queued.insert(key.clone(), (priority, Instant::now()));
                *state.depth.lane(priority == Priority::High) += 1;
                match priority {
                    Priority::High => state.high.push_back(key),
                    Priority::Low => state.low.push_back(key),
                }
                self.metrics.added(state.depth);
                true
            }
        }
    }

    fn promote_due(&self, state: &mut State<K>) {
        let now = Instant::now();
        while let Some(Reverse((at, _, _))) = state.delayed.peek() {
            if *at > now {
                break;
            }
            let Reverse((at, _, key)) = state.delayed.pop().expect("peeked");
            if let Some(&(current_at, priority)) = state.delayed_at.get(&key)
                && current_at == at
            {
                state.delayed_at.remove(&key);
                self.enqueue(state, key, priority);
            }
        }
    }

    fn pop(state: &mut State<K>) -> Option<K> {
        while let Some(key) = state.high.pop_front() {
            if state.queued.get(&key).is_some_and(|(p, _)| *p == Priority::High) {
                return Some(key);
            }
        }
        while let Some(key) = state.low.pop_front() {
            if state.queued.get(&key).is_some_and(|(p, _)| *p == Priority::Low) {
                return Some(key);
            }
        }
        None
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> WorkQueue<&'static str> {
        WorkQueue::new(Backoff::new(Duration::from_millis(10), Duration::from_secs(1)), QueueMetrics::new("test"))
    }

    #[tokio::test]
    async fn deduplicates_queued_keys() {
        let q = queue();
        q.add("a", Priority::Low);
        q.add("a", Priority::Low);
        q.add("b", Priority::Low);
        assert_eq!(q.len(), 2);
        assert_eq!(q.get().await.map(|(key, _)| key), Some("a"));
        assert_eq!(q.get().await.map(|(key, _)| key), Some("b"));
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn high_priority_overtakes_low() {
        let q = queue();
        q.add("relist-1", Priority::Low);
        q.add("relist-2", Priority::Low);
        q.add("edit", Priority::High);
        q.add("relist-2", Priority::High); // raised by a real change
        assert_eq!(q.get().await.map(|(key, _)| key), Some("edit"));
        assert_eq!(q.get().await.map(|(key, _)| key), Some("relist-2"));
        assert_eq!(q.get().await.map(|(key, _)| key), Some("relist-1"));
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_key_in_process_is_not_handed_out_twice_but_not_lost() {
        let q = queue();
        q.add("a", Priority::High);
        assert_eq!(q.get().await.map(|(key, _)| key), Some("a"));
        q.add("a", Priority::High);
        assert!(q.is_empty(), "must wait until the worker is done");
        q.done(&"a");
        assert_eq!(q.len(), 1);
        assert_eq!(q.get().await.map(|(key, _)| key), Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_adds_arrive_after_their_delay() {
        let q = queue();
        q.add_after("late", Duration::from_secs(5), Priority::Low);
        q.add_after("later", Duration::from_secs(9), Priority::Low);
        let start = Instant::now();
        assert_eq!(q.get().await.map(|(key, _)| key), Some("late"));
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(q.get().await.map(|(key, _)| key), Some("later"));
        assert_eq!(start.elapsed(), Duration::from_secs(9));
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_grows_per_key_and_resets_on_forget() {
        let q = queue();
        assert_eq!(q.add_rate_limited("a"), Duration::from_millis(10));
        assert_eq!(q.add_rate_limited("a"), Duration::from_millis(20));
        assert_eq!(q.add_rate_limited("b"), Duration::from_millis(10));
        q.forget(&"a");
        assert_eq!(q.add_rate_limited("a"), Duration::from_millis(10));
    }

    #[tokio::test]
    async fn shut_down_stops_handing_out_work() {
        let q = queue();
        q.add("a", Priority::High);
        q.shut_down();
        assert_eq!(q.get().await.map(|(key, _)| key), None);
        q.add("b", Priority::High);
        assert_eq!(q.get().await.map(|(key, _)| key), None);
    }
}
