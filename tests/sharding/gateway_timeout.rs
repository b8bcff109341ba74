//! A write answered 504 during a handoff: the proxy in front of the API server gives up on
//! the write, which still goes through, later. The writer cannot tell it from a write that
//! failed, so it keeps it registered as in flight until its bound has passed, and the
//! bucket's next owner writes only after it landed: nothing is fenced, nothing goes back.
//! The scenario runs again with the fencing policy removed: the timing layer holds alone.

use std::time::Duration;

use controlplane::gateway_timeout::GatewayTimeoutProxy;

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

async fn handoff_with_a_write_answered_504(scenario: &str) {
    let mut fleet = Fleet::new(scenario, 8).await;
    // Long leases, so that a write delivered `delay` after its 504 still reaches the server
    // within its bound (0.45 × (lease duration − renew deadline) = 4.5 s): inside the model,
    // where a write may land late, but not after the server was sent it past its bound.
    fleet.lease_args = ["--lease-duration=15s", "--renew-deadline=5s", "--retry-period=1s"].map(String::from).into();
    let delay = Duration::from_secs(4);
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
