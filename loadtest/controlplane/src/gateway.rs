//! A real gateway for the tests, the load test and the demo: Traefik v3, built once from
//! the Go module proxy by `loadtest/gateway/build.sh` and cached next to the control plane,
//! run as a local process against the local API server with its Kubernetes Gateway and CRD
//! providers.
//!
//! Its backends are small HTTP servers in network namespaces the caller creates
//! ([`Backend`]): an EndpointSlice refuses loopback addresses, and Traefik's Gateway
//! provider refuses ExternalName Services, so a route's backend needs an address of its own.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::process::Process;
use crate::{ControlPlane, free_port};

/// The controllerName of Traefik's GatewayClasses.
pub const TRAEFIK_CONTROLLER: &str = "traefik.io/gateway-controller";

/// Runs `loadtest/gateway/build.sh` once per process: builds Traefik if missing and returns
/// the cache dir (`traefik` and `crds/`).
pub fn ensure_gateway() -> Result<PathBuf> {
    static DIR: crate::tools::Built = crate::tools::Built::new();
    crate::tools::built_once(&DIR, "../gateway/build.sh", &[], "gateway")
}

/// The CRD files the gateway tests install: the Gateway API standard channel, Traefik's
/// and Envoy Gateway's BackendTrafficPolicy.
pub fn crd_files() -> Result<Vec<PathBuf>> {
    let crds = ensure_gateway()?.join("crds");
    Ok(["gateway-api.yaml", "traefik.yaml", "envoy-gateway-backendtrafficpolicy.yaml"].map(|f| crds.join(f)).to_vec())
}

/// One Traefik process. Its `web` entry point listens on 127.0.0.1:[`Traefik::web_port`]; a
/// Gateway listener with that port binds to it.
pub struct Traefik {
    pub web_port: u16,
    process: Process,
}

impl Traefik {
    /// Starts Traefik watching `namespaces` of `cp` (all when empty) as the admin, and waits
    /// until it pings.
    pub fn start(cp: &ControlPlane, namespaces: &[&str], log_name: &str) -> Result<Self> {
        let bin = ensure_gateway()?.join("traefik");
        let (web_port, ping_port) = (free_port()?, free_port()?);
        let ca = cp.dir().join("ca.crt").display().to_string();
        let mut args = vec![
            format!("--entrypoints.web.address=127.0.0.1:{web_port}"),
            format!("--entrypoints.ping.address=127.0.0.1:{ping_port}"),
            "--ping=true".into(),
            "--ping.entrypoint=ping".into(),
            "--log.level=INFO".into(),
        ];
        for provider in ["kubernetesgateway", "kubernetescrd"] {
            args.push(format!("--providers.{provider}=true"));
            args.push(format!("--providers.{provider}.endpoint={}", cp.server_url()));
            args.push(format!("--providers.{provider}.token={}", cp.admin_token()));
            args.push(format!("--providers.{provider}.certauthfilepath={ca}"));
            if !namespaces.is_empty() {
                args.push(format!("--providers.{provider}.namespaces={}", namespaces.join(",")));
            }
        }
        let log = cp.dir().join(format!("{log_name}.log"));
        let mut process = Process::start("traefik", &bin, &args, &log)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = process.exited() {
                return Err(process.failure(&format!("exited during start-up ({status})")));
            }
            if get(ping_port, "localhost", "/ping").is_ok_and(|r| r.status == 200) {
                return Ok(Self { web_port, process });
            }
            if Instant::now() > deadline {
                return Err(process.failure("did not answer /ping within 60 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A GET through the gateway's `web` entry point.
    pub fn get(&self, host: &str, path: &str) -> Result<Response> {
        get(self.web_port, host, path)
    }

    pub fn log_path(&self) -> &Path {
        &self.process.log_path
    }

    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(5));
    }
}

/// An HTTP answer: the status code and the body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// A bare HTTP/1.0 GET on 127.0.0.1:`port` with a `Host` header.
pub fn get(port: u16, host: &str, path: &str) -> Result<Response> {
    let mut stream = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let status = raw.split(' ').nth(1).and_then(|code| code.parse().ok()).context("no HTTP status line")?;
    let body = raw.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    Ok(Response { status, body })
}

/// An HTTP server in a network namespace of its own, reachable from this host at
/// [`Backend::address`]:[`Backend::port`]. It serves `files` (path, body). Dropping it stops
/// the server and removes the namespace and its link.
pub struct Backend {
    pub address: Ipv4Addr,
    pub port: u16,
    netns: String,
    host_link: String,
    server: Option<Process>,
    _root: tempfile::TempDir,
}

impl Backend {
    pub fn start(files: &[(&str, &str)]) -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Link names have at most 15 characters; addresses are 10.<a>.<b>.{1,2}/30.
        let netns = format!("tpo-{pid}-{n}");
        let host_link = format!("tpo{}h{n}", pid % 100_000);
        let peer_link = format!("tpo{}n{n}", pid % 100_000);
        let subnet = (pid % 200) * 64 + n; // distinct per process and backend
        let (a, b) = (200 + (subnet / 64 % 50) as u8, ((subnet % 64) * 4) as u8);
        let (host_addr, address) = (Ipv4Addr::new(10, a, b, 1), Ipv4Addr::new(10, a, b, 2));
        let root = tempfile::Builder::new().prefix("tpo-backend-").tempdir()?;
        for (path, body) in files {
            let file = root.path().join(path.trim_start_matches('/'));
            std::fs::create_dir_all(file.parent().expect("a file has a parent"))?;
            std::fs::write(file, body)?;
        }
        let mut backend =
            Self { address, port: 8080, netns: netns.clone(), host_link: host_link.clone(), server: None, _root: root };
        run("ip", &["netns", "add", &netns])?;
        run("ip", &["link", "add", &host_link, "type", "veth", "peer", "name", &peer_link, "netns", &netns])?;
        run("ip", &["addr", "add", &format!("{host_addr}/30"), "dev", &host_link])?;
        run("ip", &["link", "set", &host_link, "up"])?;
        run("ip", &["-n", &netns, "addr", "add", &format!("{address}/30"), "dev", &peer_link])?;
        run("ip", &["-n", &netns, "link", "set", &peer_link, "up"])?;
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &netns, "python3", "-m", "http.server", "--bind"]);
        command.arg(address.to_string()).arg(backend.port.to_string()).arg("--directory").arg(backend._root.path());
        let log = backend._root.path().join("server.log");
        backend.server = Some(Process::start_command("backend", command, &log)?);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&SocketAddr::from((address, backend.port)), Duration::from_millis(200))
            .is_err()
        {
            if Instant::now() > deadline {
                bail!("the backend at {address}:{} did not listen within 20 s (python3 is needed)", backend.port);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(backend)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.stop(Duration::from_secs(2));
        }
        let _ = run("ip", &["link", "del", &self.host_link]);
        let _ = run("ip", &["netns", "del", &self.netns]);
    }
}

fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program).args(args).output().with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
