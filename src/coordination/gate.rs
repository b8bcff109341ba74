//! Sharding wraps the reconciler: [`Sharded`] resolves an object's bucket, registers the
//! reconcile with [`Ownership`] (so a handoff can drain it), and hands the business
//! reconciler a [`WriteGate`] that checks the bucket is still ours before every write and
//! gives the bucket's fencing epoch to stamp on it. The reconciler knows nothing of
//! buckets, as in timebertt's sharding wrapper and kubert's `is_current_for`.

use std::sync::Arc;
use std::time::Duration;

use kube::Resource;
use kube::api::ObjectMeta;
use tokio::time::Instant;

use super::ownership::{InFlight, Ownership};
use crate::error::{Error, Result};
use crate::runtime::gate::{GatedReconciler, WriteGate};
use crate::runtime::{Action, ObjectKey, Reconciler};
use crate::sharding::bucket::{self, BUCKET_LABEL, Bucket, Mode};
use crate::telemetry::audit::Audit;

/// The bucket of an object. In label mode: its bucket label (set by hand, or kept by the
/// cache trim when it differs), or else its namespace's bucket. With the shard selector:
/// its namespace's bucket, as the API server computes it; labels play no part.
pub fn bucket_of_object<K: Resource>(object: &K, mode: Mode) -> Option<Bucket> {
    bucket_of_meta(object.meta(), mode)
}

/// [`bucket_of_object`], from an object's metadata.
pub fn bucket_of_meta(meta: &ObjectMeta, mode: Mode) -> Option<Bucket> {
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    match (mode, meta.labels.as_ref().and_then(|labels| labels.get(BUCKET_LABEL))) {
        (Mode::Labels, Some(label)) => bucket::parse_label(label),
        _ => Some(mode.bucket_of(namespace)),
    }
}

pub struct Sharded<R> {
    inner: R,
    ownership: Arc<Ownership>,
    audit: Audit,
}

impl<R> Sharded<R> {
    pub fn new(inner: R, ownership: Arc<Ownership>, audit: Audit) -> Self {
        Self { inner, ownership, audit }
    }
}

impl<K, R> Reconciler<K> for Sharded<R>
where
    K: Resource + Send + Sync + 'static,
    R: GatedReconciler<K>,
{
    async fn reconcile(&self, key: &ObjectKey, object: Arc<K>) -> Result<Action> {
        let mode = self.ownership.mode();
        let Some(in_flight) = bucket_of_object(object.as_ref(), mode).and_then(|b| self.ownership.begin(b)) else {
            return Ok(Action::Skip);
        };
        let gate = ShardGate { in_flight, mode, key, audit: &self.audit };
        self.audit.record("reconcile_start", key, &gate.in_flight.bucket.to_string());
        let result = self.inner.reconcile(key, object, &gate).await;
        self.audit.record("reconcile_end", key, result.as_ref().map_or_else(|e| e.kind(), |_| "ok"));
        result
    }

    fn forget(&self, key: &ObjectKey) {
        self.inner.forget(key);
    }
}

/// One reconcile's right to write its object's bucket.
struct ShardGate<'a> {
    in_flight: InFlight,
    mode: Mode,
    key: &'a ObjectKey,
    audit: &'a Audit,
}

impl WriteGate for ShardGate<'_> {
    fn check(&self, what: &str) -> Result<u64> {
        match self.in_flight.permit() {
            Some(epoch) => {
                self.audit.record("write", self.key, what);
                Ok(epoch)
            }
            None => {
                self.audit.record("write_refused", self.key, what);
                Err(Error::LostOwnership)
            }
        }
    }

    fn write_bound(&self) -> Duration {
        self.in_flight.write_bound()
    }

    fn abandoned(&self, sent: Instant) {
        self.in_flight.abandoned(sent);
    }

    /// Children carry their bucket label only where watches select by it.
    fn routing_labels(&self) -> Vec<(String, String)> {
        match self.mode {
            Mode::Labels => vec![(BUCKET_LABEL.to_string(), bucket::label_value(self.in_flight.bucket))],
            Mode::ShardSelector => Vec::new(),
        }
    }
}
