//! Sharding keeps the gate: [`Sharded`] takes an object's bucket (as the cache keeps it, from
//! [`slicing`]), registers the reconcile with [`Ownership`] (so a handoff can drain
//! it), and gives the business reconciler a [`WriteGate`] that checks the bucket is still
//! ours before every write, stamps the bucket's fencing epoch on it (in
//! [`Names::fence_annotation`]), and reads the fencing policy's refusal ([`FENCED_MESSAGE`]).
//! The reconciler knows nothing of buckets or fencing, as in timebertt's sharding wrapper
//! and kubert's `is_current_for`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::core::Status;
use tokio::time::Instant;

use super::audit::Audit;
use super::ownership::{InFlight, Ownership};
use super::{FENCED_MESSAGE, Names};
use crate::bucket::{self, Mode};
use crate::bucket_id::{BucketId, BucketIds};
use crate::shard_range;
use sharded_runtime::error::{Error, Result};
use sharded_runtime::gate::{Permit, WriteGate};
use sharded_runtime::parts::{SliceSelector, Slicing};
use sharded_runtime::reconciler::Gatekeeper;
use sharded_runtime::{Action, ObjectKey};

/// How a sharded controller's watches and cache see buckets: by the IDs `ownership` names
/// them with now (see [`BucketIds`]), as the API server's filter sees them (in label mode,
/// a hand-set bucket label wins), as the write gate does.
pub fn slicing(ownership: &Arc<Ownership>, bucket_label: &'static str) -> Slicing {
    let (of_meta, of_namespace, of_slice) = (ownership.clone(), ownership.clone(), ownership.clone());
    Slicing::new(
        move |meta| of_meta.id_of_meta(meta, bucket_label),
        move |namespace| of_namespace.id_of_namespace(namespace),
        move |ids| slice_selector(&of_slice.ids(), bucket_label, ids),
    )
}

/// What our watches ask the API server for, to see the buckets `owned`: in label mode, a
/// selector on `bucket_label`; with the shard selector, their ranges. An ID whose range has
/// changed since names nothing, and is left out.
pub fn slice_selector(ids: &BucketIds, bucket_label: &str, owned: &BTreeSet<BucketId>) -> Option<SliceSelector> {
    match ids.mode() {
        Mode::Labels => bucket::selector(bucket_label, owned).map(SliceSelector::Labels),
        Mode::ShardSelector => {
            let buckets = owned.iter().filter_map(|id| ids.bucket(*id)).collect();
            shard_range::selector(ids.ranges(), &buckets).map(SliceSelector::Shards)
        }
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
        let token = self.in_flight.permit();
        match (token, token.and_then(|_| self.in_flight.landing_in())) {
            (Some(_), Some(wait)) => {
                self.audit.record("write_held", self.key, what);
                Err(Error::EarlierWriteLanding(wait))
            }
            (Some(token), None) => {
                self.audit.record("write", self.key, what);
                Ok(Permit { token, sent })
            }
            (None, _) => {
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

    /// The fencing policy refused the write: a newer owner has written since. The token it
    /// names goes to [`Ownership::seen`], so that a token above every generation we know (a
    /// lost floor) reaches the leader.
    fn is_fenced(&self, refusal: &Status) -> bool {
        let fenced = refusal.message.contains(FENCED_MESSAGE);
        if fenced && let Some(token) = stored_token(&refusal.message) {
            self.in_flight.found_token(token);
        }
        fenced
    }

    /// Children carry their bucket label only where watches select by it.
    fn routing_labels(&self) -> Vec<(String, String)> {
        match self.mode {
            Mode::Labels => vec![(self.names.bucket_label.to_string(), bucket::label_value(self.in_flight.bucket))],
            Mode::ShardSelector => Vec::new(),
        }
    }
}

/// The stored token a fencing refusal names (see [`FENCED_MESSAGE`]): `… over the stored N`.
fn stored_token(message: &str) -> Option<u64> {
    let (_, after) = message.split_once(" over the stored ")?;
    let digits = after.find(|c: char| !c.is_ascii_digit()).map_or(after, |end| &after[..end]);
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash_ranges::{HashRanges, Ranges, by_hash};

    #[test]
    fn a_slice_is_selected_by_its_current_ranges_and_stale_ids_by_none() {
        let labels = BucketIds::new(Mode::Labels);
        let selected = slice_selector(&labels, "example.com/bucket", &BTreeSet::from([3, 1]));
        assert_eq!(selected, Some(SliceSelector::Labels("example.com/bucket in (1,3)".into())));
        let mut ids = BucketIds::new(Mode::ShardSelector);
        let namespaces = (1..=20).map(|n| (format!("team-{n}"), 100)).collect();
        let split = Ranges::new(HashRanges::uniform().split(&by_hash(&namespaces)));
        let changed = *HashRanges::uniform().changed(&split).first().expect("a split");
        ids.adopt(&split);
        assert_eq!(slice_selector(&ids, "", &BTreeSet::from([changed])), None, "the old ID of a changed bucket");
        let selected = slice_selector(&ids, "", &BTreeSet::from([ids.id(changed)]));
        let expected = shard_range::selector(&split, &BTreeSet::from([changed])).map(SliceSelector::Shards);
        assert_eq!(selected, expected);
    }

    #[test]
    fn the_stored_token_is_read_from_the_fencing_refusal() {
        let refusal = "trafficpolicy.dev-fencing: refused a write with shard epoch 1 over the stored 3006: a newer \
                       owner of the bucket has written since";
        assert_eq!(stored_token(refusal), Some(3006));
        assert_eq!(
            stored_token("refused a write with shard epoch 1 over the stored 999999999999999999"),
            Some(999_999_999_999_999_999)
        );
        assert_eq!(stored_token("may not set, change or remove it (absent -> 5)"), None);
        assert_eq!(stored_token("over the stored x"), None);
    }
}
