//! Cached bytes per policy. Creates policies the way users and the operator write them
//! (a `kubectl apply`-style last-applied annotation, the server's managedFields, a status),
//! lists them back, then decodes the same JSON three times: into a map of whole objects, into
//! the runtime's cache of trimmed objects (managed fields and the last-applied annotation
//! dropped), and into the cache in the compact form the operator keeps, and reads jemalloc's
//! allocated-bytes counter around each. Then it fills the runtime's other per-policy state as a converged replica
//! holds it (the child versions of both children, the queue's scheduled resync) and measures
//! each the same way. The generation predicate keeps nothing of its own: the cache is its
//! memory.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tikv_jemalloc_ctl::{epoch, stats};
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::cached::CachedPolicy;
use traffic_policy_operator::runtime::cache;
use traffic_policy_operator::runtime::key::ObjectKey;
use traffic_policy_operator::runtime::parts::Scope;
use traffic_policy_operator::runtime::stored::Stored;

#[derive(clap::Args)]
pub struct Args {
    /// Policies to create and measure.
    #[arg(long, default_value_t = 5000)]
    objects: usize,
    /// Namespaces to spread them over.
    #[arg(long, default_value_t = 50)]
    namespaces: usize,
    /// Where to write the JSON result.
    #[arg(long, default_value = "target/loadtest/cache-bytes.json")]
    out: PathBuf,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = controlplane::Config { controller_manager: false, ..Default::default() };
    let cp = tokio::task::spawn_blocking(move || controlplane::ControlPlane::start(config)).await??;
    let client = cp.client().await?;
    install_crd(&client).await?;

    let started = Instant::now();
    create_policies(&client, &args).await?;
    eprintln!("created {} policies in {:.1} s", args.objects, started.elapsed().as_secs_f64());

    // The JSON of every object, as the API server serves it.
    let list = Api::<ApplicationTrafficPolicy>::all(client.clone()).list(&ListParams::default()).await?;
    let raw: Vec<Vec<u8>> = list.items.iter().map(serde_json::to_vec).collect::<Result<_, _>>()?;
    drop(list);
    let wire_bytes: usize = raw.iter().map(Vec::len).sum();

    let untrimmed = untrimmed_bytes(&raw)?;
    let trimmed = store_bytes::<ApplicationTrafficPolicy>(&raw)?;
    let compact = store_bytes::<CachedPolicy>(&raw)?;
    let runtime = runtime_bytes(&raw)?;
    let total = compact + runtime.child_versions + runtime.queue;
    let n = raw.len() as f64;
    let result = json!({
        "objects": raw.len(),
        "json_bytes_per_object": wire_bytes as f64 / n,
        "cached_bytes_per_object_untrimmed": untrimmed as f64 / n,
        "cached_bytes_per_object_trimmed_object": trimmed as f64 / n,
        "cached_bytes_per_object_compact": compact as f64 / n,
        "compact_to_untrimmed_ratio": compact as f64 / untrimmed as f64,
        "child_versions_bytes_per_object": runtime.child_versions as f64 / n,
        "queue_bytes_per_object": runtime.queue as f64 / n,
        "runtime_bytes_per_object": total as f64 / n,
    });
    println!(
        "| objects | JSON bytes/object | cached bytes/object: whole object | trimmed object | compact (operator) | compact / whole |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} |",
        raw.len(),
        wire_bytes as f64 / n,
        untrimmed as f64 / n,
        trimmed as f64 / n,
        compact as f64 / n,
        compact as f64 / untrimmed as f64
    );
    println!();
    println!("| per policy | cache (compact) | child versions | queue (resync) | total |");
    println!("|---|---|---|---|---|");
    println!(
        "| bytes | {:.0} | {:.0} | {:.0} | {:.0} |",
        compact as f64 / n,
        runtime.child_versions as f64 / n,
        runtime.queue as f64 / n,
        total as f64 / n
    );
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&result)?)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// Heap bytes held by whole objects decoded from `raw`, by key.
fn untrimmed_bytes(raw: &[Vec<u8>]) -> anyhow::Result<usize> {
    let before = allocated()?;
    let mut objects = std::collections::HashMap::new();
    for bytes in raw {
        let object: ApplicationTrafficPolicy = serde_json::from_slice(bytes)?;
        objects.insert(ObjectKey::of(&object), std::sync::Arc::new(object));
    }
    let held = allocated()?.saturating_sub(before);
    drop(objects);
    Ok(held)
}

/// Heap bytes held by the runtime's cache filled from `raw` in the form `S`, as the watch
/// path fills it.
fn store_bytes<S: Stored<Object = ApplicationTrafficPolicy>>(raw: &[Vec<u8>]) -> anyhow::Result<usize> {
    let before = allocated()?;
    let (cache, mut writer) = cache::new::<S>();
    let all = Scope::everything();
    writer.apply(0, &all, &watcher::Event::Init);
    for bytes in raw {
        let object: ApplicationTrafficPolicy = serde_json::from_slice(bytes)?;
        writer.apply(0, &all, &watcher::Event::InitApply(object));
    }
    writer.apply(0, &all, &watcher::Event::InitDone);
    anyhow::ensure!(cache.len() == raw.len(), "the cache holds {} of {}", cache.len(), raw.len());
    let held = allocated()?.saturating_sub(before);
    drop((cache, writer));
    Ok(held)
}

