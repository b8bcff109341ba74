//! What Prometheus sees: each metric read from `/metrics` after causing what it counts.

use controlplane::Grant;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, Cidr, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, eventually};

/// Whether this API server refuses the NetworkPolicy of a valid policy with a CIDR with host
/// bits, the refusal these tests cause (v1.32 takes it).
fn refuses_host_bit_cidrs(env: &TestEnv) -> bool {
    env.cp.release().refuses_cidr_host_bits()
}

/// Policy `fine`, Ready, and, where the server refuses it, policy `refused`, whose
/// NetworkPolicy the API server refuses.
async fn fine_and_refused(env: &TestEnv) {
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("fine", 80)).await.unwrap();
    let refusal = refuses_host_bit_cidrs(env);
    if refusal {
        let mut refused = policy("refused", 81);
        // A CIDR with host bits set passes the CRD; NetworkPolicy validation refuses it.
        refused.spec.ingress_rules[0].from[0].ip_block.cidr = Cidr("10.0.0.1/8".into());
        refused.spec.ingress_rules[0].from[0].ip_block.except.clear();
        policies.create(&PostParams::default(), &refused).await.unwrap();
    }
    env.wait_ready("fine", ConditionStatus::True).await;
    if refusal {
        env.wait_ready("refused", ConditionStatus::False).await;
    }
}

/// API requests, process metrics, both queue lanes, terminal errors and policies by Ready
/// status and reason, after one policy that applies and one the API server refuses (where it
/// refuses one: the refusal's counts are checked there only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_work_shows_in_metrics() {
    let env = TestEnv::new("e2e-metrics").await;
    let operator = env.start_operator(&[]).await;
    fine_and_refused(&env).await;
    let refusal = refuses_host_bit_cidrs(&env);

    let m = |name: &str, label: Option<&str>| operator.metric(name, label);
    assert!(m("rest_client_requests_total", Some("method=\"PATCH\",code=\"200\"")) >= 2.0, "child applies counted");
    if refusal {
        assert!(m("rest_client_requests_total", Some("code=\"422\"")) >= 1.0, "the refused apply counted by its code");
    }
    assert!(m("rest_client_request_duration_seconds_count", Some("verb=\"GET\"")) >= 1.0);
    let version = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert_eq!(m("traffic_policy_operator_build_info", Some(&version)), 1.0, "build_info carries the version");
    // The shared control plane applies Priority and Fairness: no client-side limit, no waits.
    assert_eq!(m("rest_client_rate_limiter_duration_seconds_count", None), 0.0);
    assert!(m("process_resident_memory_bytes", None) > 1e6);
    assert!(m("process_open_fds", None) >= 3.0);
    assert!(m("process_start_time_seconds", None) > 1.6e9);
    assert!(operator.get("/metrics").unwrap().contains("process_cpu_seconds_total"));
    let text = operator.get("/metrics").unwrap();
    for lane in ["high", "low"] {
        assert!(text.contains(&format!("priority=\"{lane}\"")), "no workqueue_depth series for the {lane} lane");
    }
    if refusal {
        // Counted as the reconcile returns, just after it wrote the status.
        eventually("the refusal is counted as a terminal error", || async {
            (m("controller_runtime_terminal_reconcile_errors_total", None) >= 1.0).then_some(())
        })
        .await;
    }
    // Reported every 10 s from the cache.
    eventually("policies are counted by Ready status and reason", || async {
        let applied = m("traffic_policy_policies", Some("ready=\"True\",reason=\"Applied\""));
        let invalid = m("traffic_policy_policies", Some("ready=\"False\",reason=\"InvalidSpec\""));
        (applied == 1.0 && invalid == if refusal { 1.0 } else { 0.0 }).then_some(())
    })
    .await;
}

