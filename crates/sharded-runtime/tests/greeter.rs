//! The example controller (examples/greeter/) as two members on the real control plane:
//! each greeting gets its ConfigMap from the member whose slice holds its namespace, and an
//! edit of a greeting's spec reaches its ConfigMap.

#[path = "../examples/greeter/main.rs"]
mod greeter;

use std::time::Duration;

use controlplane::ControlPlane;
use controlplane::poll::eventually;
use greeter::{Greeting, GreetingSpec, MEMBER_ANNOTATION};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use tokio_util::sync::CancellationToken;

const MEMBERS: [&str; 2] = ["a", "b"];

/// The member whose slice holds `namespace`.
fn owner(namespace: &str) -> &'static str {
    let bucket = greeter::bucket_of(namespace);
    MEMBERS.into_iter().find(|m| greeter::slice_of(m, &MEMBERS).contains(&bucket)).expect("every bucket has an owner")
}

/// Cancels the members when the test ends, pass or fail.
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

async fn install_crd(client: &Client) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let params = PatchParams::apply("greeter-test").force();
    crds.patch("greetings.example.com", &params, &Patch::Apply(Greeting::crd())).await.unwrap();
    let greetings = Api::<Greeting>::all(client.clone());
    eventually(Duration::from_secs(30), "the Greeting CRD served", async || {
        greetings.list(&Default::default()).await.map(drop).map_err(|e| e.to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_each_greet_their_own_namespaces() {
    // The members' logs, shown when the test fails.
    let _ =
        tracing_subscriber::fmt().with_test_writer().with_env_filter("sharded_runtime=debug,greeter=debug").try_init();
    let cp = tokio::task::spawn_blocking(ControlPlane::shared).await.unwrap();
    let client = cp.client().await.unwrap();
    install_crd(&client).await;

    // Names that differ in more than their last characters: FNV-1a puts `team-1` … `team-8` in
    // neighbouring buckets, all of one member's.
    let namespaces: Vec<String> =
        ["shop", "payments", "search", "checkout", "billing", "catalog"].map(String::from).to_vec();
    let owners: Vec<&str> = namespaces.iter().map(|ns| owner(ns)).collect();
    assert!(MEMBERS.iter().all(|m| owners.contains(m)), "each member must own one of the namespaces: {owners:?}");
    for namespace in &namespaces {
        let ns = Namespace {
            metadata: ObjectMeta { name: Some(namespace.clone()), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
        let greeting = Greeting::new("hi", GreetingSpec { name: namespace.clone() });
        Api::<Greeting>::namespaced(client.clone(), namespace).create(&PostParams::default(), &greeting).await.unwrap();
    }

    let shutdown = CancellationToken::new();
    let _stop = StopOnDrop(shutdown.clone());
    let members: Vec<_> = MEMBERS
        .into_iter()
        .map(|member| tokio::spawn(greeter::run(client.clone(), member, &MEMBERS, shutdown.clone())))
        .collect();

    let greeting_in = |namespace: &str| {
        let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
        async move {
            let found = api.get_opt("hi-greeting").await.map_err(|e| e.to_string())?.ok_or("no ConfigMap yet")?;
            let says = found.data.as_ref().and_then(|d| d.get("greeting")).cloned().unwrap_or_default();
            let writer = found.annotations().get(MEMBER_ANNOTATION).cloned().unwrap_or_default();
            Ok::<_, String>((says, writer))
        }
    };
    for (namespace, owner) in namespaces.iter().zip(&owners) {
        let (says, writer) = eventually(Duration::from_secs(60), &format!("the greeting in {namespace}"), async || {
            greeting_in(namespace).await
        })
        .await;
        assert_eq!(says, format!("hello, {namespace}"));
        assert_eq!(writer, *owner, "{namespace} is written by the member whose slice holds it");
    }

    // An edit of the spec (a new generation) reaches the ConfigMap.
    let edited = &namespaces[0];
    let patch = serde_json::json!({ "spec": { "name": "world" } });
    Api::<Greeting>::namespaced(client.clone(), edited)
        .patch("hi", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the edited greeting", async || match greeting_in(edited).await? {
        (says, _) if says == "hello, world" => Ok(()),
        (says, _) => Err(says),
    })
    .await;

    shutdown.cancel();
    for member in members {
        assert!(member.await.unwrap(), "each member drains on shutdown");
    }
}
