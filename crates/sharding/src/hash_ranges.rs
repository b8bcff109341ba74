//! Shard-selector buckets as hash ranges that follow the data.
//!
//! In shard-selector mode a bucket is a range of the API server's hash of the namespace
//! (64-bit FNV-1a). Uniform ranges, the top 10 bits, put names that differ only at the end
//! (`team-1` … `team-200`) into a few buckets, and no placement of buckets can balance
//! slices made of a few heavy ones. A [`HashRanges`] table gives each bucket a range of its
//! own instead: [`HashRanges::split`] divides a crowded range where its namespaces are, down
//! to one namespace a range, and takes the index for the new half from two empty neighbours
//! merged into one.
//!
//! Bucket indexes are not tied to range order, so one split changes three buckets: the one
//! split, the empty one that absorbs its neighbour, and the freed index that takes the upper
//! half. Every other bucket keeps its range, its namespaces and its owner.
//!
//! The table is written as the entries that differ from the uniform one: nothing at all
//! until a split.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, LazyLock};

use xxhash_rust::xxh3::xxh3_64;

use super::bucket::{BUCKETS, Bucket, HASH_SHIFT, fnv1a_64};

/// A bucket holding more than this share of all objects, in two namespaces or more, is split.
const CROWDED_SHARE: u64 = 256;

/// Each bucket's range of the server's namespace hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashRanges {
    /// A hash of `by_start`: assignments and slices are hashed often (the model checker),
    /// and this keeps it cheap.
    fingerprint: u64,
    /// `(start, bucket)` sorted by start, every bucket once, the first at 0: a bucket's range
    /// ends where the next entry's starts (the last at 2^64).
    by_start: Vec<(u64, Bucket)>,
}

impl Hash for HashRanges {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.fingerprint.hash(state);
    }
}

impl Default for HashRanges {
    fn default() -> Self {
        Self::uniform()
    }
}

/// Ranges as an assignment holds them: uniform ones without an allocation, since assignments
/// are made, cloned and compared all the time (the model checker makes millions), and split
/// ones shared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ranges(Option<Arc<HashRanges>>);

impl Ranges {
    /// `ranges`, held as uniform when they are.
    pub fn new(ranges: HashRanges) -> Self {
        Self((!ranges.is_uniform()).then(|| Arc::new(ranges)))
    }

    /// Whether these are the uniform ranges.
    pub fn is_uniform(&self) -> bool {
        self.0.is_none()
    }
}

impl std::ops::Deref for Ranges {
    type Target = HashRanges;

    fn deref(&self) -> &HashRanges {
        match &self.0 {
            Some(split) => split,
            None => HashRanges::uniform_ref(),
        }
    }
}

/// A half-open range of the hash; `end` is 2^64 for the last.
pub type Range = (u64, u128);

/// Objects per namespace, keyed by the namespace's hash.
pub type ByHash = BTreeMap<u64, u32>;

impl HashRanges {
    /// Bucket `b` is `[b << 54, (b + 1) << 54)`: the top bits of the hash.
    pub fn uniform() -> Self {
        Self::new((0..BUCKETS).map(|b| (uniform_start(b), b)).collect())
    }

