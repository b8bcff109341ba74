//! `loadtest run --gateway traefik`: every policy gets a route under one Gateway served by a
//! real Traefik, and, once converged, single edits are timed from the spec edit to the
//! moment the gateway enforces the new limit (its first 429 on that policy's host).

use std::time::{Duration, Instant};

use controlplane::gateway::{Backend, TRAEFIK_CONTROLLER, Traefik};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::gateway::{Provider, Traefik as Traefik_, gateway, gateway_class};

use crate::args::Args;
use crate::workload::{GATEWAY, SERVICE, edit_percentiles, host};

/// The gateway and what it needs: running until dropped.
pub struct Running {
    pub traefik: Traefik,
    _backend: Backend,
}

/// Installs the gateway CRDs, starts a backend and Traefik, and creates the GatewayClass,
/// the Gateway and a Service with an EndpointSlice in every namespace of the run.
pub async fn start(cp: &controlplane::ControlPlane, client: &Client, args: &Args) -> anyhow::Result<Running> {
    for file in tokio::task::spawn_blocking(controlplane::gateway::crd_files).await?? {
        let objects = controlplane::manifests::read(&file)?;
        controlplane::manifests::apply(client, &objects, "loadtest").await?;
    }
    let namespaces: Vec<String> = (0..args.namespaces).map(|n| args.namespace_name(n)).collect();
    let backend = tokio::task::spawn_blocking(|| Backend::start(&[("index.html", "app")])).await??;
    // Every namespace: Traefik starts informers per namespace it is given.
    let traefik = tokio::task::block_in_place(|| Traefik::start(cp, &[], "traefik"))?;
    eprintln!("traefik: log {}", traefik.log_path().display());
    let create = |api: Api<DynamicObject>, object: Value| async move {
        api.create(&PostParams::default(), &serde_json::from_value(object)?).await?;
        anyhow::Ok(())
    };
    create(
        Api::all_with(client.clone(), &gateway_class()),
        json!({ "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": { "name": "loadtest" },
                "spec": { "controllerName": TRAEFIK_CONTROLLER } }),
    )
    .await?;
    create(
        Api::namespaced_with(client.clone(), &namespaces[0], &gateway()),
        json!({ "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": { "name": GATEWAY },
                "spec": { "gatewayClassName": "loadtest", "listeners": [{ "name": "web", "port": traefik.web_port,
                    "protocol": "HTTP", "allowedRoutes": { "namespaces": { "from": "All" } } }] } }),
    )
    .await?;
    for namespace in &namespaces {
        let service: Service = serde_json::from_value(json!({ "metadata": { "name": SERVICE },
            "spec": { "ports": [{ "port": 80, "targetPort": backend.port, "protocol": "TCP" }] } }))?;
        Api::<Service>::namespaced(client.clone(), namespace).create(&PostParams::default(), &service).await?;
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": { "name": SERVICE, "labels": { "kubernetes.io/service-name": SERVICE } },
            "addressType": "IPv4",
            "endpoints": [{ "addresses": [backend.address.to_string()], "conditions": { "ready": true } }],
            "ports": [{ "port": backend.port, "protocol": "TCP" }]
        }))?;
        Api::<EndpointSlice>::namespaced(client.clone(), namespace).create(&PostParams::default(), &slice).await?;
    }
    Ok(Running { traefik, _backend: backend })
}

/// Waits until the gateway routes every policy that has a route (each host answers 200),
/// then times `edits` single edits, one at a time, spread over them: each lowers a policy's
/// limit to 1 request/s (burst 1), then probes its host every 10 ms until the gateway
/// answers 429.
pub async fn edit_to_enforcement(
    client: &Client,
    args: &Args,
    running: &Running,
    edits: usize,
) -> anyhow::Result<Value> {
    let port = running.traefik.web_port;
    let probe = move |host: String| async move {
        tokio::task::spawn_blocking(move || controlplane::gateway::get(port, &host, "/").map(|r| r.status).unwrap_or(0))
            .await
            .unwrap_or(0)
    };
    let routed: Vec<usize> = (0..args.objects).step_by(args.route_stride()).collect();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(1200);
    for (n, &i) in routed.iter().enumerate() {
        while probe(host(i)).await != 200 {
            anyhow::ensure!(Instant::now() < deadline, "{} was not routed within 1200 s", host(i));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if (n + 1) % 100 == 0 {
            eprintln!("gateway: {} of {} routes answer, {:.0} s", n + 1, routed.len(), started.elapsed().as_secs_f64());
        }
    }
    let all_routed_seconds = started.elapsed().as_secs_f64();
    let mut latencies = Vec::new();
    let mut written_latencies = Vec::new();
    let mut failed = Vec::new();
    for k in 0..edits.min(routed.len()) {
        let i = routed[k * routed.len() / edits.min(routed.len())];
        let host = host(i);
        let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), &args.namespace_of(i));
        let patch = json!({ "spec": { "rateLimit": { "requestsPerSecond": 1, "burst": 1 } } });
        // Beside the probe: when the operator's write of the new limit is in the API server.
        let middlewares =
            Api::<DynamicObject>::namespaced_with(client.clone(), &args.namespace_of(i), &Traefik_.resource());
        let edited = Instant::now();
        api.patch(&format!("app-{i}"), &PatchParams::default(), &Patch::Merge(&patch)).await?;
        let written = tokio::spawn({
            let name = format!("app-{i}");
            async move {
                loop {
                    let current = middlewares.get_opt(&name).await.ok().flatten();
                    if current.is_some_and(|m| m.data["spec"]["rateLimit"]["average"] == 1) {
                        return Some(edited.elapsed().as_secs_f64() * 1000.0);
                    }
                    if edited.elapsed() > Duration::from_secs(60) {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        let deadline = edited + Duration::from_secs(60);
        loop {
            if probe(host.clone()).await == 429 {
                latencies.push(edited.elapsed().as_secs_f64() * 1000.0);
                written_latencies.extend(written.await?);
                break;
            }
            if Instant::now() > deadline {
                failed.push(api.get(&format!("app-{i}")).await?.name_any());
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if (k + 1) % 50 == 0 {
            eprintln!("gateway edits: {} of {edits} timed", k + 1);
        }
    }
    let mut timing = edit_percentiles(latencies);
    timing["not_enforced_within_60_s"] = json!(failed);
    timing["routes"] = json!(routed.len());
    timing["written_ms"] = edit_percentiles(written_latencies);
    timing["all_routed_after_convergence_seconds"] = json!(all_routed_seconds);
    Ok(timing)
}
