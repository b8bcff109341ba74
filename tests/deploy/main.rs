//! deploy/, the alerts and the Dockerfile, checked against real tools: the API server
//! (server-side dry-run, pod-security admission, RBAC) and promtool.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{TestEnv, eventually};
use controlplane::ControlPlane;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

fn repo(path: &str) -> PathBuf {
    Path::new(REPO).join(path)
}

fn kubectl(cp: &ControlPlane, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", cp.kubeconfig_path())
        .current_dir(REPO)
        .output()
        .expect("kubectl runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// The monitoring.coreos.com CRDs, kept in the repository (see their README for origin).
fn monitoring_crds() -> PathBuf {
    repo("tests/testdata/monitoring-crds/")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kustomization_passes_a_server_side_dry_run_without_pod_security_warnings() {
    let env = TestEnv::new("deploy-dry-run").await;
    let crds = monitoring_crds();
    let (ok, _, err) = kubectl(env.cp, &["apply", "--server-side", "-f", crds.to_str().unwrap()]);
    assert!(ok, "{err}");
    for crd in ["servicemonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com"] {
        let (ok, _, err) =
            kubectl(env.cp, &["wait", "--for=condition=established", "--timeout=60s", &format!("crd/{crd}")]);
        assert!(ok, "{err}");
    }
    // The namespace must exist for pod-security admission to judge the StatefulSet.
    let (ok, _, err) = kubectl(env.cp, &["apply", "-f", "deploy/namespace.yaml"]);
    assert!(ok, "{err}");

    let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", "deploy/"]);
    println!("{out}{err}");
    assert!(ok, "dry-run failed: {err}");
    assert!(out.contains("statefulset.apps/traffic-policy-operator created (server dry run)"), "{out}");
    assert!(out.contains("prometheusrule.monitoring.coreos.com/traffic-policy-operator created (server dry run)"));
    // (kubectl's own notes about last-applied annotations on objects the harness installed
    // may appear; pod-security warnings must not.)
    assert!(!err.contains("PodSecurity"), "pod-security admission warned: {err}");

    // The same check does see a pod that breaks the restricted profile.
    let loose = r#"{"apiVersion":"apps/v1","kind":"StatefulSet","metadata":{"name":"loose","namespace":"traffic-policy-operator"},
        "spec":{"serviceName":"loose","selector":{"matchLabels":{"a":"b"}},"template":{"metadata":{"labels":{"a":"b"}},
        "spec":{"containers":[{"name":"c","image":"busybox"}]}}}}"#;
    let path = env.cp.dir().join("loose.json");
    std::fs::write(&path, loose).unwrap();
    let (_, _, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-f", path.to_str().unwrap()]);
    assert!(err.contains("violate PodSecurity \"restricted:latest\""), "expected a pod-security warning, got: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_identity_is_denied_what_its_roles_do_not_grant() {
    let env = TestEnv::new("deploy-rbac").await;
    let identity = env.operator_identity("operator", None).await;
    let client = identity.client(env.cp).await.unwrap();
    // Granted: listing NetworkPolicies cluster-wide.
    Api::<NetworkPolicy>::all(client.clone()).list(&ListParams::default()).await.expect("list is granted");
    // Not granted: reading Secrets, deleting NetworkPolicies.
    let denied = |r: kube::Result<()>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    assert!(denied(Api::<Secret>::all(client.clone()).list(&ListParams::default()).await.map(|_| ())));
    let nps = Api::<NetworkPolicy>::namespaced(client, &env.namespace);
    assert!(denied(nps.delete("anything", &DeleteParams::default()).await.map(|_| ())));
}

#[test]
fn alert_rules_pass_promtool_unit_tests() {
    let run = |args: &[&str]| {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(repo("deploy/prometheus"))
            .output()
            .expect("promtool is installed (Debian package prometheus)");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
        text
    };
    assert!(run(&["check", "rules", "alerts.yaml"]).contains("SUCCESS: 7 rules found"));
    assert!(run(&["test", "rules", "alerts_test.yaml"]).contains("SUCCESS"));
}

#[test]
fn the_prometheus_rule_carries_the_same_alerts_as_the_plain_rules_file() {
    let plain: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo("deploy/prometheus/alerts.yaml")).unwrap()).unwrap();
    let rule: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo("deploy/prometheusrule.yaml")).unwrap()).unwrap();
    assert_eq!(
        rule["spec"]["groups"], plain["groups"],
        "deploy/prometheusrule.yaml and deploy/prometheus/alerts.yaml differ"
    );
}

