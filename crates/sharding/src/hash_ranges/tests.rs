use super::*;
use crate::bucket::Mode;
use crate::counts::{self, Counts};
use crate::ring::Ring;

/// `team-1` … `team-N`, with their objects: the names users have, which the server's hash
/// puts into a few uniform buckets.
fn teams(objects: impl Fn(usize) -> u32, namespaces: usize) -> Vec<(String, u32)> {
    (1..=namespaces).map(|n| (format!("team-{n}"), objects(n))).collect()
}

/// Objects proportional to 1/rank, as `loadtest run --zipf 1` deals them.
fn zipf(total: u32, namespaces: usize) -> impl Fn(usize) -> u32 {
    let harmonic: f64 = (1..=namespaces).map(|n| 1.0 / n as f64).sum();
    move |n| (f64::from(total) / (n as f64 * harmonic)).round() as u32
}

fn by_hash(namespaces: &[(String, u32)]) -> ByHash {
    namespaces.iter().map(|(name, n)| (fnv1a_64(name.as_bytes()), *n)).collect()
}

fn counts_of(table: &HashRanges, namespaces: &[(String, u32)]) -> Counts {
    let mut counts = Counts::new();
    for (name, n) in namespaces {
        *counts.entry(table.bucket_of(name)).or_default() += n;
    }
    counts
}

/// The largest of three slices over their mean, with buckets placed by the ring as the
/// leader places them once it balances by objects.
fn largest_of_three(table: &HashRanges, namespaces: &[(String, u32)]) -> f64 {
    let counts = counts_of(table, namespaces);
    let owners = Ring::new(&["replica-0", "replica-1", "replica-2"]).assign_weighted(&counts::weights(Some(&counts)));
    let mut slices = [0u64; 3];
    for (bucket, objects) in &counts {
        slices[owners[usize::from(*bucket)].expect("placed")] += u64::from(*objects);
    }
    let mean = slices.iter().sum::<u64>() as f64 / 3.0;
    *slices.iter().max().expect("three") as f64 / mean
}

#[test]
fn the_uniform_table_is_the_servers_top_bits() {
    let uniform = HashRanges::uniform();
    assert!(uniform.is_uniform());
    for i in 0..5_000 {
        let namespace = format!("team-{i}");
        assert_eq!(uniform.bucket_of(&namespace), Mode::ShardSelector.bucket_of(&namespace));
    }
    assert_eq!(uniform.encode(), "", "nothing to write until a split");
    assert_eq!(HashRanges::decode("").unwrap(), uniform);
}

#[test]
fn team_names_balance_once_their_ranges_are_split() {
    for (naming, namespaces) in [("100 each", teams(|_| 100, 200)), ("Zipf", teams(zipf(20_000, 200), 200))] {
        let uniform = HashRanges::uniform();
        let split = uniform.split(&by_hash(&namespaces));
        let (before, after) = (largest_of_three(&uniform, &namespaces), largest_of_three(&split, &namespaces));
        assert!(before > 1.3, "{naming}: uniform ranges crowd these names ({before:.3})");
        assert!(after <= 1.1, "{naming}: the largest slice is {after:.3} × the mean");
        // What stays together is small: two namespaces or more hold at most 1/256 of the objects.
        let mut together: BTreeMap<Bucket, (u32, u32)> = BTreeMap::new();
        for (name, objects) in &namespaces {
            let (names, sum) = together.entry(split.bucket_of(name)).or_default();
            (*names, *sum) = (*names + 1, *sum + objects);
        }
        let total: u32 = namespaces.iter().map(|(_, n)| n).sum();
        let crowded = together.values().filter(|(names, sum)| *names > 1 && u64::from(*sum) > u64::from(total) / 256);
        assert_eq!(crowded.count(), 0, "{naming}");
    }
}

