//! `cargo run -p controlplane`: start a local control plane, write a kubeconfig, print how
//! to use it, and stop everything on Ctrl-C.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use controlplane::{Config, ControlPlane, Release};

#[derive(Parser)]
#[command(about = "Run a local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager)")]
struct Args {
    /// Where to write the admin kubeconfig.
    #[arg(long, default_value = ".controlplane/kubeconfig")]
    kubeconfig: PathBuf,
    /// The apiserver port on 127.0.0.1 (a free one by default).
    #[arg(long)]
    port: Option<u16>,
    /// Feature gates for kube-apiserver, comma-separated (e.g. SomeGate=true).
    #[arg(long, value_delimiter = ',')]
    feature_gates: Vec<String>,
    /// An extra kube-apiserver flag; repeatable (e.g. --apiserver-arg=--max-requests-inflight=800).
    #[arg(long, allow_hyphen_values = true)]
    apiserver_arg: Vec<String>,
    /// Run the oldest Kubernetes the operator supports instead of the current one.
    #[arg(long)]
    oldest: bool,
    /// Also run a Traefik gateway against it (built once from its Go module) and a small
    /// HTTP backend that answers `GET /` with this text, in a network namespace of its own
    /// (needs root, `ip` and python3).
    #[arg(long)]
    gateway_backend: Option<String>,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("controlplane: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let config = Config {
        apiserver_args: args.apiserver_arg,
        feature_gates: args.feature_gates,
        controller_manager: true,
        apiserver_port: args.port,
        release: if args.oldest { Release::Oldest } else { Release::Current },
        audit_writes: false,
    };
    let cp = ControlPlane::start(config)?;
    if let Some(parent) = args.kubeconfig.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(cp.kubeconfig_path(), &args.kubeconfig)?;
    let kubeconfig = std::path::absolute(&args.kubeconfig)?;
    println!(
        "Kubernetes {} control plane ready at {} in {:.1} s",
        cp.release().version(),
        cp.server_url(),
        started.elapsed().as_secs_f64()
    );
    println!("  logs and data: {}", cp.dir().display());
    // Dropped (stopped) before the control plane.
    let mut gateway = None;
    if let Some(text) = &args.gateway_backend {
        // The CRDs first: Traefik's Gateway provider looks for them when it starts.
        install_gateway_crds(&cp)?;
        let backend = controlplane::gateway::Backend::start(&[("index.html", text)])?;
        let traefik = controlplane::gateway::Traefik::start(&cp, &[], "traefik")?;
        println!("backend on {}:{}", backend.address, backend.port);
        println!("gateway on 127.0.0.1:{} (Traefik; log: {})", traefik.web_port, traefik.log_path().display());
        gateway = Some((traefik, backend));
    }
    println!("Use it from another shell:");
    println!("  export KUBECONFIG={}", kubeconfig.display());
    println!("  kubectl get ns");
    println!("Press Ctrl-C to stop everything.");
    wait_for_ctrl_c()?;
    println!("stopping...");
    drop(gateway);
    drop(cp);
    println!("stopped");
    Ok(())
}

/// Applies the Gateway API, Traefik and Envoy Gateway CRDs and waits until they are established.
fn install_gateway_crds(cp: &ControlPlane) -> anyhow::Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let client = cp.client().await?;
        let crds = kube::Api::<CustomResourceDefinition>::all(client.clone());
        for file in controlplane::gateway::crd_files()? {
            let objects = controlplane::manifests::read(&file)?;
            controlplane::manifests::apply(&client, &objects, "controlplane").await?;
            for object in &objects {
                let name = kube::ResourceExt::name_any(object);
                let deadline = Instant::now() + std::time::Duration::from_secs(60);
                loop {
                    let crd = crds.get(&name).await?;
                    let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
                    if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
                        break;
                    }
                    anyhow::ensure!(Instant::now() < deadline, "CRD {name} not established within 60 s");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
        anyhow::Ok(())
    })
}

fn wait_for_ctrl_c() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })?;
    Ok(())
}
