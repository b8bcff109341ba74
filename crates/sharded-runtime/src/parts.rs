//! A watch of this replica's slice that lists only what a handoff moves.
//!
//! The slice is a set of buckets that changes with the assignment. It is watched in parts,
//! each part one watch of the buckets gained in one change:
//! - a gained bucket goes into a new part, whose list brings only what was gained;
//! - a lost bucket leaves its part without a restart: its events are ignored from then on,
//!   and a [`SliceEvent::Dropped`] tells consumers to forget what they hold of it;
//! - a part whose watch relists (`410 Gone`, a restart of the API server) relists its own
//!   buckets only.
//!
//! One watch of the whole slice would relist all of it on every change. The parts stay few:
//! a gain that would make more than [`MAX_PARTS`] folds them into one watch of the whole
//! slice (one relist, which consumers see as a part listing what it covers).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Debug;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{AbortHandle, Abortable, BoxStream, SelectAll};
use futures::{StreamExt, TryStreamExt};
use kube::Resource;
use kube::api::{Api, ListParams, ObjectMeta, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;

use super::watch_health::{Probe, WatchHealth};
use super::watch_stall;
use crate::metrics;

/// How a watch asks the API server for this replica's slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceSelector {
    /// A label selector.
    Labels(String),
    /// A `shardSelector` expression (KEP-5866): ranges of the server's hash of a field.
    Shards(String),
}

/// More parts than this are folded into one watch at the next gain.
pub const MAX_PARTS: usize = 8;

/// Buckets of the slice.
pub type Buckets = BTreeSet<u16>;

/// The buckets this replica owns, `None` until it knows.
pub type SliceWatch = tokio::sync::watch::Receiver<Option<Buckets>>;

/// How objects fall into buckets, and how a watch asks the API server for some buckets.
#[derive(Clone)]
pub struct Slicing {
    bucket_of: Arc<BucketOf>,
    namespace_bucket: Arc<dyn Fn(&str) -> u16 + Send + Sync>,
    selector: Arc<SelectorOf>,
}

type BucketOf = dyn Fn(&ObjectMeta) -> Option<u16> + Send + Sync;
type SelectorOf = dyn Fn(&Buckets) -> Option<SliceSelector> + Send + Sync;

impl Slicing {
    /// `bucket_of` must say what the API server's filter says (in label mode, a hand-set
    /// bucket label wins over the namespace); `namespace_bucket` is the bucket a namespace's
    /// objects fall in without such a label.
    pub fn new(
        bucket_of: impl Fn(&ObjectMeta) -> Option<u16> + Send + Sync + 'static,
        namespace_bucket: impl Fn(&str) -> u16 + Send + Sync + 'static,
        selector: impl Fn(&Buckets) -> Option<SliceSelector> + Send + Sync + 'static,
    ) -> Self {
        Self {
            bucket_of: Arc::new(bucket_of),
            namespace_bucket: Arc::new(namespace_bucket),
            selector: Arc::new(selector),
        }
    }

    /// The bucket of an object (`None`: it is in none, e.g. a malformed bucket label).
    pub fn bucket_of(&self, meta: &ObjectMeta) -> Option<u16> {
        (self.bucket_of)(meta)
    }

    /// The scope of a part that covers `buckets`.
    pub fn scope(&self, buckets: Arc<Buckets>) -> Scope {
        Scope { buckets, slicing: self.clone() }
    }
}

/// The buckets a part of the slice covers.
#[derive(Clone)]
pub struct Scope {
    buckets: Arc<Buckets>,
    slicing: Slicing,
}

impl Scope {
    /// One bucket that holds every namespace: for tools and tests that watch unsharded.
    pub fn everything() -> Self {
        Slicing::new(|_| Some(0), |_| 0, |_| None).scope(Arc::new(Buckets::from([0])))
    }

    /// Whether the object with `meta` is in one of the scope's buckets.
    pub fn covers(&self, meta: &ObjectMeta) -> bool {
        self.holds(self.slicing.bucket_of(meta))
    }

    /// Whether `bucket` (an object's, as [`Self::bucket_of`] gave it) is one of the scope's.
    pub fn holds(&self, bucket: Option<u16>) -> bool {
        bucket.is_some_and(|bucket| self.buckets.contains(&bucket))
    }

    /// The bucket of an object, as the scope's slicing says.
    pub fn bucket_of(&self, meta: &ObjectMeta) -> Option<u16> {
        self.slicing.bucket_of(meta)
    }

