//! A second controller on the runtime, sharded by the `sharding` crate: for each `Greeting`
//! (`example.com/v1`), a ConfigMap `<name>-greeting` that says hello to `spec.name`.
//!
//! Run one process per member. Each reconciles only the namespaces whose buckets the ring
//! gives it among the members, and its watches ask the API server for those namespaces
//! only (a shard selector; a server without them sends everything, and the runtime drops
//! what is not the member's). The members are fixed here, so no bucket ever moves and the
//! gate is [`Unguarded`]; traffic-policy-operator adds Leases, handoffs and fencing on top
//! of the same pieces.
//!
//! ```sh
//! cargo run -q -p sharded-runtime --example greeter -- crd | kubectl apply -f -
//! cargo run -p sharded-runtime --example greeter -- run a a,b &   # member a of a and b
//! cargo run -p sharded-runtime --example greeter -- run b a,b &
//! ```

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, PartialObjectMeta, Patch, PatchParams};
use kube::core::Request;
use kube::{Client, CustomResource, CustomResourceExt, Resource, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sharded_runtime::backoff::Backoff;
use sharded_runtime::child_versions::{ChildVersions, ContentStamp, content_hash};
use sharded_runtime::error::Result;
use sharded_runtime::gate::{WriteGate, bounded, with_server_timeout};
use sharded_runtime::health::Health;
use sharded_runtime::parts::{self, Buckets, SliceSelector, Slicing};
use sharded_runtime::reconciler::Unguarded;
use sharded_runtime::watch_health::WatchHealth;
use sharded_runtime::{Action, Controller, ObjectKey, Reconciler, Settings, cache, watch};
use sharding::bucket::{Bucket, Mode};
use sharding::{ring::Ring, shard_range};
use tokio_util::sync::CancellationToken;

#[derive(CustomResource, Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[kube(group = "example.com", version = "v1", kind = "Greeting", namespaced)]
pub struct GreetingSpec {
    pub name: String,
}

/// On each greeting ConfigMap: the member that wrote it.
pub const MEMBER_ANNOTATION: &str = "example.com/member";
const CHILD_LABEL: &str = "example.com/greeting";
const STAMP: ContentStamp = ContentStamp { annotation: "example.com/content", field_manager: "greeter" };

/// The buckets `member` owns among `members`: the same on every member.
pub fn slice_of(member: &str, members: &[&str]) -> Buckets {
    let ring = Ring::new(members);
    let owners = ring.assign_names();
    (0..).zip(owners).filter(|(_, owner)| *owner == Some(member)).map(|(bucket, _)| bucket).collect()
}

/// A namespace's bucket, as the API server's shard selector hashes it.
pub fn bucket_of(namespace: &str) -> Bucket {
    Mode::ShardSelector.bucket_of(namespace)
}

/// Runs `member`'s controller until `shutdown`; returns whether it drained.
pub async fn run(client: Client, member: &str, members: &[&str], shutdown: CancellationToken) -> bool {
    let (_keep_slice, slice) = tokio::sync::watch::channel(Some(slice_of(member, members)));
    let slicing = Slicing::new(
        |meta| Some(bucket_of(meta.namespace.as_deref().unwrap_or_default())),
        bucket_of,
        |buckets| shard_range::selector(buckets).map(SliceSelector::Shards),
    );
    let watch_health = WatchHealth::new();
    let greetings = parts::watch(Api::<Greeting>::all(client.clone()), None, slice.clone(), slicing.clone(), {
        watch_health.clone()
    });
    let (cache, writer) = cache::new::<Greeting>();
    let primary = watch::primary(greetings, |_| false, writer);
    let children = parts::watch(
        Api::<PartialObjectMeta<ConfigMap>>::all(client.clone()),
        Some(CHILD_LABEL.to_string()),
        slice.clone(),
        slicing,
        watch_health.clone(),
    );
    let children = vec![watch::children(children, "ConfigMap", "Greeting", STAMP).boxed()];
    let versions = Arc::new(ChildVersions::default());
    let settings = Settings {
        name: "greeting",
        workers: 4,
        resync: Duration::from_secs(600),
        drain_timeout: Duration::from_secs(10),
        reconcile_timeout: Duration::from_secs(30),
        list_deadline: Duration::from_secs(60),
        backoff: Backoff::default(),
    };
    let controller = Controller::new(settings, cache, Health::with_gates(&[]), watch_health);
    let greeter = Arc::new(Greeter { client, member: member.to_string(), versions: versions.clone() });
    let gate = Arc::new(Unguarded { write_bound: Duration::from_secs(10) });
    controller.run(primary, children, slice, versions, greeter, gate, shutdown).await
}

struct Greeter {
    client: Client,
    member: String,
    versions: Arc<ChildVersions>,
}

impl Reconciler<Greeting> for Greeter {
    async fn reconcile(&self, key: &ObjectKey, greeting: Arc<Greeting>, gate: &dyn WriteGate) -> Result<Action> {
        let mut child = greeting_of(key, &greeting, &self.member);
        let content = content_hash(&child);
        // Already as we would write it (from our last write, or the child watch): no write.
        if self.versions.holds("ConfigMap", key, content) {
            return Ok(Action::Done);
        }
        let permit = gate.check("ConfigMap")?;
        STAMP.put(child.annotations_mut(), content);
        gate.stamp(&permit, child.annotations_mut());
        let api = Api::<ConfigMap>::namespaced(self.client.clone(), key.namespace());
        let params = PatchParams::apply(STAMP.field_manager).force();
        let request = Request::new(api.resource_url())
            .patch(&child.name_any(), &params, &Patch::Apply(&child))
            .map_err(kube::Error::BuildRequest)?;
        let request = with_server_timeout(request, gate.write_bound());
        #[derive(Deserialize)]
        struct Written {
            metadata: ObjectMeta,
        }
        let written: Written = bounded(gate, &permit, self.client.request(request)).await?;
        let version = written.metadata.resource_version.unwrap_or_default();
        self.versions.written("ConfigMap", key, &version, greeting.meta().generation, content);
        Ok(Action::Done)
    }

    fn forget(&self, key: &ObjectKey) {
        self.versions.forget_owner(key);
    }
}

/// The ConfigMap a greeting asks for (pure).
fn greeting_of(key: &ObjectKey, greeting: &Greeting, member: &str) -> ConfigMap {
    let owner = OwnerReference {
        api_version: Greeting::api_version(&()).into(),
        kind: Greeting::kind(&()).into(),
        name: key.name().into(),
        uid: greeting.meta().uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("{}-greeting", key.name())),
            namespace: Some(key.namespace().into()),
            labels: Some([(CHILD_LABEL.to_string(), "true".to_string())].into()),
            annotations: Some([(MEMBER_ANNOTATION.to_string(), member.to_string())].into()),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        data: Some([("greeting".to_string(), format!("hello, {}", greeting.spec.name))].into()),
        ..Default::default()
    }
}

#[cfg_attr(test, allow(dead_code))]
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["crd"] => println!("{}", serde_json::to_string_pretty(&Greeting::crd())?),
        ["run", member, members] => {
            let members: Vec<&str> = members.split(',').collect();
            anyhow::ensure!(members.contains(member), "{member} is not one of the members {members:?}");
            let shutdown = CancellationToken::new();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let _ = tokio::signal::ctrl_c().await;
                stop.cancel();
            });
            run(Client::try_default().await?, member, &members, shutdown).await;
        }
        _ => anyhow::bail!("usage: greeter crd | greeter run MEMBER MEMBER,MEMBER,..."),
    }
    Ok(())
}
