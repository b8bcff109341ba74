//! Fencing tokens are the operator's alone: the API server refuses anyone else's write that
//! sets, changes or removes one, and a token above every generation the operator granted (an
//! install whose generation floor was lost left it) is reported, never hidden behind an old
//! Ready, and then granted above without a hand edit.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::api::*;

use crate::lifecycle::policy;
use crate::support::{TestEnv, eventually};

const TOKEN: &str = "trafficpolicy.dev/shard-epoch";
/// A token far above every generation the test's install grants before it sees this one.
const FOREIGN: &str = "999999999999";

/// A tenant who may edit ConfigMaps and NetworkPolicies, and the policies' status, in `env`'s namespace.
async fn tenant(env: &TestEnv) -> Client {
    let user = "tenant-editor";
    let rule = |group: &str, resources: &[&str]| PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(resources.iter().map(|r| r.to_string()).collect()),
        verbs: ["get", "list", "create", "update", "patch"].iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    };
    let role = Role {
        metadata: ObjectMeta { name: Some(user.into()), ..Default::default() },
        rules: Some(vec![
            rule("", &["configmaps"]),
            rule("networking.k8s.io", &["networkpolicies"]),
            rule("trafficpolicy.dev", &["applicationtrafficpolicies", "applicationtrafficpolicies/status"]),
        ]),
    };
    let binding = RoleBinding {
        metadata: ObjectMeta { name: Some(user.into()), ..Default::default() },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: user.into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: user.into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    env.api::<Role>().create(&PostParams::default(), &role).await.unwrap();
    env.api::<RoleBinding>().create(&PostParams::default(), &binding).await.unwrap();
    env.cp.client_as(user).await.unwrap()
}

fn annotate(value: Option<&str>) -> Patch<serde_json::Value> {
    Patch::Merge(json!({ "metadata": { "annotations": { TOKEN: value } } }))
}

