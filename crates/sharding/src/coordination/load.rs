//! This replica's report of the objects it holds per bucket, which its member Lease carries
//! to the leader for balancing by objects (see [`crate::balance`]).
//!
//! The report is counted from the controller's cache, and only while the cache holds exactly the
//! slice of the assignment we follow: the watch must have completed a list of every bucket we
//! own, and of no other. Otherwise buckets still being listed would count as empty, and the leader
//! would rebalance on a false picture. Until then, the previous report stands, and its older
//! generation tells the leader to wait.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ownership::Ownership;
use crate::counts::{Counts, Report};
use sharded_runtime::Listed;
use sharded_runtime::cache::Cache;
use sharded_runtime::stored::Stored;

/// How often the cache is counted: a rebalance waits for reports of the current generation.
const COUNT_EVERY: Duration = Duration::from_secs(5);

/// The latest count of this replica's objects per bucket.
#[derive(Default)]
pub struct LoadReport {
    latest: Mutex<Option<String>>,
}

impl LoadReport {
    /// The latest report, encoded for the Lease annotation.
    pub fn latest(&self) -> Option<String> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Counts the cache every few seconds, forever.
    pub async fn keep<T: Stored>(&self, cache: Cache<T>, ownership: Arc<Ownership>, listed: Listed) {
        let mut tick = tokio::time::interval(COUNT_EVERY);
        loop {
            tick.tick().await;
            let (generation, owned, ids) = ownership.owned_at();
            if listed.borrow().as_ref() != Some(&owned) {
                continue;
            }
            let mut counts = Counts::new();
            for (key, _) in cache.state() {
                let bucket = ids.bucket_of(key.namespace());
                if owned.contains(&ids.id(bucket)) {
                    *counts.entry(bucket).or_default() += 1;
                }
            }
            let report = Report { generation, counts }.encode();
            *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
        }
    }
}