#[test]
fn a_split_moves_only_the_namespaces_of_the_buckets_it_changes() {
    let namespaces = teams(|_| 100, 200);
    let (uniform, split) = (HashRanges::uniform(), HashRanges::uniform().split(&by_hash(&namespaces)));
    let changed = uniform.changed(&split);
    let crowded: BTreeSet<Bucket> = namespaces.iter().map(|(name, _)| uniform.bucket_of(name)).collect();
    // Each split changes three buckets at most: the one split, and two empty neighbours.
    let splits = namespaces.len() - crowded.len();
    assert!((splits..=3 * splits).contains(&changed.len()), "{} changed by {splits} splits", changed.len());
    for (name, _) in &namespaces {
        let (was, is) = (uniform.bucket_of(name), split.bucket_of(name));
        assert!(was == is || (changed.contains(&was) && changed.contains(&is)), "{name}: {was} -> {is}");
    }
    // A far namespace, in an unchanged bucket, stays where it was.
    let unchanged = (0..10_000).map(|i| format!("other-{i}-x")).find(|n| !changed.contains(&uniform.bucket_of(n)));
    let unchanged = unchanged.expect("most buckets are unchanged");
    assert_eq!(split.bucket_of(&unchanged), uniform.bucket_of(&unchanged));
}

#[test]
fn split_ranges_still_cover_the_hash_once() {
    let namespaces = teams(zipf(20_000, 200), 200);
    let split = HashRanges::uniform().split(&by_hash(&namespaces));
    let width: u128 = split.ranges().iter().map(|(start, end)| end - u128::from(*start)).sum();
    assert_eq!(width, 1u128 << 64);
    for (name, _) in &namespaces {
        let (start, end) = split.ranges()[usize::from(split.bucket_of(name))];
        let hash = fnv1a_64(name.as_bytes());
        assert!(u128::from(start) <= u128::from(hash) && u128::from(hash) < end, "{name}");
    }
}

#[test]
fn a_table_already_split_for_its_namespaces_stays() {
    let namespaces = teams(|_| 100, 200);
    let split = HashRanges::uniform().split(&by_hash(&namespaces));
    assert_eq!(split.split(&by_hash(&namespaces)), split, "nothing crowded, nothing changes");
    // A new namespace joins another's range: that one range is split, three buckets change.
    let mut more = namespaces.clone();
    let joining = (201..100_000)
        .map(|n| format!("team-{n}"))
        .find(|name| namespaces.iter().any(|(other, _)| split.bucket_of(other) == split.bucket_of(name)))
        .expect("some new name shares a bucket");
    more.push((joining, 100));
    assert_eq!(split.changed(&split.split(&by_hash(&more))).len(), 3);
}

#[test]
fn small_ranges_are_not_split() {
    // Two namespaces of one object each, among 10,000 objects elsewhere: below 1/256.
    let mut namespaces = teams(|_| 1, 2);
    namespaces.push(("elsewhere-x".into(), 10_000));
    let uniform = HashRanges::uniform();
    assert_eq!(uniform.bucket_of("team-1"), uniform.bucket_of("team-2"), "the case this test is about");
    assert!(uniform.split(&by_hash(&namespaces)).is_uniform());
}

#[test]
fn tables_round_trip_and_bad_ones_say_why() {
    let split = HashRanges::uniform().split(&by_hash(&teams(|_| 100, 200)));
    assert!(!split.is_uniform());
    assert_eq!(HashRanges::decode(&split.encode()).unwrap(), split);
    assert!(HashRanges::decode("5").unwrap_err().contains("bad range"));
    assert!(HashRanges::decode("zz:1").unwrap_err().contains("range start"));
    assert!(HashRanges::decode("10:1024").unwrap_err().contains("out of range"));
    assert!(HashRanges::decode("10:3,20:3").unwrap_err().contains("listed twice"));
    assert!(HashRanges::decode("40000000000000:0").unwrap_err().contains("start at 0"), "bucket 1 starts there");
    assert!(HashRanges::decode("10:0").unwrap_err().contains("start at 0"), "nothing starts at 0");
}
