//! Namespaces to buckets: a fixed, stable hash that every replica computes alike.
//!
//! Two modes, one per fleet (the assignment says which):
//! - **labels**: the bucket is `xxh3_64(namespace) mod BUCKETS`. It is written as a label on
//!   every object (the program chooses the label's name), so that each replica's watches ask
//!   the API server for its own buckets only. `xxh3` is specified and
//!   stable across Rust releases, unlike std's `DefaultHasher`.
//! - **shard selector**: the bucket is the top bits of the API server's own namespace hash
//!   (64-bit FNV-1a), so each bucket is a range of it, and watches ask for the ranges (see
//!   [`super::shard_range`]); nothing is labelled.
//!
//! Changing `BUCKETS` or a mode's hash re-shards every object: they are part of the
//! on-cluster format.

use xxhash_rust::xxh3::xxh3_64;

/// The number of buckets. Enough for tight balance with up to a few dozen replicas; few
/// enough that one replica's label selector stays a few kilobytes.
pub const BUCKETS: u16 = 1024;

/// A bucket of namespaces, 0 to [`BUCKETS`] − 1.
pub type Bucket = u16;

/// How buckets are computed and how a replica's watches select its slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The bucket label (any API server).
    #[default]
    Labels,
    /// The API server's shard selector (kube-apiserver with `ShardedListAndWatch`).
    ShardSelector,
}

impl Mode {
    /// The bucket of `namespace` in this mode.
    pub fn bucket_of(self, namespace: &str) -> Bucket {
        match self {
            Mode::Labels => bucket_of(namespace),
            Mode::ShardSelector => server_bucket_of(namespace),
        }
    }

    /// The mode's name: `labels` or `shard-selector`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Labels => "labels",
            Mode::ShardSelector => "shard-selector",
        }
    }

    /// The mode named `value`.
    pub fn parse(value: &str) -> Option<Self> {
        [Mode::Labels, Mode::ShardSelector].into_iter().find(|m| m.as_str() == value)
    }
}

/// The label mode's bucket.
pub fn bucket_of(namespace: &str) -> Bucket {
    (xxh3_64(namespace.as_bytes()) % u64::from(BUCKETS)) as Bucket
}

/// How far the server's hash is shifted to give a shard-selector bucket: 64 bits minus
/// log2(BUCKETS).
pub const HASH_SHIFT: u32 = 64 - BUCKETS.trailing_zeros();
const _: () = assert!(BUCKETS.is_power_of_two(), "a bucket must be a whole hash range");

/// FNV-1a, 64 bits, as `k8s.io/apimachinery/pkg/sharding` computes it (Go's `hash/fnv`).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The shard-selector mode's bucket: the top bits of the server's hash of the namespace.
fn server_bucket_of(namespace: &str) -> Bucket {
    (fnv1a_64(namespace.as_bytes()) >> HASH_SHIFT) as Bucket
}

/// The label value for a bucket.
pub fn label_value(bucket: Bucket) -> String {
    bucket.to_string()
}

/// Parses a label value; `None` for anything that is not a bucket.
pub fn parse_label(value: &str) -> Option<Bucket> {
    value.parse::<Bucket>().ok().filter(|b| *b < BUCKETS)
}

/// A selector of `label` matching exactly `buckets`; `None` when the set is empty (nothing
/// to watch). Owning every bucket is written as the label's existence, a short selector.
pub fn selector(label: &str, buckets: &std::collections::BTreeSet<Bucket>) -> Option<String> {
    if buckets.is_empty() {
        return None;
    }
    if buckets.len() == usize::from(BUCKETS) {
        return Some(label.to_string());
    }
    let values: Vec<String> = buckets.iter().map(|b| b.to_string()).collect();
    Some(format!("{label} in ({})", values.join(",")))
}

