//! Faults beyond crashes: a duplicate process, deleted coordination objects, a write that
//! arrives late, and a delete-and-recreate hidden in a watch gap.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use controlplane::ControlPlane;
use controlplane::proxy::HoldingProxy;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::coordination::{ASSIGNMENT_CONFIGMAP, LEADER_LEASE};
use traffic_policy_operator::sharding::assignment::{Assignment, Slot};
use traffic_policy_operator::sharding::bucket::{self, Mode};
use traffic_policy_operator::sharding::ring::Ring;

use crate::common::{eventually, expected_mode};
use crate::fleet::{self, Fleet, policy, set_rate, until};
use crate::server::{self, rate_of};
use crate::{SERIAL, writers};

fn assignment_generation(cm: &ConfigMap) -> u64 {
    cm.data.as_ref().and_then(|d| d.get("generation")?.parse().ok()).unwrap_or(0)
}

async fn restart_apiserver() {
    tokio::task::spawn_blocking(|| ControlPlane::shared().restart_apiserver().unwrap()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_the_same_pod_name_waits_for_the_first() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("twin", 10).await;
    fleet.start("r-0").await;
    fleet.start("r-1").await;
    fleet.converged("the initial creation").await;
    let first = fleet.users["r-0"][0].clone();
    // A force-deleted pod's replacement, while the old process still runs and renews.
    let mut twin = fleet.spawn("r-0", None).await;
    let second = fleet.users["r-0"][1].clone();
    let (stop_churn, churner) = fleet.churn();
    // Both processes see every change; only one may act on them, while 40 writes land.
    let by_first = || server::writes(&fleet.env.cp.audit_log_path(), &[first.clone()].into_iter().collect()).len();
    let baseline = by_first();
    eventually("the first r-0 made 40 more writes while the second one waited", || async {
        assert!(!twin.is_ready(), "the second r-0 became ready while the first one holds the lease");
        assert!(writers(&fleet, std::slice::from_ref(&second)).is_empty(), "the second r-0 wrote");
        (by_first() >= baseline + 40).then_some(())
    })
    .await;
    assert!(writers(&fleet, std::slice::from_ref(&second)).is_empty(), "the second r-0 wrote while the first ran");
    let readyz = twin.get("/readyz").unwrap();
    assert!(readyz.contains("waiting for"), "{readyz}");

    // The first process dies: the second takes the lease over once it expires, and works.
    let t_kill = fleet.kill("r-0");
    twin.wait_ready().await;
    fleet.replicas.insert("r-0".into(), twin);
    // It takes the first one's slice over: the changes that keep coming are its to write.
    let second_users = [second.clone()].into_iter().collect();
    let took_over = eventually("the second r-0 writes after the first died", || async {
        let written = server::writes(&fleet.env.cp.audit_log_path(), &second_users).len();
        (written > 0).then_some(written)
    })
    .await;
    stop_churn.store(true, Ordering::Relaxed);
    churner.await.unwrap();
    fleet.converged("the first r-0 died").await;
    fleet.balanced().await;
    let reconciles = crate::assert_no_overlapping_reconciles(&fleet, &[(t_kill, "r-0".into())]);
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: duplicate pod name: {reconciles} reconciles, {} writes seen by the server, {} overlapping, \
         {} fenced; the second process wrote only after the first died ({} writes)",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced,
        took_over
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_member_lease_is_not_taken_for_a_dead_member() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("lease", 30).await;
    // A member Lease left behind by a pod that is gone: it never renews, so it is never given
    // buckets, and it holds nothing up.
    let leases = fleet.env.api::<Lease>();
    let ghost: Lease = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "traffic-policy-operator-member-ghost" },
        "spec": { "holderIdentity": "ghost_0", "leaseDurationSeconds": 4,
                  "renewTime": "2026-01-01T00:00:00.000000Z" }
    }))
    .unwrap();
    leases.create(&PostParams::default(), &ghost).await.unwrap();
    let (assignments, named) = assignment_members(fleet.client(), &fleet.env.namespace);
    for name in ["r-0", "r-1", "r-2"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    fleet.balanced().await;
    let (stop_churn, churner) = fleet.churn();
    let name = "traffic-policy-operator-member-r-1";
    let published = fleet.env.api::<ConfigMap>().get(ASSIGNMENT_CONFIGMAP).await.unwrap();
    let assignment = Assignment::decode(&published.data.unwrap()).unwrap();
    let r1_slice: BTreeSet<_> = (0..bucket::BUCKETS)
        .filter(
            |b| matches!(&assignment.slots[usize::from(*b)], Slot::Owned { member, .. } if is_replica(member, "r-1")),
        )
        .collect();
    let before = fleet.server_writes().len();
    leases.delete(name, &DeleteParams::default()).await.unwrap();
    // r-1 keeps working and writes its Lease again; its slice moves only through revocation.
    eventually("r-1 holds its member lease again", || async {
        let lease = leases.get_opt(name).await.ok()??;
        lease.spec?.holder_identity.filter(|h| is_replica(h, "r-1")).map(|_| ())
    })
    .await;
    fleet.converged("the lease deletion").await;
    fleet.balanced().await;
    stop_churn.store(true, Ordering::Relaxed);
    churner.await.unwrap();
    fleet.converged("the last change").await;
    let reconciles = crate::assert_no_overlapping_reconciles(&fleet, &[]);
    assignments.abort();
    let named = named.lock().unwrap().clone();
    assert!(
        !named.is_empty() && !named.iter().any(|m| is_replica(m, "ghost")),
        "the ghost was given buckets: {named:?}"
    );
    // From the server's side: r-1 kept its slice, as it never stopped renewing.
    let r1 = &fleet.users["r-1"];
    let moved: BTreeSet<String> = fleet.server_writes()[before..]
        .iter()
        .filter(|w| !r1.contains(&w.user))
        .filter(|w| w.object.split('/').nth(1).is_some_and(|ns| r1_slice.contains(&expected_mode().bucket_of(ns))))
        .map(|w| format!("{} by {}", w.object, w.user))
        .collect();
    assert!(moved.is_empty(), "r-1's objects were written by others after its Lease was deleted: {moved:?}");
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: deleted member lease (and a ghost Lease, never given buckets): {reconciles} reconciles, {} writes seen by the server, \
         {} overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_assignment_and_a_lapse_of_every_replica_keep_epochs_growing() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("assignment", 20).await;
    for name in ["r-0", "r-1"] {
        fleet.start(name).await;
    }
    fleet.converged("the initial creation").await;
    let configmaps = fleet.env.api::<ConfigMap>();
    let assignment = ASSIGNMENT_CONFIGMAP;
    let before = assignment_generation(&configmaps.get(assignment).await.unwrap());
    let (stop_churn, churner) = fleet.churn();
    configmaps.delete(assignment, &DeleteParams::default()).await.unwrap();
    // Every replica lapses while the API server is down.
    restart_apiserver().await;
    let after = eventually("the assignment is published again", || async {
        configmaps.get_opt(assignment).await.ok()?.map(|cm| assignment_generation(&cm))
    })
    .await;
    assert!(after > before, "the generation went back from {before} to {after}: epochs would go back");
    stop_churn.store(true, Ordering::Relaxed);
    churner.await.unwrap();
    fleet.converged("the assignment was deleted and every replica lapsed").await;
    fleet.balanced().await;
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: deleted assignment (generation {before} → {after}) and an apiserver restart: \
         {} writes seen by the server, {} overlapping, {} fenced",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_from_a_deposed_owner_is_fenced_by_the_api_server() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("fence", 12).await;
    fleet.start("r-1").await;
    fleet.start("r-2").await;
    // r-0 reaches the API server through a proxy that can hold its requests.
    let proxy = HoldingProxy::start(fleet.env.cp.server_url().rsplit(':').next().unwrap().parse().unwrap()).unwrap();
    let mut slow = fleet.spawn("r-0", Some(proxy.port())).await;
    slow.wait_ready().await;
    fleet.replicas.insert("r-0".into(), slow);
    fleet.converged("the initial creation").await;
    fleet.balanced().await;

    // A policy in r-0's slice.
    let namespace = fleet.namespace_owned_by("r-0");
    let child = format!("{namespace}/app-0");
    let client = fleet.client();

    // r-0's watches restart on every change of its slice, and a watch request sent once the
    // hold is on would wait with the rest. So first see an edit reach r-0 through its watch,
    // and r-0 finish with it (its status write, held, would stall r-0 on the old spec):
    // two edits in a row, the second made once r-0 has written the first, and no change of
    // r-0's slice meanwhile. The relist that brought the first ended before r-0 wrote it.
    let r0_since = |kind: &'static str, since: u128| {
        fleet.audit().iter().any(|e| e.t > since && e.replica == "r-0" && e.event == kind)
    };
    let applied_by_r0 = |rate: u64, since: u128| {
        fleet.forward.last(&child) == Some(rate)
            && fleet.audit().iter().any(|e| {
                e.t > since && e.replica == "r-0" && e.event == "reconcile_end" && e.detail == "ok" && e.object == child
            })
    };
    let mut attempts = 0;
    loop {
        let first = fleet::now_ns();
        let rate = set_rate(&client, &namespace, "app-0").await.unwrap();
        until("r-0 applied a spec change", || applied_by_r0(rate, first)).await;
        let second = fleet::now_ns();
        let rate = set_rate(&client, &namespace, "app-0").await.unwrap();
        until("r-0 applied the next spec change", || applied_by_r0(rate, second)).await;
        if !r0_since("owned", first) {
            break;
        }
        attempts += 1;
        assert!(attempts < 5, "r-0's slice kept changing; its watch never settled");
    }

    // r-0's write of the next spec is held on its way, past r-0's lease and a handoff (its
    // renewals are held too, so its slice is revoked and given to another replica). Held,
    // not delayed by a fixed time: a handoff slower than the delay would let the write land
    // before it, accepted.
    let fenced_before = fleet.verdict().fenced;
    proxy.hold();
    let held_since = fleet::now_ns();
    let stale = set_rate(&client, &namespace, "app-0").await.unwrap();
    until("r-0 sent its write of the spec change into the hold", || {
        fleet.audit().iter().any(|e| e.t > held_since && e.replica == "r-0" && e.event == "write" && e.object == child)
    })
    .await;
    let newer = eventually("a new owner applied the spec r-0's write carries, then a newer one", || async {
        let cm = fleet.env_api_configmap(&namespace, "app-0").await?;
        (rate_of(&cm)? == stale).then_some(())?;
        set_rate(&client, &namespace, "app-0").await
    })
    .await;
    until("the new owner applied the newer spec", || fleet.forward.last(&child) == Some(newer)).await;

    // When the late write arrives, the API server must refuse it, and keep the newer state.
    proxy.release();
    eventually("the late write reached the API server and was fenced", || async {
        (fleet.verdict().fenced > fenced_before).then_some(())
    })
    .await;
    let cm = fleet.env_api_configmap(&namespace, "app-0").await.unwrap();
    assert_eq!(rate_of(&cm), Some(newer), "the late write must not have replaced the newer state");
    fleet.converged("the late write").await;
    let slow_users = fleet.users["r-0"].clone();
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: late write held past a handoff: {} writes seen by the server, {} overlapping, \
         {} fenced late writes",
        verdict.writes,
        verdict.overlapping.len(),
        verdict.fenced
    );
    assert!(verdict.fenced >= 1);
    let slow: std::collections::BTreeSet<String> = slow_users.into_iter().collect();
    assert!(verdict.fenced_by.is_subset(&slow), "only the held process is fenced: {:?}", verdict.fenced_by);
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_deleted_and_created_again_while_the_watch_is_down_is_reconciled() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("regap", 1).await;
    // Leases long enough to outlast the freeze and the restart: the replica must not lapse,
    // whose recovery would relist anyway; only its watch has a gap.
    fleet.lease_args = ["--lease-duration=60s", "--renew-deadline=45s", "--retry-period=2s"].map(String::from).into();
    fleet.start("r-0").await;
    fleet.converged("the initial creation").await;
    let namespace = fleet.namespaces[0].clone();
    let policies = Api::<ApplicationTrafficPolicy>::namespaced(fleet.client(), &namespace);
    let old_uid = policies.get("app-0").await.unwrap().uid().unwrap();

    // The replica is frozen and the API server restarts, which breaks its watches before
    // anything happens that they could carry. Then the policy is deleted and created again with
    // the same spec (generation 1 again), and etcd's history is compacted past it, so the
    // watch cannot resume: it relists, and finds a known name at a known generation. The
    // children are orphaned rather than collected, so no event of theirs points the replica at
    // the policy: only the policy's own watch can tell it something changed.
    fleet.replicas["r-0"].process.signal(libc::SIGSTOP);
    let thaw = scopeguard(&fleet.replicas["r-0"].process);
    restart_apiserver().await;
    let orphan = DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Orphan), ..Default::default() };
    eventually("the policy is deleted after the restart", || async {
        policies.delete("app-0", &orphan).await.ok().map(|_| ())
    })
    .await;
    until_gone(&policies, "app-0").await;
    let mut again = policy("app-0", "regap");
    again.metadata.namespace = Some(namespace.clone());
    // Restored from a copy that kept its bucket label (as `kubectl get -o yaml` would): the
    // label-selected watch sees it at once, with no unlabelled phase that would hide the gap.
    // (The shard-selected watch sees it at once anyway.)
    if expected_mode() == Mode::Labels {
        let bucket = bucket::label_value(bucket::bucket_of(&namespace));
        again.labels_mut().insert(traffic_policy_operator::coordination::BUCKET_LABEL.into(), bucket);
    }
    let created = policies.create(&PostParams::default(), &again).await.unwrap();
    assert_ne!(created.uid(), Some(old_uid.clone()));
    let revision: u64 = created.resource_version().unwrap().parse().unwrap();
    tokio::task::spawn_blocking(move || ControlPlane::shared().compact_etcd(revision).unwrap()).await.unwrap();
    drop(thaw);

    let ready = eventually("the new policy is Ready for its generation", || async {
        let p = policies.get_opt("app-0").await.ok()??;
        let s = p.status.as_ref()?;
        let ready = s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == ConditionStatus::True);
        (ready && s.observed_generation == p.metadata.generation).then_some(p)
    })
    .await;
    let new_uid = ready.uid().unwrap();
    eventually("the children belong to the new policy", || async {
        let cm = fleet.env_api_configmap(&namespace, "app-0").await?;
        cm.owner_references().iter().any(|o| o.uid == new_uid).then_some(())
    })
    .await;
    // Its generation 1 is its own: the replica had reported the old policy's generation 1 under
    // the same name, which must not count for the new one.
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(fleet.client(), &namespace);
    eventually("an Applied event about the new policy", || async {
        let events = events.list(&ListParams::default()).await.ok()?;
        events
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Applied"))
            .any(|e| e.regarding.as_ref().and_then(|r| r.uid.as_deref()) == Some(new_uid.as_str()))
            .then_some(())
    })
    .await;
    let verdict = fleet.finish().await;
    println!(
        "delete and recreate in a watch gap: reconciled and reported; {} writes seen by the server",
        verdict.writes
    );
}

