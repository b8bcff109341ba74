//! The example controller with Leases (examples/leased_greeter.rs) as two members on the real
//! control plane: each greeting's ConfigMap comes from the member the published assignment
//! gives its namespace's bucket, stamped with that bucket's fencing token; when one member
//! stops, its buckets move and the other rewrites their ConfigMaps with a higher token.

#[path = "../examples/leased_greeter.rs"]
mod leased_greeter;

use std::collections::BTreeMap;
use std::time::Duration;

use controlplane::ControlPlane;
use controlplane::poll::eventually;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use leased_greeter::{Greeting, GreetingSpec, MEMBER_ANNOTATION, NAMES};
use sharding::assignment::Assignment;
use sharding::bucket::Mode;
use sharding::coordination::published::decode;
use sharding::membership::pod_of;
use tokio_util::sync::CancellationToken;

const COORDINATION_NAMESPACE: &str = "greeters";

/// Cancels the members when the test ends, pass or fail.
struct StopOnDrop(Vec<CancellationToken>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.iter().for_each(CancellationToken::cancel);
    }
}

async fn create_namespace(client: &Client, name: &str) {
    let ns = Namespace { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
}

/// The published assignment: each bucket's owning member (by pod name).
async fn owners(client: &Client) -> Result<Vec<Option<String>>, String> {
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), COORDINATION_NAMESPACE);
    let published = configmaps.get_opt(NAMES.assignment_configmap).await.map_err(|e| e.to_string())?;
    let (assignment, _): (Assignment, _) = published.as_ref().and_then(decode).ok_or("nothing published yet")?;
    Ok(assignment.slots.iter().map(|slot| slot.owner().map(|owner| pod_of(owner).to_string())).collect())
}

/// Each namespace's greeting ConfigMap: what it says, who wrote it, and its fencing token.
async fn greetings(client: &Client, namespaces: &[String]) -> Result<BTreeMap<String, (String, String, u64)>, String> {
    let mut found = BTreeMap::new();
    for namespace in namespaces {
        let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
        let cm = api.get_opt("hi-greeting").await.map_err(|e| e.to_string())?.ok_or(format!("none in {namespace}"))?;
        let says = cm.data.as_ref().and_then(|d| d.get("greeting")).cloned().unwrap_or_default();
        let writer = cm.annotations().get(MEMBER_ANNOTATION).cloned().unwrap_or_default();
        let token = cm.annotations().get(NAMES.fence_annotation).and_then(|t| t.parse().ok()).ok_or("no token")?;
        found.insert(namespace.clone(), (says, writer, token));
    }
    Ok(found)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_leases_greet_their_buckets_and_hand_them_over() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("sharding=info,sharded_runtime=info,leased_greeter=debug")
        .try_init();
    let cp = tokio::task::spawn_blocking(ControlPlane::shared).await.unwrap();
    let client = cp.client().await.unwrap();
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let params = PatchParams::apply("leased-greeter-test").force();
    crds.patch("greetings.example.com", &params, &Patch::Apply(Greeting::crd())).await.unwrap();
    eventually(Duration::from_secs(30), "the Greeting CRD served", async || {
        Api::<Greeting>::all(client.clone()).list(&Default::default()).await.map(drop).map_err(|e| e.to_string())
    })
    .await;
    create_namespace(&client, COORDINATION_NAMESPACE).await;

    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    let _stop = StopOnDrop(vec![stop_a.clone(), stop_b.clone()]);
    let member = |name: &'static str, stop: &CancellationToken| {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move { leased_greeter::run(client, name, COORDINATION_NAMESPACE, stop).await })
    };
    let (a, b) = (member("a", &stop_a), member("b", &stop_b));

    // Which member owns what depends on the incarnations' names: greet in two namespaces of
    // each member's slice.
    let bucket = |namespace: &str| usize::from(Mode::ShardSelector.bucket_of(namespace));
    let owners_now = eventually(Duration::from_secs(60), "an assignment to both members", async || {
        let owners = owners(&client).await?;
        let members: std::collections::BTreeSet<_> = owners.iter().flatten().collect();
        if members.len() < 2 { Err(format!("buckets owned by {members:?} only")) } else { Ok(owners) }
    })
    .await;
    let candidates = ["shop", "payments", "search", "checkout", "billing", "catalog", "orders", "cart", "users"];
    let candidates = candidates.iter().chain(&["reviews", "ads", "mail", "auth", "media", "inventory", "pricing"]);
    let mut namespaces = Vec::new();
    for name in ["a", "b"] {
        let theirs = candidates.clone().filter(|ns| owners_now[bucket(ns)].as_deref() == Some(name));
        namespaces.extend(theirs.take(2).map(|ns| ns.to_string()));
    }
    assert_eq!(namespaces.len(), 4, "two candidate namespaces in each member's slice: {owners_now:?}");
    for namespace in &namespaces {
        create_namespace(&client, namespace).await;
        let greeting = Greeting::new("hi", GreetingSpec { name: namespace.clone() });
        Api::<Greeting>::namespaced(client.clone(), namespace).create(&PostParams::default(), &greeting).await.unwrap();
    }

    // Each ConfigMap comes from its bucket's owner.
    let before = eventually(Duration::from_secs(60), "each greeting written by its bucket's owner", async || {
        let owners = owners(&client).await?;
        let found = greetings(&client, &namespaces).await?;
        for (namespace, (says, writer, _)) in &found {
            let owner = owners[bucket(namespace)].as_deref().unwrap_or("nobody");
            if *says != format!("hello, {namespace}") || writer != owner {
                return Err(format!("{namespace}: {says:?} by {writer}, owner {owner}"));
            }
        }
        Ok(found)
    })
    .await;

    // Member a stops: it hands its buckets over, and b rewrites their ConfigMaps with the
    // higher fencing token of the new epoch.
    stop_a.cancel();
    assert!(a.await.unwrap().unwrap(), "member a drains on shutdown");
    let after = eventually(Duration::from_secs(60), "every greeting written by b", async || {
        let found = greetings(&client, &namespaces).await?;
        match found.iter().find(|(_, (_, writer, _))| writer != "b") {
            Some((namespace, (_, writer, _))) => Err(format!("{namespace} still by {writer}")),
            None => Ok(found),
        }
    })
    .await;
    let moved: Vec<_> = before.iter().filter(|(_, (_, writer, _))| writer == "a").map(|(ns, _)| ns).collect();
    assert!(!moved.is_empty(), "member a wrote some greetings before it stopped: {before:?}");
    for namespace in moved {
        assert!(
            after[namespace].2 > before[namespace].2,
            "{namespace}: a moved bucket's token rises: {before:?} {after:?}"
        );
    }

    stop_b.cancel();
    assert!(b.await.unwrap().unwrap(), "member b drains on shutdown");
}