/// A compact form for logs: `0-5,9,12-20`.
pub fn ranges(buckets: &std::collections::BTreeSet<Bucket>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut iter = buckets.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while iter.peek() == Some(&(end + 1)) {
            end = iter.next().expect("peeked");
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn buckets_are_part_of_the_on_cluster_format() {
        // Literal values: if one changes, every cluster re-shards on upgrade.
        let pinned = [("default", bucket_of("default")), ("shop", bucket_of("shop"))];
        assert_eq!(pinned, [("default", 26), ("shop", 217)]);
        for i in 0..10_000 {
            assert!(bucket_of(&format!("ns-{i}")) < BUCKETS);
        }
    }

    #[test]
    fn namespaces_spread_evenly_over_buckets() {
        let mut counts = vec![0u32; usize::from(BUCKETS)];
        for i in 0..102_400 {
            counts[usize::from(bucket_of(&format!("team-{i}")))] += 1;
        }
        // 100 expected per bucket; a binomial spread stays well within 60..140.
        assert!(counts.iter().all(|&c| (60..140).contains(&c)), "{:?}", (counts.iter().min(), counts.iter().max()));
    }

    #[test]
    fn label_round_trip_and_rejects() {
        assert_eq!(parse_label(&label_value(1023)), Some(1023));
        assert_eq!(parse_label("1024"), None);
        assert_eq!(parse_label("-1"), None);
        assert_eq!(parse_label("x"), None);
    }

    #[test]
    fn modes_hash_differently_and_round_trip() {
        assert_eq!(Mode::Labels.bucket_of("default"), 26);
        assert_eq!(Mode::ShardSelector.bucket_of("a"), 701);
        for mode in [Mode::Labels, Mode::ShardSelector] {
            assert_eq!(Mode::parse(mode.as_str()), Some(mode));
        }
        assert_eq!(Mode::parse("bogus"), None);
    }

    #[test]
    fn the_hash_is_go_fnv1a_64() {
        // Values of Go's hash/fnv New64a, as the API server computes them.
        assert_eq!(fnv1a_64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a_64(b"b"), 0xaf63df4c8601f1a5);
        assert_eq!(server_bucket_of("a"), 0xaf63dc4c8601ec8c_u64.wrapping_shr(54) as Bucket);
        assert_eq!(server_bucket_of("a"), 701);
    }

    #[test]
    fn a_namespace_is_in_its_buckets_range() {
        for i in 0..2_000 {
            let ns = format!("team-{i}");
            let (hash, b) = (fnv1a_64(ns.as_bytes()), u64::from(server_bucket_of(&ns)));
            assert!((b << HASH_SHIFT..(b + 1) << HASH_SHIFT).contains(&hash) || (b == 1023 && hash >= b << HASH_SHIFT));
        }
    }

    /// A limit of the server's hash, pinned so that docs/sharding.md stays true: FNV-1a mixes
    /// a name's last byte into the low bits only, so names that differ only at the end fall
    /// into a few buckets; two more bytes after the varying part spread them.
    #[test]
    fn names_that_differ_only_at_the_end_share_few_buckets() {
        let distinct = |names: Vec<String>| names.iter().map(|n| server_bucket_of(n)).collect::<BTreeSet<_>>().len();
        assert!(distinct((0..200).map(|i| format!("ns-{i}")).collect()) <= 8);
        assert!(distinct((0..200).map(|i| format!("ns-{i}-x")).collect()) >= 150);
    }

    #[test]
    fn ranges_are_compact() {
        assert_eq!(ranges(&BTreeSet::from([0, 1, 2, 5, 7, 8])), "0-2,5,7-8");
        assert_eq!(ranges(&BTreeSet::new()), "");
    }

    #[test]
    fn selectors() {
        assert_eq!(selector("example.com/bucket", &BTreeSet::new()), None);
        assert_eq!(selector("example.com/bucket", &BTreeSet::from([3, 1])).unwrap(), "example.com/bucket in (1,3)");
        assert_eq!(selector("example.com/bucket", &(0..BUCKETS).collect()).unwrap(), "example.com/bucket");
    }
}
