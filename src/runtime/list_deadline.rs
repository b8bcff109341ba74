//! The deadline for the watches to list the slice.
//!
//! A watch whose lists keep failing without being refused (a proxy that answers 504, a list
//! that times out) is retried with backoff for ever, and no object of a bucket it has not
//! listed is reconciled meanwhile. A process in that state holds work it does nothing with.
//! Past the deadline it says so through [`WatchHealth`](super::watch_health::WatchHealth),
//! and whoever hands out work gives it to someone else. It asks for work again after a hold
//! that doubles with each miss in a row, so a fault that lasts costs few handoffs.

use std::time::Duration;

use tokio::time::Instant;

use super::backoff::Backoff;

/// Misses in a row double the hold up to this many deadlines.
const MAX_HOLD_DEADLINES: u32 = 16;

pub struct ListDeadline {
    deadline: Duration,
    hold: Backoff,
    /// Since when some owned bucket has not been listed by every watch.
    unlisted_since: Option<Instant>,
    /// Why the deadline was missed, and until when the miss stands.
    missed: Option<(String, Instant)>,
    /// Misses in a row: reset once an owned slice is listed in full.
    misses: u32,
}

impl ListDeadline {
    pub fn new(deadline: Duration) -> Self {
        let hold = Backoff::new(deadline, deadline.saturating_mul(MAX_HOLD_DEADLINES));
        Self { deadline, hold, unlisted_since: None, missed: None, misses: 0 }
    }

    /// At `now`, `unlisted` of the `owned` buckets are not listed by every watch. Returns why
    /// this process should be given no work, while it should not.
    pub fn observe(&mut self, now: Instant, unlisted: usize, owned: usize) -> Option<String> {
        if unlisted == 0 {
            self.unlisted_since = None;
            if owned > 0 && self.missed.is_none() {
                self.misses = 0;
            }
            // A miss stands for its hold even once its buckets were given away.
            if self.missed.as_ref().is_some_and(|(_, until)| now >= *until) {
                self.missed = None;
            }
        } else {
            let since = *self.unlisted_since.get_or_insert(now);
            if self.missed.is_none() && now.duration_since(since) >= self.deadline {
                self.misses += 1;
                let why = format!(
                    "the watches have not listed {unlisted} of the slice's {owned} buckets within {:?}",
                    self.deadline
                );
                self.missed = Some((why, now + self.hold.delay(self.misses)));
            }
        }
        self.missed.as_ref().map(|(why, _)| why.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(10);

    #[test]
    fn a_slice_listed_in_time_never_misses() {
        let (mut d, t0) = (ListDeadline::new(DEADLINE), Instant::now());
        assert_eq!(d.observe(t0, 4, 4), None);
        assert_eq!(d.observe(t0 + Duration::from_secs(9), 1, 4), None, "within the deadline");
        assert_eq!(d.observe(t0 + Duration::from_secs(10), 0, 4), None, "listed");
        assert_eq!(d.observe(t0 + Duration::from_secs(15), 2, 6), None, "a new part starts its own deadline");
    }

    #[test]
    fn a_miss_stands_for_a_hold_that_doubles_until_the_slice_lists() {
        let (mut d, t0) = (ListDeadline::new(DEADLINE), Instant::now());
        let at = |s: u64| t0 + Duration::from_secs(s);
        d.observe(at(0), 3, 4);
        let why = d.observe(at(10), 3, 4).expect("missed");
        assert!(why.contains("3 of the slice's 4 buckets"), "{why}");
        // The buckets are given away; the miss stands for one deadline, then it asks again.
        assert!(d.observe(at(12), 0, 0).is_some());
        assert_eq!(d.observe(at(20), 0, 0), None);
        // Given buckets again, it misses again: the hold doubles.
        d.observe(at(22), 4, 4);
        assert!(d.observe(at(32), 4, 4).is_some());
        assert!(d.observe(at(40), 0, 0).is_some());
        assert!(d.observe(at(51), 0, 0).is_some(), "held for two deadlines");
        assert_eq!(d.observe(at(52), 0, 0), None);
        // This time the slice lists: the next miss is held for one deadline again.
        d.observe(at(53), 4, 4);
        assert_eq!(d.observe(at(55), 0, 4), None);
        d.observe(at(60), 1, 5);
        assert!(d.observe(at(70), 1, 5).is_some());
        assert!(d.observe(at(79), 0, 0).is_some());
        assert_eq!(d.observe(at(80), 0, 0), None);
    }
}
