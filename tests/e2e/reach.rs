//! The operator-reach admission policy: the operator's identity writes only what it manages,
//! and never in the protected namespaces, whatever its ClusterRole grants.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::ObjectMeta;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
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

/// A NetworkPolicy a user made, with the name a policy's child would have, is not taken over:
/// the write is refused and the policy says why, and the user's object is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_object_of_a_childs_name_is_not_taken_over() {
    let env = TestEnv::new("e2e-reach-user").await;
    let users =
        NetworkPolicy { metadata: ObjectMeta { name: Some("web".into()), ..Default::default() }, ..Default::default() };
    let nps = env.api::<NetworkPolicy>();
    let apply = PatchParams::apply("a-user");
    nps.patch("web", &apply, &Patch::Apply(&users)).await.unwrap();
    let _operator = env.start_operator(&[]).await;
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("web", 80)).await.unwrap();
    let failed = env.wait_ready("web", ConditionStatus::False).await;
    let ready = failed.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert!(ready.message.contains("operator-reach"), "Ready=False does not say why: {ready:?}");
    let users = nps.get("web").await.unwrap();
    assert!(users.metadata.owner_references.is_none(), "the user's NetworkPolicy was taken over");
}
