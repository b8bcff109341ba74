//! The sharding protocol against the real control plane: replicas are separate processes
//! of the real binary, run under deploy/'s roles, writing audit logs that the checks read.
//!
//! One test, one story: the scenarios share 300 policies in 60 namespaces and run one after
//! another while a background task keeps changing specs, and the invariants are checked
//! after each step and over the whole audit at the end.

mod audit;
#[path = "../common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{Operator, TestEnv, eventually};
use controlplane::Identity;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};

const LEASE_DURATION: Duration = Duration::from_secs(4);
const RENEW_DEADLINE: Duration = Duration::from_secs(3);
/// The bound on how long any object may stay without an owner.
const UNOWNED_BOUND: Duration = Duration::from_secs(4 + 5);
const NAMESPACES: usize = 60;
const PER_NAMESPACE: usize = 5;

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

struct Fleet {
    env: TestEnv,
    identity: Identity,
    audit_dir: PathBuf,
    replicas: BTreeMap<String, Operator>,
}

impl Fleet {
    async fn start(&mut self, name: &str) {
        let args = vec![
            format!("--namespace={}", self.env.namespace),
            format!("--audit-log={}", self.audit_dir.join(format!("{name}.jsonl")).display()),
            "--workers=4".to_string(),
        ];
        let replica = Operator::launch(self.env.cp, &self.identity, name, &args).await;
        self.replicas.insert(name.to_string(), replica);
    }

    fn kill(&mut self, name: &str) -> u128 {
        let mut replica = self.replicas.remove(name).unwrap();
        let t = now_ns();
        replica.process.signal(libc::SIGKILL);
        replica.stop();
        t
    }

    fn terminate(&mut self, name: &str) -> u128 {
        let mut replica = self.replicas.remove(name).unwrap();
        let t = now_ns();
        let status = replica.stop().expect("exits");
        assert!(status.success(), "{name} must exit 0 on SIGTERM, got {status}");
        t
    }

    /// Per replica: (buckets owned, objects cached).
    fn shares(&self) -> BTreeMap<String, (f64, f64)> {
        self.replicas
            .iter()
            .map(|(name, r)| {
                (
                    name.clone(),
                    (r.metric("traffic_policy_buckets_owned", None), r.metric("traffic_policy_cached_objects", None)),
                )
            })
            .collect()
    }

    /// Every replica owns something, and the caches add up to the total: each holds only
    /// its own slice.
    async fn balanced(&self, total: usize) -> BTreeMap<String, (f64, f64)> {
        eventually("every replica owns a slice and the caches add up to the total", || async {
            let shares = self.shares();
            let cached: f64 = shares.values().map(|(_, c)| c).sum();
            let owned: f64 = shares.values().map(|(b, _)| b).sum();
            (shares.values().all(|(b, c)| *b > 0.0 && *c > 0.0) && cached == total as f64 && owned == 1024.0)
                .then_some(shares)
        })
        .await
    }
}

/// Waits until every policy is Ready for its latest generation.
async fn converged(client: &Client, what: &str) -> usize {
    let policies = Api::<ApplicationTrafficPolicy>::all(client.clone());
    eventually(&format!("every policy converges after {what}"), || async {
        let list = policies.list(&ListParams::default().labels("sharding-test=true")).await.ok()?;
        let all = list.items.iter().all(|p| {
            p.status.as_ref().is_some_and(|s| {
                s.observed_generation == p.metadata.generation
                    && s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == ConditionStatus::True)
            })
        });
        all.then_some(list.items.len())
    })
    .await
}

async fn create_policies(client: &Client, namespace: &str, count: usize) {
    let ns =
        Namespace { metadata: ObjectMeta { name: Some(namespace.into()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    let policies = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    for i in 0..count {
        let policy: ApplicationTrafficPolicy = serde_json::from_value(json!({
            "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
            "metadata": { "name": format!("app-{i}"), "labels": { "sharding-test": "true" } },
            "spec": {
                "applicationSelector": { "matchLabels": { "app": format!("app-{i}") } },
                "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8" } }], "ports": [{ "port": 8080 }] }],
                "rateLimit": { "requestsPerSecond": 1 }
            }
        }))
        .unwrap();
        policies.create(&PostParams::default(), &policy).await.unwrap();
    }
}

/// Keeps changing specs (a new generation every 50 ms) until stopped.
fn churn(client: Client, namespaces: Vec<String>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut changes = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let ns = &namespaces[rand::random_range(0..namespaces.len())];
            let name = format!("app-{}", rand::random_range(0..PER_NAMESPACE));
            let patch = json!({ "spec": { "rateLimit": { "requestsPerSecond": 1 + changes % 1000 } } });
            let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), ns);
            // The apiserver restart makes some of these fail; that is fine.
            if api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok() {
                changes += 1;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        changes
    })
}

