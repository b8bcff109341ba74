//! Restarts and transient errors.

use controlplane::Grant;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, audited_writes, eventually};

/// Policies and children as the API server holds them: what a restart must leave alone.
async fn stored(env: &TestEnv) -> Vec<serde_json::Value> {
    let params = ListParams::default();
    let mut all = Vec::new();
    for p in env.api::<ApplicationTrafficPolicy>().list(&params).await.unwrap() {
        all.push(serde_json::json!([p.name_any(), p.resource_version(), p.status]));
    }
    let children = params.labels("app.kubernetes.io/managed-by=traffic-policy-operator");
    for np in env.api::<NetworkPolicy>().list(&children).await.unwrap() {
        all.push(serde_json::json!([np.name_any(), np.resource_version(), np.spec]));
    }
    for cm in env.api::<ConfigMap>().list(&children).await.unwrap() {
        all.push(serde_json::json!([cm.name_any(), cm.resource_version(), cm.data]));
    }
    all
}

/// A restart, then resyncs every second: each policy is reconciled again and again, and
/// nothing is written, as kube-apiserver's audit log shows (an apply that changes nothing
/// still counts there). The new process has a new fencing epoch; it has no need to stamp it on
/// what it leaves as it is (docs/sharding.md, "Fencing without rewrites").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_and_resyncing_operator_writes_nothing() {
    let env = TestEnv::new("e2e-restart").await;
    let mut first = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    for i in 0..5 {
        policies.create(&PostParams::default(), &policy(&format!("app-{i}"), 8000 + i)).await.unwrap();
    }
    for i in 0..5 {
        env.wait_ready(&format!("app-{i}"), ConditionStatus::True).await;
    }
    let before = stored(&env).await;
    let status = first.stop().expect("the operator exits");
    assert!(status.success(), "SIGTERM must end in exit 0, got {status}");

    let identity = env.operator_identity("operator-again", None).await;
    let second = Operator::start(&env, &identity, &["--resync-period=1s"]).await;
    eventually("the new operator reconciled every policy three times", || async {
        (second.successful_reconciles() >= 15.0).then_some(())
    })
    .await;
    let writes: Vec<String> =
        audited_writes(env.cp, &identity.user).into_iter().filter(|w| w.contains("/app-")).collect();
    assert_eq!(writes, Vec::<String>::new(), "the restarted operator wrote policies or children");
    assert_eq!(stored(&env).await, before, "a policy or child changed");
}

/// The Applied events about policy `name`: their names and notes.
async fn applied_events(env: &TestEnv, name: &str) -> Vec<(String, String)> {
    let events = env.api::<Event>().list(&ListParams::default()).await.unwrap();
    events
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Applied"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.name_any(), e.note.unwrap_or_default()))
        .collect()
}

fn notes(events: &[(String, String)]) -> Vec<&str> {
    events.iter().map(|(_, note)| note.as_str()).collect()
}

/// Starts an operator as `user` under deploy/'s ClusterRole, except that it may only `verbs`
/// `resource`; `env.operator_identity(user, None)` grants the full role later.
async fn start_limited(env: &TestEnv, role: &str, user: &str, resource: &str, verbs: &[&str]) -> Operator {
    let limited = env
        .limited_cluster_role(role, |rule| {
            if rule.resources.as_ref().unwrap().iter().any(|r| r == resource) {
                rule.verbs = verbs.iter().map(|verb| verb.to_string()).collect();
            }
        })
        .await;
    let identity = env.operator_identity(user, Some(vec![Grant::ClusterRole(limited)])).await;
    Operator::start(env, &identity, &[]).await
}