#[test]
fn the_deployed_crd_is_the_generated_one() {
    let generated = std::fs::read_to_string(repo("crds/applicationtrafficpolicies.trafficpolicy.dev.yaml")).unwrap();
    let deployed = std::fs::read_to_string(repo("deploy/crd.yaml")).unwrap();
    assert!(
        deployed == generated,
        "deploy/crd.yaml is stale: cp crds/applicationtrafficpolicies.trafficpolicy.dev.yaml deploy/crd.yaml"
    );
}

/// The image cannot be built here (no Docker engine); every path it copies and the binary
/// it runs must at least exist.
#[test]
fn the_dockerfile_refers_to_what_exists() {
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let mut checked = 0;
    for line in dockerfile.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("COPY ")
            && !rest.starts_with("--from")
        {
            let parts: Vec<&str> = rest.split_whitespace().collect();
            for source in &parts[..parts.len() - 1] {
                assert!(repo(source).exists(), "Dockerfile copies {source}, which does not exist");
                checked += 1;
            }
        }
    }
    assert!(checked >= 6, "found only {checked} COPY sources");
    let binary = env!("CARGO_BIN_EXE_traffic-policy-operator");
    let name = Path::new(binary).file_name().unwrap().to_str().unwrap();
    assert!(dockerfile.contains(&format!("target/release/{name} ")), "the Dockerfile copies another binary");
    assert!(dockerfile.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{name}\"]")));
    for dummy in [
        "src/main.rs",
        "src/lib.rs",
        "loadtest/src/main.rs",
        "loadtest/controlplane/src/main.rs",
        "loadtest/controlplane/src/lib.rs",
    ] {
        assert!(repo(dummy).exists(), "the dependency layer stubs {dummy}, which the real build replaces");
    }
}

/// deploy/flowschema.yaml puts the operator's Lease and assignment requests in the
/// `leader-election` priority level and leaves its other requests where they were, as the
/// API server's response headers say (they name the flow schema and level of each request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flowschema_puts_coordination_requests_in_the_leader_election_level() {
    let env = TestEnv::new("deploy-flowschema").await;
    let identity = env.operator_identity("traffic-policy-operator", None).await;
    // As a namespace overlay would place it: the subject and the rules in the test's namespace.
    let mut schema: FlowSchema = common::read_yaml("deploy/flowschema.yaml");
    for rule in schema.spec.as_mut().unwrap().rules.iter_mut().flatten() {
        for subject in &mut rule.subjects {
            subject.service_account.as_mut().unwrap().namespace = env.namespace.clone();
        }
        rule.resource_rules.iter_mut().flatten().for_each(|r| r.namespaces = Some(vec![env.namespace.clone()]));
    }
    let apply = PatchParams::apply("deploy-tests").force();
    let schemas = Api::<FlowSchema>::all(env.client.clone());
    let schema = schemas.patch(&schema.name_any(), &apply, &Patch::Apply(&schema)).await.unwrap();
    let levels = Api::<PriorityLevelConfiguration>::all(env.client.clone());
    let leader_election = levels.get("leader-election").await.unwrap().uid().unwrap();

    let client = identity.client(env.cp).await.unwrap();
    let served_by = |path: String| {
        let client = client.clone();
        async move {
            let response =
                client.send(http::Request::get(path).body(kube::client::Body::empty()).unwrap()).await.ok()?;
            let header = |name: &str| response.headers().get(name)?.to_str().ok().map(str::to_string);
            Some((header("X-Kubernetes-PF-FlowSchema-UID")?, header("X-Kubernetes-PF-PriorityLevel-UID")?))
        }
    };
    let ns = env.namespace.clone();
    let ours = (schema.uid().unwrap(), leader_election.clone());
    for path in
        [format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"), format!("/api/v1/namespaces/{ns}/configmaps")]
    {
        // A new flow schema takes effect asynchronously.
        eventually(&format!("{path} is served by the flow schema"), || async {
            (served_by(path.clone()).await? == ours).then_some(())
        })
        .await;
    }
    let policies = format!("/apis/trafficpolicy.dev/v1/namespaces/{ns}/applicationtrafficpolicies");
    let (_, level) = served_by(policies).await.expect("APF headers on every response");
    assert_ne!(level, leader_election, "policy requests must stay out of the leader-election level");
}