/// Defect 6: a reconcile that never ends holds up neither the buckets its replica gains at the
/// same time nor the bucket it blocks, which moves on after the revocation deadline without
/// an acknowledgement; and the stuck replica never writes the policy it stalls on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_reconcile_holds_up_neither_the_buckets_gained_nor_the_one_it_blocks() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("stuck", 16).await;
    // When r-1 leaves as r-2 joins, `stuck` moves from r-0 to r-2 while `gained` moves from
    // r-1 to r-0: r-0 gains and loses in one step. The ring is deterministic, so pick them by it.
    let (two, next) = (Ring::new(&["r-0", "r-1"]), Ring::new(&["r-0", "r-2"]));
    let (two, next) = (two.assign_names(), next.assign_names());
    let moving = |from: &str, to: &str| {
        let ns = fleet.namespaces.iter().find(|ns| {
            let bucket = usize::from(expected_mode().bucket_of(ns));
            two[bucket] == Some(from) && next[bucket] == Some(to)
        });
        ns.unwrap_or_else(|| panic!("no namespace of the scenario moves from {from} to {to}")).clone()
    };
    let (stuck_ns, gained_ns) = (moving("r-0", "r-2"), moving("r-1", "r-0"));
    let stuck = format!("{stuck_ns}/app-0");
    let suite_args = fleet.lease_args.clone();
    fleet.lease_args.extend([format!("--test-stall-on={stuck}"), "--reconcile-timeout=600s".into()]);
    fleet.start("r-0").await;
    fleet.lease_args = suite_args;
    fleet.start("r-1").await;
    let stuck_policies = Api::<ApplicationTrafficPolicy>::namespaced(fleet.client(), &stuck_ns);
    let is_ready = ApplicationTrafficPolicy::is_ready;
    // Everything converges but the stuck policy, which r-0 holds and never writes.
    let gained_policies = Api::<ApplicationTrafficPolicy>::namespaced(fleet.client(), &gained_ns);
    eventually("the policies of r-1's slice converge", || async {
        gained_policies.list(&Default::default()).await.ok()?.items.iter().all(is_ready).then_some(())
    })
    .await;
    assert!(!is_ready(&stuck_policies.get("app-0").await.unwrap()), "the stuck policy was reconciled");

    // r-1 leaves and r-2 joins: r-0 must drop `stuck` (which it cannot drain) and take `gained`.
    let mut r2 = fleet.spawn("r-2", None).await;
    fleet.terminate("r-1");
    r2.wait_ready().await;
    fleet.replicas.insert("r-2".into(), r2);
    let joined = std::time::Instant::now();
    let edited = std::time::Instant::now();
    let value = set_rate(&fleet.client(), &gained_ns, "app-1").await.unwrap();
    let gained_edit = eventually("r-0 reconciles an edit in a namespace it gained", || async {
        let p = gained_policies.get("app-1").await.ok()?;
        let done = is_ready(&p) && p.spec.rate_limit.as_ref()?.requests_per_second as u64 == value;
        done.then(|| edited.elapsed())
    })
    .await;
    let r0_users: std::collections::BTreeSet<String> = fleet.users["r-0"].iter().cloned().collect();
    let r0_wrote_gained = server::writes(&fleet.env.cp.audit_log_path(), &r0_users)
        .iter()
        .any(|w| w.object.starts_with(&format!("configmaps/{gained_ns}/app-1")) && w.code < 300);
    assert!(r0_wrote_gained, "the edit in {gained_ns} was not written by r-0, which gained it");

    // The stuck bucket moves to r-2 after the revocation deadline, without r-0's acknowledgement.
    eventually("r-2 reconciles the policy r-0 is stuck on", || async {
        is_ready(&stuck_policies.get("app-0").await.ok()?).then_some(())
    })
    .await;
    let took = joined.elapsed();
    let writes = server::writes(&fleet.env.cp.audit_log_path(), &r0_users);
    // Children and status; the leader's labelling of the policy is not the reconcile's.
    let reconciled = |w: &&server::Write| {
        w.object.ends_with(&format!("/{stuck_ns}/app-0/status"))
            || ["configmaps", "networkpolicies"].iter().any(|k| w.object == format!("{k}/{stuck_ns}/app-0"))
    };
    let stuck_by_r0: Vec<_> = writes.iter().filter(reconciled).collect();
    assert!(stuck_by_r0.is_empty(), "r-0 wrote for the policy it is stuck on: {stuck_by_r0:?}");
    assert!(fleet.replicas["r-0"].is_ready(), "a stuck reconcile made r-0 unready");
    // r-0 cannot drain before the reconcile timeout, so it exits only when killed.
    fleet.kill("r-0");
    fleet.converged("the stuck bucket moved").await;
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: stuck reconcile: an edit in a gained namespace reconciled after {:.2} s; the stuck \
         bucket moved on {:.2} s after r-2 joined, without an acknowledgement; {} writes seen by the server, {} overlapping",
        gained_edit.as_secs_f64(),
        took.as_secs_f64(),
        verdict.writes,
        verdict.overlapping.len()
    );
    assert!(
        gained_edit < fleet::lease_duration() * 3,
        "an edit in a gained namespace waited {gained_edit:?} behind a stuck reconcile"
    );
    assert!(took < fleet::lease_duration() * 3, "the stuck bucket took {took:?} to move on");
}

