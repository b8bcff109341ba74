//! The reconcile against recorded API answers, as controller-rs tests its reconciler: a
//! client whose every request is recorded and answered from a table, and a write gate that
//! says yes (or no). What it sends, in which order, for each answer the API server may give.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response};
use kube::Client;
use kube::client::Body;
use kube::core::Status;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::runtime::Priority;

use super::*;
use crate::api::ApplicationTrafficPolicySpec;
use crate::runtime::gate::Permit;

/// One request the reconcile sent: method, path (no query) and body.
#[derive(Clone, Debug)]
struct Sent {
    method: Method,
    path: String,
    query: Option<String>,
    body: Value,
}

type Answer = fn(&Method, &str) -> (u16, Value);

/// A client that records each request and answers it with `answer`.
fn recording_client(answer: Answer) -> (Client, Arc<Mutex<Vec<Sent>>>) {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let record = sent.clone();
    let service = tower::service_fn(move |request: Request<Body>| {
        let record = record.clone();
        async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await?;
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (method, path) = (parts.method.clone(), parts.uri.path().to_string());
            let query = parts.uri.query().map(str::to_string);
            let (code, answer) = answer(&method, &path);
            record.lock().unwrap().push(Sent { method, path, query, body });
            let response = Response::builder().status(code).body(Body::from(serde_json::to_vec(&answer).unwrap()));
            Ok::<_, kube::Error>(response.unwrap())
        }
    });
    (Client::new(service, "default"), sent)
}

/// The API server as it answers a healthy reconcile: no child exists yet, and each apply
/// answers with a new resourceVersion.
fn accepts(method: &Method, path: &str) -> (u16, Value) {
    match path {
        _ if method == Method::GET => {
            (404, serde_json::to_value(Status::failure("not found", "NotFound").with_code(404)).unwrap())
        }
        p if p.ends_with("/status") || p.contains("/events") => (200, json!({})),
        _ => (200, json!({ "metadata": { "resourceVersion": "41" } })),
    }
}

/// A tenant made a NetworkPolicy of the policy's name; the ConfigMap is the policy's own.
fn a_tenant_holds_the_network_policy(method: &Method, path: &str) -> (u16, Value) {
    let meta = |extra: Value| {
        let mut metadata = json!({ "name": "web", "namespace": "shop", "resourceVersion": "17" });
        metadata.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json!({ "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": metadata })
    };
    match path {
        NETWORK_POLICY if method == Method::GET => {
            (200, meta(json!({ "managedFields": [{ "manager": "kubectl-create", "operation": "Update" }] })))
        }
        CONFIG_MAP if method == Method::GET => (
            200,
            meta(
                json!({ "ownerReferences": [{ "apiVersion": "trafficpolicy.dev/v1", "kind": "ApplicationTrafficPolicy",
                "name": "web", "uid": "an-earlier-uid", "controller": true }] }),
            ),
        ),
        _ => accepts(method, path),
    }
}

/// Like [`a_tenant_holds_the_network_policy`], with the NetworkPolicy the policy's own too.
fn both_children_are_the_policys(method: &Method, path: &str) -> (u16, Value) {
    match path {
        NETWORK_POLICY if method == Method::GET => a_tenant_holds_the_network_policy(method, CONFIG_MAP),
        _ => a_tenant_holds_the_network_policy(method, path),
    }
}

/// Refuses the NetworkPolicy as invalid (a value the CRD schema could not rule out).
fn refuses_the_network_policy(method: &Method, path: &str) -> (u16, Value) {
    if path.contains("/networkpolicies/") && method == Method::PATCH {
        let status = Status::failure("NetworkPolicy.networking.k8s.io \"web\" is invalid", "Invalid").with_code(422);
        return (422, serde_json::to_value(status).unwrap());
    }
    accepts(method, path)
}

/// The fencing policy refuses every child: a higher token is stored.
fn fences_the_children(method: &Method, path: &str) -> (u16, Value) {
    if (path.contains("/networkpolicies/") || path.contains("/configmaps/")) && method == Method::PATCH {
        let status = Status::failure("denied: a newer token (fenced)", "Forbidden").with_code(403);
        return (403, serde_json::to_value(status).unwrap());
    }
    accepts(method, path)
}

/// A gate that permits every write with token 7, or none.
struct TestGate {
    permits: bool,
}

