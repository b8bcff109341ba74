//! Fixtures shared by the e2e and sharding suites: the shared control plane with our CRD
//! and ClusterRole installed, one namespace per test, and the real operator binary run as
//! a separate process under the roles from deploy/.
#![allow(dead_code)] // each suite uses its own part

use std::path::Path;
use std::time::{Duration, Instant};

use controlplane::manifests;
use controlplane::process::Process;
use controlplane::{ControlPlane, Grant};
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, GroupSubject, Subject};
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;
use traffic_policy_operator::api::{ApplicationTrafficPolicy, ConditionStatus};
use traffic_policy_operator::coordination::FENCE_ANNOTATION;
use traffic_policy_operator::sharding::bucket::Mode;

pub const DEADLINE: Duration = Duration::from_secs(60);
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// Polls `check` every 100 ms until it returns `Some`, or panics after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_within(DEADLINE, what, check).await
}

/// [`eventually`] with a deadline of the caller's, for work that is slow on purpose.
pub async fn eventually_within<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A test's own namespace on the shared control plane.
pub struct TestEnv {
    pub cp: &'static ControlPlane,
    pub client: Client,
    pub namespace: String,
}

/// A namespace with this label is outside the operator-reach policy's binding on the shared
/// control plane: there, the operator's own checks are all that keep it to its objects.
pub const WITHOUT_OPERATOR_REACH: (&str, &str) = ("tpo-test/operator-reach", "absent");

impl TestEnv {
    pub async fn new(namespace: &str) -> Self {
        Self::with_labels(namespace, &[]).await
    }

    /// A namespace that the operator-reach admission policy does not cover, as in a cluster
    /// without it.
    pub async fn without_operator_reach(namespace: &str) -> Self {
        Self::with_labels(namespace, &[WITHOUT_OPERATOR_REACH]).await
    }

