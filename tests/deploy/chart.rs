//! The Helm chart in deploy/helm/: helm's lint, the same objects as the kustomize install for
//! the same settings, and a server-side dry-run.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

use crate::common::TestEnv;
use crate::{REPO, documents, kubectl};

const CHART: &str = "deploy/helm/traffic-policy-operator";

/// Labels Helm adds by convention, and the two the kustomize base adds to its own objects
/// but not to its components': compared by neither side.
const UNCOMPARED_LABELS: [&str; 6] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/name",
    "app.kubernetes.io/part-of",
];

/// Kinds without a namespace, which kustomize's `namespace:` sets anyway on the kinds it does
/// not know (the API server ignores it).
const CLUSTER_SCOPED: [&str; 9] = [
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "FlowSchema",
];

pub fn helm(kubeconfig: Option<&std::path::Path>, args: &[&str]) -> (bool, String, String) {
    let helm = controlplane::tools::helm().unwrap_or_else(|e| panic!("{e:#}"));
    let mut command = Command::new(helm);
    command.args(args).current_dir(REPO);
    if let Some(kubeconfig) = kubeconfig {
        command.env("KUBECONFIG", kubeconfig);
    }
    let out = command.output().expect("helm runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Numbers as floats (the CRD says `1.0` where kustomize prints `1`) and runs of whitespace
/// as one space (kustomize refolds multi-line CEL expressions).
fn normalized(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), normalized(v))).collect()),
        Value::Array(list) => Value::Array(list.iter().map(normalized).collect()),
        Value::Number(n) => n.as_f64().map(Value::from).unwrap_or_else(|| value.clone()),
        Value::String(s) => Value::String(s.split_whitespace().collect::<Vec<_>>().join(" ")),
        other => other.clone(),
    }
}

/// The objects of a rendering by kind, namespace and name, normalized for comparison.
fn objects(yaml: &str) -> BTreeMap<String, Value> {
    let mut objects = BTreeMap::new();
    for mut object in documents(yaml) {
        let kind = object["kind"].as_str().unwrap().to_string();
        let meta = object["metadata"].as_object_mut().unwrap();
        if CLUSTER_SCOPED.contains(&kind.as_str()) {
            meta.remove("namespace");
        }
        if let Some(labels) = meta.get_mut("labels").and_then(Value::as_object_mut) {
            labels.retain(|key, _| !UNCOMPARED_LABELS.contains(&key.as_str()));
            if labels.is_empty() {
                meta.remove("labels");
            }
        }
        let namespace = meta.get("namespace").and_then(Value::as_str).unwrap_or("");
        let key = format!("{kind} {namespace}/{}", meta["name"].as_str().unwrap());
        assert!(objects.insert(key.clone(), normalized(&object)).is_none(), "{key} rendered twice");
    }
    objects
}

fn render(kustomizations: &[&str], release_namespace: &str, values: &[&str]) -> (String, String) {
    let mut kustomized = String::new();
    for dir in kustomizations {
        let out = Command::new("kubectl").args(["kustomize", dir]).current_dir(REPO).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        kustomized += &format!("---\n{}", String::from_utf8(out.stdout).unwrap());
    }
    let mut args = vec!["template", "tpo", CHART, "--namespace", release_namespace, "--include-crds"];
    args.extend(["--set", "createNamespace=true"]);
    values.iter().for_each(|v| args.extend(["--set", v]));
    let (ok, rendered, err) = helm(None, &args);
    assert!(ok, "helm template {values:?}: {err}");
    (kustomized, rendered)
}

#[test]
fn the_chart_lints_clean() {
    let (ok, out, err) = helm(None, &["lint", "--strict", CHART]);
    assert!(ok, "helm lint --strict failed:\n{out}{err}");
    assert!(out.contains("1 chart(s) linted, 0 chart(s) failed"), "{out}");
}

