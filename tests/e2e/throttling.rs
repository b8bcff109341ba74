//! The client-side rate limit: it slows the work down, and never the Lease renewals.

use std::time::Instant;

use kube::api::PostParams;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

use crate::lifecycle::policy;
use crate::support::{TestEnv, eventually};

/// Two requests a second for the work: before the last of six policies is Ready, at least 18
/// requests go out (two applies and a status write each; labels and events come on top),
/// beyond a burst of one, so that takes at least 8.5 s. Meanwhile the replica renews its Lease every half second (four requests a
/// second with the assignment read): if renewals shared the limit, it would lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_slows_the_work_but_not_the_lease_renewals() {
    let env = TestEnv::new("e2e-throttled").await;
    let operator = env.start_operator(&["--kube-api-qps=2", "--kube-api-burst=1"]).await;
    let policies = env.api::<ApplicationTrafficPolicy>();
    let started = Instant::now();
    for i in 0..6 {
        policies.create(&PostParams::default(), &policy(&format!("app-{i}"), 9000 + i)).await.unwrap();
    }
    let mut lapsed = false;
    eventually("every policy is Ready", || {
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
    assert!(took.as_secs_f64() >= 8.5, "18 requests at 2 a second took only {took:?}: no rate limit");
    println!("six policies at --kube-api-qps=2: Ready after {:.1} s, the Lease held throughout", took.as_secs_f64());
}
