//! A write answered 504 during a handoff: the proxy in front of the API server gives up on
//! the write, which still goes through, later. The writer cannot tell it from a write that
//! failed, so it keeps it registered as in flight until its bound has passed, and the
//! bucket's next owner writes only after it landed: nothing is fenced, nothing goes back.
//! The scenario runs again with the fencing policy removed: the timing layer holds alone.
//! And once without a handoff: the same replica writes a newer spec meanwhile.

use std::time::Duration;

use controlplane::gateway_timeout::GatewayTimeoutProxy;
use kube::Api;
use traffic_policy_operator::api::ApplicationTrafficPolicy;

use crate::SERIAL;
use crate::common::{Unfenced, eventually};
use crate::fleet::{Fleet, set_rate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_answered_504_during_a_handoff_lands_before_the_next_owner_writes() {
    let _turn = SERIAL.lock().await;
    handoff_with_a_write_answered_504("gateway-timeout").await;
}

/// Judged by the grants each accepted write came after (see `grants`), with nothing to
/// refuse a late write but timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_answered_504_during_a_handoff_lands_before_the_next_owner_writes_without_fencing() {
    let _turn = SERIAL.lock().await;
    let unfenced = Unfenced::remove().await;
    handoff_with_a_write_answered_504("gateway-timeout-unfenced").await;
    unfenced.restore().await;
}

/// No handoff: the same replica, and so the same epoch, writes a child and then the status
/// again for a newer spec while its write answered 504 may still land. No fence refuses the
/// late write (its epoch is the same); the child's apply carries the resourceVersion it read,
/// and the replica holds every newer write of the bucket until the late one can no longer
/// land. The child never goes back, and the status ends on the newest generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_answered_504_land_before_the_same_replica_writes_a_newer_spec() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("flip-flop", 1).await;
    fleet.lease_args = ["--lease-duration=15s", "--renew-deadline=5s", "--retry-period=1s"].map(String::from).into();
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    fleet.start_via("r-0", &format!("http://127.0.0.1:{}", proxy.port())).await;
    fleet.converged("the initial creation").await;
    let namespace = fleet.namespaces[0].clone();

    let newer = flip_while_a_write_is_late(&fleet, &proxy, &format!("/namespaces/{namespace}/configmaps/app-0")).await;
    let child = format!("{namespace}/app-0");
    eventually("the replica applied the newer spec", || async {
        (fleet.forward.last(&child) == Some(newer)).then_some(())
    })
    .await;
    let status = format!("/namespaces/{namespace}/applicationtrafficpolicies/app-0/status");
    flip_while_a_write_is_late(&fleet, &proxy, &status).await;
    let policies = Api::<ApplicationTrafficPolicy>::namespaced(fleet.client(), &namespace);
    eventually("the status reports the newest generation", || async {
        let policy = policies.get("app-0").await.ok()?;
        (policy.status?.observed_generation == policy.metadata.generation).then_some(())
    })
    .await;
    fleet.converged("the flip-flops").await;
    let delivered = proxy.delivered();
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: flip-flop: a child write and a status write answered 504 and delivered {DELAY:?} later, \
         the spec changed meanwhile: delivered {delivered:?}; {} writes seen by the server, none went back",
        verdict.writes
    );
    drop(proxy);
}

/// How late a write answered 504 reaches the API server.
const DELAY: Duration = Duration::from_secs(4);

/// Changes app-0's spec with its next write through `path` answered 504 and delivered
/// [`DELAY`] later, then changes it again before that; returns once the late write reached
/// the server, with the newer spec's counter.
async fn flip_while_a_write_is_late(fleet: &Fleet, proxy: &GatewayTimeoutProxy, path: &str) -> u64 {
    let (namespace, client) = (&fleet.namespaces[0], fleet.client());
    let before = proxy.delivered().len();
    proxy.time_out_next_write(path, DELAY);
    set_rate(&client, namespace, "app-0").await.unwrap();
    eventually(&format!("the write of {path} was answered 504"), || async { (!proxy.armed()).then_some(()) }).await;
    let newer = set_rate(&client, namespace, "app-0").await.unwrap();
    eventually(&format!("the write of {path} answered 504 reached the API server"), || async {
        (proxy.delivered().len() > before).then_some(())
    })
    .await;
    newer
}

async fn handoff_with_a_write_answered_504(scenario: &str) {
    let mut fleet = Fleet::new(scenario, 8).await;
    // Long leases, so that a write delivered `delay` after its 504 still reaches the server
    // within its bound (0.45 × (lease duration − renew deadline) = 4.5 s): inside the model,
    // where a write may land late, but not after the server was sent it past its bound.
    fleet.lease_args = ["--lease-duration=15s", "--renew-deadline=5s", "--retry-period=1s"].map(String::from).into();
    let delay = DELAY;
    fleet.start("r-1").await;
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    fleet.start_via("r-0", &format!("http://127.0.0.1:{}", proxy.port())).await;
    fleet.converged("the initial creation").await;
    fleet.balanced().await;
    let namespace = fleet.namespace_owned_by("r-0");
    let client = fleet.client();

    // r-0's write of a spec change is answered 504 and delivered later. Then r-0 leaves, and
    // the bucket's next owner applies a newer spec.
    proxy.time_out_next_write(&format!("/namespaces/{namespace}/configmaps/app-0"), delay);
    set_rate(&client, &namespace, "app-0").await.unwrap();
    eventually("r-0's write was answered 504", || async { (!proxy.armed()).then_some(()) }).await;
    fleet.terminate("r-0");
    let newer = set_rate(&client, &namespace, "app-0").await.unwrap();
    let child = format!("{namespace}/app-0");
    eventually("the write answered 504 reached the API server", || async {
        (!proxy.delivered().is_empty()).then_some(())
    })
    .await;
    eventually("the next owner applied the newer spec", || async {
        (fleet.forward.last(&child) == Some(newer)).then_some(())
    })
    .await;
    fleet.converged("the handoff").await;
    let delivered = proxy.delivered();
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: {scenario}: a write answered 504 and delivered {delay:?} later, during a handoff: delivered {delivered:?}; \
         {} writes seen by the server, {} overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert!(delivered.iter().all(|(_, code)| *code == 200), "the late write was accepted, not refused: {delivered:?}");
    assert_eq!(verdict.fenced, 0, "the next owner wrote before the write answered 504 landed");
    drop(proxy);
}