    /// The uniform table, built once.
    fn uniform_ref() -> &'static Self {
        static UNIFORM: LazyLock<HashRanges> = LazyLock::new(HashRanges::uniform);
        &UNIFORM
    }

    fn new(by_start: Vec<(u64, Bucket)>) -> Self {
        let bytes: Vec<u8> = by_start
            .iter()
            .flat_map(|(start, b)| [start.to_le_bytes().as_slice(), &b.to_le_bytes()].concat())
            .collect();
        Self { fingerprint: xxh3_64(&bytes), by_start }
    }

    /// Whether every bucket has its uniform range.
    pub fn is_uniform(&self) -> bool {
        self == Self::uniform_ref()
    }

    /// The bucket whose range holds `hash`.
    pub fn bucket_of_hash(&self, hash: u64) -> Bucket {
        let after = self.by_start.partition_point(|(start, _)| *start <= hash);
        self.by_start[after - 1].1
    }

    /// The bucket of `namespace`, as the server hashes it.
    pub fn bucket_of(&self, namespace: &str) -> Bucket {
        self.bucket_of_hash(fnv1a_64(namespace.as_bytes()))
    }

    /// Every bucket's range, by bucket.
    pub fn ranges(&self) -> Vec<Range> {
        let mut ranges = vec![(0, 0); usize::from(BUCKETS)];
        for (i, (start, b)) in self.by_start.iter().enumerate() {
            let end = self.by_start.get(i + 1).map_or(1u128 << 64, |(next, _)| u128::from(*next));
            ranges[usize::from(*b)] = (*start, end);
        }
        ranges
    }

    /// The buckets whose range differs between `self` and `other`: what a change of table
    /// must take from their owners first.
    pub fn changed(&self, other: &HashRanges) -> BTreeSet<Bucket> {
        let (ours, theirs) = (self.ranges(), other.ranges());
        (0..BUCKETS).filter(|b| ours[usize::from(*b)] != theirs[usize::from(*b)]).collect()
    }

    /// This table with its crowded ranges split, as far as empty neighbours free indexes for
    /// them: a range is crowded while it holds two namespaces or more and more than
    /// 1/[`CROWDED_SHARE`] of all objects. The most crowded goes first, and is split where
    /// half its objects lie on either side. Unchanged when nothing is crowded.
    pub fn split(&self, namespaces: &ByHash) -> Self {
        let total: u64 = namespaces.values().map(|n| u64::from(*n)).sum();
        let crowded_above = total / CROWDED_SHARE;
        let mut table = self.clone();
        let split = loop {
            let held = table.namespaces_by_position(namespaces);
            let crowded = held
                .iter()
                .enumerate()
                .filter(|(_, inside)| inside.len() > 1)
                .map(|(position, inside)| (inside.iter().map(|(_, n)| u64::from(*n)).sum::<u64>(), position))
                .filter(|(objects, _)| *objects > crowded_above)
                .max_by_key(|(objects, position)| (*objects, std::cmp::Reverse(*position)));
            let Some((_, position)) = crowded else { break table };
            let at = halfway(&held[position]);
            let Some((merged, freed)) = table.free_an_index(&held) else { break table };
            // Freeing removed the entry at `merged + 1`, before or after the one to split.
            let position = if merged < position { position - 1 } else { position };
            table.by_start.insert(position + 1, (at, freed));
        };
        Self::new(split.by_start)
    }

    /// The namespaces (hash, objects) in each entry of `by_start`, by position.
    fn namespaces_by_position(&self, namespaces: &ByHash) -> Vec<Vec<(u64, u32)>> {
        let mut held = vec![Vec::new(); self.by_start.len()];
        for (hash, objects) in namespaces {
            let position = self.by_start.partition_point(|(start, _)| start <= hash) - 1;
            held[position].push((*hash, *objects));
        }
        held
    }

    /// Merges the narrowest pair of empty neighbours into the first of them, which frees the
    /// second's index: (the first's position, the freed bucket). Narrow ones first, so
    /// that wide empty ranges, where new namespaces would crowd together, do not grow.
    fn free_an_index(&mut self, held: &[Vec<(u64, u32)>]) -> Option<(usize, Bucket)> {
        let width = |position: usize| {
            let end = self.by_start.get(position + 1).map_or(1u128 << 64, |(next, _)| u128::from(*next));
            end - u128::from(self.by_start[position].0)
        };
        let pair = (0..self.by_start.len().saturating_sub(1))
            .filter(|p| held[*p].is_empty() && held[p + 1].is_empty())
            .min_by_key(|p| (width(*p) + width(p + 1), *p))?;
        let (_, freed) = self.by_start.remove(pair + 1);
        Some((pair, freed))
    }

    /// The entries that differ from the uniform table, as `start:bucket` (start in hex), in
    /// start order; empty for the uniform table.
    pub fn encode(&self) -> String {
        let moved = self.by_start.iter().filter(|(start, b)| *start != uniform_start(*b));
        moved.map(|(start, b)| format!("{start:x}:{b}")).collect::<Vec<_>>().join(",")
    }

    /// Reads a table as [`HashRanges::encode`] wrote it: the listed entries, and every bucket
    /// not listed at its uniform start.
    pub fn decode(value: &str) -> Result<Self, String> {
        let mut listed = BTreeMap::new();
        for entry in value.split(',').filter(|e| !e.is_empty()) {
            let (start, bucket) = entry.split_once(':').ok_or_else(|| format!("bad range {entry:?}"))?;
            let start = u64::from_str_radix(start, 16).map_err(|e| format!("range start {start:?}: {e}"))?;
            let bucket: Bucket = bucket.parse().map_err(|e| format!("range bucket {bucket:?}: {e}"))?;
            if bucket >= BUCKETS || listed.insert(bucket, start).is_some() {
                return Err(format!("range bucket {bucket} out of range or listed twice"));
            }
        }
        let mut by_start: Vec<(u64, Bucket)> =
            (0..BUCKETS).map(|b| (listed.get(&b).copied().unwrap_or_else(|| uniform_start(b)), b)).collect();
        by_start.sort_unstable();
        if by_start[0].0 != 0 || by_start.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err("ranges must start at 0 and not overlap".into());
        }
        Ok(Self::new(by_start))
    }
}

/// Objects per namespace hash, from objects per namespace.
pub fn by_hash(namespaces: &BTreeMap<String, u32>) -> ByHash {
    let mut hashed = ByHash::new();
    for (namespace, objects) in namespaces {
        *hashed.entry(fnv1a_64(namespace.as_bytes())).or_default() += objects;
    }
    hashed
}

fn uniform_start(bucket: Bucket) -> u64 {
    u64::from(bucket) << HASH_SHIFT
}

/// Where to split the namespaces of one range (in hash order, two or more): the hash of the
/// first namespace of the upper part, chosen so the parts' objects are as even as they can be.
fn halfway(inside: &[(u64, u32)]) -> u64 {
    let total: u64 = inside.iter().map(|(_, n)| u64::from(*n)).sum();
    let mut below = 0u64;
    let mut best = (u64::MAX, 1);
    for (i, (_, objects)) in inside.iter().enumerate().take(inside.len() - 1) {
        below += u64::from(*objects);
        best = best.min((below.abs_diff(total - below), i + 1));
    }
    inside[best.1].0
}

#[cfg(test)]
mod tests;
