//! The operator-reach admission policy: the operator's identity writes only what it manages,
//! and never in the protected namespaces, whatever its ClusterRole grants. (Objects of a
//! child's name that are not the operator's: `clash.rs`.)

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::core::ObjectMeta;

use crate::support::{Operator, TestEnv, eventually};

const MANAGED: [(&str, &str); 1] = [("app.kubernetes.io/managed-by", "traffic-policy-operator")];

fn refusal(result: kube::Result<impl Sized>) -> Option<String> {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 && status.message.contains("operator-reach") => {
            Some(status.message)
        }
        _ => None,
    }
}

fn config_map(namespace: &str, name: &str, managed: bool) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: managed.then(|| MANAGED.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Writes its ClusterRole allows are refused with a message naming what is missing: an
/// unlabelled ConfigMap, a labelled one without a policy as its controller, and anything
/// in kube-system.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_identity_writes_only_what_it_manages() {
    let env = TestEnv::new("e2e-reach").await;
    let identity = env.operator_identity("reach", None).await;
    let client = identity.client(env.cp).await.unwrap();
    let own = Api::<ConfigMap>::namespaced(client.clone(), &env.namespace);
    let create = PostParams::default();
    // The harness installs the policy at start-up; the API server enforces it shortly after.
    let message = eventually("an unlabelled ConfigMap is refused", || async {
        refusal(own.create(&create, &config_map(&env.namespace, "unlabelled", false)).await)
    })
    .await;
    assert!(message.contains("lacks, before or after this CREATE, the label"), "{message}");
    let message = refusal(own.create(&create, &config_map(&env.namespace, "not-owned", true)).await)
        .expect("a labelled ConfigMap without a controller reference is refused");
    assert!(
        message.contains(&format!("configmaps {}/not-owned would have no controller reference", env.namespace)),
        "{message}"
    );
    let system = Api::<ConfigMap>::namespaced(client.clone(), "kube-system");
    let message = refusal(system.create(&create, &config_map("kube-system", "anything", true)).await)
        .expect("a ConfigMap in kube-system is refused");
    assert!(message.contains("protected namespace kube-system"), "{message}");
    // The same writes from another identity are none of this policy's business.
    let admin = Api::<ConfigMap>::namespaced(env.client.clone(), &env.namespace);
    admin.create(&create, &config_map(&env.namespace, "unlabelled", false)).await.expect("the admin may");
}

/// Each replica asks the server whether both policies refuse what they must for its identity,
/// and with `--admission-policies=required` (the shipped install's) is ready only while they
/// do: here, operator-reach does not cover one operator's namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_ready_only_while_both_admission_policies_are_in_force() {
    let covered = TestEnv::new("e2e-admission").await;
    let operator = covered.start_operator(&["--admission-policies=required"]).await;
    let in_force = |operator: &Operator| {
        let text = operator.get("/metrics").ok()?;
        let value = |policy: &str| {
            let series = format!("traffic_policy_admission_policy_in_force{{policy=\"{policy}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
        };
        Some((value("fencing")?, value("operator-reach")?))
    };
    assert_eq!(in_force(&operator), Some((1.0, 1.0)), "ready, with both policies in force");

    let uncovered = TestEnv::without_operator_reach("e2e-admission-uncovered").await;
    let identity = uncovered.operator_identity("operator", None).await;
    let args = [
        format!("--watch-namespace={}", uncovered.namespace),
        format!("--namespace={}", uncovered.namespace),
        "--admission-policies=required".into(),
    ];
    let uncovered_operator = Operator::spawn(uncovered.cp, &identity.kubeconfig_path, "operator-uncovered", &args);
    eventually("the replica finds operator-reach not in force", || async {
        (in_force(&uncovered_operator)? == (1.0, 0.0)).then_some(())
    })
    .await;
    eventually("it waits for nothing else", || async {
        let readyz = uncovered_operator.get("/readyz").ok()?;
        readyz
            .contains("not ready: waiting for admission policies\n")
            .then_some(())
            .or_else(|| readyz.trim_end().ends_with("not ready: waiting for admission policies").then_some(()))
    })
    .await;
    assert!(!uncovered_operator.is_ready());
}