/// For each kustomize install, the chart with the matching values renders the same objects.
#[test]
fn the_chart_renders_what_kustomize_renders_for_the_same_settings() {
    let cases: [(&str, &str, &[&str]); 4] = [
        ("deploy/", "traffic-policy-operator", &[]),
        ("deploy/overlays/bucket-labels/", "traffic-policy-operator", &["bucketLabels.enabled=true"]),
        (
            "deploy/overlays/monitoring/",
            "traffic-policy-operator",
            &[
                "monitoring.enabled=true",
                "metricsNetworkPolicy.enabled=true",
                "monitoring.labels.release=kube-prometheus-stack",
            ],
        ),
        ("deploy/overlays/other-namespace/", "platform-traffic", &[]),
    ];
    for (kustomization, namespace, values) in cases {
        let (kustomized, rendered) = render(&["deploy/crd/", kustomization], namespace, values);
        let (kustomized, rendered) = (objects(&kustomized), objects(&rendered));
        let only = |a: &BTreeMap<String, Value>, b: &BTreeMap<String, Value>| {
            a.keys().filter(|k| !b.contains_key(*k)).cloned().collect::<Vec<_>>()
        };
        assert!(
            kustomized.keys().eq(rendered.keys()),
            "{kustomization} vs the chart with {values:?}: only in kustomize {:?}, only in the chart {:?}",
            only(&kustomized, &rendered),
            only(&rendered, &kustomized)
        );
        for (key, object) in &kustomized {
            assert!(
                rendered[key] == *object,
                "{kustomization} vs the chart with {values:?}: {key} differs\nkustomize: {object}\nchart:     {}",
                rendered[key]
            );
        }
        assert!(kustomized.len() >= 16, "{kustomization}: only {} objects", kustomized.len());
    }
    // The metrics-auth component has no overlay: one is written for the comparison.
    let overlay = std::path::Path::new(REPO).join("target/tmp/metrics-auth-install");
    std::fs::create_dir_all(&overlay).unwrap();
    let kustomization = "namespace: traffic-policy-operator\nresources: [../../../deploy/base]\ncomponents:\n  \
        - ../../../deploy/components/fencing\n  - ../../../deploy/components/operator-reach\n  \
        - ../../../deploy/components/metrics-auth\n  - ../../../deploy/components/admission-required\n";
    std::fs::write(overlay.join("kustomization.yaml"), kustomization).unwrap();
    let (kustomized, rendered) = render(
        &["deploy/crd/", "target/tmp/metrics-auth-install/"],
        "traffic-policy-operator",
        &["metricsAuth.enabled=true"],
    );
    assert_eq!(objects(&kustomized), objects(&rendered), "the metrics-auth component and metricsAuth.enabled differ");
    assert!(rendered.contains("- --metrics-auth=kubernetes"), "{rendered}");

    // Settings without a kustomize counterpart reach the StatefulSet.
    let (_, rendered) = render(&["deploy/"], "ops", &["replicas=5", "image.tag=9.9.9", "priorityClassName=critical"]);
    let statefulset = objects(&rendered).remove("StatefulSet ops/traffic-policy-operator").unwrap();
    assert_eq!(statefulset["spec"]["replicas"], 5.0);
    assert_eq!(statefulset["spec"]["template"]["spec"]["priorityClassName"], "critical");
    assert_eq!(statefulset["spec"]["template"]["spec"]["containers"][0]["image"], "traffic-policy-operator:9.9.9");
}

/// The chart's objects, every option on, as the API server would create them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_passes_a_server_side_dry_run() {
    let env = TestEnv::new("deploy-helm-dry-run").await;
    let every_option = ["--set", "bucketLabels.enabled=true", "--set", "metricsAuth.enabled=true"];
    let mut args = vec!["template", "tpo", CHART, "--namespace", &env.namespace];
    args.extend(every_option);
    let (ok, rendered, err) = helm(None, &args);
    assert!(ok, "{err}");
    let path = env.cp.dir().join("chart.yaml");
    std::fs::write(&path, &rendered).unwrap();
    let (ok, out, err) = kubectl(env.cp, &["apply", "--dry-run=server", "-f", path.to_str().unwrap()]);
    assert!(ok, "dry-run of the chart failed: {err}");
    for object in [
        "statefulset.apps/traffic-policy-operator",
        "validatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-fencing",
        "validatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-operator-reach",
        "mutatingadmissionpolicy.admissionregistration.k8s.io/trafficpolicy.dev-bucket-label",
        "clusterrole.rbac.authorization.k8s.io/traffic-policy-operator-view",
        "clusterrole.rbac.authorization.k8s.io/traffic-policy-operator-metrics-reader",
    ] {
        assert!(out.contains(object), "the chart does not install {object}: {out}");
    }
    assert!(!err.contains("PodSecurity") && !err.contains("unknown field"), "warnings: {err}");
}
