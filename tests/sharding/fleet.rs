//! A fleet of operator replicas for one scenario: separate processes of the real binary,
//! each under its own service account (so the API server's audit log tells them apart),
//! in the scenario's own operator namespace, writing replica-side audit logs too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use controlplane::Grant;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use traffic_policy_operator::api::ApplicationTrafficPolicy;
use traffic_policy_operator::coordination::ASSIGNMENT_CONFIGMAP;
use traffic_policy_operator::sharding::assignment::{Assignment, Slot};

use crate::audit;
use crate::common::{Operator, TestEnv, eventually, operator_cluster_role};
use crate::grants;
use crate::server::{self, ForwardOnly, Verdict};

pub fn lease_duration() -> Duration {
    crate::common::lease_timings().0
}

pub const PER_NAMESPACE: usize = 5;

pub fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// One counter for every spec change the tests make: values only ever grow.
static COUNTER: AtomicU64 = AtomicU64::new(1);

pub struct Fleet {
    pub env: TestEnv,
    pub audit_dir: PathBuf,
    pub replicas: BTreeMap<String, Operator>,
    /// The service-account users of every process started, by replica name.
    pub users: BTreeMap<String, Vec<String>>,
    pub namespaces: Vec<String>,
    pub forward: ForwardOnly,
    /// Lease flags for the processes started from now on, instead of the suite's.
    pub lease_args: Vec<String>,
    /// Judge by spec changes as well as epochs (see `server::judge_by`).
    pub judge_spec_changes: bool,
    watcher: tokio::task::JoinHandle<()>,
    launches: usize,
    scenario: String,
}

impl Fleet {
    /// A fleet for `scenario`, with `namespaces` × [`PER_NAMESPACE`] policies of its own.
    pub async fn new(scenario: &str, namespaces: usize) -> Self {
        let env = TestEnv::new(&format!("op-{scenario}")).await;
        remove_leftovers(&env.client).await;
        let audit_dir = env.cp.dir().join(format!("audit-{scenario}"));
        std::fs::create_dir_all(&audit_dir).unwrap();
        let (forward, watcher) = ForwardOnly::watch(env.client.clone());
        let mut fleet = Self {
            env,
            audit_dir,
            replicas: BTreeMap::new(),
            users: BTreeMap::new(),
            namespaces: Vec::new(),
            forward,
            lease_args: Vec::new(),
            judge_spec_changes: true,
            watcher,
            launches: 0,
            scenario: scenario.into(),
        };
        for i in 0..namespaces {
            // The varying part is not last: the shard selector's hash (FNV-1a) spreads names that
            // differ only in their last character over very few buckets (docs/sharding.md).
            let ns = format!("{scenario}-{i}-ns");
            create_policies(&fleet.env.client, &ns, scenario, PER_NAMESPACE).await;
            fleet.namespaces.push(ns);
        }
        fleet
    }

    pub fn client(&self) -> Client {
        self.env.client.clone()
    }

    pub fn total(&self) -> usize {
        self.namespaces.len() * PER_NAMESPACE
    }

    /// Starts replica `name` as a new process and waits until it is ready.
    pub async fn start(&mut self, name: &str) {
        let mut replica = self.spawn(name, None).await;
        replica.wait_ready().await;
        self.replicas.insert(name.to_string(), replica);
    }

    /// Starts a process for replica `name` without waiting, optionally through another
    /// API server address (a proxy); returns it unregistered.
    pub async fn spawn(&mut self, name: &str, via_port: Option<u16>) -> Operator {
        let server = via_port.map(|port| format!("https://127.0.0.1:{port}"));
        self.launch(name, server, &operator_cluster_role().metadata.name.unwrap(), &[]).await
    }

    /// Starts replica `name` talking to the API server at `server` (a proxy), and waits until
    /// it is ready.
    pub async fn start_via(&mut self, name: &str, server: &str) {
        let role = operator_cluster_role().metadata.name.unwrap();
        let mut replica = self.launch(name, Some(server.to_string()), &role, &[]).await;
        replica.wait_ready().await;
        self.replicas.insert(name.to_string(), replica);
    }

    /// Starts replica `name` under ClusterRole `cluster_role` with `extra_args`, optionally
    /// through another API server address (a proxy), registered but not waited for: it may
    /// never be ready.
    pub async fn start_unready(&mut self, name: &str, cluster_role: &str, server: Option<&str>, extra_args: &[&str]) {
        let replica = self.launch(name, server.map(str::to_string), cluster_role, extra_args).await;
        self.replicas.insert(name.to_string(), replica);
    }

