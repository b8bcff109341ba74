//! deploy/, the alerts and the Dockerfile, checked against real tools: the API server
//! (server-side dry-run, pod-security admission, RBAC) and promtool.

#[path = "../common/mod.rs"]
mod common;

mod chart;
mod reinstall;
mod roles;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{TestEnv, eventually, eventually_within};
use controlplane::ControlPlane;
use k8s_openapi::api::apps::v1::StatefulSet;
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

/// The documents of a multi-document YAML stream, such as `kubectl kustomize` prints.
/// Waits until the CRDs `target` names are established. `kubectl wait` fails at once on a CRD
/// whose status has no conditions yet (just after it was created), so it is asked again.
async fn wait_established(cp: &ControlPlane, target: &[&str]) {
    let args = [&["wait", "--for=condition=established", "--timeout=10s"], target].concat();
    eventually_within(Duration::from_secs(60), &format!("{target:?} established"), || async {
        kubectl(cp, &args).0.then_some(())
    })
    .await
}

fn documents(yaml: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_multiple::<Option<serde_json::Value>>(yaml).unwrap().into_iter().flatten().collect()
}

/// The monitoring.coreos.com CRDs, kept in the repository (see their README for origin).
fn monitoring_crds() -> PathBuf {
    repo("tests/testdata/monitoring-crds/")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kustomization_passes_a_server_side_dry_run_without_pod_security_warnings() {
    let env = TestEnv::new("deploy-dry-run").await;
    // The default install needs nothing but Kubernetes: it is tried before the Prometheus
    // Operator's CRDs exist (no other test of this suite installs them).
    let (present, _, _) = kubectl(env.cp, &["get", "crd", "servicemonitors.monitoring.coreos.com"]);
    assert!(!present, "this control plane must not have the Prometheus Operator's CRDs yet");
    // The namespace must exist for pod-security admission to judge the StatefulSet.
    let (ok, _, err) = kubectl(env.cp, &["apply", "-f", "deploy/base/namespace.yaml"]);
    assert!(ok, "{err}");
    let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", "deploy/"]);
    println!("{out}{err}");
    assert!(ok, "dry-run of deploy/ failed without the monitoring CRDs: {err}");
    assert!(out.contains("statefulset.apps/traffic-policy-operator created (server dry run)"), "{out}");
    assert!(out.contains("validatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-fencing"), "{out}");
    assert!(
        out.contains("validatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-operator-reach"),
        "{out}"
    );
    assert!(!out.contains("monitoring.coreos.com"), "deploy/ installs monitoring objects: {out}");
    assert!(!out.contains("bucket-label"), "deploy/ installs the bucket-label component, which needs 1.36: {out}");

    // Bucket labels at admission: the policy, its binding and the grant to label namespaces.
    let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", "deploy/overlays/bucket-labels/"]);
    assert!(ok, "dry-run of the bucket-labels overlay failed: {err}");
    for object in [
        "mutatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-bucket-label",
        "mutatingadmissionpolicybinding.admissionregistration.k8s.io/trafficpolicy.dev-bucket-label",
        "clusterrole.rbac.authorization.k8s.io/traffic-policy-operator-namespace-labels",
        "clusterrolebinding.rbac.authorization.k8s.io/traffic-policy-operator-namespace-labels",
        "statefulset.apps/traffic-policy-operator",
    ] {
        assert!(out.contains(object), "the bucket-labels overlay does not install {object}: {out}");
    }
    // (kubectl's own notes about last-applied annotations on objects the harness installed
    // may appear; pod-security warnings must not.)
    assert!(!err.contains("PodSecurity"), "pod-security admission warned: {err}");

    // The monitoring overlay needs the CRDs: refused without them, accepted with them.
    let (ok, _, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", "deploy/overlays/monitoring/"]);
    assert!(!ok && err.contains("ServiceMonitor"), "expected the missing CRDs to be named: {err}");
    let crds = monitoring_crds();
    let (ok, _, err) = kubectl(env.cp, &["apply", "--server-side", "-f", crds.to_str().unwrap()]);
    assert!(ok, "{err}");
    for crd in ["servicemonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com"] {
        wait_established(env.cp, &[&format!("crd/{crd}")]).await;
    }
    let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", "deploy/overlays/monitoring/"]);
    assert!(ok, "dry-run of the monitoring overlay failed: {err}");
    for object in [
        "prometheusrule.monitoring.coreos.com/traffic-policy-operator",
        "servicemonitor.monitoring.coreos.com/traffic-policy-operator",
        "networkpolicy.networking.k8s.io/traffic-policy-operator-metrics",
        "configmap/traffic-policy-operator-dashboard",
    ] {
        assert!(out.contains(&format!("{object} created (server dry run)")), "{object} missing from: {out}");
    }

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
    assert!(run(&["check", "rules", "alerts.yaml"]).contains("SUCCESS: 16 rules found"));
    assert!(run(&["test", "rules", "alerts_test.yaml"]).contains("SUCCESS"));
}

#[test]
fn the_prometheus_rule_carries_the_same_alerts_as_the_plain_rules_file() {
    let plain: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(repo("deploy/prometheus/alerts.yaml")).unwrap()).unwrap();
    let rule: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo("deploy/components/monitoring/prometheusrule.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        rule["spec"]["groups"], plain["groups"],
        "deploy/components/monitoring/prometheusrule.yaml and deploy/prometheus/alerts.yaml differ"
    );
}

#[test]
fn the_deployed_crds_are_the_generated_one() {
    let generated = std::fs::read_to_string(repo("crds/applicationtrafficpolicies.trafficpolicy.dev.yaml")).unwrap();
    for copy in [
        "deploy/crd/applicationtrafficpolicies.trafficpolicy.dev.yaml",
        "deploy/helm/traffic-policy-operator/crds/applicationtrafficpolicies.trafficpolicy.dev.yaml",
    ] {
        let deployed = std::fs::read_to_string(repo(copy)).unwrap();
        assert!(
            deployed == generated,
            "{copy} is stale: cp crds/applicationtrafficpolicies.trafficpolicy.dev.yaml {copy}"
        );
    }
}

/// The image cannot be built here (no Docker engine); every path it copies and the binary
/// it runs must at least exist.
#[test]
fn the_dockerfile_refers_to_what_exists() {
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let sources = copied_sources(&dockerfile);
    for source in &sources {
        assert!(repo(source).exists(), "Dockerfile copies {source}, which does not exist");
    }
    assert!(sources.len() >= 6, "found only {} COPY sources", sources.len());
    let ignore = std::fs::read_to_string(repo(".dockerignore")).expect("a .dockerignore keeps the context small");
    for source in sources {
        assert!(!docker_ignores(&ignore, source), ".dockerignore keeps out {source}, which the Dockerfile copies");
    }
    assert!(docker_ignores(&ignore, "target/debug/traffic-policy-operator") && docker_ignores(&ignore, "loadtest/src"));
    for from in dockerfile.lines().filter_map(|l| l.trim().strip_prefix("FROM ")) {
        let image = from.split_whitespace().next().unwrap();
        let digest = image.split_once("@sha256:").unwrap_or_else(|| panic!("{image} is not pinned by digest")).1;
        assert!(digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()), "{image}: bad digest");
    }
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

/// The source paths of the Dockerfile's `COPY` lines from the build context.
fn copied_sources(dockerfile: &str) -> Vec<&str> {
    dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("COPY "))
        .filter(|rest| !rest.starts_with("--from"))
        .flat_map(|rest| {
            let parts: Vec<&str> = rest.split_whitespace().collect();
            parts[..parts.len() - 1].to_vec()
        })
        .collect()
}

