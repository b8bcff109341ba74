//! The queue-depth alert, live: a real Prometheus scrapes two operator replicas on the real
//! control plane and evaluates deploy/'s alert rules. The rule is the shipped one with its
//! threshold and `for` shortened to fit a test. Two cases: a restart's backlog (the initial
//! list, in the low lane) must page no one; a burst of edits (the high lane) must. Then
//! every expression of the Grafana dashboard is run against the same Prometheus.

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{Operator, TestEnv};

use controlplane::process::Process;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::coordination::BUCKET_LABEL;
use traffic_policy_operator::sharding::bucket::{bucket_of, label_value};

const ALERT: &str = "TrafficPolicyWorkQueueDepthHigh";
/// The same rule on the low lane: it shows that the backlog was deep enough to fire the
/// alert, had the alert looked at it.
const PROBE: &str = "BacklogProbe";
/// 500 a replica: the queue stays above the test threshold (100) for many times the alert's `for`.
const POLICIES: usize = 1000;
const NAMESPACES: usize = 20;

/// The shipped rules, with the queue-depth alert's threshold and duration shortened, plus
/// the probe.
fn test_rules() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yaml");
    let mut rules: serde_json::Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let list = rules["groups"][0]["rules"].as_array_mut().unwrap();
    let rule = list.iter_mut().find(|r| r["alert"].as_str() == Some(ALERT)).expect("the queue-depth alert is shipped");
    let expr = rule["expr"].as_str().unwrap().to_string();
    assert!(expr.ends_with("> 500") && expr.contains("priority=\"high\""), "{expr}");
    rule["expr"] = expr.replace("> 500", "> 100").into();
    rule["for"] = "5s".into();
    let mut probe = rule.clone();
    probe["alert"] = PROBE.into();
    probe["expr"] = expr.replace("> 500", "> 100").replace("priority=\"high\"", "priority=\"low\"").into();
    list.push(probe);
    serde_saphyr::to_string(&rules).unwrap()
}

fn policy_name(i: usize) -> (String, String) {
    (format!("backlog-{}", i % NAMESPACES), format!("app-{i}"))
}

/// The most advanced state of `alert` over its per-replica instances.
fn alert_state(prometheus_port: u16, alert: &str) -> Option<String> {
    let response = controlplane::http_get_plain(prometheus_port, "/api/v1/alerts").ok()?;
    let body = response.split_once("\r\n\r\n")?.1;
    let alerts: serde_json::Value = serde_json::from_str(body).ok()?;
    let states: Vec<String> = alerts["data"]["alerts"]
        .as_array()?
        .iter()
        .filter(|a| a["labels"]["alertname"] == alert)
        .filter_map(|a| a["state"].as_str().map(str::to_string))
        .collect();
    Some(if states.iter().any(|s| s == "firing") {
        "firing".into()
    } else if states.iter().any(|s| s == "pending") {
        "pending".into()
    } else {
        "inactive".into()
    })
}

