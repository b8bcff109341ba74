//! Per-key exponential backoff: `base * 2^(failures-1)`, capped.
//!
//! A formula rather than a backoff crate: the queue keeps one failure count per key, and
//! the crates model a stateful retry loop per operation, which is not what a queue needs.

use std::time::Duration;

/// Exponential backoff from `base`, doubling per failure, capped at `cap`.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// Backoff that starts at `base` and never exceeds `cap`.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
    }

    /// The delay before retry number `failures` (1 for the first retry).
    pub fn delay(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(31);
        self.base.saturating_mul(1u32 << exponent).min(self.cap)
    }
}

impl Default for Backoff {
    /// client-go's per-item limiter: 5 ms doubling up to 1000 s; we cap at 5 minutes so
    /// that a fixed cause (RBAC, a webhook) is retried within a useful time.
    fn default() -> Self {
        Self::new(Duration::from_millis(5), Duration::from_secs(300))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_then_caps() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<u64> = (1..=6).map(|n| b.delay(n).as_millis() as u64).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.delay(10_000), Duration::from_secs(1), "no overflow on long failure runs");
    }
}
