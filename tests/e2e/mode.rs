//! The sharding mode: the API server's shard selector where it honours one, bucket labels
//! otherwise. The shared control plane serves shard selectors unless
//! `TPO_TEST_SHARDED_LIST_AND_WATCH=off`; CI runs the suites both ways.

use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::PostParams;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::coordination::BUCKET_LABEL;
use traffic_policy_operator::sharding::bucket::Mode;

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, expected_mode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sharding_mode_follows_what_the_api_server_offers() {
    let env = TestEnv::new("e2e-mode").await;
    let mode = expected_mode();
    let operator = env.start_operator(&[]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    policies.create(&PostParams::default(), &policy("web", 80)).await.unwrap();
    env.wait_ready("web", ConditionStatus::True).await;

    // The metric, the children, the policy and `shards` all say which mode is in use.
    let series = format!("mode=\"{}\"", mode.as_str());
    assert_eq!(operator.metric("traffic_policy_shard_mode", Some(&series)), 1.0, "mode {}", mode.as_str());
    let labelled = mode == Mode::Labels;
    let web = policies.get("web").await.unwrap();
    assert_eq!(web.labels().contains_key(BUCKET_LABEL), labelled, "policy labels: {:?}", web.labels());
    let child = env.api::<ConfigMap>().get("web").await.unwrap();
    assert_eq!(child.labels().contains_key(BUCKET_LABEL), labelled, "child labels: {:?}", child.labels());
    let shards = Command::new(env!("CARGO_BIN_EXE_traffic-policy-operator"))
        .args(["shards", "--namespace", &env.namespace, "--kubeconfig"])
        .arg(env.cp.kubeconfig_path())
        .output()
        .unwrap();
    let shards = String::from_utf8_lossy(&shards.stdout);
    assert!(shards.contains(&format!("sharding mode {}", mode.as_str())), "{shards}");
    // The one replica leads and works: nothing says it is kept from buckets.
    assert!(!shards.contains("gets no buckets"), "{shards}");
}

/// `--shard-mode=shard-selector` on a server without the feature gate is a clear start-up
/// error, not a replica that silently watches everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_the_shard_selector_fails_clearly_where_the_server_lacks_it() {
    let env = TestEnv::new("e2e-mode-forced").await;
    let identity = env.operator_identity("forced", None).await;
    let args = vec![
        format!("--watch-namespace={}", env.namespace),
        format!("--namespace={}", env.namespace),
        "--shard-mode=shard-selector".to_string(),
    ];
    let mut operator = Operator::spawn(env.cp, &identity.kubeconfig_path, "forced", &args);
    match expected_mode() {
        Mode::ShardSelector => {
            operator.wait_ready().await;
            assert_eq!(operator.metric("traffic_policy_shard_mode", Some("mode=\"shard-selector\"")), 1.0);
        }
        Mode::Labels => {
            let deadline = Instant::now() + Duration::from_secs(30);
            let status = loop {
                if let Some(status) = operator.process.exited() {
                    break status;
                }
                assert!(Instant::now() < deadline, "the forced replica did not exit");
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert!(!status.success());
            let log = std::fs::read_to_string(&operator.process.log_path).unwrap();
            assert!(log.contains("enable kube-apiserver's ShardedListAndWatch feature gate"), "{log}");
        }
    }
}