/// Whether `.dockerignore` (the subset of its syntax we use: `dir/`, `dir/*`, `!path`, the
/// last matching line winning) keeps `path` out of the build context.
fn docker_ignores(dockerignore: &str, path: &str) -> bool {
    let mut ignored = false;
    for line in dockerignore.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (keep, pattern) = match line.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, line),
        };
        let matches = match pattern.strip_suffix("/*") {
            Some(dir) => path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/') && rest.len() > 1),
            None => {
                let pattern = pattern.trim_end_matches('/');
                path == pattern || path.starts_with(&format!("{pattern}/"))
            }
        };
        if matches {
            ignored = !keep;
        }
    }
    ignored
}

/// deploy/base/flowschema.yaml puts the operator's Lease and assignment requests in the
/// `leader-election` priority level and leaves its other requests where they were (a list of
/// ConfigMaps, as its children's watch makes, included), as the API server's response headers
/// say (they name the flow schema and level of each request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flowschema_puts_coordination_requests_in_the_leader_election_level() {
    let env = TestEnv::new("deploy-flowschema").await;
    let identity = env.operator_identity("traffic-policy-operator", None).await;
    // As kustomize's `namespace:` places it: the subject in the test's namespace.
    let mut schema: FlowSchema = common::read_yaml("deploy/base/flowschema.yaml");
    for rule in schema.spec.as_mut().unwrap().rules.iter_mut().flatten() {
        for subject in &mut rule.subjects {
            subject.service_account.as_mut().unwrap().namespace = env.namespace.clone();
        }
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
    let assignment = format!("/api/v1/namespaces/{ns}/configmaps/traffic-policy-operator-assignment");
    for path in [format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"), assignment] {
        // A new flow schema takes effect asynchronously.
        eventually(&format!("{path} is served by the flow schema"), || async {
            (served_by(path.clone()).await? == ours).then_some(())
        })
        .await;
    }
    for path in [
        format!("/apis/trafficpolicy.dev/v1/namespaces/{ns}/applicationtrafficpolicies"),
        format!("/api/v1/namespaces/{ns}/configmaps"),
        "/api/v1/configmaps".to_string(),
    ] {
        let (_, level) = served_by(path.clone()).await.expect("APF headers on every response");
        assert_ne!(level, leader_election, "{path} must stay out of the leader-election level");
    }
}

