//! The greeter's business half, shared by the runtime's example (fixed members) and the
//! sharding crate's (members with Leases): a `Greeting` (`example.com/v1`) and the ConfigMap
//! `<name>-greeting` that says hello to its `spec.name`, written through whatever gate the
//! member's gatekeeper gives.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, PartialObjectMeta, Patch, PatchParams};
use kube::core::Request;
use kube::{Client, CustomResource, Resource, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sharded_runtime::backoff::Backoff;
use sharded_runtime::child_versions::{ChildVersions, ContentStamp, content_hash};
use sharded_runtime::error::Result;
use sharded_runtime::gate::{WriteGate, bounded, with_server_timeout};
use sharded_runtime::health::Health;
use sharded_runtime::parts::{self, SliceWatch, Slicing};
use sharded_runtime::queue::Priority;
use sharded_runtime::watch_health::WatchHealth;
use sharded_runtime::{Action, Controller, Gatekeeper, ObjectKey, Reconciler, Settings, cache, watch};
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

/// One member's controller: the slice it follows, how objects fall into buckets, and who
/// says whether it may write.
pub struct Member<G> {
    pub name: String,
    pub slice: SliceWatch,
    pub slicing: Slicing,
    pub health: Arc<Health>,
    pub watch_health: Arc<WatchHealth>,
    pub gatekeeper: Arc<G>,
}

/// Runs `member`'s controller until `shutdown`; returns whether it drained.
pub async fn run_controller<G: Gatekeeper>(client: Client, member: Member<G>, shutdown: CancellationToken) -> bool {
    let Member { name, slice, slicing, health, watch_health, gatekeeper } = member;
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
    let controller = Controller::new(settings, cache, health, watch_health);
    let greeter = Arc::new(Greeter { client, member: name, versions: versions.clone() });
    controller.run(primary, children, slice, versions, greeter, gatekeeper, shutdown).await
}

struct Greeter {
    client: Client,
    member: String,
    versions: Arc<ChildVersions>,
}

impl Reconciler<Greeting> for Greeter {
    async fn reconcile(
        &self,
        key: &ObjectKey,
        greeting: Arc<Greeting>,
        gate: &dyn WriteGate,
        _: Priority,
    ) -> Result<Action> {
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