/// Every member any published assignment named, as seen by a watch of the assignment.
fn assignment_members(
    client: kube::Client,
    namespace: &str,
) -> (tokio::task::JoinHandle<()>, std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let named = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let config = watcher::Config::default().fields(&format!("metadata.name={ASSIGNMENT_CONFIGMAP}"));
    let events = watcher(Api::<ConfigMap>::namespaced(client, namespace), config).default_backoff().applied_objects();
    let seen = named.clone();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(Ok(cm)) = events.next().await {
            let members = cm.data.and_then(|d| d.get("members").cloned()).unwrap_or_default();
            seen.lock().unwrap().extend(members.split(',').filter(|m| !m.is_empty()).map(str::to_string));
        }
    });
    (task, named)
}

/// Whether assignment member `member` (an incarnation, `replica_nonce`) is of `replica`.
fn is_replica(member: &str, replica: &str) -> bool {
    member.split('_').next() == Some(replica)
}

async fn until_gone(api: &Api<ApplicationTrafficPolicy>, name: &str) {
    eventually(&format!("{name} is gone"), || async { api.get_opt(name).await.ok()?.is_none().then_some(()) }).await;
}

/// Sends SIGCONT when dropped, so a failing test does not leave a process frozen.
fn scopeguard(process: &controlplane::process::Process) -> impl Drop + '_ {
    struct Thaw<'a>(&'a controlplane::process::Process);
    impl Drop for Thaw<'_> {
        fn drop(&mut self) {
            self.0.signal(libc::SIGCONT);
        }
    }
    Thaw(process)
}

