//! The client-side rate limit: it slows the work down, and never the Lease renewals; by
//! default it is on only where the API server does not apply Priority and Fairness.

use std::time::{Duration, Instant};

use controlplane::{Config, ControlPlane};
use kube::api::PostParams;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{Operator, TestEnv, eventually_within};

const RATE_LIMIT: &str = "traffic_policy_client_rate_limit_qps";

/// Four requests a second for the work: before the last of six policies is Ready, at least 18
/// requests go out (two applies and a status write each; the start-up lists and watches and
/// the events come on top), beyond a burst of one, so that takes at least 4.25 s. Meanwhile the
/// replica renews its Lease every half second (four requests a second with the assignment
/// read): if renewals shared the limit, it would lapse. The work is slow on purpose, so the
/// wait is longer than the suites' usual deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_slows_the_work_but_not_the_lease_renewals() {
    let env = TestEnv::new("e2e-throttled").await;
    let operator = env.start_operator(&["--kube-api-qps=4", "--kube-api-burst=1"]).await;
    assert_eq!(exported_limit(&operator), Some(4.0), "a limit given is a limit kept");
    let policies = env.api::<ApplicationTrafficPolicy>();
    let started = Instant::now();
    for i in 0..6 {
        policies.create(&PostParams::default(), &policy(&format!("app-{i}"), 9000 + i)).await.unwrap();
    }
    let mut lapsed = false;
    eventually_within(Duration::from_secs(180), "every policy is Ready", || {
        lapsed |= operator.metric("traffic_policy_lease_held", None) != 1.0 || !operator.is_ready();
        let policies = policies.clone();
        async move {
            let list = policies.list(&Default::default()).await.ok()?;
            let ready = |p: &ApplicationTrafficPolicy| {
                p.status.as_ref().is_some_and(|s| {
                    s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == ConditionStatus::True)
                })
            };
            (list.items.len() == 6 && list.items.iter().all(ready)).then_some(())
        }
    })
    .await;
    let took = started.elapsed();
    assert!(!lapsed, "the replica lost its right to write, or its readiness, while throttled");
    assert!(took.as_secs_f64() >= 4.25, "18 requests at 4 a second took only {took:?}: no rate limit");
    let requests = operator.metric("rest_client_requests_total", None);
    // Every throttled request's wait is observed; the start-up lists and watches alone
    // queue several requests behind a burst of one.
    let waits = operator.metric("rest_client_rate_limiter_duration_seconds_count", None);
    let waited = operator.metric("rest_client_rate_limiter_duration_seconds_sum", None);
    assert!(waits >= 18.0, "only {waits} rate-limiter waits observed for at least 18 requests");
    assert!(waited > 0.5, "requests at 4 a second, burst 1, waited only {waited} s in all");
    println!(
        "six policies at --kube-api-qps=4: Ready after {:.1} s, {requests} API requests in all (Leases included), \
         the Lease held throughout",
        took.as_secs_f64()
    );
}

/// kube-apiserver applies Priority and Fairness by default, so the shared control plane gets
/// no client-side limit from `auto`; a server started without it gets the fallback of 500.
/// Each replica reads it from the server's own responses, before its first watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_limits_the_rate_only_where_the_server_lacks_priority_and_fairness() {
    let env = TestEnv::new("e2e-rate-auto").await;
    let operator = env.start_operator(&[]).await;
    assert_eq!(exported_limit(&operator), Some(0.0), "off where the server applies Priority and Fairness");

    let config = Config {
        apiserver_args: vec!["--enable-priority-and-fairness=false".into()],
        controller_manager: false,
        ..Config::default()
    };
    let cp = tokio::task::spawn_blocking(|| ControlPlane::start(config)).await.unwrap().unwrap();
    // The admin identity needs no RBAC; the replica will not get ready without the CRD, but
    // it decides its rate limit first.
    let args = ["--namespace=default".to_string(), "--watch-namespace=default".to_string()];
    let mut without_fairness = Operator::spawn(&cp, &cp.kubeconfig_path(), "no-fairness", &args);
    let deadline = Instant::now() + Duration::from_secs(60);
    let limit = loop {
        if let Some(limit) = exported_limit(&without_fairness) {
            break limit;
        }
        if let Some(status) = without_fairness.process.exited() {
            panic!("{}", without_fairness.process.failure(&format!("exited ({status})")));
        }
        assert!(Instant::now() < deadline, "{}", without_fairness.process.failure("no rate limit exported in time"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(limit, 500.0, "the fallback where the server lacks Priority and Fairness");
}

/// The exported limit, if the replica's /metrics has the gauge (a sum would read a missing
/// gauge as 0, which here means "off").
fn exported_limit(operator: &Operator) -> Option<f64> {
    let text = operator.get("/metrics").ok()?;
    let line = text.lines().find(|l| l.split(' ').next() == Some(RATE_LIMIT))?;
    line.rsplit(' ').next()?.parse().ok()
}
