//! Buckets as hash ranges, for the API server's shard selector (KEP-5866, the
//! `ShardedListAndWatch` feature gate): the server hashes `object.metadata.namespace` with
//! 64-bit FNV-1a and keeps the objects whose hash lies in one of the requested ranges.
//!
//! In this mode every bucket is one contiguous range of that hash: the top 10 bits,
//! `[b << 54, (b + 1) << 54)`, unless the leader split them (see `hash_ranges`). A slice is
//! the union of its buckets' ranges with adjacent ones merged. The server computes the same
//! hash, so no label is needed: a new object is in its owner's watch the moment it is created.

use std::collections::BTreeSet;

use super::bucket::Bucket;
use super::hash_ranges::{HashRanges, Range};

/// The field the ranges are over: a slice is a set of namespaces.
const FIELD: &str = "object.metadata.namespace";

/// The shard selector for `buckets` under `ranges`; `None` when the set is empty (nothing
/// to watch).
///
/// Bounds are written with 16 hex digits (17 for the end of the hash space, `2^64`): the
/// server compares them as strings, shorter first, against a 16-digit hash.
pub fn selector(ranges: &HashRanges, buckets: &BTreeSet<Bucket>) -> Option<String> {
    let all = ranges.ranges();
    let mut wanted: Vec<Range> = buckets.iter().map(|b| all[usize::from(*b)]).collect();
    wanted.sort_unstable();
    let bound = |at: u128| if at == 1 << 64 { "0x10000000000000000".to_string() } else { format!("0x{at:016x}") };
    let ranges: Vec<String> = merged(wanted)
        .into_iter()
        .map(|(start, end)| format!("shardRange({FIELD}, '{}', '{}')", bound(start), bound(end)))
        .collect();
    (!ranges.is_empty()).then(|| ranges.join(" || "))
}

/// Adjacent ranges, sorted, merged into runs: half-open `[start, end)`.
fn merged(sorted: Vec<Range>) -> Vec<(u128, u128)> {
    let mut runs: Vec<(u128, u128)> = Vec::new();
    for (start, end) in sorted {
        match runs.last_mut() {
            Some((_, last_end)) if *last_end == u128::from(start) => *last_end = end,
            _ => runs.push((u128::from(start), end)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::bucket::BUCKETS;

    #[test]
    fn adjacent_buckets_merge_into_one_range() {
        let uniform = HashRanges::uniform();
        let selector = |buckets: &BTreeSet<Bucket>| selector(&uniform, buckets);
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

    #[test]
    fn split_ranges_are_selected_as_the_leader_split_them() {
        let namespaces = (1..=200).map(|n| (format!("team-{n}"), 100)).collect();
        let split = HashRanges::uniform().split(&crate::hash_ranges::by_hash(&namespaces));
        for n in [1, 77, 200] {
            let namespace = format!("team-{n}");
            let bucket = split.bucket_of(&namespace);
            let (start, end) = split.ranges()[usize::from(bucket)];
            let expected = if end == 1 << 64 { "0x10000000000000000".to_string() } else { format!("0x{end:016x}") };
            let expected = format!("shardRange({FIELD}, '0x{start:016x}', '{expected}')");
            assert_eq!(selector(&split, &BTreeSet::from([bucket])).unwrap(), expected, "{namespace}");
        }
        let all = selector(&split, &(0..BUCKETS).collect()).unwrap();
        assert_eq!(all, selector(&HashRanges::uniform(), &(0..BUCKETS).collect()).unwrap(), "one range in all");
    }
}
