//! Ports for the processes the tests start.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Result, bail};

/// A port that was free on 127.0.0.1 a moment ago, for a process to listen on.
///
/// Taken below the kernel's ephemeral range: a port the kernel picked for us (`bind(0)`) is
/// from that range, and between our check and the process's bind, any outgoing connection
/// on the machine could take it as its local port ("Address already in use" at start, seen
/// in CI). Below the range only listeners take ports, and ours take turns through a counter.
pub fn free_port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    const LOWEST: u32 = 10_000;
    let span = ephemeral_start.saturating_sub(LOWEST);
    if span < 1_000 {
        // No room below the range: fall back to the kernel's pick.
        return Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port());
    }
    // Processes started at once (test binaries, load tools) start at different points.
    let offset = std::process::id().wrapping_mul(7919);
    for _ in 0..span {
        let port = LOWEST + offset.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    bail!("no free port between {LOWEST} and {ephemeral_start}")
}
