//! The leader's own count of every namespace's objects, for placing slices within the
//! members' capacities and for splitting crowded hash ranges.
//!
//! The replicas report what they hold, but nobody holds a bucket that no member has room
//! for, and before the first assignment nobody holds anything; and they report by bucket,
//! not by namespace. So while any member advertises a capacity, or the leader may split
//! ranges, it counts the sharded objects itself: a paged list of their metadata, counted by
//! namespace and kept as the count only, never cached.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// Objects per namespace.
pub type ByNamespace = BTreeMap<String, u32>;

/// How often the objects are counted while a member advertises a capacity.
pub const COUNT_EVERY: Duration = Duration::from_secs(30);
/// Objects per page of the list: small pages keep the leader's memory flat.
const PAGE: u32 = 500;
/// The least time between two counts, however often one is asked for.
const AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// The latest count, and a signal for each new one.
pub struct Census {
    client: Client,
    /// The CustomResourceDefinition of the sharded objects.
    crd: String,
    /// Where the program's watches look; `None`: every namespace.
    namespace: Option<String>,
    latest: Mutex<Option<ByNamespace>>,
    counted: watch::Sender<u64>,
    /// Asks for a count before the next period.
    wake: Notify,
}

impl Census {
    /// Counts the objects of CRD `crd`, in `namespace` or in all.
    pub fn new(client: Client, crd: &str, namespace: Option<String>) -> Self {
        let counted = watch::channel(0).0;
        Self { client, crd: crd.into(), namespace, latest: Mutex::default(), counted, wake: Notify::new() }
    }

    /// The latest count; `None` before the first.
    pub fn latest(&self) -> Option<ByNamespace> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Changes with each count.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.counted.subscribe()
    }

    /// Asks for a count now (at most one every [`AT_MOST_EVERY`]): a member reports more
    /// objects than its capacity, so the last count is out of date.
    pub fn count_soon(&self) {
        self.wake.notify_one();
    }

    /// Forgets the count, once this replica no longer leads: the next leader's is its own.
    pub fn forget(&self) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Counts every [`COUNT_EVERY`] while `wanted()` says a count is needed (asking every
    /// second otherwise), until `stop`.
    pub async fn keep(&self, wanted: impl Fn() -> bool, stop: CancellationToken) {
        loop {
            let pause = if wanted() { self.count_once().await } else { self.forget_for_now() };
            let earliest = tokio::time::sleep(AT_MOST_EVERY.min(pause));
            tokio::select! {
                _ = earliest => {}
                _ = stop.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(pause.saturating_sub(AT_MOST_EVERY)) => {}
                _ = self.wake.notified() => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    fn forget_for_now(&self) -> Duration {
        self.forget();
        Duration::from_secs(1)
    }

    async fn count_once(&self) -> Duration {
        match self.count().await {
            Ok(counts) => {
                *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(counts);
                self.counted.send_modify(|n| *n += 1);
            }
            // The previous count stands; a leader without any places nothing.
            Err(error) => {
                tracing::warn!(%error, "counting the objects per namespace failed; trying again");
                return Duration::from_secs(5);
            }
        }
        COUNT_EVERY
    }

    async fn count(&self) -> Result<ByNamespace, kube::Error> {
        let api: Api<DynamicObject> = match &self.namespace {
            Some(namespace) => Api::namespaced_with(self.client.clone(), namespace, &self.resource().await?),
            None => Api::all_with(self.client.clone(), &self.resource().await?),
        };
        let mut counts = ByNamespace::new();
        let mut params = ListParams::default().limit(PAGE);
        loop {
            let page = api.list_metadata(&params).await?;
            for object in &page.items {
                *counts.entry(object.namespace().unwrap_or_default()).or_default() += 1;
            }
            match page.metadata.continue_.filter(|token| !token.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(counts),
            }
        }
    }

    /// The sharded resource, from its CustomResourceDefinition: its group, its storage
    /// version and its plural.
    async fn resource(&self) -> Result<ApiResource, kube::Error> {
        let crd = Api::<CustomResourceDefinition>::all(self.client.clone()).get(&self.crd).await?;
        let version = crd.spec.versions.iter().find(|v| v.storage).or(crd.spec.versions.first());
        let version = version.map(|v| v.name.clone()).unwrap_or_default();
        let group = crd.spec.group.clone();
        Ok(ApiResource {
            api_version: format!("{group}/{version}"),
            group,
            version,
            kind: crd.spec.names.kind.clone(),
            plural: crd.spec.names.plural.clone(),
        })
    }
}
