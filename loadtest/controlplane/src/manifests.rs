//! Objects of any kind from the repository's YAML files (deploy/'s components), applied as
//! `kubectl apply --server-side` would, for the test harness and the load tool alike.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};

/// The objects of a multi-document YAML file.
pub fn read(path: &Path) -> Result<Vec<DynamicObject>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let documents: Vec<Option<DynamicObject>> =
        serde_saphyr::from_multiple(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(documents.into_iter().flatten().collect())
}

/// Makes `expression` the operator's identity in every ValidatingAdmissionPolicy of `objects`
/// that declares the variable `fromOperator` (the fencing and operator-reach policies), for a
/// harness whose operators run under identities of its own. The expression then needs no
/// parameter: the policy's `paramKind` and its bindings' `paramRef` (the operator's namespace)
/// are removed, so the policy applies whether or not that namespace exists.
pub fn set_operator_identity(objects: &mut [DynamicObject], expression: &str) {
    let is = |o: &DynamicObject, kind: &str| o.types.as_ref().is_some_and(|t| t.kind == kind);
    let mut changed = Vec::new();
    for policy in objects.iter_mut().filter(|o| is(o, "ValidatingAdmissionPolicy")) {
        let variables = policy.data["spec"]["variables"].as_array_mut().into_iter().flatten();
        let mut declares = false;
        for variable in variables.filter(|v| v["name"] == "fromOperator") {
            variable["expression"] = expression.into();
            declares = true;
        }
        if let Some(spec) = policy.data["spec"].as_object_mut().filter(|_| declares) {
            spec.remove("paramKind");
            changed.push(policy.name_any());
        }
    }
    for binding in objects.iter_mut().filter(|o| is(o, "ValidatingAdmissionPolicyBinding")) {
        let spec = binding.data["spec"].as_object_mut();
        if let Some(spec) = spec.filter(|spec| changed.iter().any(|name| spec["policyName"] == name.as_str())) {
            spec.remove("paramRef");
        }
    }
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

/// Waits until the API server would create an ApplicationTrafficPolicy in `namespace` (a dry
/// run, so nothing is stored): the bucket-label component's admission policy refuses writes
/// of policies (503) until the server has loaded their schema for it.
pub async fn wait_policies_admitted(client: &Client, namespace: &str, limit: Duration) -> Result<()> {
    let kind = GroupVersionKind::gvk("trafficpolicy.dev", "v1", "ApplicationTrafficPolicy");
    let resource = ApiResource::from_gvk_with_plural(&kind, "applicationtrafficpolicies");
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource);
    let probe: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": "admission-probe" },
        "spec": { "applicationSelector": { "matchLabels": { "app": "probe" } } }
    }))?;
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    let deadline = Instant::now() + limit;
    loop {
        match api.create(&dry_run, &probe).await {
            Ok(_) => return Ok(()),
            Err(error) => anyhow::ensure!(Instant::now() < deadline, "still refused after {limit:?}: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