    async fn launch(
        &mut self,
        name: &str,
        server: Option<String>,
        cluster_role: &str,
        extra_args: &[&str],
    ) -> Operator {
        self.launches += 1;
        let account = format!("{name}-{}", self.launches);
        let grants = vec![Grant::ClusterRole(cluster_role.to_string())];
        let identity = self.env.operator_identity(&account, Some(grants)).await;
        self.users.entry(name.to_string()).or_default().push(identity.user.clone());
        let mut kubeconfig = identity.kubeconfig_path.clone();
        if let Some(server) = server {
            let text = std::fs::read_to_string(&kubeconfig).unwrap();
            let text = text.replace(&self.env.cp.server_url(), &server);
            kubeconfig = kubeconfig.with_extension("proxied.kubeconfig");
            std::fs::write(&kubeconfig, text).unwrap();
        }
        let mut args = vec![
            format!("--namespace={}", self.env.namespace),
            format!("--audit-log={}", self.audit_dir.join(format!("{account}.jsonl")).display()),
            "--workers=4".to_string(),
        ];
        args.extend(self.lease_args.iter().cloned());
        args.extend(extra_args.iter().map(|a| a.to_string()));
        Operator::spawn(self.env.cp, &kubeconfig, name, &args)
    }

    pub fn kill(&mut self, name: &str) -> u128 {
        let mut replica = self.replicas.remove(name).unwrap();
        let t = now_ns();
        replica.process.signal(libc::SIGKILL);
        replica.stop();
        t
    }

    pub fn terminate(&mut self, name: &str) -> u128 {
        let mut replica = self.replicas.remove(name).unwrap();
        let t = now_ns();
        let status = replica.stop().expect("exits");
        assert!(status.success(), "{name} must exit 0 on SIGTERM, got {status}");
        t
    }

    /// Uninstalls the operator and installs it again in `operator_namespace`, as a namespace
    /// move or a delete and re-apply of the install does: every replica stops, the operator's
    /// namespace goes with its Leases and assignment, and the replicas started from now on run
    /// in the new one. The policies and their children stay.
    pub async fn reinstall(&mut self, operator_namespace: &str) {
        for name in self.replicas.keys().cloned().collect::<Vec<_>>() {
            self.terminate(&name);
        }
        let namespaces = Api::<Namespace>::all(self.client());
        let old = self.env.namespace.clone();
        namespaces.delete(&old, &DeleteParams::default()).await.unwrap();
        eventually(&format!("the operator's namespace {old} is gone"), || async {
            namespaces.get_opt(&old).await.ok()?.is_none().then_some(())
        })
        .await;
        self.env = TestEnv::new(operator_namespace).await;
    }

    /// Per replica: (buckets owned, objects cached).
    pub fn shares(&self) -> BTreeMap<String, (f64, f64)> {
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

    /// Every replica owns something, all 1024 buckets are owned, and no handoff is pending in
    /// the published assignment.
    pub async fn balanced(&self) -> BTreeMap<String, (f64, f64)> {
        let configmaps = self.env.api::<ConfigMap>();
        eventually("every replica owns a slice, every bucket is owned, no handoff is pending", || async {
            let shares = self.shares();
            let owned: f64 = shares.values().map(|(b, _)| b).sum();
            let published = configmaps.get_opt(ASSIGNMENT_CONFIGMAP).await.ok()??;
            let assignment = Assignment::decode(&published.data?).ok()?;
            let settled = assignment.slots.iter().all(|s| matches!(s, Slot::Owned { .. }));
            (shares.values().all(|(b, _)| *b > 0.0) && owned == 1024.0 && settled).then_some(shares)
        })
        .await
    }

    /// Waits until every policy of this scenario is Ready for its latest generation.
    pub async fn converged(&self, what: &str) -> usize {
        let policies = Api::<ApplicationTrafficPolicy>::all(self.client());
        let labels = format!("scenario={}", self.scenario);
        eventually(&format!("every policy converges after {what}"), || async {
            let list = policies.list(&ListParams::default().labels(&labels)).await.ok()?;
            let all = list.items.iter().all(ApplicationTrafficPolicy::is_ready);
            all.then_some(list.items.len())
        })
        .await
    }

    /// Changes the spec of every policy of the fleet once.
    pub async fn change_every_policy(&self) {
        for ns in &self.namespaces {
            for i in 0..PER_NAMESPACE {
                set_rate(&self.client(), ns, &format!("app-{i}")).await.expect("spec changed");
            }
        }
    }

    /// A namespace of the fleet in `replica`'s slice, as its own audit log last said.
    pub fn namespace_owned_by(&self, replica: &str) -> String {
        let owned = audit::ownership_changes(&self.audit())
            .into_iter()
            .rfind(|(_, r, _)| r == replica)
            .map(|(_, _, buckets)| buckets)
            .unwrap_or_else(|| panic!("{replica} never owned anything"));
        let mode = crate::common::expected_mode();
        let owned_ns = self.namespaces.iter().find(|ns| owned.contains(&mode.bucket_of(ns)));
        owned_ns.cloned().unwrap_or_else(|| panic!("{replica} owns none of the fleet's namespaces"))
    }

    /// The published assignment.
    pub async fn assignment(&self) -> Assignment {
        let published = self.env.api::<ConfigMap>().get(ASSIGNMENT_CONFIGMAP).await.unwrap();
        Assignment::decode(published.data.as_ref().unwrap()).unwrap()
    }

    /// Keeps changing specs (one every 50 ms) until the returned flag is set.
    pub fn churn(&self) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u64>) {
        let stop = Arc::new(AtomicBool::new(false));
        let (client, namespaces, flag) = (self.client(), self.namespaces.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut changes = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let ns = &namespaces[rand::random_range(0..namespaces.len())];
                let name = format!("app-{}", rand::random_range(0..PER_NAMESPACE));
                // A restarting API server makes some of these fail; that is fine.
                if set_rate(&client, ns, &name).await.is_some() {
                    changes += 1;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            changes
        });
        (stop, task)
    }