/// Every `namespace` and `namespaces` value anywhere in `value`, with where it was found.
fn namespaces_in(value: &serde_json::Value, at: &str, found: &mut Vec<(String, String)>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, child) in map {
                let key = key.as_str();
                let here = format!("{at}.{key}");
                match (key, child) {
                    ("namespace", serde_json::Value::String(ns)) => found.push((here, ns.clone())),
                    ("namespaces", serde_json::Value::Array(list)) => {
                        found.extend(list.iter().map(|ns| (here.clone(), ns.as_str().unwrap_or_default().to_string())))
                    }
                    _ => namespaces_in(child, &here, found),
                }
            }
        }
        serde_json::Value::Array(list) => list.iter().for_each(|v| namespaces_in(v, at, found)),
        _ => {}
    }
}

/// A user's kustomization that sets `namespace:` over `dir`, written under target/tmp/.
pub(crate) fn namespace_over(dir: &str, namespace: &str) -> String {
    let at = format!("target/tmp/namespace-{namespace}-over-{}", dir.trim_end_matches('/').replace('/', "-"));
    std::fs::create_dir_all(repo(&at)).unwrap();
    let kustomization = format!("namespace: {namespace}\nresources: [../../../{dir}]\n");
    std::fs::write(repo(&at).join("kustomization.yaml"), kustomization).unwrap();
    at
}

/// Checks that the rendering of `dir` names no namespace but `target`: every `namespace`
/// and `namespaces` value (a rule's `*` aside), the cluster-scoped ClusterRoleBindings' and
/// FlowSchema's subjects included, and the admission policies' parameter, from which they take
/// the operator's identity.
fn names_only(env: &TestEnv, dir: &str, target: &str) {
    let (ok, rendered, err) = kubectl(env.cp, &["kustomize", dir]);
    assert!(ok, "{err}");
    let mut found = Vec::new();
    let mut kinds = Vec::new();
    let mut parameters = Vec::new();
    for doc in documents(&rendered) {
        let kind = doc["kind"].as_str().unwrap().to_string();
        namespaces_in(&doc, &kind, &mut found);
        match kind.as_str() {
            "ValidatingAdmissionPolicyBinding" => parameters.push(doc["spec"]["paramRef"]["name"].clone()),
            "ValidatingAdmissionPolicy" => {
                assert_eq!(doc["spec"]["paramKind"]["kind"], "Namespace", "{dir}: {doc}");
                assert!(doc.to_string().contains("params.metadata.name"), "{dir}: the identity ignores the parameter");
            }
            _ => {}
        }
        kinds.push(kind);
    }
    let elsewhere: Vec<_> = found.iter().filter(|(_, ns)| ns != target && ns != "*").collect();
    assert!(elsewhere.is_empty(), "{dir}: left in another namespace: {elsewhere:?}");
    for place in ["ClusterRoleBinding.subjects.namespace", "FlowSchema.spec.rules.subjects.serviceAccount.namespace"] {
        assert!(found.iter().any(|(at, _)| at == place), "{dir}: {place} not rendered: {found:?}");
    }
    assert!(kinds.iter().any(|k| k == "Namespace"), "{dir}: no Namespace");
    assert_eq!(parameters.len(), 2, "{dir}: the fencing and operator-reach bindings: {parameters:?}");
    assert!(parameters.iter().all(|p| p == target), "{dir}: a policy takes another namespace: {parameters:?}");
}

