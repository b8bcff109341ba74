//! A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) run as
//! local processes for integration tests, e2e tests, the load test and the demo.
//!
//! The binaries are built once from the official Go modules by `build.sh` next to this
//! crate and cached outside the repository. Each [`ControlPlane`] lives in a fresh
//! directory with its own certificates, ports and logs, and is torn down on drop; its
//! processes also die with the test process, even on `kill -9` (see [`process`]).
//!
//! ```no_run
//! let cp = controlplane::ControlPlane::shared();  // one per test process
//! # async fn f(cp: &controlplane::ControlPlane) -> anyhow::Result<()> {
//! let client = cp.client().await?;                  // admin (system:masters)
//! # Ok(()) }
//! ```

mod certs;
pub use certs::self_signed_localhost;
pub mod gateway;
pub mod gateway_timeout;
mod identity;
pub mod manifests;
pub mod poll;
mod ports;
pub mod process;
pub mod proxy;
mod release;
pub mod tools;
pub use release::Release;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine;

pub use identity::{Grant, Identity};
pub use ports::free_port;
use process::Process;

/// What the test control plane audits: writes by service accounts to the objects an
/// operator under test writes. Everything else is left out to keep the log small.
const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Request
    userGroups: ["system:serviceaccounts"]
    verbs: ["create", "update", "patch", "delete"]
    resources:
      - group: ""
        resources: ["configmaps"]
      - group: "networking.k8s.io"
        resources: ["networkpolicies"]
      - group: "trafficpolicy.dev"
        resources: ["applicationtrafficpolicies", "applicationtrafficpolicies/status"]
      - group: "gateway.networking.k8s.io"
        resources: ["httproutes"]
      - group: "traefik.io"
        resources: ["middlewares"]
      - group: "gateway.envoyproxy.io"
        resources: ["backendtrafficpolicies"]
      - group: "coordination.k8s.io"
        resources: ["leases"]
  - level: None
"#;

const READY_TIMEOUT: Duration = Duration::from_secs(90);
const STOP_GRACE: Duration = Duration::from_secs(10);
/// kube-apiserver's graceful termination takes about 30 s here (it drains long-running
/// requests); fault tests want a restart, not a drain, so it gets SIGKILL after this.
const APISERVER_STOP_GRACE: Duration = Duration::from_secs(2);

/// kube-apiserver's alpha gate for shard selectors on list and watch (KEP-5866).
pub const SHARDED_LIST_AND_WATCH: &str = "ShardedListAndWatch=true";

/// Whether the shared control plane serves shard selectors: yes where its release has them,
/// unless `TPO_TEST_SHARDED_LIST_AND_WATCH=off`, so that the suites run in either sharding mode
/// (the operator picks the shard selector where the server honours it, labels otherwise).
pub fn sharded_list_and_watch() -> bool {
    Release::of_tests().has_shard_selectors()
        && std::env::var("TPO_TEST_SHARDED_LIST_AND_WATCH").as_deref() != Ok("off")
}

/// What to start. `Config::default()` is what the tests use.
#[derive(Clone, Debug)]
pub struct Config {
    /// Extra kube-apiserver flags, e.g. `--max-requests-inflight=800`.
    pub apiserver_args: Vec<String>,
    /// Feature gates for kube-apiserver, e.g. `SomeGate=true`.
    pub feature_gates: Vec<String>,
    /// Start kube-controller-manager (garbage collector, namespace and ClusterRole aggregation
    /// controllers).
    pub controller_manager: bool,
    /// A fixed apiserver port; a free one when `None`.
    pub apiserver_port: Option<u16>,
    /// Which Kubernetes to run; [`Release::of_tests`] by default.
    pub release: Release,
    /// Write kube-apiserver's audit log of what service accounts write (see
    /// [`ControlPlane::audit_log_path`]): the tests judge safety from what the server received.
    pub audit_writes: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            apiserver_args: Vec::new(),
            feature_gates: Vec::new(),
            controller_manager: true,
            apiserver_port: None,
            release: Release::of_tests(),
            audit_writes: false,
        }
    }
}

struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    apiserver: u16,
    controller_manager: u16,
}

pub struct ControlPlane {
    config: Config,
    bin_dir: PathBuf,
    dir: PathBuf,
    /// Removed on drop; kept when the start fails, so its logs can be read.
    temp: Option<tempfile::TempDir>,
    ports: Ports,
    admin_token: String,
    ca_pem: String,
    etcd: Mutex<Option<Process>>,
    apiserver: Mutex<Option<Process>>,
    controller_manager: Mutex<Option<Process>>,
}

impl ControlPlane {
    /// Builds the binaries if needed, then starts every component and waits until ready.
    pub fn start(config: Config) -> Result<Self> {
        let bin_dir = config.release.binaries()?;
        let temp = tempfile::Builder::new().prefix("tpo-controlplane-").tempdir().context("create a temp dir")?;
        let dir = temp.path().to_owned();
        let pki = certs::generate(&dir)?;
        let admin_token = random_token()?;
        std::fs::write(dir.join("tokens.csv"), format!("{admin_token},admin,admin-uid,\"system:masters\"\n"))?;
        let ports = Ports {
            etcd_client: free_port()?,
            etcd_peer: free_port()?,
            apiserver: match config.apiserver_port {
                Some(port) => port,
                None => free_port()?,
            },
            controller_manager: free_port()?,
        };
        let cp = Self {
            config,
            bin_dir,
            dir,
            temp: Some(temp),
            ports,
            admin_token,
            ca_pem: pki.ca_pem,
            etcd: Mutex::new(None),
            apiserver: Mutex::new(None),
            controller_manager: Mutex::new(None),
        };
        let mut cp = cp;
        if let Err(error) = cp.boot() {
            cp.stop_all();
            if let Some(temp) = cp.temp.take() {
                let _ = temp.keep();
            }
            return Err(error);
        }
        Ok(cp)
    }

    fn boot(&self) -> Result<()> {
        std::fs::write(self.kubeconfig_path(), self.kubeconfig_yaml(&self.admin_token, "admin"))?;
        self.start_etcd()?;
        self.start_apiserver()?;
        if self.config.controller_manager {
            self.start_controller_manager()?;
        }
        Ok(())
    }

