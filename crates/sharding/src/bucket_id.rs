//! How this process names buckets to the runtime: a [`BucketId`] is a bucket's index with,
//! in its top bits, how many times this process has seen that bucket's range change.
//!
//! A change of ranges (see [`crate::hash_ranges`]) moves namespaces between the changed
//! buckets. The leader revokes them before it publishes the change, so normally nobody holds
//! one across it. But a replica cut off meanwhile may read the assignment before the change
//! and the one after only. It must still see each changed bucket as lost and gained: its
//! watch of the old range stops, its cache forgets what that range held, the new range is
//! listed, and a reconcile of an object cached under the old range gets no permit. A new ID
//! for a bucket whose range changed does all of that through the runtime's ordinary handling
//! of a lost and a gained bucket.
//!
//! IDs are never written anywhere: each process numbers the changes it saw. In label mode
//! ranges never change, and an ID is the bucket.

use std::collections::BTreeMap;

use kube::api::ObjectMeta;

use super::bucket::{self, BUCKETS, Bucket, Mode};
use super::hash_ranges::{HashRanges, Ranges};

/// A bucket as this process names it to the runtime.
pub type BucketId = u16;

const INDEX_BITS: u32 = BUCKETS.trailing_zeros();
/// The changes of one bucket's range that an ID tells apart.
const CHANGES: u16 = 1 << (16 - INDEX_BITS);

/// The current ranges, and how often each bucket's has changed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BucketIds {
    mode: Mode,
    ranges: Ranges,
    /// Buckets whose range changed, with the count modulo [`CHANGES`]; the rest never did.
    changes: BTreeMap<Bucket, u16>,
}

impl BucketIds {
    /// IDs in `mode`, under uniform ranges.
    pub fn new(mode: Mode) -> Self {
        Self { mode, ranges: Ranges::default(), changes: BTreeMap::new() }
    }

    /// Takes `ranges` as the current ones: each bucket whose range differs gets a new ID.
    pub fn adopt(&mut self, ranges: &Ranges) {
        if self.mode == Mode::Labels || self.ranges == *ranges {
            return;
        }
        for bucket in self.ranges.changed(ranges) {
            let changes = self.changes.entry(bucket).or_default();
            *changes = (*changes + 1) % CHANGES;
        }
        self.ranges = ranges.clone();
    }

    /// The ID of `bucket` now.
    pub fn id(&self, bucket: Bucket) -> BucketId {
        (self.changes.get(&bucket).copied().unwrap_or(0) << INDEX_BITS) | bucket
    }

    /// The bucket `id` names, if its range is still the one it named.
    pub fn bucket(&self, id: BucketId) -> Option<Bucket> {
        let bucket = id % BUCKETS;
        (self.id(bucket) == id).then_some(bucket)
    }

    /// The bucket of `namespace`'s objects (in label mode, of those without a bucket label).
    pub fn bucket_of(&self, namespace: &str) -> Bucket {
        match self.mode {
            Mode::Labels => bucket::bucket_of(namespace),
            Mode::ShardSelector => self.ranges.bucket_of(namespace),
        }
    }

    /// The ID of the bucket of `namespace`'s objects.
    pub fn of_namespace(&self, namespace: &str) -> BucketId {
        self.id(self.bucket_of(namespace))
    }

    /// The ID of an object's bucket, from its metadata. In label mode: its bucket label
    /// (which may have been set by hand), or else its namespace's bucket. With the shard
    /// selector: its namespace's bucket, as the API server computes it; labels play no part.
    pub fn of_meta(&self, meta: &ObjectMeta, bucket_label: &str) -> Option<BucketId> {
        let namespace = meta.namespace.as_deref().unwrap_or_default();
        match (self.mode, meta.labels.as_ref().and_then(|labels| labels.get(bucket_label))) {
            (Mode::Labels, Some(label)) => bucket::parse_label(label),
            _ => Some(self.of_namespace(namespace)),
        }
    }

    /// The current ranges.
    pub fn ranges(&self) -> &HashRanges {
        &self.ranges
    }

    /// How this process computes buckets.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash_ranges::by_hash;

    fn split_for(names: &[&str]) -> Ranges {
        let namespaces = names.iter().map(|n| (n.to_string(), 100)).collect();
        Ranges::new(HashRanges::uniform().split(&by_hash(&namespaces)))
    }

    #[test]
    fn a_bucket_whose_range_changed_gets_a_new_id_and_the_others_keep_theirs() {
        let names: Vec<String> = (1..=50).map(|n| format!("team-{n}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let (uniform, split) = (Ranges::default(), split_for(&names));
        let changed = uniform.changed(&split);
        let mut ids = BucketIds::new(Mode::ShardSelector);
        let before: Vec<BucketId> = (0..BUCKETS).map(|b| ids.id(b)).collect();
        assert!(before.iter().zip(0..BUCKETS).all(|(id, b)| *id == b), "no change seen: the ID is the bucket");
        ids.adopt(&split);
        for b in 0..BUCKETS {
            let (old, new) = (before[usize::from(b)], ids.id(b));
            assert_eq!(old != new, changed.contains(&b), "bucket {b}");
            assert_eq!(ids.bucket(new), Some(b));
            assert_eq!(ids.bucket(old), (old == new).then_some(b), "an old ID names nothing now");
        }
        // Back to uniform: changed again, so new IDs again, not the first ones.
        ids.adopt(&uniform);
        let first_changed = *changed.first().expect("some");
        assert_ne!(ids.id(first_changed), before[usize::from(first_changed)]);
        assert_eq!(ids.bucket_of("team-1"), uniform.bucket_of("team-1"));
    }

    #[test]
    fn label_mode_ids_are_buckets() {
        let mut ids = BucketIds::new(Mode::Labels);
        ids.adopt(&split_for(&["team-1", "team-2", "team-3"]));
        assert_eq!(ids.of_namespace("team-1"), bucket::bucket_of("team-1"));
        let labelled = ObjectMeta {
            namespace: Some("shop".into()),
            labels: Some([("example.com/bucket".to_string(), "7".to_string())].into()),
            ..Default::default()
        };
        assert_eq!(ids.of_meta(&labelled, "example.com/bucket"), Some(7), "a hand-set bucket wins");
        let selector_ids = BucketIds::new(Mode::ShardSelector);
        let shop = selector_ids.of_namespace("shop");
        assert_eq!(selector_ids.of_meta(&labelled, "example.com/bucket"), Some(shop), "the server ignores labels");
    }
}