    /// Whether the scope covers `namespace`'s bucket: for what is known by key only (the
    /// children of an owner), where a hand-set bucket label cannot be seen.
    pub fn covers_namespace(&self, namespace: &str) -> bool {
        self.buckets.contains(&(self.slicing.namespace_bucket)(namespace))
    }

    /// The buckets the scope covers.
    pub fn buckets(&self) -> &Buckets {
        &self.buckets
    }
}

impl Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scope({} buckets)", self.buckets.len())
    }
}

/// What a watch of the slice reports.
pub enum SliceEvent<K> {
    /// An event of part `part`'s watch, which covers `scope` now. A list (`Init` to
    /// `InitDone`) replaces what is known of `scope`; `scope` may shrink during it.
    Part { part: u64, scope: Scope, event: watcher::Event<K> },
    /// These buckets left the slice: forget what is known of them.
    Dropped(Scope),
    /// The part's watch is closed; a list it had under way will not complete.
    Closed { part: u64 },
}

/// What a slice can be watched of: a resource of a static type (cluster-scoped ones in
/// one bucket, as a controller of namespaces has them).
pub trait Watchable:
    Resource<DynamicType = (), Scope: WatchScope> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}

impl<K> Watchable for K where
    K: Resource<DynamicType = (), Scope: WatchScope> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}

/// A watch of `api`, in parts, of the slice `slice` names; `fixed_labels` are always
/// required in addition. Nothing is watched until the slice is known. Errors are counted,
/// logged and retried with kube-runtime's default backoff; refusals and stalls are told to
/// `health`, whose timeout each watch asks for.
pub fn watch<K: Watchable>(
    api: Api<K>,
    fixed_labels: Option<String>,
    slice: SliceWatch,
    slicing: Slicing,
    health: Arc<WatchHealth>,
) -> BoxStream<'static, SliceEvent<K>> {
    let timeout = health.watch_timeout();
    let api = K::Scope::api(watch_stall::limited(api.clone().into_client(), timeout), api.namespace());
    let selecting = move |selector: &SliceSelector| match selector {
        SliceSelector::Labels(labels) => (api.clone(), with_fixed(&fixed_labels, Some(labels))),
        SliceSelector::Shards(shards) => (shard_selecting(&api, shards), with_fixed(&fixed_labels, None)),
    };
    let probing = selecting.clone();
    let open = move |selector: Option<SliceSelector>| -> WatchEvents<K> {
        let Some(selector) = selector else {
            // Nothing to watch: an empty list, and the part counts as listed.
            return futures::stream::iter([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)])
                .chain(futures::stream::pending())
                .boxed();
        };
        let (api, labels) = selecting(&selector);
        // A consistent list (not `any_semantic`): after a handoff, the new owner must not
        // start from an older state than the previous owner last wrote from.
        let config = labels.iter().fold(watch_stall::watcher_config(timeout), |c, l| c.labels(l));
        watcher(api, config).default_backoff().boxed()
    };
    // A list of one object, then a watch from there that the server ends after a second: a
    // refused watch is refused here too, and a stalled one fails its limit.
    let probe = move |selector: SliceSelector| -> Probe {
        let (api, labels) = probing(&selector);
        Arc::new(move || -> BoxFuture<'static, Result<(), kube::Error>> {
            let list = ListParams { label_selector: labels.clone(), limit: Some(1), ..Default::default() };
            let watch = WatchParams { label_selector: labels.clone(), timeout: Some(1), ..Default::default() };
            let api = api.clone();
            Box::pin(async move {
                let version = api.list(&list).await?.metadata.resource_version.unwrap_or_default();
                let events = api.watch(&watch, &version).await?;
                events
                    .try_for_each(|event| {
                        std::future::ready(match event {
                            WatchEvent::Error(status) => Err(kube::Error::Api(status)),
                            _ => Ok(()),
                        })
                    })
                    .await
            })
        })
    };
    sliced(slice, slicing, Box::new(open), Watched { health, probe: Box::new(probe) })
}

/// Where a slice watch tells of refusals, and how it lists one object with a selector.
struct Watched {
    health: Arc<WatchHealth>,
    probe: Box<dyn Fn(SliceSelector) -> Probe + Send>,
}