/// Polls both alerts until `done` says so from their state histories (each starts
/// `inactive`, and records each change).
async fn watch_alerts(
    port: u16,
    phase: &str,
    done: impl Fn(&[String], &[String]) -> bool,
) -> (Vec<String>, Vec<String>) {
    let started = Instant::now();
    let (mut alert, mut probe) = (vec!["inactive".to_string()], vec!["inactive".to_string()]);
    loop {
        for (name, history) in [(ALERT, &mut alert), (PROBE, &mut probe)] {
            if let Some(state) = alert_state(port, name)
                && history.last() != Some(&state)
            {
                println!("{phase} {:6.1} s  {name}: {state}", started.elapsed().as_secs_f64());
                history.push(state);
            }
        }
        if done(&alert, &probe) {
            return (alert, probe);
        }
        assert!(started.elapsed() < Duration::from_secs(240), "{phase}: {ALERT} {alert:?}, {PROBE} {probe:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_depth_alert_fires_on_edits_and_not_on_a_restart_backlog() {
    let env = TestEnv::new("tpo-alerts").await;
    let identity = env.operator_identity("operator", None).await;

    // Policies that are already labelled and wait for replicas that (re)start: a restart.
    for n in 0..NAMESPACES {
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(format!("backlog-{n}")), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(env.client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    }
    let create = futures::future::join_all((0..POLICIES).map(|i| {
        let client = env.client.clone();
        async move {
            let (namespace, name) = policy_name(i);
            let api = Api::<ApplicationTrafficPolicy>::namespaced(client, &namespace);
            let policy: ApplicationTrafficPolicy = serde_json::from_value(json!({
                "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
                "metadata": { "name": name, "labels": { BUCKET_LABEL: label_value(bucket_of(&namespace)) } },
                "spec": { "applicationSelector": { "matchLabels": { "app": format!("app-{i}") } } }
            }))
            .unwrap();
            api.create(&PostParams::default(), &policy).await.map(|_| ())
        }
    }));
    for result in create.await {
        result.unwrap();
    }

    let dir = env.cp.dir().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), test_rules()).unwrap();
    // Few workers, so the queue fills faster than it drains. The ports are known before the
    // replicas start, so Prometheus watches from the first moment.
    let ports: Vec<(u16, u16)> =
        (0..2).map(|_| (controlplane::free_port().unwrap(), controlplane::free_port().unwrap())).collect();
    // The job name the rules select, and the labels a ServiceMonitor's scrape would attach.
    let targets: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (metrics, _))| {
            format!(
                "{{ targets: ['127.0.0.1:{metrics}'], labels: {{ namespace: '{}', pod: 'alerts-{i}' }} }}",
                env.namespace
            )
        })
        .collect();
    let config = format!(
        "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nrule_files: [rules.yaml]\n\
         scrape_configs:\n  - job_name: traffic-policy-operator-metrics\n    static_configs: [{}]\n",
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

    let mut replicas = Vec::new();
    for (i, (metrics, probes)) in ports.iter().enumerate() {
        let args = vec![
            format!("--namespace={}", env.namespace),
            "--workers=1".to_string(),
            format!("--metrics-addr=127.0.0.1:{metrics}"),
            format!("--health-probe-addr=127.0.0.1:{probes}"),
        ];
        replicas.push(Operator::launch(env.cp, &identity, &format!("alerts-{i}"), &args).await);
    }

    // 1. The restart's backlog: deep enough to fire the probe, yet the alert stays quiet
    //    until the backlog has drained.
    let (alert, probe) =
        watch_alerts(port, "backlog", |_, probe| probe.ends_with(&["firing".into(), "inactive".into()])).await;
    assert_eq!(alert, ["inactive"], "the queue-depth alert paged on a restart's backlog");
    assert!(probe.contains(&"firing".to_string()));
    let replicas = &replicas;
    let lane = |priority: &'static str| {
        replicas.iter().map(|r| r.metric("workqueue_depth", Some(&format!("priority=\"{priority}\"")))).sum::<f64>()
    };
    common::eventually("the backlog drains completely", || async move { (lane("low") == 0.0).then_some(()) }).await;

    // 2. A burst of edits: each is a change someone waits for, in the high lane. 64 in flight:
    //    1,000 at once from the admin identity, which API priority and fairness exempts, can
    //    hold the replicas' Lease renewals past their deadline and move their slices mid-burst.
    let edits = futures::stream::iter((0..POLICIES).map(|i| {
        let client = env.client.clone();
        async move {
            let (namespace, name) = policy_name(i);
            let patch = json!({ "spec": { "rateLimit": { "requestsPerSecond": 1000 + i } } });
            let api = Api::<ApplicationTrafficPolicy>::namespaced(client, &namespace);
            // A merge patch of one value can be sent again: a burst of requests on reused
            // connections sometimes meets one the server closed (hyper's IncompleteMessage),
            // which says nothing of the patch.
            let mut attempts = 0;
            loop {
                attempts += 1;
                match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Ok(_) => return Ok(()),
                    Err(error @ kube::Error::Api(_)) => return Err(error),
                    Err(error) if attempts == 3 => return Err(error),
                    Err(_) => {}
                }
            }
        }
    }));
    let edits: Vec<Result<(), kube::Error>> = edits.buffer_unordered(64).collect().await;
    for result in edits {
        result.unwrap();
    }
    // Fired, then resolved. Prometheus only fires after 5 s pending, but polls slowed by the
    // burst (or a query that failed meanwhile) can miss that stage, so the history need not show it.
    let fired_and_resolved =
        |alert: &[String]| alert.iter().any(|s| s == "firing") && alert.last().is_some_and(|s| s == "inactive");
    let (alert, _) = watch_alerts(port, "edits", |alert, _| fired_and_resolved(alert)).await;
    assert!(fired_and_resolved(&alert), "{alert:?}");
    common::eventually("the edits drain completely", || async move { (lane("high") == 0.0).then_some(()) }).await;

    // 3. The dashboard, against the same Prometheus: every expression parses and has data.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/traffic-policy-operator.json"))
            .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            // Grafana's variables, as it would fill them in.
            let query = expr.replace("$namespace", &env.namespace).replace("$__rate_interval", "5m");
            let response =
                controlplane::http_get_plain(port, &format!("/api/v1/query?query={}", percent_encode(&query))).unwrap();
            let body: serde_json::Value = serde_json::from_str(response.split_once("\r\n\r\n").unwrap().1).unwrap();
            assert_eq!(body["status"], "success", "{}: {expr}: {body}", panel["title"]);
            let series = body["data"]["result"].as_array().map_or(0, Vec::len);
            assert!(series > 0, "{}: no data for {expr}", panel["title"]);
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} dashboard expressions");
}

/// Percent-encoding for a URL query value (RFC 3986 unreserved characters pass).
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn which(program: &str) -> std::path::PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(program)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("{program} is not on PATH (Debian package prometheus)"))
}
