//! Time in the model: real time in milliseconds, and each process's own clock, which may run
//! faster or slower than real time by a fixed rate. The operator's decision functions are
//! given `Instant`s read from the process's own clock, never real time.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

pub const SECOND: u64 = 1000;

/// The `Instant` a process reads when its clock shows `ms`.
pub fn at(ms: u64) -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now) + Duration::from_millis(ms)
}

/// A process's clock: it shows real time scaled by `1 + drift_ppm / 1_000_000`. Offsets do
/// not matter to the protocol (no process compares its clock with another's), rates do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Clock {
    pub drift_ppm: i64,
}

impl Clock {
    pub fn shows(self, real: u64) -> u64 {
        (i128::from(real) * i128::from(1_000_000 + self.drift_ppm) / 1_000_000) as u64
    }

    pub fn read(self, real: u64) -> Instant {
        at(self.shows(real))
    }

    /// The last real instant at which this clock shows at most `local`.
    pub fn last_showing(self, local: u64) -> u64 {
        last_instant(0, local * 2 + SECOND, |real| self.shows(real) <= local).unwrap_or(0)
    }
}

/// The last instant at which `holds` is true, for a `holds` that is true at `from` and
/// turns false once, by `to`; `None` if it does not turn false in `from..=to`.
pub fn last_instant(from: u64, to: u64, holds: impl Fn(u64) -> bool) -> Option<u64> {
    if !holds(from) || holds(to) {
        return None;
    }
    let (mut yes, mut no) = (from, to);
    while no - yes > 1 {
        let mid = yes + (no - yes) / 2;
        if holds(mid) { yes = mid } else { no = mid }
    }
    Some(yes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_clock_shows_a_deadline_late_in_real_time() {
        let slow = Clock { drift_ppm: -10_000 };
        assert_eq!(slow.shows(1000), 990);
        let last = slow.last_showing(3000);
        assert!(slow.shows(last) <= 3000 && slow.shows(last + 1) > 3000);
        assert_eq!(last, 3031);
        assert_eq!(Clock::default().last_showing(3000), 3000);
    }
}