    async fn with_labels(namespace: &str, labels: &[(&str, &str)]) -> Self {
        let cp = tokio::task::spawn_blocking(ControlPlane::shared).await.unwrap();
        let client = cp.client().await.unwrap();
        install_once(cp).await;
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(namespace.into()), labels: Some(labels), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
        Self { cp, client, namespace: namespace.into() }
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// A ServiceAccount bound to deploy/'s ClusterRoles, the bucket-label component's included
    /// (or to `cluster_grants` when given)
    /// and to deploy/'s Role in this namespace, which serves as the operator's namespace.
    pub async fn operator_identity(&self, name: &str, cluster_grants: Option<Vec<Grant>>) -> controlplane::Identity {
        let mut role: Role = read_yaml("deploy/base/role.yaml");
        role.metadata.namespace = Some(self.namespace.clone());
        let apply = PatchParams::apply("e2e-tests").force();
        self.api::<Role>().patch(&role.name_any(), &apply, &Patch::Apply(&role)).await.unwrap();
        let mut grants = cluster_grants.unwrap_or_else(|| {
            let deployed = [operator_cluster_role(), read_yaml(NAMESPACE_LABELS_ROLE)];
            deployed.iter().map(|role| Grant::ClusterRole(role.name_any())).collect()
        });
        grants.push(Grant::Role { namespace: self.namespace.clone(), name: role.name_any() });
        self.cp.identity(&self.namespace, name, &grants).await.unwrap()
    }

    /// deploy/'s ClusterRole as `name`, with `edit` applied to each rule, installed; its name.
    pub async fn limited_cluster_role(&self, name: &str, edit: impl Fn(&mut PolicyRule)) -> String {
        let mut limited = operator_cluster_role();
        limited.metadata.name = Some(name.into());
        limited.rules.iter_mut().flatten().for_each(edit);
        let apply = PatchParams::apply("e2e-tests").force();
        Api::<ClusterRole>::all(self.client.clone()).patch(name, &apply, &Patch::Apply(&limited)).await.unwrap();
        name.to_string()
    }

    /// Starts the operator for this namespace under deploy/'s ClusterRoles (see `operator_identity`).
    pub async fn start_operator(&self, extra_args: &[&str]) -> Operator {
        let identity = self.operator_identity("operator", None).await;
        Operator::start(self, &identity, extra_args).await
    }

    /// Waits until the policy reports Ready with `status` for its current generation.
    pub async fn wait_ready(&self, name: &str, status: ConditionStatus) -> ApplicationTrafficPolicy {
        let api = self.api::<ApplicationTrafficPolicy>();
        eventually(&format!("{name} is Ready={status:?} for its generation"), || async {
            let policy = api.get_opt(name).await.ok()??;
            let s = policy.status.as_ref()?;
            let ready = s.conditions.iter().find(|c| c.type_ == "Ready")?;
            (ready.status == status && s.observed_generation == policy.metadata.generation).then_some(policy)
        })
        .await
    }
}

async fn install_once(cp: &'static ControlPlane) {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            let client = cp.client().await.unwrap();
            let apply = PatchParams::apply("e2e-tests").force();
            let crd: CustomResourceDefinition = read_yaml("crds/applicationtrafficpolicies.trafficpolicy.dev.yaml");
            let crds = Api::<CustomResourceDefinition>::all(client.clone());
            crds.patch(&crd.name_any(), &apply, &Patch::Apply(&crd)).await.unwrap();
            // The admission policies of deploy/'s components: fencing, the operator's reach, and
            // bucket labels where the server has MutatingAdmissionPolicy.
            // Every test runs its operators under service accounts of its own: each is the operator
            // to the fencing policy; any other identity (the admin, an impersonated tenant) is not.
            let mut components = vec!["fencing/fencing.yaml", "operator-reach/operator-reach.yaml"];
            if cp.release().has_mutating_admission_policy() {
                components.push("bucket-labels/bucket-labels.yaml");
            }
            for component in components {
                let mut objects = manifests::read(&Path::new(REPO).join("deploy/components").join(component)).unwrap();
                manifests::set_operator_identity(&mut objects, FROM_OPERATOR);
                exempt_from_operator_reach(&mut objects);
                manifests::apply(&client, &objects, "e2e-tests").await.unwrap();
            }
            // deploy/base/flowschema.yaml, for every service account: each test runs its operators
            // under accounts of its own.
            let mut schema: FlowSchema = read_yaml("deploy/base/flowschema.yaml");
            schema.metadata.name = Some("traffic-policy-operator-coordination-tests".into());
            let spec = schema.spec.as_mut().unwrap();
            spec.matching_precedence = Some(310);
            for rule in spec.rules.iter_mut().flatten() {
                rule.subjects = vec![Subject {
                    kind: "Group".into(),
                    group: Some(GroupSubject { name: "system:serviceaccounts".into() }),
                    ..Default::default()
                }];
                // Leases only: the tests' children may share a namespace with their operator.
                let rules = rule.resource_rules.get_or_insert_default();
                rules.retain(|r| r.resources.iter().any(|resource| resource == "leases"));
                rules.iter_mut().for_each(|r| r.namespaces = Some(vec!["*".into()]));
            }
            let schemas = Api::<FlowSchema>::all(client.clone());
            schemas.patch(&schema.name_any(), &apply, &Patch::Apply(&schema)).await.unwrap();
            for role in [operator_cluster_role(), read_yaml(NAMESPACE_LABELS_ROLE)] {
                Api::<ClusterRole>::all(client.clone())
                    .patch(&role.name_any(), &apply, &Patch::Apply(&role))
                    .await
                    .unwrap();
            }
            eventually("the CRD is established", || async {
                let crd = crds.get(&crd.name_any()).await.ok()?;
                crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
            })
            .await;
            manifests::wait_policies_admitted(&client, "default", DEADLINE).await.unwrap();
        })
        .await;
}

/// Leaves the namespaces labelled [`WITHOUT_OPERATOR_REACH`] out of the operator-reach binding.
fn exempt_from_operator_reach(objects: &mut [kube::api::DynamicObject]) {
    let (key, _) = WITHOUT_OPERATOR_REACH;
    for binding in objects.iter_mut().filter(|o| o.name_any() == "trafficpolicy.dev-operator-reach") {
        if binding.types.as_ref().is_some_and(|t| t.kind == "ValidatingAdmissionPolicyBinding") {
            binding.data["spec"]["matchResources"] = serde_json::json!({
                "namespaceSelector": { "matchExpressions": [{ "key": key, "operator": "DoesNotExist" }] }
            });
        }
    }
}

/// The fencing policy's binding, removed while a scenario shows that the timing layer holds
/// on its own; put back by [`Unfenced::restore`], or when dropped (a failed test).
/// Installs the gateway CRDs (Gateway API, Traefik's, Envoy Gateway's BackendTrafficPolicy),
/// once per test process; the first call may build Traefik (see `controlplane::gateway`).
pub async fn install_gateway_crds(client: &Client) {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            let files = tokio::task::spawn_blocking(controlplane::gateway::crd_files).await.unwrap().unwrap();
            let mut names = Vec::new();
            for file in files {
                let objects = manifests::read(&file).unwrap();
                names.extend(objects.iter().map(|o| o.name_any()));
                manifests::apply(client, &objects, "e2e-tests").await.unwrap();
            }
            let crds = Api::<CustomResourceDefinition>::all(client.clone());
            for name in names {
                eventually(&format!("CRD {name} is established"), || async {
                    let crd = crds.get(&name).await.ok()?;
                    let conditions = crd.status?.conditions?;
                    conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
                })
                .await;
            }
        })
        .await;
}

