//! The queue-depth alert, live: a real Prometheus scrapes two operator replicas on the real
//! control plane and evaluates deploy/'s alert rules while the replicas work off a backlog.
//! The rule is the shipped one with its threshold and `for` shortened to fit a test.

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{Operator, TestEnv};

use controlplane::process::Process;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;

const ALERT: &str = "TrafficPolicyWorkQueueDepthHigh";

/// The shipped rules, with the queue-depth alert's threshold and duration shortened.
fn test_rules() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yaml");
    let mut rules: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rule = rules["groups"][0]["rules"]
        .as_sequence_mut()
        .unwrap()
        .iter_mut()
        .find(|r| r["alert"].as_str() == Some(ALERT))
        .expect("the queue-depth alert is shipped");
    let expr = rule["expr"].as_str().unwrap().to_string();
    assert!(expr.ends_with("> 500"), "{expr}");
    rule["expr"] = expr.replace("> 500", "> 100").into();
    rule["for"] = "5s".into();
    serde_yaml::to_string(&rules).unwrap()
}

fn alert_state(prometheus_port: u16) -> Option<String> {
    let response = controlplane::http_get_plain(prometheus_port, "/api/v1/alerts").ok()?;
    let body = response.split_once("\r\n\r\n")?.1;
    let alerts: serde_json::Value = serde_json::from_str(body).ok()?;
    let states: Vec<String> = alerts["data"]["alerts"]
        .as_array()?
        .iter()
        .filter(|a| a["labels"]["alertname"] == ALERT)
        .filter_map(|a| a["state"].as_str().map(str::to_string))
        .collect();
    // Per-replica alerts: report the most advanced state.
    Some(if states.iter().any(|s| s == "firing") {
        "firing".into()
    } else if states.iter().any(|s| s == "pending") {
        "pending".into()
    } else {
        "inactive".into()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depth_alert_fires_on_a_backlog_and_resolves_when_it_drains() {
    let env = TestEnv::new("tpo-alerts").await;
    let identity = env.operator_identity("operator", None).await;

    // The backlog: 2,000 policies waiting before the replicas start.
    for n in 0..20 {
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(format!("backlog-{n}")), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(env.client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    }
    let create = futures::future::join_all((0..2000).map(|i| {
        let client = env.client.clone();
        async move {
            let api = Api::<ApplicationTrafficPolicy>::namespaced(client, &format!("backlog-{}", i % 20));
            let policy: ApplicationTrafficPolicy = serde_json::from_value(json!({
                "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
                "metadata": { "name": format!("app-{i}") },
                "spec": { "applicationSelector": { "matchLabels": { "app": format!("app-{i}") } } }
            }))
            .unwrap();
            api.create(&PostParams::default(), &policy).await.map(|_| ())
        }
    }));
    for result in create.await {
        result.unwrap();
    }

    // Few workers, so the queue fills faster than it drains.
    let args = vec![format!("--namespace={}", env.namespace), "--workers=1".to_string()];
    let mut replicas = Vec::new();
    for name in ["alerts-0", "alerts-1"] {
        replicas.push(Operator::launch(env.cp, &identity, name, &args).await);
    }

    let dir = env.cp.dir().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), test_rules()).unwrap();
    let targets: Vec<String> = replicas.iter().map(|r| format!("'127.0.0.1:{}'", r.admin_port)).collect();
    let config = format!(
        "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nrule_files: [rules.yaml]\n\
         scrape_configs:\n  - job_name: traffic-policy-operator\n    static_configs: [{{ targets: [{}] }}]\n",
        targets.join(", ")
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let port = controlplane::free_port().unwrap();
    let args = [
        format!("--config.file={}", dir.join("prometheus.yml").display()),
        format!("--storage.tsdb.path={}", dir.join("data").display()),
        format!("--web.listen-address=127.0.0.1:{port}"),
        "--log.level=warn".to_string(),
    ];
    let binary = which("prometheus");
    let _prometheus = Process::start("prometheus", &binary, &args, &dir.join("prometheus.log")).unwrap();

    // Watch the alert's state until it has gone pending, firing, and away again.
    let started = Instant::now();
    let mut transitions: Vec<(f64, String)> = Vec::new();
    loop {
        if let Some(state) = alert_state(port)
            && transitions.last().is_none_or(|(_, last)| *last != state)
        {
            println!("{:6.1} s  {ALERT}: {state}", started.elapsed().as_secs_f64());
            transitions.push((started.elapsed().as_secs_f64(), state));
        }
        let states: Vec<&str> = transitions.iter().map(|(_, s)| s.as_str()).collect();
        if states.ends_with(&["pending", "firing", "inactive"]) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(240), "alert states so far: {transitions:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let replicas = &replicas;
    common::eventually("the backlog drains completely", || async move {
        (replicas.iter().map(|r| r.metric("workqueue_depth", None)).sum::<f64>() == 0.0).then_some(())
    })
    .await;
}

fn which(program: &str) -> std::path::PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(program)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("{program} is not on PATH (Debian package prometheus)"))
}