    /// Our writes the API server received from this fleet's processes so far.
    pub fn server_writes(&self) -> Vec<server::Write> {
        let users: BTreeSet<String> = self.users.values().flatten().cloned().collect();
        server::writes(&self.env.cp.audit_log_path(), &users)
    }

    /// What the API server received from this fleet's processes, judged by the tokens and
    /// spec changes the writes carry, and against the grants of the assignment's history.
    pub fn verdict(&self) -> Verdict {
        let mut verdict = server::judge_by(&self.server_writes(), self.judge_spec_changes);
        let users: BTreeSet<String> = self.users.values().flatten().cloned().collect();
        verdict.after_grant = grants::violations(&self.env.cp.audit_log_path(), &users);
        verdict
    }

    pub fn audit(&self) -> Vec<audit::Entry> {
        audit::read_all(&self.audit_dir)
    }

    /// Stops every replica and checks what the server saw: no overlapping writes, no
    /// child going back to an older spec. Returns the verdict for the summary.
    pub async fn finish(mut self) -> Verdict {
        for name in self.replicas.keys().cloned().collect::<Vec<_>>() {
            self.terminate(&name);
        }
        self.watcher.abort();
        let verdict = self.verdict();
        let regressions = self.forward.regressions();
        assert!(verdict.overlapping.is_empty(), "overlapping writes seen by the server: {:?}", verdict.overlapping);
        assert!(
            verdict.after_grant.is_empty(),
            "writes after their bucket was granted to another: {:?}",
            verdict.after_grant
        );
        assert!(regressions.is_empty(), "children went back to an older spec: {regressions:?}");
        // The next scenario's fleet has its own assignment, with its own generations: it must
        // not find this one's children, stamped with epochs of another count.
        let namespaces = Api::<Namespace>::all(self.client());
        for ns in &self.namespaces {
            let _ = namespaces.delete(ns, &DeleteParams::default()).await;
        }
        for ns in &self.namespaces {
            eventually(&format!("namespace {ns} is gone"), || async {
                namespaces.get_opt(ns).await.ok()?.is_none().then_some(())
            })
            .await;
        }
        verdict
    }
}

/// Sets a policy's rate to the next value of the global counter; the value set. One change
/// at a time: two concurrent changes of one policy (the churn and a scenario's own) could
/// reach the API server in the opposite order of their values, and its spec go back.
pub async fn set_rate(client: &Client, namespace: &str, name: &str) -> Option<u64> {
    change_spec(client, namespace, name, |value| json!({ "spec": { "rateLimit": { "requestsPerSecond": value } } }))
        .await
}