pub struct Unfenced {
    binding: Option<ValidatingAdmissionPolicyBinding>,
}

impl Unfenced {
    pub const BINDING: &str = "trafficpolicy.dev-fencing";

    pub async fn remove() -> Self {
        // The binding is there to remove only once the suite installed it, which a scenario
        // run first would not have done yet.
        let cp = tokio::task::spawn_blocking(ControlPlane::shared).await.unwrap();
        install_once(cp).await;
        let client = shared_client().await;
        let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone());
        let mut binding = bindings.get(Self::BINDING).await.unwrap();
        bindings.delete(Self::BINDING, &Default::default()).await.unwrap();
        eventually("the fencing policy no longer refuses a token set by hand", || async {
            (!fencing_in_force(&client).await).then_some(())
        })
        .await;
        binding.metadata = ObjectMeta { name: binding.metadata.name.take(), ..Default::default() };
        Self { binding: Some(binding) }
    }

    pub async fn restore(mut self) {
        if let Some(binding) = self.binding.take() {
            restore_binding(binding).await;
        }
    }
}

impl Drop for Unfenced {
    fn drop(&mut self) {
        if let Some(binding) = self.binding.take() {
            tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(restore_binding(binding)));
        }
    }
}

async fn shared_client() -> Client {
    let cp = tokio::task::spawn_blocking(ControlPlane::shared).await.unwrap();
    cp.client().await.unwrap()
}

async fn restore_binding(binding: ValidatingAdmissionPolicyBinding) {
    let client = shared_client().await;
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    eventually("the fencing policy refuses a token set by hand again", || async {
        fencing_in_force(&client).await.then_some(())
    })
    .await;
}

