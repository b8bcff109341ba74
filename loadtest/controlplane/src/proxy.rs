//! A TCP proxy in front of the API server that can delay what clients send: the fault of a
//! slow network, for tests of late writes. While a delay is set, every chunk a client sends
//! is forwarded that long after it was read, in order; replies flow freely. A request is
//! then applied late, and so is the client's cancellation of it (HTTP/2 resets the stream
//! when the client gives up), which arrives after the request was applied. TLS passes
//! through untouched (the API server's certificate names 127.0.0.1).
//!
//! Threads, not tasks: the proxy must keep running while the test's runtime is busy.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

pub struct DelayingProxy {
    port: u16,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl DelayingProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target`.
    pub fn start(target: u16) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let (delay_ms, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (delay, stopping) = (delay_ms.clone(), stop.clone());
        thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(server) = TcpStream::connect(("127.0.0.1", target)) {
                            connect(client, server, delay.clone());
                        }
                    }
                    // Polling accept lets the thread notice `stop` without another connection.
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Self { port, delay_ms, stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, forward what clients send `delay` after reading it.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms.store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for DelayingProxy {
    fn drop(&mut self) {
        self.set_delay(Duration::ZERO);
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn connect(client: TcpStream, server: TcpStream, delay_ms: Arc<AtomicU64>) {
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else { return };
    // Client → server: read, stamp with when it is due, and forward in order when due.
    let (chunks, due) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut from = client;
        let mut buffer = [0u8; 16 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 {
                break;
            }
            let at = Instant::now() + Duration::from_millis(delay_ms.load(Ordering::SeqCst));
            if chunks.send((at, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    thread::spawn(move || {
        let mut to = server;
        for (at, chunk) in due {
            thread::sleep(at.saturating_duration_since(Instant::now()));
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
