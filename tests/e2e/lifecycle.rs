//! Create, update, drift, delete: observed through the API server and the metrics.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use traffic_policy_operator::api::*;

use crate::support::{TestEnv, eventually};

pub fn policy(name: &str, port: i32) -> ApplicationTrafficPolicy {
    ApplicationTrafficPolicy::new(
        name,
        ApplicationTrafficPolicySpec {
            application_selector: ApplicationSelector { match_labels: [("app", name)].into_iter().collect() },
            ingress_rules: vec![IngressRule {
                from: vec![Peer {
                    ip_block: IpBlock { cidr: Cidr("10.0.0.0/8".into()), except: vec![Cidr("10.1.0.0/16".into())] },
                }],
                ports: vec![PortRule { protocol: Protocol::Http, port }],
            }],
            egress_rules: vec![],
            rate_limit: Some(RateLimit { requests_per_second: 100, burst: 10 }),
            gateway: None,
        },
    )
}

fn ingress_port(np: &NetworkPolicy) -> (Option<String>, Option<IntOrString>) {
    let port = &np.spec.as_ref().unwrap().ingress.as_ref().unwrap()[0].ports.as_ref().unwrap()[0];
    (port.protocol.clone(), port.port.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_update_and_delete() {
    let env = TestEnv::new("e2e-lifecycle").await;
    let _operator = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    let nps = env.api::<NetworkPolicy>();
    let cms = env.api::<ConfigMap>();

    policies.create(&PostParams::default(), &policy("web", 8080)).await.unwrap();
    let ready = env.wait_ready("web", ConditionStatus::True).await;
    assert_eq!(ready.status.as_ref().unwrap().observed_generation, Some(1));
    let np = nps.get("web").await.unwrap();
    assert_eq!(ingress_port(&np), (Some("TCP".into()), Some(IntOrString::Int(8080))), "HTTP is enforced as TCP");
    assert_eq!(np.owner_references()[0].uid, ready.uid().unwrap());
    let cm = cms.get("web").await.unwrap();
    assert!(cm.data.unwrap()["ratelimit.json"].contains("\"requestsPerSecond\": 100"));

    let patch = json!({ "spec": { "ingressRules": [{ "ports": [{ "protocol": "UDP", "port": 5353 }] }] } });
    policies.patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let updated = env.wait_ready("web", ConditionStatus::True).await;
    assert_eq!(updated.status.unwrap().observed_generation, Some(2));
    eventually("the NetworkPolicy follows the new spec", || async {
        let np = nps.get("web").await.ok()?;
        (ingress_port(&np) == (Some("UDP".into()), Some(IntOrString::Int(5353)))).then_some(())
    })
    .await;

    policies.delete("web", &DeleteParams::default()).await.unwrap();
    eventually("the children are garbage-collected", || async {
        (nps.get_opt("web").await.ok()?.is_none() && cms.get_opt("web").await.ok()?.is_none()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_label_updates_cause_no_reconcile() {
    let env = TestEnv::new("e2e-predicate").await;
    // One worker: keys are served in the order their events arrived.
    let operator = env.start_operator(&["--workers=1"]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("quiet", 80)).await.unwrap();
    env.wait_ready("quiet", ConditionStatus::True).await;
    let np_version = env.api::<NetworkPolicy>().get("quiet").await.unwrap().resource_version();
    // Status becomes visible a moment before the reconcile is counted.
    let before = eventually("the first reconcile is counted", || async {
        let count = operator.successful_reconciles();
        (count >= 1.0).then_some(count)
    })
    .await;

    let labels = json!({ "metadata": { "labels": { "team": "blue" }, "annotations": { "note": "hi" } } });
    policies.patch("quiet", &PatchParams::default(), &Patch::Merge(&labels)).await.unwrap();
    let status = json!({ "status": { "conditions": [
        { "type": "Ready", "status": "True", "reason": "Applied", "message": "NetworkPolicy and rate-limit ConfigMap are in place",
          "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1 },
        { "type": "Audited", "status": "Unknown", "reason": "Pending", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z" } ] } });
    policies.patch_status("quiet", &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();

    // A barrier: this spec change is queued after anything the updates above could queue.
    policies.create(&PostParams::default(), &policy("barrier", 81)).await.unwrap();
    env.wait_ready("barrier", ConditionStatus::True).await;
    eventually("the barrier's reconcile is counted", || async {
        (operator.successful_reconciles() >= before + 1.0).then_some(())
    })
    .await;
    assert_eq!(operator.successful_reconciles(), before + 1.0, "only the barrier was reconciled");
    assert_eq!(env.api::<NetworkPolicy>().get("quiet").await.unwrap().resource_version(), np_version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_or_edited_children_are_restored() {
    let env = TestEnv::new("e2e-drift").await;
    let _operator = env.start_operator(&[]).await;
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &policy("drift", 443)).await.unwrap();
    env.wait_ready("drift", ConditionStatus::True).await;
    let nps = env.api::<NetworkPolicy>();
    let cms = env.api::<ConfigMap>();

    let old_uid = nps.get("drift").await.unwrap().uid();
    nps.delete("drift", &DeleteParams::default()).await.unwrap();
    eventually("the NetworkPolicy is recreated", || async {
        let np = nps.get_opt("drift").await.ok()??;
        (np.uid() != old_uid && ingress_port(&np).1 == Some(IntOrString::Int(443))).then_some(())
    })
    .await;

    let edit = json!({ "data": { "ratelimit.json": "{}" } });
    cms.patch("drift", &PatchParams::default(), &Patch::Merge(&edit)).await.unwrap();
    eventually("the ConfigMap is restored", || async {
        cms.get("drift").await.ok()?.data?["ratelimit.json"].contains("requestsPerSecond").then_some(())
    })
    .await;

    let events = env.api::<Event>();
    eventually("a Repaired event is recorded", || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items.iter().any(|e| e.reason.as_deref() == Some("Repaired")).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_the_server_refuses_is_reported_and_not_retried() {
    let env = TestEnv::new("e2e-invalid").await;
    let operator = env.start_operator(&[]).await;
    let mut bad = policy("bad-key", 80);
    // A CIDR with host bits set passes the CRD's isCIDR rule; NetworkPolicy validation refuses it.
    bad.spec.ingress_rules[0].from[0].ip_block.cidr = Cidr("10.0.0.1/8".into());
    bad.spec.ingress_rules[0].from[0].ip_block.except.clear();
    env.api::<ApplicationTrafficPolicy>().create(&PostParams::default(), &bad).await.unwrap();
    if !env.cp.release().refuses_cidr_host_bits() {
        // v1.32 accepts the NetworkPolicy, so the policy takes effect.
        env.wait_ready("bad-key", ConditionStatus::True).await;
        println!("skipped the refusal: this kube-apiserver accepts a CIDR with host bits, and so did the policy");
        return;
    }
    let reported = env.wait_ready("bad-key", ConditionStatus::False).await;
    let ready = &reported.status.unwrap().conditions[0];
    assert_eq!(ready.reason, "InvalidSpec");
    assert!(ready.message.contains("ipBlock.cidr"), "{}", ready.message);
    eventually("the error is counted", || async {
        (operator.metric("controller_runtime_reconcile_errors_total", Some("kind=\"invalid_spec\"")) >= 1.0)
            .then_some(())
    })
    .await;
    assert_eq!(operator.metric("workqueue_retries_total", None), 0.0, "terminal errors are not retried with backoff");

    // What a user sees: the message with `-o wide`, and the kind under the category name.
    let kubectl = |args: &[&str]| {
        let out = std::process::Command::new("kubectl")
            .arg(format!("--kubeconfig={}", env.cp.kubeconfig_path().display()))
            .args(["-n", &env.namespace])
            .args(args)
            .output()
            .expect("kubectl runs");
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let wide = kubectl(&["get", "atp", "bad-key", "-o", "wide"]);
    assert!(wide.contains("MESSAGE") && wide.contains("ipBlock.cidr"), "{wide}");
    assert!(!kubectl(&["get", "atp", "bad-key"]).contains("MESSAGE"), "the message is for -o wide only");
    assert!(kubectl(&["get", "trafficpolicy"]).contains("bad-key"), "the category lists the policy");
}
