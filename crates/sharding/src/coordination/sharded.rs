//! Sharding keeps the gate: [`Sharded`] takes an object's bucket (as the cache keeps it, from
//! [`bucket_of_meta`]), registers the reconcile with [`Ownership`] (so a handoff can drain
//! it), and gives the business reconciler a [`WriteGate`] that checks the bucket is still
//! ours before every write, stamps the bucket's fencing epoch on it (in
//! [`Names::fence_annotation`]), and reads the fencing policy's refusal ([`FENCED_MESSAGE`]).
//! The reconciler knows nothing of buckets or fencing, as in timebertt's sharding wrapper
//! and kubert's `is_current_for`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::ObjectMeta;
use kube::core::Status;
use tokio::time::Instant;

use super::audit::Audit;
use super::ownership::{InFlight, Ownership};
use super::{FENCED_MESSAGE, Names};
use crate::bucket::{self, Bucket, Mode};
use sharded_runtime::error::{Error, Result};
use sharded_runtime::gate::{Permit, WriteGate};
use sharded_runtime::reconciler::Gatekeeper;
use sharded_runtime::{Action, ObjectKey};

/// The bucket of an object, from its metadata. In label mode: its bucket label (which may
/// have been set by hand), or else its namespace's bucket. With the shard selector: its
/// namespace's bucket, as the API server computes it; labels play no part.
pub fn bucket_of_meta(meta: &ObjectMeta, mode: Mode, bucket_label: &str) -> Option<Bucket> {
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    match (mode, meta.labels.as_ref().and_then(|labels| labels.get(bucket_label))) {
        (Mode::Labels, Some(label)) => bucket::parse_label(label),
        _ => Some(mode.bucket_of(namespace)),
    }
}

/// The gatekeeper of a sharded controller: a reconcile may write while its object's bucket
/// is this replica's, and is registered with [`Ownership`] meanwhile, so that a handoff
/// drains it.
pub struct Sharded {
    ownership: Arc<Ownership>,
    names: Names,
    audit: Audit,
}

impl Sharded {
    /// Admits reconciles by `ownership`, stamping tokens under `names`.
    pub fn new(ownership: Arc<Ownership>, names: Names, audit: Audit) -> Self {
        Self { ownership, names, audit }
    }
}

impl Gatekeeper for Sharded {
    type Gate<'a> = ShardGate<'a>;

    fn admit<'a>(&'a self, key: &'a ObjectKey, bucket: Option<u16>) -> Option<ShardGate<'a>> {
        let in_flight = self.ownership.begin(bucket?)?;
        self.audit.record("reconcile_start", key, &in_flight.bucket.to_string());
        Some(ShardGate { in_flight, mode: self.ownership.mode(), names: &self.names, key, audit: &self.audit })
    }

    fn finished(&self, gate: ShardGate<'_>, outcome: &Result<Action>) {
        self.audit.record("reconcile_end", gate.key, outcome.as_ref().map_or_else(|e| e.kind(), |_| "ok"));
    }
}

/// One reconcile's right to write its object's bucket.
pub struct ShardGate<'a> {
    in_flight: InFlight,
    mode: Mode,
    names: &'a Names,
    key: &'a ObjectKey,
    audit: &'a Audit,
}

impl WriteGate for ShardGate<'_> {
    fn check(&self, what: &str) -> Result<Permit> {
        // Before the check: a write counts as sent from before ownership said yes.
        let sent = Instant::now();
        match self.in_flight.permit() {
            Some(token) => {
                self.audit.record("write", self.key, what);
                Ok(Permit { token, sent })
            }
            None => {
                self.audit.record("write_refused", self.key, what);
                Err(Error::LostOwnership)
            }
        }
    }

    fn permitted(&self) -> bool {
        self.in_flight.permit().is_some()
    }

    fn write_bound(&self) -> Duration {
        self.in_flight.write_bound()
    }

    fn abandoned(&self, sent: Instant) {
        self.in_flight.abandoned(sent);
    }

    fn stamp(&self, permit: &Permit, annotations: &mut BTreeMap<String, String>) {
        annotations.insert(self.names.fence_annotation.into(), permit.token.to_string());
    }

    /// The fencing policy refused the write: a newer owner has written since.
    fn is_fenced(&self, refusal: &Status) -> bool {
        refusal.message.contains(FENCED_MESSAGE)
    }

    /// Children carry their bucket label only where watches select by it.
    fn routing_labels(&self) -> Vec<(String, String)> {
        match self.mode {
            Mode::Labels => vec![(self.names.bucket_label.to_string(), bucket::label_value(self.in_flight.bucket))],
            Mode::ShardSelector => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_set_bucket_label_routes_in_label_mode_only() {
        const BUCKET_LABEL: &str = "example.com/bucket";
        let meta = |label: Option<&str>| ObjectMeta {
            namespace: Some("shop".into()),
            labels: label.map(|label| [(BUCKET_LABEL.to_string(), label.to_string())].into()),
            ..Default::default()
        };
        let implied = bucket::bucket_of("shop");
        assert_eq!(bucket_of_meta(&meta(None), Mode::Labels, BUCKET_LABEL), Some(implied));
        let other = if implied == 7 { "8" } else { "7" };
        assert_eq!(
            bucket_of_meta(&meta(Some(other)), Mode::Labels, BUCKET_LABEL),
            bucket::parse_label(other),
            "a hand-set bucket wins"
        );
        assert_eq!(
            bucket_of_meta(&meta(Some("x")), Mode::Labels, BUCKET_LABEL),
            None,
            "a malformed label is in no bucket"
        );
        let shard_bucket = Some(Mode::ShardSelector.bucket_of("shop"));
        assert_eq!(
            bucket_of_meta(&meta(Some(other)), Mode::ShardSelector, BUCKET_LABEL),
            shard_bucket,
            "the server ignores labels"
        );
    }
}