/// `namespace:` set as users set it, over deploy/, over an overlay, or in the overlay made
/// for it, reaches every place that names the namespace, and the result passes a server
/// dry-run. (tests/deploy/reinstall.rs runs an operator installed this way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_set_with_kustomize_moves_every_reference_to_it() {
    let env = TestEnv::new("deploy-overlay").await;
    let overlay: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo("deploy/overlays/other-namespace/kustomization.yaml")).unwrap(),
    )
    .unwrap();
    let target = overlay["namespace"].as_str().unwrap().to_string();
    names_only(&env, "deploy/overlays/other-namespace/", &target);
    names_only(&env, &namespace_over("deploy/", &target), &target);
    names_only(&env, &namespace_over("deploy/overlays/bucket-labels/", &target), &target);

    let (ok, _, err) = kubectl(env.cp, &["create", "namespace", &target]);
    assert!(ok || err.contains("AlreadyExists"), "{err}");
    for dir in ["deploy/overlays/other-namespace/".to_string(), namespace_over("deploy/", &target)] {
        let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-k", &dir]);
        assert!(ok, "dry-run of {dir} failed: {err}");
        assert!(out.contains("statefulset.apps/traffic-policy-operator created (server dry run)"), "{out}");
    }
}

/// The image's command line, run as the image runs it: its ENTRYPOINT executed directly (the
/// image has no shell) as its USER, with the StatefulSet's arguments and only the environment
/// the pod gives it. A kubeconfig stands in for the mounted service-account token, and the
/// ports are moved to free ones. The binary is the debug build of the same sources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_command_line_starts_a_ready_replica() {
    use std::os::unix::process::CommandExt;
    let env = TestEnv::new("deploy-container").await;
    let identity = env.operator_identity("container", None).await;
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let user = dockerfile.lines().find_map(|l| l.strip_prefix("USER ")).expect("the image names its user");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    let (uid, gid): (u32, u32) = (uid.parse().unwrap(), gid.parse().unwrap());
    assert_ne!(uid, 0, "the image runs as root");

    let statefulset: StatefulSet = common::read_yaml("deploy/base/statefulset.yaml");
    let pod = statefulset.spec.unwrap().template.spec.unwrap();
    let container = &pod.containers[0];
    let (metrics_port, probe_port) = (controlplane::free_port().unwrap(), controlplane::free_port().unwrap());
    let ports = |arg: &String| {
        arg.replace("0.0.0.0:8080", &format!("127.0.0.1:{metrics_port}"))
            .replace("0.0.0.0:8081", &format!("127.0.0.1:{probe_port}"))
    };
    let args: Vec<String> = container.args.iter().flatten().map(ports).collect();
    assert!(args.iter().any(|a| a.contains(&metrics_port.to_string())), "no metrics address in {args:?}");
    assert!(args.iter().any(|a| a.contains(&probe_port.to_string())), "no probe address in {args:?}");
    let mut command = Command::new(env!("CARGO_BIN_EXE_traffic-policy-operator"));
    command.args(&args).env_clear().uid(uid).gid(gid).current_dir("/");
    for var in container.env.iter().flatten() {
        let field = var.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.as_str());
        let value = match field {
            Some("metadata.name") => "traffic-policy-operator-0".to_string(),
            Some("metadata.namespace") => env.namespace.clone(),
            other => var.value.clone().unwrap_or_else(|| panic!("{}: unexpected source {other:?}", var.name)),
        };
        command.env(&var.name, value);
    }
    command.env("KUBECONFIG", &identity.kubeconfig_path);
    let log = env.cp.dir().join("container.log");
    let process =
        std::sync::Mutex::new(controlplane::process::Process::start_command("container", command, &log).unwrap());
    let readyz = eventually("the container's process is ready", || async {
        let mut process = process.lock().unwrap();
        if let Some(status) = process.exited() {
            panic!("{}", process.failure(&format!("exited ({status})")));
        }
        controlplane::http_get_plain(probe_port, "/readyz").ok().filter(|r| r.contains(" 200 "))
    })
    .await;
    let mut process = process.into_inner().unwrap();
    assert!(readyz.contains("ok"));
    let metrics = controlplane::http_get_plain(metrics_port, "/metrics").unwrap();
    assert!(metrics.contains("traffic_policy_lease_held"), "{metrics}");
    // Probes and metrics each on their own port only.
    assert!(controlplane::http_get_plain(probe_port, "/metrics").unwrap().contains(" 404 "));
    assert!(controlplane::http_get_plain(metrics_port, "/readyz").unwrap().contains(" 404 "));
    let status = process.stop(Duration::from_secs(20)).unwrap();
    assert!(status.success(), "exit on SIGTERM: {status}");
}

