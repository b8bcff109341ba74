//! Membership that knows what a replica can do: a replica that cannot watch its slice (its
//! watches are refused or stall, or its lists never complete), or that shards in another
//! mode than the fleet, is given no buckets, says why, and every policy keeps converging,
//! judged from the API server. A leader that cannot see its members (its Lease watch stalls) gives
//! leadership up.

use std::time::{Duration, Instant};

use controlplane::gateway_timeout::GatewayTimeoutProxy;

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use traffic_policy_operator::coordination::{
    LEADER_LEASE, MEMBER_LEASE_PREFIX, MODE_ANNOTATION, NOT_WORKING_ANNOTATION,
};

use traffic_policy_operator::runtime::watch_stall;

use crate::SERIAL;
use crate::common::{eventually, eventually_within};
use crate::fleet::{Fleet, lease_duration};

/// What replica `pod`'s member Lease says: its holder and annotations.
async fn member_lease(fleet: &Fleet, pod: &str) -> Option<(String, std::collections::BTreeMap<String, String>)> {
    let lease = fleet.env.api::<Lease>().get_opt(&format!("{MEMBER_LEASE_PREFIX}{pod}")).await.ok()??;
    let holder = lease.spec.as_ref()?.holder_identity.clone().filter(|h| !h.is_empty())?;
    Some((holder, lease.annotations().clone()))
}

/// Waits until replica `pod` has renewed its member Lease twice: the leader takes it for alive.
async fn renewing(fleet: &Fleet, pod: &str) -> String {
    let renewals = std::sync::Mutex::new(std::collections::BTreeSet::new());
    eventually(&format!("{pod} renews its member Lease"), || async {
        let lease = fleet.env.api::<Lease>().get_opt(&format!("{MEMBER_LEASE_PREFIX}{pod}")).await.ok()??;
        let spec = lease.spec?;
        let holder = spec.holder_identity.filter(|h| !h.is_empty())?;
        let mut seen = renewals.lock().unwrap();
        seen.insert(serde_json::to_string(&spec.renew_time?).ok()?);
        (seen.len() >= 3).then_some(holder)
    })
    .await
}

/// Whether replica `pod` says it works and the assignment gives it buckets.
async fn works_and_is_given_buckets(fleet: &Fleet, pod: &str) -> Option<()> {
    let (holder, annotations) = member_lease(fleet, pod).await?;
    let given = fleet.assignment().await.shares().contains_key(&holder);
    (!annotations.contains_key(NOT_WORKING_ANNOTATION) && given).then_some(())
}

/// Stops the fleet, prints the scenario's summary with what the server saw, and checks that
/// no write was fenced.
async fn finish_with_nothing_fenced(fleet: Fleet, summary: &str) {
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: {summary}; {} writes seen by the server, {} overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert_eq!(verdict.fenced, 0, "no write was fenced");
}

