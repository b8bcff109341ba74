//! Keys to try again after their own exponential backoff: for work outside the controller's
//! queue (labelling objects and namespaces), so that a failure that lasts never turns into a
//! hot loop of requests.

use std::collections::HashMap;

use tokio_util::time::DelayQueue;

use crate::backoff::Backoff;

/// Keys whose work failed for a reason other than throttling (RBAC, a webhook), each due again
/// after its own backoff.
pub struct Retries<K> {
    due: DelayQueue<K>,
    failures: HashMap<K, u32>,
    backoff: Backoff,
}

impl<K: Clone + Eq + std::hash::Hash> Retries<K> {
    /// `key` failed (once more): it is due again after its backoff.
    pub fn later(&mut self, key: K) {
        let failures = self.failures.get(&key).map_or(1, |failures| failures + 1);
        self.later_with_failures(key, failures);
    }

    /// [`Self::later`], as the `failures`-th failure in a row: for a caller that counts the
    /// failures itself, across successes.
    pub fn later_with_failures(&mut self, key: K, failures: u32) {
        self.failures.insert(key.clone(), failures);
        self.due.insert(key, self.backoff.delay(failures));
    }

    /// `key` succeeded: its next failure starts a new backoff.
    pub fn forget(&mut self, key: &K) {
        self.failures.remove(key);
    }

    /// Whether `key` has failed since it last succeeded (its retry is due or pending).
    pub fn failing(&self, key: &K) -> bool {
        self.failures.contains_key(key)
    }

    /// The next key whose backoff has passed; pending forever while none waits.
    pub async fn next_due(&mut self) -> Option<K> {
        match std::future::poll_fn(|cx| self.due.poll_expired(cx)).await {
            Some(expired) => Some(expired.into_inner()),
            None => std::future::pending().await,
        }
    }

    /// Keys waiting to be due.
    pub fn len(&self) -> usize {
        self.due.len()
    }
}

impl<K> Default for Retries<K> {
    fn default() -> Self {
        Self { due: DelayQueue::new(), failures: HashMap::new(), backoff: Backoff::default() }
    }
}

impl<K> Retries<K> {
    /// Whether no key waits.
    pub fn is_empty(&self) -> bool {
        self.due.is_empty()
    }
}