/// With a certificate and key, /metrics is served over HTTPS only, as a scraper that checks
/// the certificate sees it; a new certificate written over the files is served without a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_be_served_over_https_with_the_certificate_reloaded() {
    let env = TestEnv::new("deploy-metrics-tls").await;
    // First the test control plane's serving certificate for 127.0.0.1, signed by its CA.
    let dir = env.cp.dir().join("metrics-tls");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_path, key_path) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::copy(env.cp.dir().join("apiserver.crt"), &cert_path).unwrap();
    std::fs::copy(env.cp.dir().join("apiserver.key"), &key_path).unwrap();
    let cert = format!("--metrics-tls-cert-file={}", cert_path.display());
    let key = format!("--metrics-tls-key-file={}", key_path.display());
    let operator = env.start_operator(&[&cert, &key]).await;
    let url = format!("https://127.0.0.1:{}/metrics", operator.metrics_port);
    let scrape = |ca: &Path| {
        let out = Command::new("curl")
            .args(["--silent", "--show-error", "--fail", "--cacert"])
            .arg(ca)
            .arg(&url)
            .output()
            .expect("curl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, body, err) = scrape(&env.cp.dir().join("ca.crt"));
    assert!(ok, "{err}");
    assert!(body.contains("traffic_policy_lease_held"), "{body}");
    // Plain HTTP gets no metrics.
    let plain = controlplane::http_get_plain(operator.metrics_port, "/metrics").unwrap_or_default();
    assert!(!plain.contains("traffic_policy_lease_held"), "metrics served over plain HTTP too");

    // A rotation: another certificate, trusted on its own, replaces both files.
    let (new_cert, new_key) = controlplane::self_signed_localhost().unwrap();
    let new_ca = dir.join("new-ca.crt");
    std::fs::write(&new_ca, &new_cert).unwrap();
    assert!(!scrape(&new_ca).0, "the new certificate is trusted before it is served: the check cannot fail");
    std::fs::write(&key_path, new_key).unwrap();
    std::fs::write(&cert_path, &new_cert).unwrap();
    eventually_within(Duration::from_secs(40), "the rotated certificate is served", || async {
        scrape(&new_ca).0.then_some(())
    })
    .await;
    assert!(!scrape(&env.cp.dir().join("ca.crt")).0, "the old certificate is still served");
}

/// Every alert has a description and a runbook in docs/runbooks.md, and the monitoring
/// overlay points every runbook_url at the base URL it names in one place: a copy of the
/// overlay with another URL there moves all of them.
#[test]
fn every_alert_has_a_runbook_whose_url_the_overlay_sets_in_one_place() {
    let overlay = std::fs::read_to_string(repo("deploy/overlays/monitoring/kustomization.yaml")).unwrap();
    let ours = "runbooks=https://github.com/traffic-policy-operator/traffic-policy-operator/blob/main/docs/runbooks.md";
    assert!(overlay.contains(ours), "the overlay names the runbooks' URL in a literal");
    // A copy elsewhere, with its paths made relative to there and another URL.
    let dir = std::env::temp_dir().join(format!("tpo-overlay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let up = "../".repeat(dir.components().count() - 1);
    let deploy = format!("{up}{}/deploy/", REPO.trim_start_matches('/'));
    let copy = overlay.replace("../../", &deploy).replace(ours, "runbooks=https://runbooks.example/ops.md");
    std::fs::write(dir.join("kustomization.yaml"), copy).unwrap();
    let out = Command::new("kubectl").arg("kustomize").arg(&dir).output().expect("kubectl runs");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let rendered = String::from_utf8(out.stdout).unwrap();
    let rule = documents(&rendered)
        .into_iter()
        .find(|doc| doc["kind"] == "PrometheusRule")
        .expect("the overlay renders the PrometheusRule");
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    let rules = rule["spec"]["groups"][0]["rules"].as_array().unwrap();
    assert!(rules.len() >= 14);
    for rule in rules {
        let alert = rule["alert"].as_str().unwrap();
        let annotations = &rule["annotations"];
        assert_eq!(
            annotations["runbook_url"].as_str(),
            Some(format!("https://runbooks.example/ops.md#{}", alert.to_lowercase()).as_str())
        );
        // Templated with the pod, the namespace or the value, except where there is none (absent()).
        let description = annotations["description"].as_str().unwrap_or_default();
        let absent = rule["expr"].as_str().unwrap_or_default().starts_with("absent(");
        assert!(description.contains("{{") || (absent && !description.is_empty()), "{alert}: no templated description");
        assert!(runbooks.contains(&format!("\n## {alert}\n")), "{alert} has no runbook in docs/runbooks.md");
    }
}