/// Watch errors by resource, labelling errors, unlabelled policies and 403s, from a replica
/// whose role lacks the ConfigMap watch and the policy patch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_prometheus_could_not_see_before_show_in_metrics() {
    let env = TestEnv::new("e2e-metrics-failing").await;
    let limited = env
        .limited_cluster_role("e2e-operator-without-configmap-watch-or-policy-patch", |rule| {
            let resources = rule.resources.clone().unwrap_or_default();
            if resources.contains(&"configmaps".to_string()) {
                rule.verbs.retain(|v| v != "list" && v != "watch");
            }
            if resources.contains(&"applicationtrafficpolicies".to_string()) {
                rule.verbs.retain(|v| v != "patch");
            }
        })
        .await;
    let identity = env.operator_identity("limited", Some(vec![Grant::ClusterRole(limited)])).await;
    // It watches a namespace of its own, where only its (limited) ClusterRole applies: the
    // Role of its operator namespace grants ConfigMaps there.
    let watched = format!("{}-watched", env.namespace);
    let namespace: Namespace = serde_json::from_value(serde_json::json!({ "metadata": { "name": watched } })).unwrap();
    Api::<Namespace>::all(env.client.clone()).create(&PostParams::default(), &namespace).await.unwrap();
    // Labelling is label mode's: asked for, whatever the server offers.
    let args = vec![
        format!("--watch-namespace={watched}"),
        format!("--namespace={}", env.namespace),
        "--shard-mode=labels".to_string(),
    ];
    // Never Ready (its ConfigMap watch cannot list), so not waited for.
    let operator = Operator::spawn(env.cp, &identity.kubeconfig_path, "limited", &args);
    Api::<ApplicationTrafficPolicy>::namespaced(env.client.clone(), &watched)
        .create(&PostParams::default(), &policy("unlabelled", 80))
        .await
        .unwrap();
    eventually("watch and labelling errors are counted", || async {
        let text = operator.get("/metrics").ok()?;
        let value = |series: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(series))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        (value("traffic_policy_watch_errors_total{resource=\"ConfigMap\"}") >= 1.0
            && value("traffic_policy_bucket_label_errors_total") >= 1.0
            && value("traffic_policy_unlabelled_policies") >= 1.0
            && text.lines().any(|l| l.starts_with("rest_client_requests_total") && l.contains("code=\"403\"")))
        .then_some(())
    })
    .await;
    assert_eq!(operator.metric("traffic_policy_watch_errors_total", Some("resource=\"NetworkPolicy\"")), 0.0);
    let readyz = operator.get("/readyz").unwrap();
    assert!(readyz.contains("waiting for") && readyz.contains("ConfigMap"), "{readyz}");
    // Failed labellings are retried with backoff, not in a hot loop.
    let errors = operator.metric("traffic_policy_bucket_label_errors_total", None);
    assert!(errors < 30.0, "{errors} labelling errors for one policy: retried in a hot loop");
    let _ = Api::<Namespace>::all(env.client.clone()).delete(&watched, &Default::default()).await;
}

