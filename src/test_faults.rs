//! Faults the tests inject through hidden flags, so they can show on a real cluster what a
//! panicking, stuck or dying part does. Only with the `test-faults` feature, which the
//! tests' builds have and a release build does not: without it, [`TestFaults`] has no
//! flags and does nothing.

#[cfg(feature = "test-faults")]
use std::time::Duration;

use crate::runtime::ObjectKey;

#[cfg(feature = "test-faults")]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TestFaults {
    /// Make the reconcile of this `namespace/name` panic.
    #[arg(long = "test-panic-on", env = "TPO_TEST_PANIC_ON", hide = true)]
    panic_on: Option<String>,

    /// Make the reconcile of this `namespace/name` hang before it writes, until the reconcile
    /// timeout drops it (a stuck reconcile).
    #[arg(long = "test-stall-on", env = "TPO_TEST_STALL_ON", hide = true)]
    stall_on: Option<String>,

    /// Make the follower task panic this long after start (a critical task dies while the
    /// process lives on).
    #[arg(long = "test-follower-panics-after", env = "TPO_TEST_FOLLOWER_PANICS_AFTER", hide = true,
        value_parser = humantime::parse_duration)]
    follower_panics_after: Option<Duration>,
}

#[cfg(not(feature = "test-faults"))]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TestFaults {}

impl TestFaults {
    /// At the start of every reconcile of `key`: panics or hangs if asked to.
    pub async fn before_reconcile(&self, key: &ObjectKey) {
        #[cfg(feature = "test-faults")]
        {
            // Only formatted when a flag is set: this is every reconcile's path.
            let targets = |flag: &Option<String>| flag.as_ref().is_some_and(|target| *target == key.to_string());
            if targets(&self.panic_on) {
                panic!("test fault: --test-panic-on {key}");
            }
            if targets(&self.stall_on) {
                tracing::warn!("test fault: --test-stall-on {key}: hanging until the reconcile timeout");
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(feature = "test-faults"))]
        let _ = key;
    }

    /// The follower's `work`, which panics after a while if asked to.
    pub async fn follower<T>(self, work: impl Future<Output = T>) -> T {
        #[cfg(feature = "test-faults")]
        if let Some(after) = self.follower_panics_after {
            return tokio::select! {
                done = work => done,
                _ = tokio::time::sleep(after) => panic!("test fault: the task panics after {after:?}"),
            };
        }
        work.await
    }
}