/// Seconds from `t0` until another replica first started reconciling an object in one of
/// `victim`'s buckets.
fn takeover_seconds(entries: &[audit::Entry], victim: &str, t0: u128) -> f64 {
    let buckets = audit::ownership_changes(entries)
        .into_iter()
        .rfind(|(t, r, _)| r == victim && *t < t0)
        .map(|(_, _, b)| b)
        .unwrap_or_default();
    let first = entries
        .iter()
        .find(|e| {
            e.t > t0
                && e.event == "reconcile_start"
                && e.replica != victim
                && e.detail.parse::<u16>().is_ok_and(|b| buckets.contains(&b))
        })
        .unwrap_or_else(|| panic!("nobody took over {victim}'s buckets"));
    (first.t - t0) as f64 / 1e9
}

/// The longest time any bucket had no owner, from the replicas' own announcements plus the
/// moments the test ended ownership from outside (kills, freezes).
fn longest_unowned(
    entries: &[audit::Entry],
    forced_ends: &[(u128, String)],
    from: u128,
    until: u128,
) -> (Duration, u128) {
    let mut events: Vec<(u128, String, BTreeSet<u16>)> = audit::ownership_changes(entries);
    events.extend(forced_ends.iter().map(|(t, r)| (*t, r.clone(), BTreeSet::new())));
    events.sort_by_key(|(t, _, _)| *t);
    let mut owned_by: BTreeMap<String, BTreeSet<u16>> = BTreeMap::new();
    let mut unowned_since: BTreeMap<u16, u128> = BTreeMap::new();
    let mut longest = 0u128;
    let mut longest_from = 0u128;
    for (t, replica, buckets) in events.into_iter().filter(|(t, _, _)| *t <= until) {
        owned_by.insert(replica, buckets);
        let owned: BTreeSet<u16> = owned_by.values().flatten().copied().collect();
        for b in 0..1024u16 {
            match (owned.contains(&b), unowned_since.get(&b)) {
                (true, Some(&since)) => {
                    if t.saturating_sub(since.max(from)) > longest {
                        longest = t.saturating_sub(since.max(from));
                        longest_from = since;
                    }
                    unowned_since.remove(&b);
                }
                (false, None) => {
                    unowned_since.insert(b, t);
                }
                _ => {}
            }
        }
    }
    for since in unowned_since.values() {
        if until.saturating_sub((*since).max(from)) > longest {
            longest = until.saturating_sub((*since).max(from));
            longest_from = *since;
        }
    }
    (Duration::from_nanos(longest as u64), longest_from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_work_and_hand_it_over_safely() {
    let env = TestEnv::new("tpo-system").await;
    let identity = env.operator_identity("operator", None).await;
    let audit_dir = env.cp.dir().join("audit");
    std::fs::create_dir_all(&audit_dir).unwrap();
    let client = env.client.clone();
    let mut fleet = Fleet { env, identity, audit_dir: audit_dir.clone(), replicas: BTreeMap::new() };

    // Three replicas, 300 policies in 60 namespaces.
    for name in ["r-0", "r-1", "r-2"] {
        fleet.start(name).await;
    }
    let namespaces: Vec<String> = (0..NAMESPACES).map(|i| format!("team-{i}")).collect();
    for ns in &namespaces {
        create_policies(&client, ns, PER_NAMESPACE).await;
    }
    let total = NAMESPACES * PER_NAMESPACE;
    assert_eq!(converged(&client, "the initial creation").await, total);
    let shares = fleet.balanced(total).await;
    println!("three replicas, (buckets owned, objects cached): {shares:?}");
    let t_settled = now_ns();

    let stop_churn = Arc::new(AtomicBool::new(false));
    let churner = churn(client.clone(), namespaces.clone(), stop_churn.clone());
    let mut forced_ends: Vec<(u128, String)> = Vec::new();

    // Scale out to five, then in to two.
    fleet.start("r-3").await;
    fleet.start("r-4").await;
    converged(&client, "scaling to 5").await;
    println!("five replicas: {:?}", fleet.balanced(total).await);
    for name in ["r-2", "r-3", "r-4"] {
        fleet.terminate(name);
    }
    converged(&client, "scaling to 2").await;
    println!("two replicas: {:?}", fleet.balanced(total).await);
    fleet.start("r-2").await;
    fleet.balanced(total).await;

    // kill -9 an owner, and create policies while its slice is being handed over.
    let t_kill = fleet.kill("r-0");
    forced_ends.push((t_kill, "r-0".into()));
    create_policies(&client, "late-during-handoff", PER_NAMESPACE).await;
    converged(&client, "kill -9").await;
    let total = total + PER_NAMESPACE;
    fleet.start("r-0").await;
    fleet.balanced(total).await;

    // SIGTERM an owner.
    let t_term = fleet.terminate("r-1");
    converged(&client, "SIGTERM").await;
    fleet.start("r-1").await;
    fleet.balanced(total).await;

    // Freeze an owner past its lease, then let it run again.
    let frozen = "r-2";
    fleet.replicas[frozen].process.signal(libc::SIGSTOP);
    let t_freeze = now_ns();
    forced_ends.push((t_freeze + RENEW_DEADLINE.as_nanos(), frozen.into()));
    tokio::time::sleep(2 * LEASE_DURATION).await; // the fault itself lasts this long
    let t_thaw = now_ns();
    fleet.replicas[frozen].process.signal(libc::SIGCONT);
    converged(&client, "SIGSTOP and SIGCONT").await;
    fleet.balanced(total).await;

    // Restart the API server under everyone. While it is down nobody can own anything (every
    // lease lapses); what counts is how fast ownership is back once it is up.
    let t_restart = now_ns();
    tokio::task::spawn_blocking(|| controlplane::ControlPlane::shared().restart_apiserver().unwrap()).await.unwrap();
    let t_restarted = now_ns();
    converged(&client, "an apiserver restart").await;
    fleet.balanced(total).await;

    stop_churn.store(true, Ordering::Relaxed);
    let changes = churner.await.unwrap();
    converged(&client, "the last change").await;
    let t_end = now_ns();
    for name in fleet.replicas.keys().cloned().collect::<Vec<_>>() {
        fleet.terminate(&name);
    }

    // The audit: no object was ever reconciled by two replicas at once.
    let entries = audit::read_all(&audit_dir);
    let intervals = audit::reconcile_intervals(&entries, &forced_ends, now_ns());
    let overlaps = audit::overlaps(&intervals);
    println!(
        "audit: {} entries, {} reconciles, {} writes, {changes} spec changes during faults, {} overlapping reconciles",
        entries.len(),
        intervals.len(),
        entries.iter().filter(|e| e.event == "write").count(),
        overlaps.len()
    );
    assert!(
        overlaps.is_empty(),
        "two replicas reconciled one object at once: {:?}",
        &overlaps[..overlaps.len().min(5)]
    );

    // The frozen replica wrote nothing between resuming and reading a fresh assignment.
    let fresh = entries
        .iter()
        .find(|e| e.replica == frozen && e.event == "owned" && e.t > t_thaw)
        .expect("the frozen replica re-read the assignment after resuming");
    let stale_writes: Vec<_> =
        entries.iter().filter(|e| e.replica == frozen && e.event == "write" && e.t > t_thaw && e.t < fresh.t).collect();
    assert!(stale_writes.is_empty(), "writes after resuming past the deadline: {stale_writes:?}");
    let refused = entries.iter().filter(|e| e.replica == frozen && e.event == "write_refused" && e.t > t_thaw).count();

    let kill_takeover = takeover_seconds(&entries, "r-0", t_kill);
    let term_takeover = takeover_seconds(&entries, "r-1", t_term);
    let (longest, longest_from) = longest_unowned(&entries, &forced_ends, t_settled, t_restart);
    let (after_restart, _) = longest_unowned(&entries, &forced_ends, t_restarted, t_end);
    let since_start = |t: u128| format!("{:.1} s", t.saturating_sub(t_settled) as f64 / 1e9);
    println!(
        "timeline after settling: kill -9 at {}, SIGTERM at {}, SIGSTOP at {}, SIGCONT at {}, apiserver down {} to {}",
        since_start(t_kill),
        since_start(t_term),
        since_start(t_freeze),
        since_start(t_thaw),
        since_start(t_restart),
        since_start(t_restarted),
    );
    println!(
        "longest unowned bucket before the apiserver restart: {longest:?} (from {}); after it was back: {after_restart:?}",
        since_start(longest_from)
    );
    println!("takeover after kill -9: {kill_takeover:.2} s; after SIGTERM: {term_takeover:.2} s");
    println!("frozen replica: {refused} writes refused after resuming");
    assert!(kill_takeover <= UNOWNED_BOUND.as_secs_f64(), "takeover after kill -9 took {kill_takeover:.2} s");
    assert!(longest <= UNOWNED_BOUND, "a bucket stayed unowned for {longest:?}");
    assert!(
        after_restart <= UNOWNED_BOUND,
        "a bucket stayed unowned for {after_restart:?} after the apiserver was back"
    );
}
