//! A write answered 504 during a handoff: the proxy in front of the API server gives up on
//! the write, which still goes through, later. The writer cannot tell it from a write that
//! failed, so it keeps it registered as in flight until its bound has passed, and the
//! bucket's next owner writes only after it landed: nothing is fenced, nothing goes back,
//! and no write or delete lands after the bucket was granted to the next owner.
//! The late write is a child's apply, a generated HTTPRoute's apply, or a Traefik
//! Middleware's delete (which no fencing policy sees: a delete carries no token). The
//! scenario runs again with the fencing policy removed: the timing layer holds alone.
//! And once without a handoff: the same replica writes a newer spec meanwhile.

use std::time::Duration;

use controlplane::gateway_timeout::GatewayTimeoutProxy;
use kube::api::{Api, DynamicObject};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::reconcile::gateway::{Provider, Traefik, http_route};

use crate::SERIAL;
use crate::common::{Unfenced, eventually};
use crate::fleet::{Fleet, PER_NAMESPACE, change_spec, set_path, set_rate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_answered_504_during_a_handoff_lands_before_the_next_owner_writes() {
    let _turn = SERIAL.lock().await;
    handoffs_with_a_write_answered_504("gateway-timeout", &[Late::ChildApply, Late::MiddlewareDelete]).await;
}

/// Judged by the grants each accepted write came after (see `grants`), with nothing to
/// refuse a late write but timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_answered_504_during_a_handoff_lands_before_the_next_owner_writes_without_fencing() {
    let _turn = SERIAL.lock().await;
    let unfenced = Unfenced::remove().await;
    handoffs_with_a_write_answered_504("gateway-timeout-unfenced", &[Late::ChildApply, Late::RouteApply]).await;
    unfenced.restore().await;
}

/// No handoff: the same replica, and so the same epoch, writes a child, then the status, then
/// a Middleware's delete again for a newer spec while its write answered 504 may still land.
/// No fence refuses the late write (its epoch is the same); the child's apply carries the
/// resourceVersion it read, and the replica holds every newer write of the bucket until the
/// late one can no longer land. The child never goes back, the status ends on the newest
/// generation, and the late delete lands before the Middleware is made again.
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
    // The Middleware's delete answered 504, then the limit back: the replica makes the
    // Middleware again only once the late delete can no longer land, so the delete is
    // accepted, and is not refused by the newer object's resourceVersion.
    let before = proxy.delivered().len();
    Late::MiddlewareDelete.provoke(&proxy, &fleet.client(), &namespace).await;
    eventually("the Middleware's delete was answered 504", || async { (!proxy.armed()).then_some(()) }).await;
    Late::MiddlewareDelete.newer(&fleet, &namespace).await;
    let late_delete = proxy.delivered().get(before).map(|(_, code)| *code);
    fleet.converged("the flip-flops").await;
    let delivered = proxy.delivered();
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: flip-flop: a child write, a status write and a Middleware delete answered 504 and \
         delivered {DELAY:?} later, the spec changed meanwhile: delivered {delivered:?}; {} writes seen by the \
         server, none went back",
        verdict.writes
    );
    assert_eq!(late_delete, Some(200), "the late delete was accepted before the Middleware was made again");
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

/// The write of r-0's that the proxy answers 504 and delivers [`DELAY`] later.
#[derive(Clone, Copy, Debug)]
enum Late {
    /// The apply of app-0's rate-limit ConfigMap.
    ChildApply,
    /// The apply of the HTTPRoute generated for the policy with a gateway half.
    RouteApply,
    /// The delete of that policy's Traefik Middleware, once its rate limit is removed.
    MiddlewareDelete,
}

/// The policy of each namespace with a gateway half (see `fleet::policy`).
fn gateway_policy() -> String {
    format!("app-{}", PER_NAMESPACE - 1)
}

impl Late {
    /// Arms the proxy for this write and changes the spec so that r-0 sends it.
    async fn provoke(self, proxy: &GatewayTimeoutProxy, client: &kube::Client, namespace: &str) {
        let policy = gateway_policy();
        match self {
            Late::ChildApply => {
                proxy.time_out_next_write(&format!("/namespaces/{namespace}/configmaps/app-0"), DELAY);
                set_rate(client, namespace, "app-0").await.unwrap();
            }
            Late::RouteApply => {
                proxy.time_out_next_write(&format!("/namespaces/{namespace}/httproutes/{policy}"), DELAY);
                set_path(client, namespace, &policy).await.unwrap();
            }
            Late::MiddlewareDelete => {
                proxy.time_out_next_delete(&format!("/namespaces/{namespace}/middlewares/{policy}"), DELAY);
                change_spec(client, namespace, &policy, |_| json!({ "spec": { "rateLimit": null } })).await.unwrap();
            }
        }
    }

