//! The writes that converge one policy: server-side applies of its NetworkPolicy and
//! rate-limit ConfigMap, and a Ready status for its generation. The kube-rs peers make
//! exactly these; the load test's floor makes them and the operator's "Applied" event too,
//! so that it makes every write the operator makes except those that exist only for sharding.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::desired;
use traffic_policy_operator::reconcile::events::{Events, Occurrence};

pub async fn converge(client: &Client, policy: &ApplicationTrafficPolicy, field_manager: &str) -> kube::Result<()> {
    let namespace = policy.namespace().unwrap_or_default();
    let labels = Default::default();
    let params = PatchParams::apply(field_manager).force();
    let np = desired::network_policy(policy, &labels);
    Api::<NetworkPolicy>::namespaced(client.clone(), &namespace)
        .patch(&policy.name_any(), &params, &Patch::Apply(&np))
        .await?;
    let cm = desired::rate_limit_config_map(policy, &labels);
    Api::<ConfigMap>::namespaced(client.clone(), &namespace)
        .patch(&policy.name_any(), &params, &Patch::Apply(&cm))
        .await?;
    let generation = policy.metadata.generation;
    let status = json!({ "status": { "observedGeneration": generation, "conditions": [{
        "type": "Ready", "status": "True", "reason": "Applied", "message": "NetworkPolicy and rate-limit ConfigMap are in place",
        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": generation }] } });
    Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), &namespace)
        .patch_status(&policy.name_any(), &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// [`converge`], then the event the operator publishes after applying both children.
pub async fn converge_as_the_operator(
    client: &Client,
    events: &Events,
    policy: &ApplicationTrafficPolicy,
    field_manager: &str,
) -> kube::Result<()> {
    converge(client, policy, field_manager).await?;
    let generation = policy.metadata.generation.unwrap_or_default();
    let note = format!("Applied NetworkPolicy and ConfigMap for generation {generation}");
    events.publish(policy, Occurrence::Once, "Applied", note).await
}
