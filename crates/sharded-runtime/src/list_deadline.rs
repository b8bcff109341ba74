//! The deadline for the watches to list the slice.
//!
//! A watch whose lists keep failing without being refused (a proxy that answers 504, a list
//! that times out) is retried with backoff for ever, and no object of a bucket it has not
//! listed is reconciled meanwhile. A process in that state holds work it does nothing with.
//! Past the deadline it says so through [`WatchHealth`](super::watch_health::WatchHealth),
//! and whoever hands out work gives it to someone else. Each owned bucket has its own
//! deadline, so handoffs in a row never add up to a miss. The process asks for work again
//! after a hold, counted from when its work was given away, that doubles with each miss in
//! a row, so a fault that lasts costs few handoffs.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::backoff::Backoff;
use super::parts::Buckets;

/// Misses in a row double the hold up to this many deadlines.
const MAX_HOLD_DEADLINES: u32 = 16;

/// Whether the watches list each owned bucket within the deadline; a miss stands for a hold that
/// doubles with misses in a row.
pub struct ListDeadline {
    deadline: Duration,
    hold: Backoff,
    /// Since when each owned bucket has not been listed by every watch.
    unlisted_since: BTreeMap<u16, Instant>,
    /// Why the deadline was missed, and until when the miss stands.
    missed: Option<Missed>,
    /// Misses in a row: reset once an owned slice is listed in full.
    misses: u32,
}

struct Missed {
    why: String,
    hold: Duration,
    until: Instant,
}

impl ListDeadline {
    /// A deadline of `deadline` per owned bucket.
    pub fn new(deadline: Duration) -> Self {
        let hold = Backoff::new(deadline, deadline.saturating_mul(MAX_HOLD_DEADLINES));
        Self { deadline, hold, unlisted_since: BTreeMap::new(), missed: None, misses: 0 }
    }

    /// At `now`, the buckets `unlisted` of the `owned` ones are not listed by every watch.
    /// Returns why this process should be given no work, while it should not.
    pub fn observe(&mut self, now: Instant, unlisted: &Buckets, owned: usize) -> Option<String> {
        // Each bucket has its own deadline: one gained later does not restart an older one's.
        self.unlisted_since.retain(|bucket, _| unlisted.contains(bucket));
        for bucket in unlisted {
            self.unlisted_since.entry(*bucket).or_insert(now);
        }
        let late = self.unlisted_since.values().filter(|since| now.duration_since(**since) >= self.deadline).count();
        match &mut self.missed {
            None if late > 0 => {
                self.misses += 1;
                let why = format!(
                    "the watches have not listed {late} of the slice's {owned} buckets within {:?}",
                    self.deadline
                );
                let hold = self.hold.delay(self.misses);
                self.missed = Some(Missed { why, hold, until: now + hold });
            }
            None if unlisted.is_empty() && owned > 0 => self.misses = 0,
            None => {}
            // The hold counts from when the slice is given away, however long that takes.
            Some(missed) if owned > 0 => missed.until = now + missed.hold,
            Some(missed) if now >= missed.until => self.missed = None,
            Some(_) => {}
        }
        self.missed.as_ref().map(|missed| missed.why.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(10);

    fn buckets(range: std::ops::Range<u16>) -> Buckets {
        range.collect()
    }

    #[test]
    fn each_bucket_listed_in_time_never_misses() {
        let (mut d, t0) = (ListDeadline::new(DEADLINE), Instant::now());
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(d.observe(at(0), &buckets(0..4), 4), None);
        assert_eq!(d.observe(at(9), &buckets(3..4), 4), None, "within the deadline");
        assert_eq!(d.observe(at(10), &buckets(0..0), 4), None, "listed");
        // Handoffs in a row: each bucket lists within its own deadline, never all at once.
        assert_eq!(d.observe(at(30), &buckets(4..5), 5), None);
        assert_eq!(d.observe(at(35), &buckets(4..6), 6), None);
        assert_eq!(d.observe(at(38), &buckets(5..6), 6), None);
        assert_eq!(d.observe(at(44), &buckets(5..6), 6), None, "bucket 5 is 9 s unlisted, not 14");
        assert_eq!(d.observe(at(45), &buckets(0..0), 6), None);
    }

    #[test]
    fn a_miss_stands_for_a_hold_from_the_handoff_that_doubles_until_the_slice_lists() {
        let (mut d, t0) = (ListDeadline::new(DEADLINE), Instant::now());
        let at = |s: u64| t0 + Duration::from_secs(s);
        d.observe(at(0), &buckets(0..3), 4);
        let why = d.observe(at(10), &buckets(0..3), 4).expect("missed");
        assert!(why.contains("3 of the slice's 4 buckets"), "{why}");
        // A slow handoff: the hold counts from when the slice was given away.
        assert!(d.observe(at(12), &buckets(0..3), 4).is_some());
        assert!(d.observe(at(15), &buckets(0..0), 0).is_some());
        assert!(d.observe(at(21), &buckets(0..0), 0).is_some());
        assert_eq!(d.observe(at(22), &buckets(0..0), 0), None, "held for one deadline");
        // Given buckets again, it misses again: the hold doubles.
        d.observe(at(24), &buckets(0..4), 4);
        assert!(d.observe(at(34), &buckets(0..4), 4).is_some());
        assert!(d.observe(at(35), &buckets(0..0), 0).is_some());
        assert!(d.observe(at(53), &buckets(0..0), 0).is_some(), "held for two deadlines");
        assert_eq!(d.observe(at(54), &buckets(0..0), 0), None);
        // This time the slice lists: the next miss is held for one deadline again.
        d.observe(at(55), &buckets(0..4), 4);
        assert_eq!(d.observe(at(57), &buckets(0..0), 4), None);
        d.observe(at(60), &buckets(9..10), 5);
        assert!(d.observe(at(70), &buckets(9..10), 5).is_some());
        assert!(d.observe(at(71), &buckets(0..0), 0).is_some());
        assert!(d.observe(at(79), &buckets(0..0), 0).is_some());
        assert_eq!(d.observe(at(80), &buckets(0..0), 0), None);
    }
}
