//! Objects from the repository's deploy/ directory, installed as deploy/ would install them.

use std::path::Path;
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;

/// The objects of a YAML file under deploy/.
pub fn objects(file: &str) -> anyhow::Result<Vec<DynamicObject>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    let text = std::fs::read_to_string(&path)?;
    serde_yaml::Deserializer::from_str(&text).map(|d| Ok(DynamicObject::deserialize(d)?)).collect()
}

/// Server-side applies cluster-scoped objects of any kind.
pub async fn apply(client: &Client, objects: &[DynamicObject]) -> anyhow::Result<()> {
    for object in objects {
        let params = PatchParams::apply("loadtest").force();
        api_for(client, object).patch(&object.name_any(), &params, &Patch::Apply(object)).await?;
    }
    Ok(())
}

pub fn api_for(client: &Client, object: &DynamicObject) -> Api<DynamicObject> {
    let types = object.types.clone().expect("apiVersion and kind");
    let (group, version) = types.api_version.split_once('/').unwrap_or(("", &types.api_version));
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &types.kind));
    Api::<DynamicObject>::all_with(client.clone(), &resource)
}

/// Installs the bucket-label component's admission policy, and waits until the API server
/// admits policies under it: it refuses them (503) until it has loaded the CRD's schema.
pub async fn install_bucket_labels(client: &Client, namespace: &str) -> anyhow::Result<()> {
    apply(client, &objects("components/bucket-labels/bucket-labels.yaml")?).await?;
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    let probe: ApplicationTrafficPolicy = serde_json::from_value(json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": "admission-probe" },
        "spec": { "applicationSelector": { "matchLabels": { "app": "probe" } } }
    }))?;
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match api.create(&dry_run, &probe).await {
            Ok(_) => return Ok(()),
            Err(error) => anyhow::ensure!(Instant::now() < deadline, "policies still refused after 60 s: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
