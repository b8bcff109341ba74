//! Restarts and transient errors.

use controlplane::Grant;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::runtime::gate::FENCE_ANNOTATION;

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, eventually, operator_cluster_role};

/// Each policy's status with its fencing epoch left out, and that epoch.
async fn statuses(api: &Api<ApplicationTrafficPolicy>) -> (Vec<(String, serde_json::Value)>, Vec<u64>) {
    let mut list = api.list(&ListParams::default()).await.unwrap().items;
    list.sort_by_key(|p| p.name_any());
    let epochs = list.iter().map(|p| p.status.as_ref().and_then(|s| s.shard_epoch).unwrap_or(0)).collect();
    let statuses = list
        .into_iter()
        .map(|p| {
            let name = p.name_any();
            let mut status = p.status.unwrap_or_default();
            status.shard_epoch = None;
            (name, serde_json::to_value(status).unwrap())
        })
        .collect();
    (statuses, epochs)
}

/// Each child's content with the fencing annotation left out, and that annotation.
async fn contents<K>(api: &Api<K>) -> (Vec<(String, serde_json::Value)>, Vec<u64>)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let params = ListParams::default().labels("app.kubernetes.io/managed-by=traffic-policy-operator");
    let mut content = Vec::new();
    let mut epochs = Vec::new();
    for object in api.list(&params).await.unwrap().items {
        let mut value = serde_json::to_value(&object).unwrap();
        let fence = value["metadata"]["annotations"].as_object_mut().unwrap().remove(FENCE_ANNOTATION).unwrap();
        epochs.push(fence.as_str().unwrap().parse().unwrap());
        let keep = |v: &serde_json::Value| serde_json::json!({ "spec": v["spec"], "data": v["data"], "labels": v["metadata"]["labels"] });
        content.push((object.name_any(), keep(&value)));
    }
    content.sort_by(|a, b| a.0.cmp(&b.0));
    (content, epochs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_operator_changes_nothing_but_the_fencing_epoch() {
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
        statuses(&policies).await,
        contents(&env.api::<NetworkPolicy>()).await,
        contents(&env.api::<ConfigMap>()).await,
    );
    let status = first.stop().expect("the operator exits");
    assert!(status.success(), "SIGTERM must end in exit 0, got {status}");

    let second = env.start_operator(&[]).await;
    eventually("the new operator reconciled every policy", || async {
        (second.successful_reconciles() >= 5.0).then_some(())
    })
    .await;
    // The new process is a new incarnation with a new fencing epoch: it stamps it once on each
    // child and status (so a late write of the old process would be refused), and changes
    // nothing else.
    let after = eventually("every child and status carries the new incarnation's epoch", || async {
        let after = (
            statuses(&policies).await,
            contents(&env.api::<NetworkPolicy>()).await,
            contents(&env.api::<ConfigMap>()).await,
        );
        let newer = |b: &[u64], a: &[u64]| a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a > b);
        let all = newer(&before.0.1, &after.0.1) && newer(&before.1.1, &after.1.1) && newer(&before.2.1, &after.2.1);
        all.then_some(after)
    })
    .await;
    assert_eq!(after.0.0, before.0.0, "no status changed but for its epoch");
    assert_eq!((after.1.0, after.2.0), (before.1.0, before.2.0), "no child changed but for its epoch");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_reconcile_is_caught_retried_and_wedges_nothing() {
    let env = TestEnv::new("e2e-panic").await;
    let target = format!("--test-panic-on={}/boom", env.namespace);
    let operator = env.start_operator(&[target.as_str()]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("boom", 81)).await.unwrap();
    policies.create(&PostParams::default(), &policy("fine", 82)).await.unwrap();
    env.wait_ready("fine", ConditionStatus::True).await;
    // The panicking key is retried with backoff, so the count keeps growing; the process lives.
    eventually("the panicking reconcile is retried", || async {
        (operator.metric("controller_runtime_reconcile_panics_total", None) >= 3.0).then_some(())
    })
    .await;
    assert!(operator.get("/livez").unwrap().contains(" 200 "), "the process stays live");
    assert!(operator.metric("controller_runtime_reconcile_errors_total", Some("kind=\"panic\"")) >= 3.0);
    // Other work is not held up: a later policy is served.
    policies.create(&PostParams::default(), &policy("after", 83)).await.unwrap();
    env.wait_ready("after", ConditionStatus::True).await;
}
