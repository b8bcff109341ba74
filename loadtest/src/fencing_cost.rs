//! What the fencing policy costs per write. The same server-side applies of ConfigMaps
//! that look like the operator's children (its label, a fencing epoch that grows), in
//! rounds that alternate with and without the ValidatingAdmissionPolicy installed, so
//! that both sides see the same machine load; the figure is the ratio of the medians.

use std::time::Instant;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::deploy;

#[derive(clap::Args)]
pub struct Args {
    /// Writes per round.
    #[arg(long, default_value_t = 300)]
    writes: usize,
    /// Rounds on each side (with and without the policy), alternating.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

const NAMESPACE: &str = "fencing-cost";

pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = controlplane::Config { controller_manager: false, ..Default::default() };
    let cp = tokio::task::spawn_blocking(move || controlplane::ControlPlane::start(config)).await??;
    let client = cp.client().await?;
    let ns =
        Namespace { metadata: ObjectMeta { name: Some(NAMESPACE.into()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let policy = fencing_objects()?;
    let mut epoch = 1u64;
    // One write each first: what follows are updates, which is what the policy checks.
    write_round(&client, args.writes, &mut epoch).await?;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        // Alternate which side goes first, so that neither always runs on a warmer server.
        for present in if round % 2 == 0 { [true, false] } else { [false, true] } {
            install(&client, &policy, present).await?;
            let per_write = write_round(&client, args.writes, &mut epoch).await?;
            if present { with.push(per_write) } else { without.push(per_write) }
        }
        eprintln!(
            "round {}/{}: with the policy {:.2} ms per write, without {:.2} ms",
            round + 1,
            args.rounds,
            with[round],
            without[round]
        );
    }
    let (with, without) = (median(&mut with), median(&mut without));
    println!(
        "fencing cost: {:.2} ms per write with the policy, {:.2} ms without: ratio {:.3} ({} writes × {} rounds each)",
        with,
        without,
        with / without,
        args.writes,
        args.rounds
    );
    Ok(())
}

/// Applies every object once, sequentially; mean milliseconds per write.
async fn write_round(client: &Client, writes: usize, epoch: &mut u64) -> anyhow::Result<f64> {
    *epoch += 1;
    let api = Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE);
    let params = PatchParams::apply("traffic-policy-operator").force();
    let started = Instant::now();
    for i in 0..writes {
        let cm: ConfigMap = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {
                "name": format!("child-{i}"),
                "labels": { "app.kubernetes.io/managed-by": "traffic-policy-operator" },
                "annotations": { "trafficpolicy.dev/shard-epoch": epoch.to_string() }
            },
            "data": { "ratelimit.json": format!("{{\"requestsPerSecond\": {}}}", *epoch) }
        }))?;
        api.patch(&cm.name_any(), &params, &Patch::Apply(&cm)).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1000.0 / writes as f64)
}

/// The fencing policy, with this tool's identity (the admin) as the operator's.
fn fencing_objects() -> anyhow::Result<Vec<DynamicObject>> {
    let mut objects = deploy::objects("components/fencing/fencing.yaml")?;
    controlplane::manifests::set_operator_identity(&mut objects, "request.userInfo.username == 'admin'");
    Ok(objects)
}

/// Installs (or removes) the policy and its binding, and waits until writes see the change.
async fn install(client: &Client, objects: &[DynamicObject], present: bool) -> anyhow::Result<()> {
    if present {
        deploy::apply(client, objects).await?;
    } else {
        for object in objects {
            if let Err(kube::Error::Api(s)) =
                deploy::api_for(client, object).delete(&object.name_any(), &DeleteParams::default()).await
            {
                anyhow::ensure!(s.code == 404, "deleting {}: {}", object.name_any(), s.message);
            }
        }
    }
    // The policy takes effect asynchronously: probe with a write that only it refuses.
    let api = Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE);
    let probe = |epoch: u64| -> ConfigMap {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "probe", "labels": { "app.kubernetes.io/managed-by": "traffic-policy-operator" },
                          "annotations": { "trafficpolicy.dev/shard-epoch": epoch.to_string() } }
        }))
        .expect("valid")
    };
    let params = PatchParams::apply("loadtest-probe").force();
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        api.patch("probe", &params, &Patch::Apply(probe(10))).await?;
        let refused = api.patch("probe", &params, &Patch::Apply(probe(5))).await.is_err();
        if refused == present {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the fencing policy did not take effect in 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
