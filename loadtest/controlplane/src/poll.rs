//! Waiting for a condition in tests: poll with a deadline, never sleep in its place.

use std::time::Duration;

use tokio::time::Instant;

/// Polls `check` every 200 ms until it returns `Ok`, or panics with what it last saw after
/// `within`.
pub async fn eventually<T>(within: Duration, what: &str, mut check: impl AsyncFnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(found) => return found,
            Err(seen) if Instant::now() >= deadline => panic!("{what}: not within {within:?}; last seen: {seen}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