/// A replica that applied a policy's children and stopped (or lost the policy) before it
/// wrote status and event: whoever writes that status later posts the Applied event too,
/// though it finds the children in place and writes none of them; and only once, however
/// often it reconciles the policy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_applied_but_never_reported_gets_its_event() {
    let env = TestEnv::new("e2e-unreported").await;
    let mut first = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("unreported", 8080)).await.unwrap();
    let ready = env.wait_ready("unreported", ConditionStatus::True).await;
    let first_events = eventually("the first Applied event", || async {
        Some(applied_events(&env, "unreported").await).filter(|events| !events.is_empty())
    })
    .await;
    let status = first.stop().expect("the operator exits");
    assert!(status.success(), "SIGTERM must end in exit 0, got {status}");

    // What the first replica would have left had it stopped right after the children. The
    // status carries a fencing token, which only the operator's identity may remove.
    let no_status = serde_json::json!({ "status": null });
    let as_operator = env.cp.client_as(&format!("system:serviceaccount:{}:operator", env.namespace)).await.unwrap();
    Api::<ApplicationTrafficPolicy>::namespaced(as_operator, &env.namespace)
        .patch_status("unreported", &PatchParams::default(), &Patch::Merge(&no_status))
        .await
        .unwrap();
    for (name, _) in first_events {
        env.api::<Event>().delete(&name, &DeleteParams::default()).await.unwrap();
    }

    let identity = env.operator_identity("operator-again", None).await;
    let second = Operator::start(&env, &identity, &["--resync-period=1s"]).await;
    env.wait_ready("unreported", ConditionStatus::True).await;
    eventually("the new operator reconciled the policy three times", || async {
        (second.successful_reconciles() >= 3.0).then_some(())
    })
    .await;
    let events = applied_events(&env, "unreported").await;
    let generation = ready.metadata.generation.expect("a policy has a generation");
    let expected = format!("NetworkPolicy and ConfigMap in place for generation {generation}");
    assert_eq!(notes(&events), [expected], "one Applied event, however often the policy is reconciled");
    // The audit log records policies and children (not events).
    let writes: Vec<String> =
        audited_writes(env.cp, &identity.user).into_iter().filter(|w| w.contains("/unreported")).collect();
    let status_write = format!("applicationtrafficpolicies/{}/unreported/status", env.namespace);
    assert_eq!(writes, [status_write], "the new operator wrote children it found in place");
}

/// A status write that keeps failing is retried; the generation's Applied event, published
/// with the first attempt, is not posted again with each retry, though the cache never shows a
/// status that says the generation is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_status_write_posts_its_event_once() {
    let env = TestEnv::new("e2e-status-refused").await;
    let status = "applicationtrafficpolicies/status";
    let operator = start_limited(&env, "e2e-operator-without-status-writes", "no-status", status, &["get"]).await;
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("refused", 80)).await.unwrap();
    eventually("the refused status write is retried", || async {
        (operator.metric("workqueue_retries_total", None) >= 3.0).then_some(())
    })
    .await;
    let once = ["Applied NetworkPolicy and ConfigMap for generation 1"];
    assert_eq!(notes(&applied_events(&env, "refused").await), once, "one event, not one per retry");

    env.operator_identity("no-status", None).await; // now also bound to the full role
    env.wait_ready("refused", ConditionStatus::True).await;
    eventually("the reconcile that wrote the status is over", || async {
        (operator.successful_reconciles() >= 1.0).then_some(())
    })
    .await;
    assert_eq!(notes(&applied_events(&env, "refused").await), once, "none when the status is written at last");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_permission_is_retried_with_backoff_until_granted() {
    let env = TestEnv::new("e2e-transient").await;
    let operator =
        start_limited(&env, "e2e-operator-without-configmap-writes", "limited", "configmaps", &["list", "watch"]).await;

    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("blocked", 80)).await.unwrap();
    let failed = env.wait_ready("blocked", ConditionStatus::False).await;
    let ready = &failed.status.unwrap().conditions[0];
    assert_eq!(ready.reason, "ApplyFailed");
    // A short line that names the object, who refused and why; no dump of the client's error.
    let refused = format!("ConfigMap {}/blocked: the API server refused it (403 Forbidden): ", env.namespace);
    assert!(ready.message.starts_with(&refused), "{}", ready.message);
    assert!(!ready.message.contains("Status {"), "{}", ready.message);
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
