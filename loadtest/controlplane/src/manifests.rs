//! Objects of any kind from the repository's YAML files (deploy/'s components), applied as
//! `kubectl apply --server-side` would, for the test harness and the load tool alike.

use std::fmt::Debug;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, Resource, ResourceExt};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// The objects of a multi-document YAML file.
pub fn read(path: &Path) -> Result<Vec<DynamicObject>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| DynamicObject::deserialize(document).with_context(|| format!("parsing {}", path.display())))
        .collect()
}

/// The API of a cluster-scoped object of any kind.
pub fn api_for(client: &Client, object: &DynamicObject) -> Api<DynamicObject> {
    let types = object.types.clone().expect("apiVersion and kind");
    let (group, version) = types.api_version.split_once('/').unwrap_or(("", &types.api_version));
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &types.kind));
    Api::<DynamicObject>::all_with(client.clone(), &resource)
}

/// Server-side applies cluster-scoped objects as `manager`, taking over conflicting fields.
pub async fn apply(client: &Client, objects: &[DynamicObject], manager: &str) -> Result<()> {
    let params = PatchParams::apply(manager).force();
    for object in objects {
        let name = object.name_any();
        api_for(client, object)
            .patch(&name, &params, &Patch::Apply(object))
            .await
            .with_context(|| format!("applying {name}"))?;
    }
    Ok(())
}

/// Waits until the API server would create `probe` (a dry run, so nothing is stored): an
/// admission policy refuses writes of a custom resource (503) until the server has loaded
/// the resource's schema for it.
pub async fn wait_admitted<K>(api: &Api<K>, probe: &K, limit: Duration) -> Result<()>
where
    K: Resource + Clone + Debug + serde::Serialize + DeserializeOwned,
{
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    let deadline = Instant::now() + limit;
    loop {
        match api.create(&dry_run, probe).await {
            Ok(_) => return Ok(()),
            Err(error) => anyhow::ensure!(Instant::now() < deadline, "still refused after {limit:?}: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