/// With `--metrics-auth=kubernetes`, `/metrics` answers only a bearer token whose user may
/// `get` it: 401 without a token or with a bad one, 403 for a user without the grant, the
/// metrics for one bound to deploy/'s metrics-reader role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_only_authorized_scrapers() {
    let env = TestEnv::new("e2e-metrics-auth").await;
    let component =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/components/metrics-auth/metrics-auth.yaml");
    let roles: Vec<_> = controlplane::manifests::read(&component)
        .unwrap()
        .into_iter()
        .filter(|o| o.types.as_ref().is_some_and(|t| t.kind == "ClusterRole"))
        .collect();
    controlplane::manifests::apply(&env.client, &roles, "e2e-tests").await.unwrap();
    let mut grants: Vec<Grant> = ["traffic-policy-operator", "traffic-policy-operator-metrics-auth"]
        .map(|role| Grant::ClusterRole(role.into()))
        .to_vec();
    grants.push(Grant::ClusterRole("traffic-policy-operator-namespace-labels".into()));
    let identity = env.operator_identity("operator", Some(grants)).await;
    let operator = crate::support::Operator::start(&env, &identity, &["--metrics-auth=kubernetes"]).await;
    let reader = env
        .cp
        .identity(&env.namespace, "scraper", &[Grant::ClusterRole("traffic-policy-operator-metrics-reader".into())])
        .await
        .unwrap();
    let stranger = env.cp.identity(&env.namespace, "stranger", &[]).await.unwrap();
    let scrape = |token: Option<&str>| {
        let mut curl = std::process::Command::new("curl");
        curl.args(["--silent", "--output", "-", "--write-out", "\n%{http_code}"]);
        if let Some(token) = token {
            curl.args(["--header", &format!("Authorization: Bearer {token}")]);
        }
        let out = curl.arg(format!("http://127.0.0.1:{}/metrics", operator.metrics_port)).output().expect("curl runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap();
        (code.to_string(), body.to_string())
    };
    assert_eq!(scrape(None).0, "401", "no token");
    assert_eq!(scrape(Some("not-a-token")).0, "401", "a token the API server does not know");
    assert_eq!(scrape(Some(&stranger.token)).0, "403", "a user without get on /metrics");
    let (code, body) = scrape(Some(&reader.token));
    assert_eq!(code, "200", "{body}");
    assert!(body.contains("traffic_policy_lease_held"), "{body}");
    // The verdicts are cached: scraping again costs no TokenReview or SubjectAccessReview
    // (the POSTs the operator counts, read from what the reader scrapes).
    let posts = |body: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with("rest_client_requests_total{") && l.contains("method=\"POST\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let before = posts(&scrape(Some(&reader.token)).1);
    assert!(before >= 4.0, "the two reviews of each token were not counted: {before}");
    assert_eq!(scrape(Some(&stranger.token)).0, "403");
    let after = posts(&scrape(Some(&reader.token)).1);
    assert_eq!(after, before, "a cached verdict was reviewed again");
}

/// deploy/kube-state-metrics/'s CustomResourceState config, read by a real kube-state-metrics
/// against the API server: one series per policy and condition, 1 for True and 0 for False,
/// so that Prometheus can say which policy fails and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_state_metrics_names_the_failing_policy() {
    let env = TestEnv::new("e2e-ksm").await;
    if !refuses_host_bit_cidrs(&env) {
        println!("skipped: this kube-apiserver takes a CIDR with host bits, so no policy here fails");
        return;
    }
    let _operator = env.start_operator(&[]).await;
    fine_and_refused(&env).await;

    let binary = controlplane::tools::kube_state_metrics().unwrap_or_else(|e| panic!("{e:#}"));
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kube-state-metrics/custom-resource-state.yaml");
    let (port, telemetry) = (controlplane::free_port().unwrap(), controlplane::free_port().unwrap());
    let args = [
        format!("--kubeconfig={}", env.cp.kubeconfig_path().display()),
        format!("--custom-resource-state-config-file={}", config.display()),
        "--custom-resource-state-only=true".into(),
        format!("--namespaces={}", env.namespace),
        "--host=127.0.0.1".into(),
        format!("--port={port}"),
        "--telemetry-host=127.0.0.1".into(),
        format!("--telemetry-port={telemetry}"),
    ];
    let log = env.cp.dir().join("kube-state-metrics.log");
    let _ksm = controlplane::process::Process::start("kube-state-metrics", &binary, &args, &log).unwrap();
    let series = |text: &str, name: &str| -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with("kube_applicationtrafficpolicy_status_condition{"))
            .find(|l| l.contains(&format!("name=\"{name}\"")) && l.contains("type=\"Ready\""))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let text = eventually("kube-state-metrics reports both policies", || async {
        let text = controlplane::http_get_plain(port, "/metrics").ok()?;
        (series(&text, "fine").is_some() && series(&text, "refused").is_some()).then_some(text)
    })
    .await;
    assert_eq!(series(&text, "fine"), Some(1.0), "{text}");
    assert_eq!(series(&text, "refused"), Some(0.0), "{text}");
    let line = text.lines().find(|l| l.contains("name=\"refused\"") && l.contains("type=\"Ready\"")).unwrap();
    assert!(line.contains(&format!("namespace=\"{}\"", env.namespace)) && line.contains("reason=\""), "{line}");
}