    /// A newer spec for the bucket's next owner to apply, and what shows it applied: the
    /// counter in the ConfigMap, the HTTPRoute's path, or the Middleware made again.
    async fn newer(self, fleet: &Fleet, namespace: &str) {
        let (client, policy) = (fleet.client(), gateway_policy());
        match self {
            Late::ChildApply => {
                let newer = set_rate(&client, namespace, "app-0").await.unwrap();
                let child = format!("{namespace}/app-0");
                eventually("the next owner applied the newer spec", || async {
                    (fleet.forward.last(&child) == Some(newer)).then_some(())
                })
                .await;
            }
            Late::RouteApply => {
                let newer = set_path(&client, namespace, &policy).await.unwrap();
                let routes = Api::<DynamicObject>::namespaced_with(client, namespace, &http_route());
                eventually("the next owner applied the newer path", || async {
                    let route = routes.get(&policy).await.ok()?;
                    let path = &route.data["spec"]["rules"][0]["matches"][0]["path"]["value"];
                    (*path == json!(format!("/v{newer}"))).then_some(())
                })
                .await;
            }
            Late::MiddlewareDelete => {
                let newer = set_rate(&client, namespace, &policy).await.unwrap();
                let middlewares = Api::<DynamicObject>::namespaced_with(client, namespace, &Traefik.resource());
                eventually("the next owner made the Middleware again, with the newer rate", || async {
                    let made = middlewares.get(&policy).await.ok()?;
                    (made.data["spec"]["rateLimit"]["average"] == json!(newer)).then_some(())
                })
                .await;
            }
        }
    }
}

/// For each of `lates` in turn: r-0's write of a spec change is answered 504 and delivered
/// later; r-0 leaves, and the bucket's next owner applies a newer spec. Then r-0 starts again
/// for the next.
async fn handoffs_with_a_write_answered_504(scenario: &str, lates: &[Late]) {
    let mut fleet = Fleet::new(scenario, 8).await;
    // Long leases, so that a write delivered `delay` after its 504 still reaches the server
    // within its bound (0.45 × (lease duration − renew deadline) = 4.5 s): inside the model,
    // where a write may land late, but not after the server was sent it past its bound.
    fleet.lease_args = ["--lease-duration=15s", "--renew-deadline=5s", "--retry-period=1s"].map(String::from).into();
    fleet.start("r-1").await;
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    let via_proxy = format!("http://127.0.0.1:{}", proxy.port());
    fleet.start_via("r-0", &via_proxy).await;
    fleet.converged("the initial creation").await;
    for (i, late) in lates.iter().enumerate() {
        if i > 0 {
            fleet.start_via("r-0", &via_proxy).await;
        }
        fleet.balanced().await;
        let namespace = fleet.namespace_owned_by("r-0");
        let before = proxy.delivered().len();
        late.provoke(&proxy, &fleet.client(), &namespace).await;
        eventually(&format!("r-0's {late:?} was answered 504"), || async { (!proxy.armed()).then_some(()) }).await;
        fleet.terminate("r-0");
        eventually(&format!("r-0's {late:?} answered 504 reached the API server"), || async {
            (proxy.delivered().len() > before).then_some(())
        })
        .await;
        late.newer(&fleet, &namespace).await;
        fleet.converged(&format!("the handoff after a late {late:?}")).await;
    }
    let delivered = proxy.delivered();
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: {scenario}: writes answered 504 and delivered {DELAY:?} later, each during a handoff \
         ({lates:?}): delivered {delivered:?}; {} writes seen by the server, {} overlapping, {} fenced, {} after a grant",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced,
        verdict.after_grant.len()
    );
    // A late write refused (a 404 for a delete) reached the server after the next owner wrote.
    assert!(
        delivered.iter().all(|(_, code)| *code == 200),
        "each late write landed before the next owner wrote, and so was accepted: {delivered:?}"
    );
    assert_eq!(verdict.fenced, 0, "the next owner wrote before a write answered 504 landed");
    drop(proxy);
}