/// How long a spec change of every policy takes to converge.
async fn every_change_converges(fleet: &Fleet, what: &str) -> Duration {
    let started = Instant::now();
    fleet.change_every_policy().await;
    fleet.converged(what).await;
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_watches_are_refused_gives_its_slice_up_until_they_are_allowed() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("refused", 8).await;
    fleet.start("r-0").await;
    fleet.converged("the initial creation").await;
    // r-1 may do everything but list and watch NetworkPolicies (an RBAC mistake).
    let role = "traffic-policy-operator-refused-watch";
    let refuse_watch = |rule: &mut k8s_openapi::api::rbac::v1::PolicyRule| {
        if rule.resources.iter().flatten().any(|r| r == "networkpolicies") {
            rule.verbs.retain(|v| v != "list" && v != "watch");
        }
    };
    fleet.env.limited_cluster_role(role, refuse_watch).await;
    fleet.start_unready("r-1", role, None, &[]).await;
    let holder = renewing(&fleet, "r-1").await;
    let took = every_change_converges(&fleet, "a spec change, with r-1's watches refused").await;
    let why = eventually("r-1 says on its Lease why it cannot work", || async {
        member_lease(&fleet, "r-1").await?.1.get(NOT_WORKING_ANNOTATION).cloned()
    })
    .await;
    assert!(why.contains("NetworkPolicy") && why.contains("403"), "the reason names the watch and the refusal: {why}");
    assert!(
        !fleet.assignment().await.shares().contains_key(&holder),
        "r-1 holds no buckets while it cannot watch them"
    );

    // Allowed again: its probe sees the list succeed, it says it works, and it is given buckets.
    fleet.env.limited_cluster_role(role, |_| {}).await;
    eventually("r-1 works again and is given buckets", || works_and_is_given_buckets(&fleet, "r-1")).await;
    let took_after = every_change_converges(&fleet, "r-1 was allowed to watch again").await;
    let summary = format!(
        "refused watches ({why}): every policy converged in {took:?} without r-1, {took_after:?} with it again"
    );
    finish_with_nothing_fenced(fleet, &summary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_lists_never_complete_gives_its_slice_up_until_they_do() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("unlisted", 8).await;
    fleet.start("r-0").await;
    fleet.converged("the initial creation").await;
    // r-1 talks to the API server through a proxy that answers every list and watch of
    // NetworkPolicies with 504: not a refusal, so its watch retries for ever.
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    proxy.time_out_reads(Some("/networkpolicies"));
    let server = format!("http://127.0.0.1:{}", proxy.port());
    let deadline = Duration::from_secs(10);
    let role = "traffic-policy-operator";
    fleet.start_unready("r-1", role, Some(&server), &[&format!("--list-deadline={}s", deadline.as_secs())]).await;
    let holder = renewing(&fleet, "r-1").await;
    eventually("r-1 is given buckets", || async {
        fleet.assignment().await.shares().contains_key(&holder).then_some(())
    })
    .await;
    // r-1 cannot list them: it gives them up after the deadline, asks for work again after a
    // hold, and may take buckets for another deadline before it gives them up again (for a
    // hold twice as long). A change waits at most a deadline and a handoff (a lease duration
    // and a few seconds on a loaded machine).
    let bound = deadline + lease_duration() + Duration::from_secs(10);
    let took = every_change_converges(&fleet, "a spec change, with r-1's lists failing").await;
    assert!(took <= bound, "every namespace was reconciled within {bound:?}: {took:?}");
    let why = eventually("r-1 says on its Lease that its watches did not list its slice", || async {
        let (_, annotations) = member_lease(&fleet, "r-1").await?;
        annotations.get(NOT_WORKING_ANNOTATION).cloned()
    })
    .await;
    assert!(why.contains("have not listed"), "the reason says what did not happen: {why}");

    // The lists work again: r-1 is given buckets once its hold has passed, and lists them.
    proxy.time_out_reads(None);
    let works = || works_and_is_given_buckets(&fleet, "r-1");
    eventually_within(deadline * 8, "r-1 works again and is given buckets", works).await;
    let took_after = every_change_converges(&fleet, "r-1's lists work again").await;
    let summary = format!(
        "lists that never complete ({why}): every policy converged in {took:?} without r-1, {took_after:?} with \
         it again"
    );
    finish_with_nothing_fenced(fleet, &summary).await;
    drop(proxy);
}

/// The pod whose incarnation holds the leader Lease.
async fn leader_pod(fleet: &Fleet) -> Option<String> {
    let lease = fleet.env.api::<Lease>().get_opt(LEADER_LEASE).await.ok()??;
    let holder = lease.spec?.holder_identity.filter(|h| !h.is_empty())?;
    Some(crate::audit::pod_of(&holder).to_string())
}

/// The leader's member-Lease watch stalls (a proxy stops passing it on: open and silent)
/// while its renewals and its leader Lease go through. It can no longer tell who is alive,
/// so it gives leadership up to a replica whose watch works, and a killed replica's slice
/// still moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_member_watch_stalls_steps_down_and_a_killed_replicas_slice_moves() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("stalled-leader", 8).await;
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    fleet.start_via("r-0", &format!("http://127.0.0.1:{}", proxy.port())).await;
    eventually("r-0 leads", || async { (leader_pod(&fleet).await? == "r-0").then_some(()) }).await;
    fleet.start("r-1").await;
    fleet.start("r-2").await;
    fleet.converged("the initial creation").await;
    fleet.balanced().await;

    proxy.freeze_watches(Some("/leases"));
    let frozen = Instant::now();
    let leader =
        eventually("another replica leads", || async { leader_pod(&fleet).await.filter(|p| p != "r-0") }).await;
    let stepped_down = frozen.elapsed();
    let (_, renew_deadline, retry_period) = crate::common::lease_timings();
    let bound = renew_deadline + retry_period * 2 + Duration::from_secs(2);
    assert!(stepped_down <= bound, "r-0 gave leadership up within {bound:?} of its watch stalling: {stepped_down:?}");

    let victim = if leader == "r-1" { "r-2" } else { "r-1" };
    let t_kill = fleet.kill(victim);
    let took = every_change_converges(&fleet, &format!("kill -9 of {victim}, r-0's member watch frozen")).await;
    let takeover = crate::takeover_seconds(&fleet.audit(), victim, t_kill).expect("taken over");
    let kill_bound = crate::kill_takeover_bound();
    assert!(takeover <= kill_bound, "takeover after kill -9 took {takeover:.2} s (bound {kill_bound} s)");
    assert_eq!(leader_pod(&fleet).await.as_deref(), Some(leader.as_str()), "r-0 did not campaign again");
    let summary = format!(
        "a leader's member watch frozen: {leader} led {stepped_down:?} after; {victim} killed, taken over in \
         {takeover:.2} s, every change converged in {took:?}"
    );
    finish_with_nothing_fenced(fleet, &summary).await;
    drop(proxy);
}