/// The refusal's message, or a panic naming `what` if the write went through.
fn refused<T: std::fmt::Debug>(what: &str, result: kube::Result<T>) -> String {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{what}: {status:?}");
            status.message
        }
        other => panic!("{what} was not refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_may_set_change_or_remove_a_token() {
    let env = TestEnv::new("e2e-tokens-forged").await;
    let _operator = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("web", 8080)).await.unwrap();
    env.wait_ready("web", ConditionStatus::True).await;
    let tenant = tenant(&env).await;
    let (cms, nps) = (Api::<ConfigMap>::namespaced(tenant.clone(), &env.namespace), env.api::<NetworkPolicy>());
    let tenant_nps = Api::<NetworkPolicy>::namespaced(tenant.clone(), &env.namespace);
    let stored = nps.get("web").await.unwrap().annotations()[TOKEN].clone();

    let raised =
        refused("raising a child's token", cms.patch("web", &PatchParams::default(), &annotate(Some(FOREIGN))).await);
    assert!(raised.contains("metadata.annotations[trafficpolicy.dev/shard-epoch]"), "{raised}");
    assert!(raised.contains("tenant-editor may not set, change or remove it"), "{raised}");
    let lowered = refused(
        "lowering a child's token",
        tenant_nps.patch("web", &PatchParams::default(), &annotate(Some("0"))).await,
    );
    assert!(lowered.contains(&format!("({stored} -> 0)")), "{lowered}");
    refused("removing a child's token", tenant_nps.patch("web", &PatchParams::default(), &annotate(None)).await);
    let forged: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "forged", "annotations": { TOKEN: FOREIGN } }
    }))
    .unwrap();
    refused("creating an object with a token", cms.create(&PostParams::default(), &forged).await);
    let status = Patch::Merge(json!({ "status": { "shardEpoch": 999_999_999_999u64 } }));
    let tenant_policies = Api::<ApplicationTrafficPolicy>::namespaced(tenant, &env.namespace);
    let message = refused(
        "raising status.shardEpoch",
        tenant_policies.patch_status("web", &PatchParams::default(), &status).await,
    );
    assert!(message.contains("status.shardEpoch is the operator's fencing token"), "{message}");

    // A write that leaves the token as it is passes.
    let labelled = Patch::Merge(json!({ "metadata": { "labels": { "team": "payments" } } }));
    cms.patch("web", &PatchParams::default(), &labelled).await.expect("a label set by hand passes");
    assert_eq!(nps.get("web").await.unwrap().annotations()[TOKEN], stored, "the token is the operator's");

    // The operator's own writes still pass.
    let patch = json!({ "spec": { "ingressRules": [{ "ports": [{ "protocol": "TCP", "port": 9090 }] }] } });
    policies.patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    env.wait_ready("web", ConditionStatus::True).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_above_every_generation_is_reported_and_granted_above() {
    let env = TestEnv::new("e2e-tokens-foreign").await;
    let operator = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("web", 8080)).await.unwrap();
    env.wait_ready("web", ConditionStatus::True).await;
    // A token above every generation this install granted, as an install whose generation
    // floor was lost left it: written under the operator's identity, which alone may.
    let operator_identity = format!("system:serviceaccount:{}:operator", env.namespace);
    let as_operator =
        Api::<NetworkPolicy>::namespaced(env.cp.client_as(&operator_identity).await.unwrap(), &env.namespace);
    as_operator.patch("web", &PatchParams::default(), &annotate(Some(FOREIGN))).await.unwrap();

    let patch = json!({ "spec": { "ingressRules": [{ "ports": [{ "protocol": "TCP", "port": 9090 }] }] } });
    policies.patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let conflicted = env.wait_ready("web", ConditionStatus::False).await;
    let ready = conflicted.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.reason, "FencingTokenConflict");
    assert!(ready.message.contains(&format!("NetworkPolicy {}/web", env.namespace)), "{}", ready.message);
    assert!(ready.message.contains("Fencing token conflicts"), "{}", ready.message);
    eventually("a Warning event says the same", || async {
        let events = env.api::<Event>().list(&ListParams::default()).await.ok()?;
        events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("FencingTokenConflict") && e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;
    eventually("a metric counts the refusal", || async {
        let errors = operator.metric("controller_runtime_reconcile_errors_total", Some("kind=\"foreign_token\""));
        (errors > 0.0).then_some(())
    })
    .await;

    // No hand edit: the replica tells the leader of the token, and the leader revokes every
    // bucket and grants them above it.
    env.wait_ready("web", ConditionStatus::True).await;
    let np = env.api::<NetworkPolicy>().get("web").await.unwrap();
    let token: u64 = np.annotations()[TOKEN].parse().unwrap();
    assert!(token > FOREIGN.parse().unwrap(), "written with token {token}, not above {FOREIGN}");
    let ingress = np.spec.unwrap().ingress.unwrap();
    assert_eq!(ingress[0].ports.as_ref().unwrap()[0].port, Some(IntOrString::Int(9090)), "the new spec took effect");
}

/// Two status writes of one epoch cannot be ordered by their token, so the fencing policy also
/// refuses one that reports an older generation than the stored status: a write delivered late
/// (answered 504 and applied afterwards) cannot undo a newer one of the same owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_write_of_one_epoch_for_an_older_generation_is_refused() {
    let env = TestEnv::new("e2e-tokens-order").await;
    env.operator_identity("operator", None).await;
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("web", 8080)).await.unwrap();
    let operator_identity = format!("system:serviceaccount:{}:operator", env.namespace);
    let as_operator = Api::<ApplicationTrafficPolicy>::namespaced(
        env.cp.client_as(&operator_identity).await.unwrap(),
        &env.namespace,
    );
    let write = |epoch: u64, generation: i64| {
        let status = Patch::Merge(json!({ "status": { "shardEpoch": epoch, "observedGeneration": generation } }));
        let as_operator = as_operator.clone();
        async move { as_operator.patch_status("web", &PatchParams::default(), &status).await }
    };
    write(7, 3).await.expect("the operator's status write");
    let message = refused("a status write of the same epoch for an older generation", write(7, 2).await);
    assert!(message.contains("trafficpolicy.dev-fencing: refused a status write for generation 2"), "{message}");
    assert!(message.contains("under the stored generation 3 at the same shard epoch 7"), "{message}");
    let stored = env.api::<ApplicationTrafficPolicy>().get("web").await.unwrap().status.unwrap();
    assert_eq!(stored.observed_generation, Some(3), "the refused write changed the status");
    // The same generation again, a newer one, and a new owner's first word (a higher epoch) pass.
    write(7, 3).await.expect("the same generation again");
    write(7, 4).await.expect("a newer generation");
    write(8, 2).await.expect("a higher epoch");
}

/// The epoch space has two ends, both held: the largest epoch (18 digits) fences a lower
/// one, and a longer token is refused, not read as no token, which would let any later
/// write through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_past_18_digits_is_refused_and_the_largest_fences() {
    // Outside operator-reach, so that the operator's identity may write plain ConfigMaps.
    let env = TestEnv::without_operator_reach("e2e-tokens-ends").await;
    let identity = env.operator_identity("operator", None).await;
    let own = Api::<ConfigMap>::namespaced(identity.client(env.cp).await.unwrap(), &env.namespace);
    let with_token = |name: &str, token: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some([(TOKEN.to_string(), token.to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let (largest, past) = ("999999999999999999", "1000000000000000000");
    own.create(&PostParams::default(), &with_token("largest", largest)).await.expect("18 digits are an epoch");
    let message = refused("a 19-digit token", own.create(&PostParams::default(), &with_token("past", past)).await);
    assert!(message.contains("malformed shard epoch 1000000000000000000"), "{message}");
    own.create(&PostParams::default(), &with_token("low", "5")).await.unwrap();
    let message = refused(
        "raising a token past 18 digits",
        own.patch("low", &PatchParams::default(), &annotate(Some(past))).await,
    );
    assert!(message.contains("malformed shard epoch"), "{message}");
    let message = refused(
        "a lower epoch over the largest",
        own.patch("largest", &PatchParams::default(), &annotate(Some("5"))).await,
    );
    assert!(message.contains("shard epoch 5 over the stored 999999999999999999"), "{message}");
}
