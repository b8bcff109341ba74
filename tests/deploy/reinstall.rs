//! Removing the operator never removes what users declared: on a control plane of its own,
//! the install is deleted and installed again, in the same namespace, then in another with
//! Helm, then in a third with kustomize's `namespace:`, and the policies and their children
//! outlive each removal and are reconciled again. Then the CRD is replaced from git, as
//! `kubectl replace` and GitOps syncs with Replace=true do, which loses the generation floor:
//! a reinstall still converges, and a running install writes the floor back.

use std::time::Duration;

use controlplane::{Config, ControlPlane, Grant};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::chart::helm;
use crate::common::{Operator, eventually_within};
use crate::{kubectl, wait_established};

const TENANT: &str = "shop";
const POLICY: &str = "web-frontend";
const FENCE_ANNOTATION: &str = "trafficpolicy.dev/shard-epoch";
const FLOOR_ANNOTATION: &str = "trafficpolicy.dev/reserved-generation";
const CRD: &str = "applicationtrafficpolicies.trafficpolicy.dev";

/// The uids of the policy and of its NetworkPolicy and ConfigMap.
async fn declared(client: &Client) -> [String; 3] {
    let policy = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), TENANT).get(POLICY).await.unwrap();
    let np = Api::<NetworkPolicy>::namespaced(client.clone(), TENANT).get(POLICY).await.unwrap();
    let cm = Api::<ConfigMap>::namespaced(client.clone(), TENANT).get(POLICY).await.unwrap();
    for child in [np.owner_references(), cm.owner_references()] {
        assert!(child.iter().any(|o| Some(&o.uid) == policy.uid().as_ref()), "a child is not owned by the policy");
    }
    [policy.uid().unwrap(), np.uid().unwrap(), cm.uid().unwrap()]
}

/// Runs the installed operator (namespace `namespace`) as its own service account, sets the
/// policy's rate to `rate`, waits until the ConfigMap carries it and the status is Ready for
/// the new generation, and returns the fencing token the child was written with.
async fn reconciled_by_install(cp: &ControlPlane, namespace: &str, rate: u32) -> u64 {
    let (token, mut operator) = launched_and_reconciled(cp, namespace, rate).await;
    assert_eq!(operator.stop().map(|s| s.success()), Some(true), "the replica did not exit cleanly");
    token
}

/// [`reconciled_by_install`], leaving the replica running.
async fn launched_and_reconciled(cp: &ControlPlane, namespace: &str, rate: u32) -> (u64, Operator) {
    let identity = cp.identity(namespace, "traffic-policy-operator", &[]).await.unwrap();
    let args = [format!("--namespace={namespace}")];
    let operator = Operator::launch(cp, &identity, &format!("reinstalled-{namespace}"), &args).await;
    (reconciled(cp, namespace, rate).await, operator)
}

/// Sets the policy's rate to `rate` and waits until the install in `namespace` has written it;
/// the fencing token it wrote with.
async fn reconciled(cp: &ControlPlane, namespace: &str, rate: u32) -> u64 {
    let client = cp.client().await.unwrap();
    let policies = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), TENANT);
    let patch = serde_json::json!({"spec": {"rateLimit": {"requestsPerSecond": rate}}});
    policies.patch(POLICY, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), TENANT);
    eventually_within(Duration::from_secs(90), &format!("the install in {namespace} reconciles"), || {
        let (policies, configmaps) = (policies.clone(), configmaps.clone());
        async move {
            let policy = policies.get(POLICY).await.ok()?;
            let status = policy.status.as_ref()?;
            let ready = status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == ConditionStatus::True);
            let current = status.observed_generation == policy.metadata.generation;
            let cm = configmaps.get(POLICY).await.ok()?;
            let carried = cm.data?.values().any(|v| v.contains(&format!("\"requestsPerSecond\": {rate}")));
            let token = cm.metadata.annotations?.get(FENCE_ANNOTATION)?.parse::<u64>().ok()?;
            (ready && current && carried).then_some(token)
        }
    })
    .await
}

