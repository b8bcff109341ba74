//! Buckets as hash ranges, for the API server's shard selector (KEP-5866, the
//! `ShardedListAndWatch` feature gate): the server hashes `object.metadata.namespace` with
//! 64-bit FNV-1a and keeps the objects whose hash lies in one of the requested ranges.
//!
//! In this mode a namespace's bucket is the top 10 bits of that hash, so every bucket is one
//! contiguous range, `[b << 54, (b + 1) << 54)`, and a slice is the union of its buckets'
//! ranges with adjacent ones merged. The server computes the same hash, so no label is
//! needed: a new policy is in its owner's watch the moment it is created.

use std::collections::BTreeSet;

use super::bucket::{BUCKETS, Bucket};

/// The field the ranges are over: a slice is a set of namespaces.
const FIELD: &str = "object.metadata.namespace";

/// How far the hash is shifted to give a bucket: 64 bits minus log2(BUCKETS).
const SHIFT: u32 = 64 - BUCKETS.trailing_zeros();
const _: () = assert!(BUCKETS.is_power_of_two(), "a bucket must be a whole hash range");

/// FNV-1a, 64 bits, as `k8s.io/apimachinery/pkg/sharding` computes it (Go's `hash/fnv`).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

pub fn bucket_of(namespace: &str) -> Bucket {
    (fnv1a_64(namespace.as_bytes()) >> SHIFT) as Bucket
}

/// The shard selector for `buckets`; `None` when the set is empty (nothing to watch).
///
/// Bounds are written with 16 hex digits (17 for the end of the hash space, `2^64`): the
/// server compares them as strings, shorter first, against a 16-digit hash.
pub fn selector(buckets: &BTreeSet<Bucket>) -> Option<String> {
    let bound = |b: u32| {
        if b == u32::from(BUCKETS) {
            "0x10000000000000000".to_string()
        } else {
            format!("0x{:016x}", u64::from(b) << SHIFT)
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
    fn the_hash_is_go_fnv1a_64() {
        // Values of Go's hash/fnv New64a, as the API server computes them.
        assert_eq!(fnv1a_64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a_64(b"b"), 0xaf63df4c8601f1a5);
        assert_eq!(bucket_of("a"), 0xaf63dc4c8601ec8c_u64.wrapping_shr(54) as Bucket);
        assert_eq!(bucket_of("a"), 701);
    }

    #[test]
    fn a_namespace_is_in_its_buckets_range() {
        for i in 0..2_000 {
            let ns = format!("team-{i}");
            let (hash, b) = (fnv1a_64(ns.as_bytes()), u64::from(bucket_of(&ns)));
            assert!((b << SHIFT..(b + 1) << SHIFT).contains(&hash) || (b == 1023 && hash >= b << SHIFT));
        }
    }

    /// A limit of the server's hash, pinned so that docs/sharding.md stays true: FNV-1a mixes
    /// a name's last byte into the low bits only, so names that differ only at the end fall
    /// into a few buckets; two more bytes after the varying part spread them.
    #[test]
    fn names_that_differ_only_at_the_end_share_few_buckets() {
        let distinct = |names: Vec<String>| names.iter().map(|n| bucket_of(n)).collect::<BTreeSet<_>>().len();
        assert!(distinct((0..200).map(|i| format!("ns-{i}")).collect()) <= 8);
        assert!(distinct((0..200).map(|i| format!("ns-{i}-x")).collect()) >= 150);
    }

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
