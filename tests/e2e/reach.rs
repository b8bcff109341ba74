//! The operator-reach admission policy: the operator's identity writes only what it manages,
//! and never in the protected namespaces, whatever its ClusterRole grants. (Objects of a
//! child's name that are not the operator's: `clash.rs`.)

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::core::ObjectMeta;

use crate::support::{TestEnv, eventually};

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