/// Sets the path prefix of a policy's gateway half to `/v` and the next value of the global
/// counter; the value set.
pub async fn set_path(client: &Client, namespace: &str, name: &str) -> Option<u64> {
    let path = |value| json!({ "spec": { "gateway": { "paths": [{ "type": "PathPrefix", "value": format!("/v{value}") }] } } });
    change_spec(client, namespace, name, path).await
}

/// Merges `patch(value)` into a policy, with `value` the next of the global counter; the value.
pub async fn change_spec(
    client: &Client,
    namespace: &str,
    name: &str,
    patch: impl FnOnce(u64) -> serde_json::Value,
) -> Option<u64> {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let value = COUNTER.fetch_add(1, Ordering::Relaxed);
    let patch = patch(value);
    let api = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.ok().map(|_| value)
}

/// The label on every namespace a scenario creates.
const SCENARIO_NAMESPACE: &str = "sharding-scenario";

/// Deletes what an earlier scenario that failed left behind: its children carry epochs of
/// another fleet's count, which this fleet's writes must not meet.
async fn remove_leftovers(client: &Client) {
    let namespaces = Api::<Namespace>::all(client.clone());
    let params = ListParams::default().labels(SCENARIO_NAMESPACE);
    for ns in namespaces.list(&params).await.unwrap().items {
        let _ = namespaces.delete(&ns.name_any(), &DeleteParams::default()).await;
    }
    eventually("namespaces left by earlier scenarios are gone", || async {
        namespaces.list(&params).await.ok()?.items.is_empty().then_some(())
    })
    .await;
}

pub async fn create_policies(client: &Client, namespace: &str, scenario: &str, count: usize) {
    let labels = Some([(SCENARIO_NAMESPACE.to_string(), scenario.to_string())].into());
    let meta = ObjectMeta { name: Some(namespace.into()), labels, ..Default::default() };
    let ns = Namespace { metadata: meta, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    gateway_in(client, namespace).await;
    let policies = Api::<ApplicationTrafficPolicy>::namespaced(client.clone(), namespace);
    for i in 0..count {
        policies.create(&PostParams::default(), &policy(&format!("app-{i}"), scenario)).await.unwrap();
    }
}

pub fn policy(name: &str, scenario: &str) -> ApplicationTrafficPolicy {
    let mut policy = json!({
        "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
        "metadata": { "name": name, "labels": { "scenario": scenario } },
        "spec": {
            "applicationSelector": { "matchLabels": { "app": name } },
            "ingressRules": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8" } }], "ports": [{ "port": 8080 }] }],
            "rateLimit": { "requestsPerSecond": COUNTER.fetch_add(1, Ordering::Relaxed) }
        }
    });
    // One policy per namespace has a gateway half, so that the judge sees its writes too: a
    // generated HTTPRoute and a Traefik Middleware (no Traefik runs: the route stays Pending,
    // and the policy is looked at again with backoff). The last one, which no scenario singles
    // out: those that hold or freeze one policy's writes time that policy's reconciles.
    if name == format!("app-{}", PER_NAMESPACE - 1) {
        policy["spec"]["gateway"] =
            json!({ "parentRef": { "name": "edge" }, "backendRef": { "name": "app", "port": 80 } });
    }
    serde_json::from_value(policy).unwrap()
}

/// A Gateway `edge` in `namespace`, of a class served by Traefik's controller name.
async fn gateway_in(client: &Client, namespace: &str) {
    use traffic_policy_operator::reconcile::gateway::{gateway, gateway_class};
    crate::common::install_gateway_crds(client).await;
    let apply = PatchParams::apply("sharding-tests");
    let class: DynamicObject = serde_json::from_value(json!({ "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "GatewayClass", "metadata": { "name": "sharding" },
        "spec": { "controllerName": controlplane::gateway::TRAEFIK_CONTROLLER } }))
    .unwrap();
    let classes = Api::<DynamicObject>::all_with(client.clone(), &gateway_class());
    classes.patch("sharding", &apply, &Patch::Apply(&class)).await.unwrap();
    let edge: DynamicObject = serde_json::from_value(json!({ "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway", "metadata": { "name": "edge" },
        "spec": { "gatewayClassName": "sharding", "listeners": [{ "name": "web", "port": 80, "protocol": "HTTP" }] } }))
    .unwrap();
    let gateways = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &gateway());
    gateways.patch("edge", &apply, &Patch::Apply(&edge)).await.unwrap();
}

/// Polls `check` until it holds, for up to `DEADLINE`.
pub async fn until(what: &str, mut check: impl FnMut() -> bool) {
    eventually(what, || std::future::ready(check().then_some(()))).await
}