/// [`watch`], with `open` starting the watch of a selector.
fn sliced<K>(
    slice: SliceWatch,
    slicing: Slicing,
    open: Opener<K>,
    watched: Watched,
) -> BoxStream<'static, SliceEvent<K>>
where
    K: Resource<DynamicType = ()> + Send + 'static,
{
    let parts = Parts {
        open,
        watched,
        slicing,
        owned: None,
        parts: BTreeMap::new(),
        watches: SelectAll::new(),
        next_id: 0,
        pending: VecDeque::new(),
    };
    // A slice already known when the watch starts is watched at once.
    let mut slice = slice;
    slice.mark_changed();
    futures::stream::unfold((parts, slice), |(mut parts, mut slice)| async move {
        loop {
            if let Some(event) = parts.pending.pop_front() {
                return Some((event, (parts, slice)));
            }
            tokio::select! {
                // A change of the slice first: nothing more of a lost bucket is passed on.
                biased;
                changed = slice.changed() => {
                    changed.ok()?;
                    let owned = slice.borrow_and_update().clone();
                    if let Some(owned) = owned {
                        parts.retarget(owned);
                    }
                }
                Some((part, event)) = parts.watches.next(), if !parts.watches.is_empty() => {
                    if let Some(event) = parts.route(part, event) {
                        return Some((event, (parts, slice)));
                    }
                }
            }
        }
    })
    .boxed()
}

type WatchEvents<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;
type Opener<K> = Box<dyn Fn(Option<SliceSelector>) -> WatchEvents<K> + Send>;
type PartEvents<K> = BoxStream<'static, (u64, Result<watcher::Event<K>, watcher::Error>)>;

struct Part {
    buckets: Arc<Buckets>,
    stop: AbortHandle,
}

struct Parts<K> {
    open: Opener<K>,
    watched: Watched,
    slicing: Slicing,
    /// The slice being watched, once known.
    owned: Option<Buckets>,
    parts: BTreeMap<u64, Part>,
    watches: SelectAll<PartEvents<K>>,
    next_id: u64,
    /// Events to pass on before anything else.
    pending: VecDeque<SliceEvent<K>>,
}

impl<K> Parts<K>
where
    K: Resource<DynamicType = ()> + Send + 'static,
{
    fn retarget(&mut self, owned: Buckets) {
        let first = self.owned.is_none();
        let before = self.owned.replace(owned.clone()).unwrap_or_default();
        let lost: Buckets = before.difference(&owned).copied().collect();
        let gained: Buckets = owned.difference(&before).copied().collect();
        if !lost.is_empty() {
            for part in self.parts.values_mut() {
                if !part.buckets.is_disjoint(&lost) {
                    part.buckets = Arc::new(part.buckets.difference(&lost).copied().collect());
                }
            }
            self.pending.push_back(SliceEvent::Dropped(self.slicing.scope(Arc::new(lost))));
        }
        let empty: Vec<u64> = self.parts.iter().filter(|(_, p)| p.buckets.is_empty()).map(|(id, _)| *id).collect();
        empty.into_iter().for_each(|id| self.close(id));
        if gained.is_empty() && !first {
            return;
        }
        if self.parts.len() >= MAX_PARTS {
            tracing::info!(parts = self.parts.len(), "folding the slice's watches into one (a relist of the slice)");
            let all: Vec<u64> = self.parts.keys().copied().collect();
            all.into_iter().for_each(|id| self.close(id));
            self.open(owned);
        } else {
            // The first slice may be empty: its part lists nothing, so consumers know it.
            self.open(gained);
        }
    }

    fn open(&mut self, buckets: Buckets) {
        let id = self.next_id;
        self.next_id += 1;
        let events = (self.open)((self.slicing.selector)(&buckets));
        let (stop, registration) = AbortHandle::new_pair();
        self.watches.push(Abortable::new(events, registration).map(move |event| (id, event)).boxed());
        self.parts.insert(id, Part { buckets: Arc::new(buckets), stop });
    }

    fn close(&mut self, id: u64) {
        if let Some(part) = self.parts.remove(&id) {
            part.stop.abort();
            self.pending.push_back(SliceEvent::Closed { part: id });
        }
    }

    /// Passes on an event of a part still open, unless it is about a bucket the part no
    /// longer covers.
    fn route(&self, id: u64, event: Result<watcher::Event<K>, watcher::Error>) -> Option<SliceEvent<K>> {
        let kind = K::kind(&());
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                metrics::count_watch_error(&kind);
                tracing::warn!(%kind, %error, "watch failed; retrying with backoff");
                let selector = self.parts.get(&id).and_then(|part| (self.slicing.selector)(&part.buckets));
                if let Some(selector) = selector {
                    self.watched.health.failed(&kind, &error, (self.watched.probe)(selector));
                }
                return None;
            }
        };
        let part = self.parts.get(&id)?;
        let scope = self.slicing.scope(part.buckets.clone());
        match &event {
            watcher::Event::Apply(object) | watcher::Event::InitApply(object) | watcher::Event::Delete(object) => {
                if matches!(event, watcher::Event::InitApply(_)) {
                    metrics::count_listed(&kind);
                }
                if !scope.covers(object.meta()) {
                    return None;
                }
            }
            // A part of no buckets lists nothing from the server: it says nothing of refusals.
            watcher::Event::InitDone if !part.buckets.is_empty() => self.watched.health.listed(&kind),
            watcher::Event::InitDone => {}
            watcher::Event::Init => {}
        }
        Some(SliceEvent::Part { part: id, scope, event })
    }
}

