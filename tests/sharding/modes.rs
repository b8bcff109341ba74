//! A fleet changing its sharding mode: from bucket labels to the API server's shard
//! selector, by a rolling restart (what turning the server's feature gate on and restarting
//! the operator does). A bucket of one mode holds other namespaces than the same bucket of
//! the other, so a leader gives buckets only to members of its own mode, and the new mode's
//! leader revokes every bucket in the old mode before it gives any.

use k8s_openapi::api::core::v1::ConfigMap;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::sharding::assignment::Assignment;
use traffic_policy_operator::sharding::bucket::Mode;

use crate::SERIAL;
use crate::common::{eventually, expected_mode};
use crate::fleet::{Fleet, PER_NAMESPACE, set_rate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_change_of_sharding_mode_never_overlaps() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("modes", 20).await;
    // Children lose their bucket label in the new mode, so each new owner applies every spec
    // once more: the epochs judge, the spec changes cannot.
    fleet.judge_spec_changes = false;
    fleet.lease_args.push("--shard-mode=labels".into());
    for name in ["r-0", "r-1"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    let (stop_churn, churner) = fleet.churn();
    // Restarted in the default mode: the shard selector where the server offers it.
    fleet.lease_args.retain(|a| a != "--shard-mode=labels");
    fleet.terminate("r-1");
    fleet.start("r-1").await;
    if expected_mode() == Mode::ShardSelector {
        // The old mode's leader gives r-1 nothing: its bucket numbers would name other namespaces.
        let configmaps = fleet.env.api::<ConfigMap>();
        eventually("the label-mode leader counts r-1 idle and gives it no bucket", || async {
            let idle: f64 = fleet.replicas.values().map(|r| r.metric("traffic_policy_members_idle", None)).sum();
            let published = configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await.ok()??;
            let assignment = Assignment::decode(&published.data?).ok()?;
            let given: usize = assignment.shares().iter().filter(|(m, _)| m.starts_with("r-1_")).map(|(_, n)| n).sum();
            (assignment.mode == Mode::Labels && idle == 1.0 && given == 0).then_some(())
        })
        .await;
    }
    // A fleet of two modes at work: every policy is changed once more.
    for ns in &fleet.namespaces {
        for i in 0..PER_NAMESPACE {
            set_rate(&fleet.client(), ns, &format!("app-{i}")).await;
        }
    }
    fleet.terminate("r-0");
    fleet.start("r-0").await;
    fleet.balanced().await;
    stop_churn.store(true, std::sync::atomic::Ordering::Relaxed);
    let changes = churner.await.unwrap();
    fleet.converged("the change of mode").await;
    let published = fleet.env.api::<ConfigMap>().get(ASSIGNMENT_CONFIGMAP).await.unwrap();
    let assignment = Assignment::decode(&published.data.unwrap()).unwrap();
    assert_eq!(assignment.mode, expected_mode(), "the fleet ends in the mode the server offers");
    let verdict = fleet.finish().await;
    assert_eq!(verdict.fenced, 0, "a write was refused: some process wrote after another had taken the object");
    println!(
        "sharding summary: labels → {} by a rolling restart under {changes} spec changes: {} writes seen by the \
         server, {} overlapping, {} fenced",
        assignment.mode.as_str(),
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
}
