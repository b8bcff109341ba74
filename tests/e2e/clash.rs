//! A tenant's objects that share a policy's name: the operator never writes or deletes them,
//! whether or not the operator-reach admission policy is there to refuse it. The policy says
//! whose they are, and becomes Ready once the tenant removes them.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use serde_json::Value;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, audited_writes, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_objects_are_left_alone_with_operator_reach() {
    let env = TestEnv::new("e2e-clash").await;
    tenants_objects_are_left_alone(env, true).await;
}

/// The operator's own check, with no admission policy behind it: as in the README's demo
/// before it installed operator-reach, or where a platform team turns the policy off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_objects_are_left_alone_without_operator_reach() {
    let env = TestEnv::without_operator_reach("e2e-clash-unguarded").await;
    tenants_objects_are_left_alone(env, false).await;
}

async fn tenants_objects_are_left_alone(env: TestEnv, operator_reach: bool) {
    let identity = env.operator_identity("operator", None).await;
    assert_eq!(reach_refuses(&env, &identity).await, operator_reach, "operator-reach covers the namespace");
    let (cms, nps) = (env.api::<ConfigMap>(), env.api::<NetworkPolicy>());
    cms.create(&PostParams::default(), &tenant_config_map()).await.unwrap();
    nps.create(&PostParams::default(), &tenant_network_policy()).await.unwrap();
    let before = stored(&env).await;

    let _operator = Operator::start(&env, &identity, &[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("web", 80)).await.unwrap();
    let message = conflict_reported(&env).await;
    for kind in ["NetworkPolicy", "ConfigMap"] {
        let clash = format!("{kind} {}/web exists and is not this policy's (managed by ", env.namespace);
        assert!(message.contains(&clash), "the status names the clash with the {kind}: {message}");
    }
    eventually("a Warning event names the clash", || async {
        let events = env.api::<Event>().list(&ListParams::default()).await.ok()?;
        events
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("Conflict")
                    && e.type_.as_deref() == Some("Warning")
                    && e.note.as_deref().is_some_and(|n| n.contains("is not this policy's"))
            })
            .then_some(())
    })
    .await;
    assert_eq!(stored(&env).await, before, "the tenant's objects are as they were");
    let writes = audited_writes(env.cp, &identity.user);
    let tenants = [format!("configmaps/{}/web", env.namespace), format!("networkpolicies/{}/web", env.namespace)];
    let sent: Vec<_> = writes.iter().filter(|w| tenants.contains(w)).collect();
    assert!(sent.is_empty(), "the operator sent writes to the tenant's objects: {sent:?}");

    // Deleting the policy leaves them too: nothing made them the policy's dependents.
    policies.delete("web", &DeleteParams::foreground()).await.unwrap();
    eventually("the policy is gone", || async { policies.get_opt("web").await.ok()?.is_none().then_some(()) }).await;
    assert_eq!(stored(&env).await, before, "the tenant's objects outlive the policy");

    // Once the tenant removes them, the policy made again takes effect.
    policies.create(&PostParams::default(), &policy("web", 80)).await.unwrap();
    conflict_reported(&env).await;
    cms.delete("web", &DeleteParams::default()).await.unwrap();
    nps.delete("web", &DeleteParams::default()).await.unwrap();
    let ready = env.wait_ready("web", ConditionStatus::True).await;
    let np = nps.get("web").await.unwrap();
    assert_eq!(np.owner_references()[0].uid, ready.uid().unwrap(), "the NetworkPolicy is now the policy's");
}

/// Whether operator-reach refuses the operator's identity an unlabelled ConfigMap here (a
/// dry run: nothing is stored).
async fn reach_refuses(env: &TestEnv, identity: &controlplane::Identity) -> bool {
    let client = identity.client(env.cp).await.unwrap();
    let own = Api::<ConfigMap>::namespaced(client, &env.namespace);
    let probe = ConfigMap {
        metadata: ObjectMeta { name: Some("reach-probe".into()), ..Default::default() },
        ..Default::default()
    };
    match own.create(&PostParams { dry_run: true, ..Default::default() }, &probe).await {
        Ok(_) => false,
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("operator-reach") => true,
        Err(e) => panic!("the probe failed otherwise: {e}"),
    }
}

/// Waits until the policy is Ready=False, reason Conflict, for its generation; the message.
async fn conflict_reported(env: &TestEnv) -> String {
    let policies = env.api::<ApplicationTrafficPolicy>();
    eventually("the policy reports the clash", || async {
        let policy = policies.get_opt("web").await.ok()??;
        let status = policy.status?;
        let ready = status.conditions.into_iter().find(|c| c.type_ == "Ready")?;
        let current = status.observed_generation == policy.metadata.generation;
        (current && ready.status == "False" && ready.reason == "Conflict").then_some(ready.message)
    })
    .await
}

/// The tenant's ConfigMap and NetworkPolicy as stored, in full.
async fn stored(env: &TestEnv) -> (Value, Value) {
    let cm = env.api::<ConfigMap>().get("web").await.unwrap();
    let np = env.api::<NetworkPolicy>().get("web").await.unwrap();
    (serde_json::to_value(cm).unwrap(), serde_json::to_value(np).unwrap())
}

fn tenant_config_map() -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta { name: Some("web".into()), ..Default::default() },
        data: Some([("database".to_string(), "postgres://db:5432/shop".to_string())].into()),
        ..Default::default()
    }
}

/// The database's ingress restriction: only pods labelled `app: api` reach `app: db`.
fn tenant_network_policy() -> NetworkPolicy {
    let selector = |app: &str| LabelSelector {
        match_labels: Some([("app".to_string(), app.to_string())].into()),
        ..Default::default()
    };
    let spec: NetworkPolicySpec = serde_json::from_value(serde_json::json!({
        "podSelector": selector("db"),
        "policyTypes": ["Ingress"],
        "ingress": [{ "from": [{ "podSelector": selector("api") }] }],
    }))
    .unwrap();
    NetworkPolicy { metadata: ObjectMeta { name: Some("web".into()), ..Default::default() }, spec: Some(spec) }
}
