//! Ctrl-C: a run stops at it, after cleaning up what it made.

/// Ctrl-C, from the moment this is called: `compare` listens once for all its runs, so that a
/// Ctrl-C between two runs (or while a peer is built) stops it too.
pub fn interrupts() -> std::io::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
}

/// A run stopped by Ctrl-C (after cleaning up): `compare` stops there too.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted; what the run made was cleaned up")
    }
}

impl std::error::Error for Interrupted {}