impl WriteGate for TestGate {
    fn check(&self, _: &str) -> Result<Permit> {
        match self.permits {
            true => Ok(Permit { token: 7, sent: Instant::now() }),
            false => Err(Error::LostOwnership),
        }
    }
    fn permitted(&self) -> bool {
        self.permits
    }
    fn write_bound(&self) -> Duration {
        Duration::from_secs(5)
    }
    fn routing_labels(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    fn abandoned(&self, _: Instant) {}
    fn stamp(&self, permit: &Permit, annotations: &mut BTreeMap<String, String>) {
        annotations.insert("test/token".into(), permit.token.to_string());
    }
    fn is_fenced(&self, refusal: &Status) -> bool {
        refusal.message.contains("fenced")
    }
}

fn policy() -> ApplicationTrafficPolicy {
    let spec: ApplicationTrafficPolicySpec = serde_json::from_value(json!({
        "applicationSelector": { "matchLabels": { "app": "web" } },
        "ingressRules": [{ "ports": [{ "port": 8080 }] }],
        "rateLimit": { "requestsPerSecond": 100, "burst": 20 },
    }))
    .unwrap();
    let mut policy = ApplicationTrafficPolicy::new("web", spec);
    policy.metadata.namespace = Some("shop".into());
    policy.metadata.uid = Some("3f1c5e2a-0000-4000-8000-000000000001".into());
    policy.metadata.generation = Some(2);
    policy
}

fn reconciler(client: Client) -> TrafficPolicyReconciler {
    let reporter = kube::runtime::events::Reporter { controller: "test".into(), instance: None };
    TrafficPolicyReconciler::new(client.clone(), Events::new(client, reporter), Arc::default())
}

/// What was sent, as `METHOD path` lines.
fn lines(sent: &[Sent]) -> Vec<String> {
    sent.iter().map(|s| format!("{} {}", s.method, s.path)).collect()
}

const NETWORK_POLICY: &str = "/apis/networking.k8s.io/v1/namespaces/shop/networkpolicies/web";
const CONFIG_MAP: &str = "/api/v1/namespaces/shop/configmaps/web";
const STATUS: &str = "/apis/trafficpolicy.dev/v1/namespaces/shop/applicationtrafficpolicies/web/status";

fn ready(status_patch: &Value) -> (&str, &str) {
    let ready = status_patch["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap();
    (ready["status"].as_str().unwrap(), ready["reason"].as_str().unwrap())
}

#[tokio::test]
async fn a_new_policy_is_applied_stamped_and_reported_then_nothing_is_written_again() {
    let (client, sent) = recording_client(accepts);
    let reconciler = reconciler(client);
    let key = ObjectKey::new("shop", "web");
    let gate = TestGate { permits: true };

    let action =
        reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await.unwrap();
    assert_eq!(action, Action::Done);
    let first = sent.lock().unwrap().drain(..).collect::<Vec<_>>();
    let mut reads: Vec<String> = lines(&first[..2]);
    reads.sort();
    assert_eq!(reads, [format!("GET {CONFIG_MAP}"), format!("GET {NETWORK_POLICY}")], "whose each name is, first");
    let mut children: Vec<String> = lines(&first[2..4]);
    children.sort();
    assert_eq!(children, [format!("PATCH {CONFIG_MAP}"), format!("PATCH {NETWORK_POLICY}")], "both children at once");
    for child in &first[2..4] {
        assert!(child.body["metadata"]["resourceVersion"].is_null(), "a new child has no precondition");
        let annotations = &child.body["metadata"]["annotations"];
        assert_eq!(annotations["test/token"], "7", "the gate stamps its token: {}", child.path);
        assert!(annotations[CONTENT_ANNOTATION].is_string(), "the content hash: {}", child.path);
    }
    let status = first.iter().find(|s| s.path == STATUS).expect("a status write");
    assert_eq!(ready(&status.body), ("True", "Applied"));
    assert_eq!(status.body["status"]["shardEpoch"], 7, "the status carries the token");
    assert_eq!(status.body["status"]["observedGeneration"], 2);
    let event = first.iter().find(|s| s.path.contains("/events")).expect("an Applied event");
    assert_eq!(event.body["reason"], "Applied");
    assert_eq!(first.len(), 6, "{:?}", lines(&first));

    // Again, before the cache shows the status: the children are known to hold what would
    // be written, and the event went out; only the status is written again.
    reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await.unwrap();
    assert_eq!(lines(&sent.lock().unwrap().drain(..).collect::<Vec<_>>()), [format!("PATCH {STATUS}")]);

    // Once the cache shows that status: nothing at all.
    let mut written = policy();
    written.status = Some(serde_json::from_value(status.body["status"].clone()).unwrap());
    reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&written)), &gate, Priority::High).await.unwrap();
    assert!(sent.lock().unwrap().is_empty(), "{:?}", lines(&sent.lock().unwrap()));

    // A new spec: the children are known to be as our writes left them, so they are ours
    // without a read, and forced to the new spec.
    let mut changed = policy();
    changed.spec.ingress_rules[0].ports[0].port = 9090;
    changed.metadata.generation = Some(3);
    reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&changed)), &gate, Priority::High).await.unwrap();
    let updated = sent.lock().unwrap().drain(..).collect::<Vec<_>>();
    assert!(updated.iter().all(|s| s.method != Method::GET), "no read: {:?}", lines(&updated));
    let np = updated.iter().find(|s| s.path == NETWORK_POLICY).expect("the NetworkPolicy follows the spec");
    assert!(np.query.as_deref().is_some_and(|q| q.contains("force=true")), "{:?}", np.query);
    assert!(np.body["metadata"]["resourceVersion"].is_null(), "no version was read to require");
}