    /// One control plane per test process, started on first use and torn down at exit.
    /// Tests share it and keep apart by using their own namespaces.
    pub fn shared() -> &'static ControlPlane {
        static SHARED: OnceLock<ControlPlane> = OnceLock::new();
        SHARED.get_or_init(|| {
            let feature_gates =
                if sharded_list_and_watch() { vec![SHARDED_LIST_AND_WATCH.to_string()] } else { vec![] };
            let config = Config { audit_writes: true, feature_gates, ..Config::default() };
            let cp = ControlPlane::start(config).unwrap_or_else(|e| panic!("{e:#}"));
            extern "C" fn teardown() {
                if let Some(cp) = SHARED.get() {
                    cp.stop_all();
                    let _ = std::fs::remove_dir_all(&cp.dir);
                }
            }
            // SAFETY: registering a plain extern "C" function with no captured state.
            unsafe { libc::atexit(teardown) };
            cp
        })
    }

    /// Compacts etcd's history up to `revision` (a resourceVersion): a watch that resumes
    /// from before it gets `410 Gone` and must relist, as after a long disconnection.
    pub fn compact_etcd(&self, revision: u64) -> Result<()> {
        let body = format!("{{\"revision\": \"{revision}\", \"physical\": true}}");
        let response = http_post_plain(self.ports.etcd_client, "/v3/kv/compaction", &body)?;
        if !response.starts_with("HTTP/1.0 200") && !response.starts_with("HTTP/1.1 200") {
            bail!("etcd compaction to {revision} failed: {}", response.lines().last().unwrap_or_default());
        }
        Ok(())
    }

    /// etcd's own /metrics (its client port serves them in plain HTTP).
    pub fn etcd_metrics(&self) -> Result<String> {
        http_get_plain(self.ports.etcd_client, "/metrics")
    }

    /// The directory holding certificates, data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// An admin kubeconfig (group system:masters).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The admin's bearer token (system:masters), for processes that take a token.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The Kubernetes release it runs.
    pub fn release(&self) -> Release {
        self.config.release
    }

    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.apiserver)
    }

    /// kube-apiserver's audit log (JSON lines) when [`Config::audit_writes`] is set: every
    /// create, update and patch by a service account of ConfigMaps, NetworkPolicies and
    /// ApplicationTrafficPolicies (status included), at the `Request` level.
    pub fn audit_log_path(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    pub fn log_path(&self, component: &str) -> PathBuf {
        self.dir.join(format!("{component}.log"))
    }

    /// A fresh admin client. Clients are tied to the tokio runtime that made them, so each
    /// test asks for its own.
    pub async fn client(&self) -> Result<kube::Client> {
        self.client_for_token(&self.admin_token, "admin").await
    }

    /// The admin acting as `user` (impersonation): a client with `user`'s rights only, as
    /// `kubectl --as` gives.
    pub async fn client_as(&self, user: &str) -> Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_yaml(&self.admin_token, "admin"))?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
        config.auth_info.impersonate = Some(user.into());
        Ok(kube::Client::try_from(config)?)
    }

    pub async fn client_for_token(&self, token: &str, user: &str) -> Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_yaml(token, user))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    fn kubeconfig_yaml(&self, token: &str, user: &str) -> String {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n\
             - name: local\n  context:\n    cluster: local\n    user: {user}\ncurrent-context: local\n",
            server = self.server_url()
        )
    }

    pub fn start_etcd(&self) -> Result<()> {
        let peer = format!("http://127.0.0.1:{}", self.ports.etcd_peer);
        let client = format!("http://127.0.0.1:{}", self.ports.etcd_client);
        let args = vec![
            "--name=default".to_string(),
            format!("--data-dir={}", self.dir.join("etcd-data").display()),
            format!("--listen-client-urls={client}"),
            format!("--advertise-client-urls={client}"),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster=default={peer}"),
            "--unsafe-no-fsync".to_string(),
            "--log-level=warn".to_string(),
        ];
        let mut slot = lock(&self.etcd);
        let mut etcd = self.launch("etcd", &[self.ports.etcd_client, self.ports.etcd_peer], &args)?;
        wait_until(&mut etcd, || http_get_plain(self.ports.etcd_client, "/health").is_ok_and(|b| b.contains("true")))?;
        *slot = Some(etcd);
        Ok(())
    }

    pub fn start_apiserver(&self) -> Result<()> {
        let d = |name: &str| self.dir.join(name).display().to_string();
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", self.ports.etcd_client),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={}", self.ports.apiserver),
            format!("--tls-cert-file={}", d("apiserver.crt")),
            format!("--tls-private-key-file={}", d("apiserver.key")),
            format!("--cert-dir={}", d("apiserver-certs")),
            format!("--token-auth-file={}", d("tokens.csv")),
            "--authorization-mode=RBAC".to_string(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            "--service-cluster-ip-range=10.0.0.0/24".to_string(),
            // No token controller runs, so ServiceAccount admission would reject pods.
            "--disable-admission-plugins=ServiceAccount".to_string(),
            "--profiling=false".to_string(),
        ];
        if !self.config.feature_gates.is_empty() {
            args.push(format!("--feature-gates={}", self.config.feature_gates.join(",")));
        }
        if self.config.audit_writes {
            std::fs::write(self.dir.join("audit-policy.yaml"), AUDIT_POLICY)?;
            args.push(format!("--audit-policy-file={}", d("audit-policy.yaml")));
            args.push(format!("--audit-log-path={}", self.audit_log_path().display()));
            args.push("--audit-log-mode=blocking".to_string());
            args.push("--audit-log-maxsize=0".to_string());
        }
        args.extend(self.config.apiserver_args.iter().cloned());
        let mut slot = lock(&self.apiserver);
        let mut apiserver = self.launch("kube-apiserver", &[self.ports.apiserver], &args)?;
        wait_until(&mut apiserver, || {
            self.with_runtime(|| async { self.client().await?.request_text(get("/readyz")?).await.map_err(Into::into) })
                .is_ok_and(|body| body.trim() == "ok")
        })?;
        *slot = Some(apiserver);
        Ok(())
    }

    fn start_controller_manager(&self) -> Result<()> {
        let kubeconfig = self.kubeconfig_path().display().to_string();
        let args = vec![
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--controllers=garbage-collector-controller,namespace-controller,clusterrole-aggregation-controller"
                .to_string(),
            "--leader-elect=false".to_string(),
            "--bind-address=127.0.0.1".to_string(),
            format!("--secure-port={}", self.ports.controller_manager),
            format!("--cert-dir={}", self.dir.join("controller-manager-certs").display()),
        ];
        let mut slot = lock(&self.controller_manager);
        let mut kcm = self.launch("kube-controller-manager", &[self.ports.controller_manager], &args)?;
        let port = self.ports.controller_manager;
        wait_until(&mut kcm, || self.with_runtime(|| insecure_healthz(port)).is_ok_and(|b| b.trim() == "ok"))?;
        *slot = Some(kcm);
        Ok(())
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL after 2 s). Its port stays reserved for a
    /// restart.
    pub fn stop_apiserver(&self) {
        if let Some(mut p) = lock(&self.apiserver).take() {
            let _ = p.stop(APISERVER_STOP_GRACE);
        }
    }

    pub fn restart_apiserver(&self) -> Result<()> {
        self.stop_apiserver();
        self.start_apiserver()
    }

    pub fn stop_etcd(&self) {
        if let Some(mut p) = lock(&self.etcd).take() {
            let _ = p.stop(STOP_GRACE);
        }
    }

    /// PIDs of the running components, for checks that nothing is left behind.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        [&self.etcd, &self.apiserver, &self.controller_manager]
            .iter()
            .filter_map(|slot| lock(slot).as_ref().map(|p| (p.name, p.pid())))
            .collect()
    }

    pub fn stop_all(&self) {
        if let Some(mut p) = lock(&self.controller_manager).take() {
            let _ = p.stop(STOP_GRACE);
        }
        self.stop_apiserver();
        self.stop_etcd();
    }

    fn launch(&self, name: &'static str, ports: &[u16], args: &[String]) -> Result<Process> {
        let log = self.log_path(name);
        for &port in ports {
            if TcpListener::bind(("127.0.0.1", port)).is_err() {
                bail!("{name}: port 127.0.0.1:{port} is already in use (log: {})", log.display());
            }
        }
        Process::start(name, &self.bin_dir.join(name), args, &log)
    }

    /// Runs async readiness probes from sync code, on a helper thread so that callers may
    /// already be inside a tokio runtime.
    fn with_runtime<T: Send, F: Future<Output = Result<T>>>(&self, make: impl FnOnce() -> F + Send) -> Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), make()).await? })
            })
            .join()
            .map_err(|_| anyhow!("readiness probe panicked"))?
        })
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Polls `ready` every 100 ms until it holds, the process exits, or the deadline passes.
fn wait_until(process: &mut Process, mut ready: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = process.exited() {
            return Err(process.failure(&format!("exited during start-up ({status})")));
        }
        if ready() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(process.failure(&format!("not ready after {} s", READY_TIMEOUT.as_secs())));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn get(path: &str) -> Result<http::Request<Vec<u8>>> {
    Ok(http::Request::get(path).body(Vec::new())?)
}

fn random_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A bare HTTP/1.0 GET on 127.0.0.1 (etcd's /health, an operator's /metrics); returns the
/// whole response, status line included.
pub fn http_get_plain(port: u16, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// A plain HTTP/1.0 POST of a JSON body to 127.0.0.1:`port`; the whole response.
pub fn http_post_plain(port: u16, path: &str, json: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
        json.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// kube-controller-manager serves /healthz with a self-signed certificate.
async fn insecure_healthz(port: u16) -> Result<String> {
    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse()?);
    config.accept_invalid_certs = true;
    Ok(kube::Client::try_from(config)?.request_text(get("/healthz")?).await?)
}