/// r-1's policy watches stall: a proxy passes nothing more on them (no event, no bookmark,
/// no end) while its Lease renewals go through. Past its watch timeout and a margin it says
/// it cannot work, gives its slice up, and the changes in it converge elsewhere; once its
/// watches flow again, its probe sees a watch end and it is given buckets again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_watches_stall_gives_its_slice_up_until_they_flow() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("stalled", 8).await;
    fleet.start("r-0").await;
    fleet.converged("the initial creation").await;
    let proxy = GatewayTimeoutProxy::start(fleet.env.cp).unwrap();
    fleet.start_via("r-1", &format!("http://127.0.0.1:{}", proxy.port())).await;
    let holder = renewing(&fleet, "r-1").await;
    eventually("r-1 works and is given buckets", || works_and_is_given_buckets(&fleet, "r-1")).await;

    proxy.freeze_watches(Some("/applicationtrafficpolicies"));
    // Noticed once a watch has been silent for its timeout (two lease durations) and the
    // margin, then a handoff.
    let bound = lease_duration() * 3 + watch_stall::MARGIN + Duration::from_secs(5);
    let took = every_change_converges(&fleet, "a spec change, with r-1's policy watches frozen").await;
    assert!(took <= bound, "every namespace was reconciled within {bound:?}: {took:?}");
    let why = eventually("r-1 says on its Lease that its watch stalled", || async {
        member_lease(&fleet, "r-1").await?.1.get(NOT_WORKING_ANNOTATION).cloned()
    })
    .await;
    assert!(why.contains("ApplicationTrafficPolicy stalled"), "the reason names the watch and the stall: {why}");
    assert!(!fleet.assignment().await.shares().contains_key(&holder), "r-1 holds no buckets while its watch stalls");

    proxy.freeze_watches(None);
    eventually("r-1 works again and is given buckets", || works_and_is_given_buckets(&fleet, "r-1")).await;
    let took_after = every_change_converges(&fleet, "r-1's watches flow again").await;
    let summary = format!(
        "stalled watches ({why}): every policy converged in {took:?} without r-1 (bound {bound:?}), \
         {took_after:?} with it again"
    );
    finish_with_nothing_fenced(fleet, &summary).await;
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_two_modes_leaves_no_namespace_unreconciled() {
    let _turn = SERIAL.lock().await;
    if !controlplane::sharded_list_and_watch() {
        // Without the shard selector every replica shards by labels: there is no second mode.
        println!("skipped: this kube-apiserver has no shard selector, so one mode is all a fleet can have");
        return;
    }
    let mut fleet = Fleet::new("two-modes", 8).await;
    fleet.start("r-0").await;
    fleet.converged("the initial creation").await;
    // A replica started with another mode (a flag set by hand, or a fleet mid-upgrade).
    fleet.start_unready("r-1", "traffic-policy-operator", None, &["--shard-mode=labels"]).await;
    let holder = renewing(&fleet, "r-1").await;
    let bound = lease_duration() + Duration::from_secs(5);
    let took = every_change_converges(&fleet, "a spec change, with a replica of the other mode").await;
    assert!(took <= bound, "every namespace was reconciled within {bound:?}: {took:?}");
    assert!(!fleet.assignment().await.shares().contains_key(&holder), "r-1 is given nothing in the fleet's mode");
    let (_, annotations) = member_lease(&fleet, "r-1").await.expect("r-1 holds its Lease");
    assert_eq!(annotations.get(MODE_ANNOTATION).map(String::as_str), Some("labels"), "r-1 advertises its mode");

    // The shard-selector replica leaves: the label-mode one leads, revokes every bucket of the
    // old mode, and takes them in its own.
    let left = Instant::now();
    fleet.terminate("r-0");
    fleet.change_every_policy().await;
    fleet.converged("the replica of the fleet's mode left").await;
    let handover = left.elapsed();
    assert_eq!(fleet.assignment().await.mode.as_str(), "labels");
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: two modes in one fleet: changes converged in {took:?} with r-1 idle, {handover:?} from \
         the shard-selector replica's exit to every change applied in label mode; {} writes seen by the server, {} \
         overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert!(handover <= bound, "the mode change left namespaces unreconciled for {handover:?}, over {bound:?}");
}