#[tokio::test]
async fn a_spec_the_server_refuses_is_reported_and_not_retried() {
    let (client, sent) = recording_client(refuses_the_network_policy);
    let key = ObjectKey::new("shop", "web");
    let (reconciler, gate) = (reconciler(client), TestGate { permits: true });
    let result = reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await;
    let error = result.unwrap_err();
    assert!(matches!(error, Error::InvalidSpec(_)) && error.is_terminal(), "{error:?}");
    let sent = sent.lock().unwrap();
    let status = sent.iter().find(|s| s.path == STATUS).expect("a status write");
    assert_eq!(ready(&status.body), ("False", "InvalidSpec"));
    let message = status.body["status"]["conditions"][0]["message"].as_str().unwrap();
    assert!(message.contains("is invalid"), "the server's words reach the status: {message}");
}

#[tokio::test]
async fn a_fenced_write_while_the_bucket_is_ours_is_a_token_conflict_in_the_status() {
    let (client, sent) = recording_client(fences_the_children);
    let key = ObjectKey::new("shop", "web");
    let (reconciler, gate) = (reconciler(client), TestGate { permits: true });
    let result = reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await;
    let error = result.unwrap_err();
    assert!(matches!(error, Error::ForeignToken(_)) && !error.is_terminal(), "retried with backoff: {error:?}");
    let sent = sent.lock().unwrap();
    let status = sent.iter().find(|s| s.path == STATUS).expect("a status write");
    assert_eq!(ready(&status.body), ("False", status::TOKEN_CONFLICT));
}

#[tokio::test]
async fn a_reconcile_that_may_not_write_sends_nothing() {
    let (client, sent) = recording_client(accepts);
    let key = ObjectKey::new("shop", "web");
    let (reconciler, gate) = (reconciler(client), TestGate { permits: false });
    let result = reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await;
    assert!(matches!(result, Err(Error::LostOwnership)));
    assert!(sent.lock().unwrap().is_empty(), "{:?}", lines(&sent.lock().unwrap()));
}

#[tokio::test]
async fn a_tenants_object_of_a_childs_name_is_reported_and_nothing_is_written() {
    let (client, sent) = recording_client(a_tenant_holds_the_network_policy);
    let key = ObjectKey::new("shop", "web");
    let (reconciler, gate) = (reconciler(client), TestGate { permits: true });
    let result = reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await;
    let error = result.unwrap_err();
    assert!(matches!(error, Error::NotOwned(_)) && !error.is_terminal(), "retried with backoff: {error:?}");
    assert_eq!(error.kind(), "not_owned");
    let sent = sent.lock().unwrap();
    let children: Vec<_> = sent.iter().filter(|s| s.method != Method::GET && !s.path.contains("/events")).collect();
    assert_eq!(
        lines(&children.into_iter().cloned().collect::<Vec<_>>()),
        [format!("PATCH {STATUS}")],
        "no child written"
    );
    let status = sent.iter().find(|s| s.path == STATUS).unwrap();
    assert_eq!(ready(&status.body), ("False", status::CONFLICT));
    let message = status.body["status"]["conditions"][0]["message"].as_str().unwrap();
    assert!(
        message.starts_with("NetworkPolicy shop/web exists and is not this policy's (managed by kubectl-create)"),
        "{message}"
    );
    assert!(!message.contains("ConfigMap"), "the ConfigMap is the policy's own: {message}");
    let event = sent.iter().find(|s| s.path.contains("/events")).expect("a Warning event");
    assert_eq!((event.body["type"].as_str(), event.body["reason"].as_str()), (Some("Warning"), Some("Conflict")));
}

#[tokio::test]
async fn the_policys_own_children_are_forced_back_at_the_version_read() {
    let (client, sent) = recording_client(both_children_are_the_policys);
    let key = ObjectKey::new("shop", "web");
    let (reconciler, gate) = (reconciler(client), TestGate { permits: true });
    reconciler.reconcile(&key, Arc::new(CachedPolicy::new(&policy())), &gate, Priority::High).await.unwrap();
    let sent = sent.lock().unwrap();
    for child in [NETWORK_POLICY, CONFIG_MAP] {
        let apply = sent.iter().find(|s| s.method == Method::PATCH && s.path == child).expect("applied");
        assert_eq!(apply.body["metadata"]["resourceVersion"], "17", "only at the version read: {child}");
        assert!(apply.query.as_deref().is_some_and(|q| q.contains("force=true")), "forced: {:?}", apply.query);
    }
}
