//! A TCP proxy in front of the API server that can hold what clients send: the fault of
//! a slow network or a slow admission chain, for tests of late writes. While held, bytes
//! from clients are kept in order and forwarded when released; replies flow freely. TLS
//! passes through untouched (the API server's certificate names 127.0.0.1).
//!
//! Threads, not tasks: the proxy must keep running while the test's runtime is busy.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};

pub struct HoldingProxy {
    port: u16,
    hold: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl HoldingProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target`.
    pub fn start(target: u16) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let (hold, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (hold2, stop2) = (hold.clone(), stop.clone());
        thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(server) = TcpStream::connect(("127.0.0.1", target)) {
                            connect(client, server, hold2.clone(), stop2.clone());
                        }
                    }
                    // Polling accept lets the thread notice `stop` without another connection.
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Self { port, hold, stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, hold what clients send.
    pub fn hold(&self) {
        self.hold.store(true, Ordering::SeqCst);
    }

    /// Forward everything held, in order, and what follows.
    pub fn release(&self) {
        self.hold.store(false, Ordering::SeqCst);
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.release();
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn connect(client: TcpStream, server: TcpStream, hold: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else { return };
    thread::spawn(move || pump(client, server, Some(hold), stop.clone()));
    thread::spawn(move || pump(server2, client2, None, Arc::new(AtomicBool::new(false))));
}

/// Copies `from` to `to`; with `hold`, each chunk waits while held.
fn pump(mut from: TcpStream, mut to: TcpStream, hold: Option<Arc<AtomicBool>>, stop: Arc<AtomicBool>) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(hold) = &hold {
            while hold.load(Ordering::SeqCst) && !stop.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(5));
            }
        }
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
