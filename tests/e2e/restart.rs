//! Restarts and transient errors.

use controlplane::Grant;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, eventually, operator_cluster_role};

async fn versions<K>(api: &Api<K>) -> Vec<(String, String)>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    // Our children and the policies; not the operator's own coordination objects.
    let params = ListParams::default().labels("app.kubernetes.io/managed-by=traffic-policy-operator");
    let params = if K::kind(&()) == "ApplicationTrafficPolicy" { ListParams::default() } else { params };
    let mut list: Vec<_> =
        api.list(&params).await.unwrap().items.iter().map(|o| (o.name_any(), o.resource_version().unwrap())).collect();
    list.sort();
    list
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_operator_rewrites_nothing() {
    let env = TestEnv::new("e2e-restart").await;
    let mut first = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    for i in 0..5 {
        policies.create(&PostParams::default(), &policy(&format!("app-{i}"), 8000 + i)).await.unwrap();
    }
    for i in 0..5 {
        env.wait_ready(&format!("app-{i}"), ConditionStatus::True).await;
    }
    let before = (
        versions(&policies).await,
        versions(&env.api::<NetworkPolicy>()).await,
        versions(&env.api::<ConfigMap>()).await,
    );
    let status = first.stop().expect("the operator exits");
    assert!(status.success(), "SIGTERM must end in exit 0, got {status}");

    let second = env.start_operator(&[]).await;
    eventually("the new operator reconciled every policy", || async {
        (second.successful_reconciles() >= 5.0).then_some(())
    })
    .await;
    let after = (
        versions(&policies).await,
        versions(&env.api::<NetworkPolicy>()).await,
        versions(&env.api::<ConfigMap>()).await,
    );
    assert_eq!(after, before, "no object was written again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_permission_is_retried_with_backoff_until_granted() {
    let env = TestEnv::new("e2e-transient").await;
    let mut limited: ClusterRole = operator_cluster_role();
    limited.metadata.name = Some("e2e-operator-without-configmap-writes".into());
    for rule in limited.rules.as_mut().unwrap() {
        if rule.resources.as_ref().unwrap().contains(&"configmaps".to_string()) {
            rule.verbs = vec!["list".into(), "watch".into()];
        }
    }
    Api::<ClusterRole>::all(env.client.clone())
        .patch(&limited.name_any(), &PatchParams::apply("e2e-tests").force(), &Patch::Apply(&limited))
        .await
        .unwrap();
    let identity = env.operator_identity("limited", Some(vec![Grant::ClusterRole(limited.name_any())])).await;
    let operator = Operator::start(&env, &identity, &[]).await;

    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("blocked", 80)).await.unwrap();
    let failed = env.wait_ready("blocked", ConditionStatus::False).await;
    assert_eq!(failed.status.unwrap().conditions[0].reason, "ApplyFailed");
    eventually("the failure is retried with backoff", || async {
        (operator.metric("workqueue_retries_total", None) >= 2.0).then_some(())
    })
    .await;

    env.operator_identity("limited", None).await; // now also bound to the full role
    env.wait_ready("blocked", ConditionStatus::True).await;
    assert!(env.api::<ConfigMap>().get_opt("blocked").await.unwrap().is_some());
}