/// The member Leases in `namespace`: a replica that took part in sharding made one.
async fn member_leases(client: &Client, namespace: &str) -> Vec<String> {
    let leases = Api::<Lease>::namespaced(client.clone(), namespace).list(&Default::default()).await.unwrap();
    leases.items.iter().map(|l| l.name_any()).filter(|n| n.starts_with("traffic-policy-operator-member-")).collect()
}

/// The generation floor on the CRD, if it has one.
async fn floor(client: &Client) -> Option<u64> {
    let crd = Api::<CustomResourceDefinition>::all(client.clone()).get(CRD).await.unwrap();
    crd.annotations().get(FLOOR_ANNOTATION).map(|v| v.parse().unwrap())
}

/// Deletes an install as its user would, and checks that the CRD, the policy and its
/// children are still there, the very same objects.
async fn kept_after(cp: &ControlPlane, before: &[String; 3], uninstall: impl FnOnce() -> (bool, String, String)) {
    let (ok, out, err) = uninstall();
    assert!(ok, "uninstall failed: {out}{err}");
    let client = cp.client().await.unwrap();
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    assert!(crds.get_opt(CRD).await.unwrap().is_some(), "CRD deleted");
    assert_eq!(&declared(&client).await, before, "the policy or a child was deleted or replaced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uninstall_keeps_the_policies_and_a_reinstall_reconciles_them() {
    let cp = tokio::task::spawn_blocking(|| ControlPlane::start(Config::default())).await.unwrap().unwrap();
    let client = cp.client().await.unwrap();
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", "deploy/crd/"]);
    assert!(ok, "{err}");
    assert!(!err.contains("unrecognized format"), "the API server warned about the CRD: {err}");
    wait_established(&cp, &["-f", "crds/"]).await;
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", "deploy/"]);
    assert!(ok, "{err}");
    let (ok, _, err) = kubectl(&cp, &["apply", "-f", "deploy/samples/web-frontend.yaml"]);
    assert!(ok, "{err}");

    let first = reconciled_by_install(&cp, "traffic-policy-operator", 101).await;
    let objects = declared(&client).await;
    kept_after(&cp, &objects, || kubectl(&cp, &["delete", "-k", "deploy/", "--wait=true"])).await;

    // The same install again: its replicas' tokens start above the floor the first left.
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", "deploy/"]);
    assert!(ok, "{err}");
    let second = reconciled_by_install(&cp, "traffic-policy-operator", 102).await;
    assert!(second > first, "the reinstall wrote with token {second}, below the earlier {first}");
    kept_after(&cp, &objects, || kubectl(&cp, &["delete", "-k", "deploy/", "--wait=true"])).await;

    // With Helm, in another namespace; the fencing policy now names that identity.
    let kubeconfig = cp.kubeconfig_path();
    let chart = "deploy/helm/traffic-policy-operator";
    let install = ["install", "tpo", chart, "--namespace", "platform-traffic", "--create-namespace"];
    let (ok, out, err) = helm(Some(&kubeconfig), &install);
    assert!(ok, "helm install: {out}{err}");
    let third = reconciled_by_install(&cp, "platform-traffic", 103).await;
    assert!(third > second, "the Helm install wrote with token {third}, below the earlier {second}");
    kept_after(&cp, &objects, || {
        helm(Some(&kubeconfig), &["uninstall", "tpo", "--namespace", "platform-traffic", "--wait"])
    })
    .await;

    // As users move an install with kustomize: `namespace:` over deploy/.
    let dir = crate::namespace_over("deploy/", "team-platform");
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", &dir]);
    assert!(ok, "{err}");
    let fourth = reconciled_by_install(&cp, "team-platform", 104).await;
    assert!(fourth > third, "the install in team-platform wrote with token {fourth}, below the earlier {third}");
    // Its fencing policy applies: the operator's token change above passed as that identity's,
    // and the same change by another is refused.
    let forged = serde_json::json!({"metadata": {"annotations": {FENCE_ANNOTATION: (fourth + 1).to_string()}}});
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), TENANT);
    match configmaps.patch(POLICY, &PatchParams::default(), &Patch::Merge(&forged)).await {
        Err(kube::Error::Api(refusal)) => {
            assert_eq!(refusal.code, 403, "{refusal:?}");
            assert!(refusal.message.contains("trafficpolicy.dev-fencing"), "{}", refusal.message);
        }
        other => panic!("the admin set a fencing token in the namespace-moved install: {other:?}"),
    }
    kept_after(&cp, &objects, || kubectl(&cp, &["delete", "-k", &dir, "--wait=true"])).await;

    // The CRD replaced from git while no install runs: the floor is gone, and the children
    // keep tokens above anything a new install starts from. The fencing policy refuses its
    // first writes; the replica reports the stored token, and the leader grants above it.
    let (ok, _, err) = kubectl(&cp, &["replace", "-f", "crds/"]);
    assert!(ok, "{err}");
    assert_eq!(floor(&client).await, None, "the replace kept the floor");
    let dir = crate::namespace_over("deploy/", "platform-five");
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", &dir]);
    assert!(ok, "{err}");
    let (fifth, mut operator) = launched_and_reconciled(&cp, "platform-five", 105).await;
    assert!(fifth > fourth, "after the floor was lost, the install wrote with token {fifth}, below {fourth}");

    // A second install beside it, watching the same namespaces (bound to the same ClusterRole,
    // not applied over the first's cluster-wide objects), waits and does nothing.
    let (ok, _, err) = kubectl(&cp, &["create", "namespace", "platform-six"]);
    assert!(ok, "{err}");
    // Its namespace's Role comes with its manifests, later.
    let grants = [Grant::ClusterRole("traffic-policy-operator".into())];
    let identity = cp.identity("platform-six", "traffic-policy-operator", &grants).await.unwrap();
    let mut waiting =
        Operator::spawn(&cp, &identity.kubeconfig_path, "second-install", &["--namespace=platform-six".into()]);
    eventually_within(Duration::from_secs(30), "the second install reports the first", || async {
        waiting.get("/metrics").ok().filter(|m| m.contains("traffic_policy_install_blocked 1")).map(drop)
    })
    .await;
    let blocked_by_the_first = |waiting: &Operator| {
        let log = controlplane::process::tail(&waiting.process.log_path, 200);
        assert!(log.contains("another install, in namespace platform-five"), "the reason is not logged: {log}");
        assert!(!waiting.is_ready(), "the second install is ready beside the first");
    };
    blocked_by_the_first(&waiting);
    assert!(member_leases(&client, "platform-six").await.is_empty(), "the second install took part in sharding");

    // Replaced again while the install runs: its leader writes its reservation back.
    let (ok, _, err) = kubectl(&cp, &["replace", "-f", "crds/"]);
    assert!(ok, "{err}");
    eventually_within(Duration::from_secs(60), "the leader writes the floor back", || async {
        floor(&client).await.filter(|f| *f >= fifth)
    })
    .await;
    // The install record went with the floor: the waiting install still waits.
    blocked_by_the_first(&waiting);
    assert!(member_leases(&client, "platform-six").await.is_empty(), "the second install started on a lost record");

    // The first uninstalled as its admin would (its last replica removes its entry as it leaves,
    // and its namespace goes), then the second's manifests applied: the second starts.
    assert_eq!(operator.stop().map(|s| s.success()), Some(true), "the replica did not exit cleanly");
    kept_after(&cp, &objects, || kubectl(&cp, &["delete", "-k", &dir, "--wait=true"])).await;
    let sixth_dir = crate::namespace_over("deploy/", "platform-six");
    let (ok, _, err) = kubectl(&cp, &["apply", "-k", &sixth_dir]);
    assert!(ok, "{err}");
    waiting.wait_ready().await;
    let sixth = reconciled(&cp, "platform-six", 106).await;
    assert!(sixth > fifth, "the second install wrote with token {sixth}, below {fifth}");
    assert_eq!(waiting.stop().map(|s| s.success()), Some(true), "the second replica did not exit cleanly");
    kept_after(&cp, &objects, || kubectl(&cp, &["delete", "-k", &sixth_dir, "--wait=true"])).await;
    println!(
        "policy and children kept across six uninstalls and a lost floor; tokens {first} -> {second} -> {third} -> \
         {fourth} -> {fifth} -> {sixth} (the sixth waited for the fifth)"
    );
}