impl Fleet {
    async fn env_api_configmap(&self, namespace: &str, name: &str) -> Option<ConfigMap> {
        Api::<ConfigMap>::namespaced(self.client(), namespace).get_opt(name).await.ok()?
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_not_ready_before_it_has_a_slice() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("ready", 4).await;
    // The leader Lease is held by a process that never publishes an assignment, so r-0
    // renews its member Lease but is given nothing.
    let leases = fleet.env.api::<Lease>();
    let absent_leader: Lease = serde_json::from_value(serde_json::json!({
        "metadata": { "name": LEADER_LEASE },
        "spec": { "holderIdentity": "elsewhere_0", "leaseDurationSeconds": 3600,
                  "renewTime": "2099-01-01T00:00:00.000000Z" }
    }))
    .unwrap();
    leases.create(&PostParams::default(), &absent_leader).await.unwrap();
    let mut replica = fleet.spawn("r-0", None).await;
    let member = "traffic-policy-operator-member-r-0";
    let renewals = std::sync::Mutex::new(BTreeSet::new());
    eventually("r-0 renewed its member Lease five times, never Ready meanwhile", || async {
        assert!(!replica.is_ready(), "r-0 became Ready with no assignment");
        let renewed = leases.get_opt(member).await.ok()??.spec?.renew_time?;
        let mut renewals = renewals.lock().unwrap();
        renewals.insert(renewed.0);
        (renewals.len() >= 5).then_some(())
    })
    .await;
    let readyz = replica.get("/readyz").unwrap();
    assert!(readyz.contains("waiting for") && readyz.contains("assignment"), "{readyz}");
    let policies = Api::<ApplicationTrafficPolicy>::all(fleet.client());
    let listed = policies.list(&ListParams::default().labels("scenario=ready")).await.unwrap();
    let reconciled = listed.items.iter().filter(|p| p.status.is_some()).count();
    assert_eq!(reconciled, 0, "policies were reconciled with no assignment");

    // Once the leader Lease is free, r-0 leads, publishes, and is Ready once its slice is synced.
    leases.delete(LEADER_LEASE, &DeleteParams::default()).await.unwrap();
    replica.wait_ready().await;
    fleet.replicas.insert("r-0".into(), replica);
    fleet.converged("the leader Lease was freed").await;
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: not Ready and no policy reconciled over five member-Lease renewals without an assignment; \
         then {} writes seen by the server, {} overlapping",
        verdict.writes,
        verdict.overlapping.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_follower_task_died_exits_and_its_slice_moves() {
    let _turn = SERIAL.lock().await;
    let mut fleet = Fleet::new("livez", 6).await;
    fleet.start("r-0").await;
    fleet.lease_args.push("--test-follower-panics-after=25s".into());
    fleet.start("r-1").await;
    fleet.lease_args.clear();
    fleet.converged("the initial creation").await;
    fleet.balanced().await;
    let (stop_churn, churner) = fleet.churn();
    // r-1's follower task panics: the process must not live on, Ready, with its slice frozen.
    let r1 = std::sync::Mutex::new(fleet.replicas.remove("r-1").unwrap());
    let status =
        eventually("r-1 exits after its follower task died", || async { r1.lock().unwrap().process.exited() }).await;
    assert!(!status.success(), "r-1 exited with {status} after a critical task died");
    let log = std::fs::read_to_string(&r1.lock().unwrap().process.log_path).unwrap();
    assert!(log.contains("the follower task ended"), "r-1's log does not say why it stopped");
    // Its slice moves to r-0, and the changes made meanwhile converge.
    let shares = fleet.balanced().await;
    assert_eq!(shares["r-0"].0, 1024.0);
    stop_churn.store(true, Ordering::Relaxed);
    churner.await.unwrap();
    fleet.converged("r-1 exited").await;
    let verdict = fleet.finish().await;
    println!(
        "sharding summary: a replica whose follower task died exited ({status}) and its slice moved: \
         {} writes seen by the server, {} overlapping",
        verdict.writes,
        verdict.overlapping.len()
    );
}
