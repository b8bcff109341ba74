//! Buckets as hash ranges, for the API server's shard selector (KEP-5866, the
//! `ShardedListAndWatch` feature gate): the server hashes `object.metadata.namespace` with
//! 64-bit FNV-1a and keeps the objects whose hash lies in one of the requested ranges.
//!
//! In this mode a namespace's bucket is the top 10 bits of that hash (see `bucket`), so every
//! bucket is one contiguous range, `[b << 54, (b + 1) << 54)`, and a slice is the union of its buckets'
//! ranges with adjacent ones merged. The server computes the same hash, so no label is
//! needed: a new object is in its owner's watch the moment it is created.

use std::collections::BTreeSet;

use super::bucket::{BUCKETS, Bucket, HASH_SHIFT};

/// The field the ranges are over: a slice is a set of namespaces.
const FIELD: &str = "object.metadata.namespace";

/// The shard selector for `buckets`; `None` when the set is empty (nothing to watch).
///
/// Bounds are written with 16 hex digits (17 for the end of the hash space, `2^64`): the
/// server compares them as strings, shorter first, against a 16-digit hash.
pub fn selector(buckets: &BTreeSet<Bucket>) -> Option<String> {
    let bound = |b: u32| {
        if b == u32::from(BUCKETS) {
            "0x10000000000000000".to_string()
        } else {
            format!("0x{:016x}", u64::from(b) << HASH_SHIFT)
        }
    };
    let ranges: Vec<String> = merged(buckets)
        .into_iter()
        .map(|(start, end)| format!("shardRange({FIELD}, '{}', '{}')", bound(start), bound(end)))
        .collect();
    (!ranges.is_empty()).then(|| ranges.join(" || "))
}

/// Runs of adjacent buckets as half-open `[start, end)`.
fn merged(buckets: &BTreeSet<Bucket>) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for b in buckets.iter().map(|b| u32::from(*b)) {
        match runs.last_mut() {
            Some((_, end)) if *end == b => *end = b + 1,
            _ => runs.push((b, b + 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_buckets_merge_into_one_range() {
        assert_eq!(selector(&BTreeSet::new()), None);
        assert_eq!(
            selector(&BTreeSet::from([0, 1, 2, 5])).unwrap(),
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x00c0000000000000') \
             || shardRange(object.metadata.namespace, '0x0140000000000000', '0x0180000000000000')"
        );
        assert_eq!(
            selector(&(0..BUCKETS).collect()).unwrap(),
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x10000000000000000')"
        );
        assert_eq!(
            selector(&BTreeSet::from([1023])).unwrap(),
            "shardRange(object.metadata.namespace, '0xffc0000000000000', '0x10000000000000000')"
        );
    }
}