/// Whether the fencing policy is in force: it refuses the admin's dry-run ConfigMap with a token.
async fn fencing_in_force(admin: &Client) -> bool {
    let forged = ConfigMap {
        metadata: ObjectMeta {
            name: Some("fencing-probe".into()),
            annotations: Some([(FENCE_ANNOTATION.to_string(), "1".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    Api::<ConfigMap>::namespaced(admin.clone(), "default").create(&dry_run, &forged).await.is_err()
}

/// Who the fencing policy takes for the operator on the shared control plane.
pub const FROM_OPERATOR: &str = "request.userInfo.username.startsWith('system:serviceaccount:')";

/// The bucket-label component's grant to label namespaces.
const NAMESPACE_LABELS_ROLE: &str = "deploy/components/bucket-labels/clusterrole.yaml";

pub fn operator_cluster_role() -> ClusterRole {
    read_yaml("deploy/base/clusterrole.yaml")
}

/// The one document of a YAML file in the repo (a leading `---` and comments allowed).
pub fn read_yaml<T: serde::de::DeserializeOwned>(path: &str) -> T {
    let text = std::fs::read_to_string(Path::new(REPO).join(path)).unwrap();
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Lease duration, renew deadline and retry period for the replicas the tests start.
/// The sharding mode the operator picks on the shared control plane: the shard selector
/// where its kube-apiserver honours one (see `controlplane::sharded_list_and_watch`).
pub fn expected_mode() -> Mode {
    if controlplane::sharded_list_and_watch() { Mode::ShardSelector } else { Mode::Labels }
}

/// Short timings (4 s / 3 s / 0.5 s) keep the suites quick; `TPO_TEST_LEASE_TIMINGS=15,10,2`
/// (seconds) runs them at client-go's defaults instead, to measure takeover there.
pub fn lease_timings() -> (Duration, Duration, Duration) {
    let parsed = std::env::var("TPO_TEST_LEASE_TIMINGS").ok().and_then(|v| {
        let secs: Vec<f64> = v.split(',').map(|s| s.trim().parse().ok()).collect::<Option<_>>()?;
        match secs[..] {
            [ld, rd, rp] => {
                Some((Duration::from_secs_f64(ld), Duration::from_secs_f64(rd), Duration::from_secs_f64(rp)))
            }
            _ => None,
        }
    });
    parsed.unwrap_or((Duration::from_secs(4), Duration::from_secs(3), Duration::from_millis(500)))
}

/// The operator binary, running as its own process.
pub struct Operator {
    pub process: Process,
    pub metrics_port: u16,
    pub probe_port: u16,
}

impl Operator {
    /// Starts the operator for `env`'s namespace only, with that namespace as its own.
    pub async fn start(env: &TestEnv, identity: &controlplane::Identity, extra_args: &[&str]) -> Self {
        let mut args: Vec<String> =
            vec![format!("--watch-namespace={}", env.namespace), format!("--namespace={}", env.namespace)];
        args.extend(extra_args.iter().map(|s| s.to_string()));
        let name = format!("operator-{}", env.namespace);
        Self::launch(env.cp, identity, &name, &args).await
    }

    /// Starts replica `name` with `args` plus the common flags, and waits until ready.
    pub async fn launch(cp: &ControlPlane, identity: &controlplane::Identity, name: &str, args: &[String]) -> Self {
        let mut operator = Self::spawn(cp, &identity.kubeconfig_path, name, args);
        operator.wait_ready().await;
        operator
    }

    /// Starts replica `name` with the given kubeconfig, without waiting for it.
    pub fn spawn(cp: &ControlPlane, kubeconfig: &Path, name: &str, args: &[String]) -> Self {
        let timings = lease_timings();
        // The caller may choose the ports (`--metrics-addr=127.0.0.1:PORT`); free ones otherwise.
        let port = |flag: &str| {
            let given = args.iter().find_map(|a| a.strip_prefix(&format!("{flag}=127.0.0.1:"))?.parse().ok());
            given.unwrap_or_else(|| controlplane::free_port().unwrap())
        };
        let (metrics_port, probe_port) = (port("--metrics-addr"), port("--health-probe-addr"));
        let log = cp.dir().join(format!("{name}-{metrics_port}.log"));
        let mut all: Vec<String> = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--metrics-addr=127.0.0.1:{metrics_port}"),
            format!("--health-probe-addr=127.0.0.1:{probe_port}"),
            format!("--pod-name={name}"),
            "--log-format=json".into(),
            "--log-level=info".into(),
        ];
        // The caller's own lease timings win over the suite's.
        if !args.iter().any(|a| a.starts_with("--lease-duration")) {
            all.push(format!("--lease-duration={}s", timings.0.as_secs()));
            all.push(format!("--renew-deadline={}s", timings.1.as_secs()));
            all.push(format!("--retry-period={}ms", timings.2.as_millis()));
        }
        all.extend(
            args.iter()
                .filter(|a| !a.starts_with("--metrics-addr=") && !a.starts_with("--health-probe-addr="))
                .cloned(),
        );
        let binary = Path::new(env!("CARGO_BIN_EXE_traffic-policy-operator"));
        let process = Process::start("traffic-policy-operator", binary, &all, &log).unwrap();
        Self { process, metrics_port, probe_port }
    }

    /// Polls `/readyz` until it answers 200.
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + DEADLINE;
        while !self.is_ready() {
            if let Some(status) = self.process.exited() {
                panic!("{}", self.process.failure(&format!("exited at start ({status})")));
            }
            assert!(Instant::now() < deadline, "{}", self.process.failure("not ready in time"));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn is_ready(&self) -> bool {
        self.get("/readyz").is_ok_and(|r| r.contains(" 200 "))
    }

    /// `/metrics` from the metrics server, anything else from the health-probe server.
    pub fn get(&self, path: &str) -> anyhow::Result<String> {
        let port = if path == "/metrics" { self.metrics_port } else { self.probe_port };
        controlplane::http_get_plain(port, path)
    }

    /// The sum of every series of `name` (optionally only those containing `label`).
    /// The sum of metric `name`'s series (those with `label`, if given). Of the work queue's
    /// and the controller's metrics, only the policy controller's series count: the leader's
    /// labelling controllers (`namespace-labels`, `policy-labels`) have their own.
    pub fn metric(&self, name: &str, label: Option<&str>) -> f64 {
        let text = self.get("/metrics").unwrap();
        let per_controller = name.starts_with("workqueue_") || name.starts_with("controller_runtime_");
        let controller = "controller=\"applicationtrafficpolicy\"";
        text.lines()
            .filter(|line| line.split(['{', ' ']).next() == Some(name) && label.is_none_or(|l| line.contains(l)))
            .filter(|line| !per_controller || line.contains(controller))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn successful_reconciles(&self) -> f64 {
        self.metric("controller_runtime_reconcile_total", Some("result=\"success\""))
    }

    /// SIGTERM, and how the process exited.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        self.process.stop(Duration::from_secs(20))
    }
}

/// What `user` wrote, as kube-apiserver's audit log has it (see
/// `ControlPlane::audit_log_path`): `resource/namespace/name[/subresource]`, oldest first.
pub fn audited_writes(cp: &ControlPlane, user: &str) -> Vec<String> {
    let text = std::fs::read_to_string(cp.audit_log_path()).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|e| e["stage"] == "ResponseComplete" && e["user"]["username"] == user)
        .map(|e| {
            let r = &e["objectRef"];
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            let sub = field("subresource");
            let object = format!("{}/{}/{}", field("resource"), field("namespace"), field("name"));
            if sub.is_empty() { object } else { format!("{object}/{sub}") }
        })
        .collect()
}