/// Heap bytes of the runtime's other per-policy state, each part measured alone.
struct RuntimeBytes {
    child_versions: usize,
    queue: usize,
}

/// Fills each structure as a converged replica holds it: both children of every policy
/// written, and its resync scheduled. Each holds the keys the cache hands out with
/// each event, as in the operator, so keys are counted in the store only.
fn runtime_bytes(raw: &[Vec<u8>]) -> anyhow::Result<RuntimeBytes> {
    use std::time::Duration;
    use traffic_policy_operator::runtime::metrics::QueueMetrics;
    use traffic_policy_operator::runtime::{
        backoff::Backoff,
        child_versions::ChildVersions,
        queue::{Priority, WorkQueue},
    };

    let policies: Vec<ApplicationTrafficPolicy> =
        raw.iter().map(|bytes| serde_json::from_slice(bytes)).collect::<Result<_, _>>()?;
    let (_cache, mut writer) = cache::new::<CachedPolicy>();
    let all = Scope::everything();
    let cached: Vec<ObjectKey> =
        policies.iter().filter_map(|p| writer.apply(0, &all, &watcher::Event::Apply(p.clone())).key).collect();
    let keys = || cached.iter().cloned().zip(&policies);

    let before = allocated()?;
    let versions = ChildVersions::default();
    for (i, (key, policy)) in keys().enumerate() {
        let generation = policy.metadata.generation;
        versions.written("NetworkPolicy", &key, &(2 * i + 1_000_000).to_string(), generation, i as u64);
        versions.written("ConfigMap", &key, &(2 * i + 1_000_001).to_string(), generation, i as u64);
    }
    let child_versions_bytes = allocated()?.saturating_sub(before);
    drop(versions);

    let before = allocated()?;
    let queue =
        WorkQueue::new(Backoff::new(Duration::from_millis(5), Duration::from_secs(300)), QueueMetrics::new("bench"));
    for (key, _) in keys() {
        queue.add_after(key, Duration::from_secs(3600), Priority::Low);
    }
    let queue_bytes = allocated()?.saturating_sub(before);
    drop(queue);

    Ok(RuntimeBytes { child_versions: child_versions_bytes, queue: queue_bytes })
}

fn allocated() -> anyhow::Result<usize> {
    epoch::advance().map_err(|e| anyhow::anyhow!("jemalloc epoch: {e}"))?;
    stats::allocated::read().map_err(|e| anyhow::anyhow!("jemalloc stats: {e}"))
}

pub async fn install_crd(client: &kube::Client) -> anyhow::Result<()> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/applicationtrafficpolicies.trafficpolicy.dev.yaml");
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&std::fs::read_to_string(path)?)?;
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.create(&PostParams::default(), &crd).await?;
    for _ in 0..600 {
        let crd = crds.get("applicationtrafficpolicies.trafficpolicy.dev").await?;
        let established = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        if established.iter().any(|c| c.type_ == "Established" && c.status == "True") {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    anyhow::bail!("the CRD was not established within 60 s")
}

/// Creates the policies with a last-applied annotation (as `kubectl apply` does), then
/// writes a status with a merge patch (as the operator does), 32 requests at a time.
async fn create_policies(client: &kube::Client, args: &Args) -> anyhow::Result<()> {
    for n in 0..args.namespaces {
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(format!("bench-{n}")), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    }
    futures::stream::iter(0..args.objects)
        .map(|i| {
            let client = client.clone();
            let namespace = format!("bench-{}", i % args.namespaces);
            async move {
                let spec = json!({
                    "applicationSelector": { "matchLabels": { "app": format!("app-{i}"), "tier": "web" } },
                    "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"] } }],
                                       "ports": [{ "protocol": "HTTP", "port": 8080 }] }],
                    "egressRules": [{ "to": [{ "ipBlock": { "cidr": "10.96.0.0/12" } }], "ports": [{ "protocol": "UDP", "port": 53 }] }],
                    "rateLimit": { "requestsPerSecond": 100, "burst": 20 }
                });
                let manifest = json!({
                    "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
                    "metadata": { "name": format!("app-{i}"), "namespace": namespace }, "spec": spec
                });
                let mut object: ApplicationTrafficPolicy = serde_json::from_value(manifest.clone())?;
                object.metadata.annotations = Some(
                    [("kubectl.kubernetes.io/last-applied-configuration".to_string(), manifest.to_string())].into(),
                );
                let api = Api::<ApplicationTrafficPolicy>::namespaced(client, &namespace);
                api.create(&PostParams::default(), &object).await.context("create")?;
                let status = json!({ "status": { "observedGeneration": 1, "conditions": [{
                    "type": "Ready", "status": "True", "reason": "Applied",
                    "message": "NetworkPolicy and rate-limit ConfigMap are in place",
                    "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1 }] } });
                api.patch_status(&format!("app-{i}"), &PatchParams::default(), &Patch::Merge(&status)).await.context("status")?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await
}