fn with_fixed(fixed: &Option<String>, labels: Option<&String>) -> Option<String> {
    match (fixed, labels) {
        (Some(fixed), Some(labels)) => Some(format!("{fixed},{labels}")),
        (fixed, labels) => fixed.as_ref().or(labels).cloned(),
    }
}

/// `api` with every request asking for `shardSelector=shards` (kube's list and watch
/// parameters have no field for it yet).
fn shard_selecting<K: Watchable>(api: &Api<K>, shards: &str) -> Api<K> {
    let client = crate::client::with_query(api.clone().into_client(), "shardSelector", shards);
    K::Scope::api(client, api.namespace())
}

/// How an [`Api`] of a resource of this scope is made again on another client.
pub trait WatchScope {
    fn api<K: Resource<DynamicType = (), Scope = Self>>(client: kube::Client, namespace: Option<&str>) -> Api<K>;
}

impl WatchScope for kube::core::NamespaceResourceScope {
    fn api<K: Resource<DynamicType = (), Scope = Self>>(client: kube::Client, namespace: Option<&str>) -> Api<K> {
        match namespace {
            Some(namespace) => Api::namespaced(client, namespace),
            None => Api::all(client),
        }
    }
}

impl WatchScope for kube::core::ClusterResourceScope {
    fn api<K: Resource<DynamicType = (), Scope = Self>>(client: kube::Client, _: Option<&str>) -> Api<K> {
        Api::all(client)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    /// A slicing where namespace `ns-N` is in bucket N, and the selector names the buckets.
    fn slicing() -> Slicing {
        let namespace_bucket = |ns: &str| ns.trim_start_matches("ns-").parse().unwrap();
        Slicing::new(
            move |meta| meta.namespace.as_deref().map(namespace_bucket),
            namespace_bucket,
            |buckets| {
                let names: Vec<String> = buckets.iter().map(u16::to_string).collect();
                (!buckets.is_empty()).then(|| SliceSelector::Labels(names.join(",")))
            },
        )
    }

    /// Health that no test's watch is refused by.
    fn watched() -> Watched {
        let works: Probe = Arc::new(|| -> BoxFuture<'static, Result<(), kube::Error>> { Box::pin(async { Ok(()) }) });
        Watched { health: WatchHealth::new(), probe: Box::new(move |_| works.clone()) }
    }

    fn in_bucket(bucket: &str) -> ConfigMap {
        let metadata =
            ObjectMeta { name: Some("p".into()), namespace: Some(format!("ns-{bucket}")), ..Default::default() };
        ConfigMap { metadata, ..Default::default() }
    }

    /// Watches that list one object per bucket they select, then stay quiet; the selectors
    /// opened are kept in `opened`.
    fn lister(opened: Arc<Mutex<Vec<String>>>) -> Opener<ConfigMap> {
        Box::new(move |selector| {
            let buckets = match selector {
                Some(SliceSelector::Labels(buckets)) => buckets,
                _ => String::new(),
            };
            opened.lock().unwrap().push(buckets.clone());
            let objects =
                buckets.split(',').filter(|b| !b.is_empty()).map(|b| Ok(watcher::Event::InitApply(in_bucket(b))));
            let list = [Ok(watcher::Event::Init)].into_iter().chain(objects).chain([Ok(watcher::Event::InitDone)]);
            futures::stream::iter(list.collect::<Vec<_>>()).chain(futures::stream::pending()).boxed()
        })
    }

    /// Describes the next events until a list completes.
    async fn until_listed(events: &mut BoxStream<'static, SliceEvent<ConfigMap>>) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(5), events.next()).await;
            let event = next.expect("an event in time").expect("the stream goes on");
            let (text, done) = match event {
                SliceEvent::Part { part, event: watcher::Event::InitApply(o), .. } => {
                    (format!("{part}: {}", o.metadata.namespace.unwrap()), false)
                }
                SliceEvent::Part { part, event: watcher::Event::InitDone, scope } => {
                    (format!("{part}: listed {:?}", scope.buckets()), true)
                }
                SliceEvent::Part { .. } => continue,
                SliceEvent::Dropped(scope) => (format!("dropped {:?}", scope.buckets()), false),
                SliceEvent::Closed { part } => (format!("closed {part}"), false),
            };
            seen.push(text);
            if done {
                return seen;
            }
        }
    }

    #[tokio::test]
    async fn a_gain_lists_only_what_was_gained_and_a_loss_relists_nothing() {
        let opened = Arc::new(Mutex::new(Vec::new()));
        let (slice_tx, slice) = tokio::sync::watch::channel(None);
        let mut events = sliced(slice, slicing(), lister(opened.clone()), watched());

        slice_tx.send_replace(Some(Buckets::from([1, 2])));
        assert_eq!(until_listed(&mut events).await, ["0: ns-1", "0: ns-2", "0: listed {1, 2}"]);

        slice_tx.send_replace(Some(Buckets::from([2, 3])));
        assert_eq!(until_listed(&mut events).await, ["dropped {1}", "1: ns-3", "1: listed {3}"]);
        assert_eq!(*opened.lock().unwrap(), ["1,2", "3"], "bucket 2 was not listed again");

        // Losing a part's last bucket closes its watch.
        slice_tx.send_replace(Some(Buckets::from([2, 4])));
        assert_eq!(until_listed(&mut events).await, ["dropped {3}", "closed 1", "2: ns-4", "2: listed {4}"]);
    }

    #[tokio::test]
    async fn a_slice_known_before_the_watch_starts_is_watched() {
        let opened = Arc::new(Mutex::new(Vec::new()));
        let (_slice_tx, slice) = tokio::sync::watch::channel(Some(Buckets::from([5])));
        let mut events = sliced(slice, slicing(), lister(opened.clone()), watched());
        assert_eq!(until_listed(&mut events).await, ["0: ns-5", "0: listed {5}"]);
    }

    #[tokio::test]
    async fn a_gain_past_the_most_parts_folds_them_into_one_watch() {
        let opened = Arc::new(Mutex::new(Vec::new()));
        let (slice_tx, slice) = tokio::sync::watch::channel(None);
        let mut events = sliced(slice, slicing(), lister(opened.clone()), watched());
        let mut owned = Buckets::new();
        for bucket in 1..=MAX_PARTS as u16 {
            owned.insert(bucket);
            slice_tx.send_replace(Some(owned.clone()));
            until_listed(&mut events).await;
        }
        owned.insert(100);
        slice_tx.send_replace(Some(owned.clone()));
        let seen = until_listed(&mut events).await;
        let closed = seen.iter().filter(|e| e.starts_with("closed")).count();
        assert_eq!(closed, MAX_PARTS, "{seen:?}");
        assert_eq!(seen.last().unwrap(), &format!("{MAX_PARTS}: listed {owned:?}"));
        assert_eq!(opened.lock().unwrap().last().unwrap(), "1,2,3,4,5,6,7,8,100");
    }

    #[tokio::test]
    async fn an_object_is_in_the_part_of_its_bucket_as_the_server_filters_it() {
        // As in label mode: a bucket label set by hand wins over the namespace.
        let by_label = |meta: &ObjectMeta| {
            let label = meta.labels.as_ref().and_then(|labels| labels.get("bucket"));
            label.map(|b| b.parse().unwrap()).or_else(|| slicing().bucket_of(meta))
        };
        let labelled = |namespace: &str, bucket: &str| {
            let mut object = in_bucket(namespace);
            object.metadata.labels = Some([("bucket".to_string(), bucket.to_string())].into());
            object
        };
        let objects = [labelled("5", "1"), labelled("1", "5")];
        let open: Opener<ConfigMap> = Box::new(move |_| {
            let list = [watcher::Event::Init]
                .into_iter()
                .chain(objects.iter().cloned().map(watcher::Event::InitApply))
                .chain([watcher::Event::InitDone]);
            futures::stream::iter(list.map(Ok).collect::<Vec<_>>()).chain(futures::stream::pending()).boxed()
        });
        let slicing = Slicing::new(by_label, |ns| ns.trim_start_matches("ns-").parse().unwrap(), |_| None);
        let (slice_tx, slice) = tokio::sync::watch::channel(None);
        let mut events = sliced(slice, slicing, open, watched());
        slice_tx.send_replace(Some(Buckets::from([1])));
        assert_eq!(until_listed(&mut events).await, ["0: ns-5", "0: listed {1}"]);
    }
}
