//! Objects per bucket: what each replica reports on its member Lease ([`Report`]), what the
//! leader publishes in the assignment, and the ring's weights made from them (see
//! `sharding::balance` for when they are used).

use std::collections::BTreeMap;

use super::bucket::{BUCKETS, Bucket};

/// Objects per bucket; buckets without objects are left out.
pub type Counts = BTreeMap<Bucket, u32>;

/// What a replica holds, per bucket, as counted for the assignment of `generation`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Report {
    pub generation: u64,
    pub counts: Counts,
}

impl Report {
    /// `generation/bucket:count,bucket:count`: a few kilobytes for a thousand buckets.
    pub fn encode(&self) -> String {
        format!("{}/{}", self.generation, encode_counts(&self.counts))
    }

    /// Reads a report as [`Report::encode`] wrote it.
    pub fn decode(value: &str) -> Result<Self, String> {
        let (generation, counts) = value.split_once('/').ok_or_else(|| format!("no generation in {value:?}"))?;
        let generation = generation.parse().map_err(|e| format!("generation {generation:?}: {e}"))?;
        Ok(Self { generation, counts: decode_counts(counts)? })
    }
}

/// `bucket:count,bucket:count`, buckets in order, zero counts left out.
pub fn encode_counts(counts: &Counts) -> String {
    let entries: Vec<String> = counts.iter().filter(|(_, n)| **n > 0).map(|(b, n)| format!("{b}:{n}")).collect();
    entries.join(",")
}

/// Reads `bucket:count,…`.
pub fn decode_counts(value: &str) -> Result<Counts, String> {
    value
        .split(',')
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (bucket, count) = entry.split_once(':').ok_or_else(|| format!("bad entry {entry:?}"))?;
            let bucket: Bucket = bucket.parse().map_err(|e| format!("bucket {bucket:?}: {e}"))?;
            if bucket >= BUCKETS {
                return Err(format!("bucket {bucket} out of range"));
            }
            Ok((bucket, count.parse().map_err(|e| format!("count {count:?}: {e}"))?))
        })
        .collect()
}

/// The ring's weights: each bucket's objects, scaled so that all empty buckets together
/// weigh less than one object, plus one, so that empty buckets (where new namespaces appear)
/// are still spread. Without counts, every bucket weighs the same.
pub fn weights(counts: Option<&Counts>) -> Vec<u64> {
    let count = |b: Bucket| counts.and_then(|c| c.get(&b)).map_or(0, |n| u64::from(*n));
    (0..BUCKETS).map(|b| count(b) * u64::from(BUCKETS) + 1).collect()
}

/// A member's capacity of `objects`, in the ring's weight: [`weights`] of any buckets that
/// hold `objects` or fewer in all sum to no more than this, of any that hold more, to more.
pub fn capacity_weight(objects: u64) -> u64 {
    objects.saturating_add(1).saturating_mul(u64::from(BUCKETS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_bad_ones_say_why() {
        let report = Report { generation: 7, counts: Counts::from([(3, 10), (1023, 1)]) };
        assert_eq!(report.encode(), "7/3:10,1023:1");
        assert_eq!(Report::decode(&report.encode()).unwrap(), report);
        assert_eq!(Report::decode("4/").unwrap(), Report { generation: 4, counts: Counts::new() });
        assert!(Report::decode("3:10").unwrap_err().contains("no generation"));
        assert!(Report::decode("1/1024:1").unwrap_err().contains("out of range"));
        assert!(Report::decode("1/5").unwrap_err().contains("bad entry"));
    }

    #[test]
    fn a_capacity_admits_exactly_its_objects() {
        let weight = |counts: &Counts| -> u64 {
            let w = weights(Some(counts));
            counts.keys().map(|b| w[usize::from(*b)]).sum()
        };
        // Worst case for the +1 per bucket: the objects spread over every bucket.
        let spread = |total: u32| -> Counts {
            (0..BUCKETS).map(|b| (b, total / 1024 + u32::from(u32::from(b) < total % 1024))).collect()
        };
        for capacity in [0u32, 5, 1023, 1024, 5000] {
            let cap = capacity_weight(u64::from(capacity));
            assert!(weight(&spread(capacity)) <= cap, "{capacity} objects fit");
            assert!(weight(&spread(capacity + 1)) > cap, "{} objects do not", capacity + 1);
            assert!(weight(&Counts::from([(7, capacity + 1)])) > cap);
        }
    }
}
