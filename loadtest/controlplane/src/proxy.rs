//! A TCP proxy in front of the API server that can hold what clients send: the fault of a
//! slow network, for tests of late writes. While held, what a client sends is kept until
//! the hold is released, then forwarded in order at the pace it was sent; replies flow
//! freely. A request is then applied as late as the test decides (not after a fixed delay,
//! which a slow handoff may outlast), and the client's cancellation of it (HTTP/2 resets
//! the stream when the client gives up) follows it as far behind as it was sent, not at
//! once, which would cancel the request before the server got to it. TLS passes through
//! untouched (the API server's certificate names 127.0.0.1).
//!
//! Threads, not tasks: the proxy must keep running while the test's runtime is busy.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

pub struct HoldingProxy {
    port: u16,
    held: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl HoldingProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target`.
    pub fn start(target: u16) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let (held, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (holding, stopping) = (held.clone(), stop.clone());
        thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(server) = TcpStream::connect(("127.0.0.1", target)) {
                            connect(client, server, holding.clone());
                        }
                    }
                    // Polling accept lets the thread notice `stop` without another connection.
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Self { port, held, stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, keep what clients send (including what is queued but not yet forwarded).
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Forwards what was kept, in order and at the pace it was sent, and everything after it.
    pub fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.release();
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn connect(client: TcpStream, server: TcpStream, held: Arc<AtomicBool>) {
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else { return };
    // Client → server: read, stamp with when and whether held, and forward in order.
    let (chunks, queued) = mpsc::channel::<(Instant, bool, Vec<u8>)>();
    let holding = held.clone();
    thread::spawn(move || {
        let mut from = client;
        let mut buffer = [0u8; 16 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 {
                break;
            }
            if chunks.send((Instant::now(), holding.load(Ordering::SeqCst), buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    thread::spawn(move || {
        let mut to = server;
        // Once released: when, and when the first chunk kept was read.
        let mut replay: Option<(Instant, Instant)> = None;
        for (read_at, kept, chunk) in queued {
            while held.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(10));
            }
            if kept {
                let (released, first) = *replay.get_or_insert((Instant::now(), read_at));
                thread::sleep((released + (read_at - first)).saturating_duration_since(Instant::now()));
            } else {
                replay = None;
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    // Server → client: straight through.
    thread::spawn(move || {
        let (mut from, mut to) = (server2, client2);
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
}
