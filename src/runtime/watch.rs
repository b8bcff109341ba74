//! Watch sources: the primary resource into a trimmed cache, and children as
//! metadata-only events that point at their owner.
//!
//! Both take their selector from a channel: when this replica's slice changes, the watch
//! restarts with the new selector, so the API server sends only the slice (a relist of it;
//! the cache is replaced when the list completes). With no selector, the watch is an empty
//! list. Both retry with kube-runtime's default backoff and relist after `410 Gone`.

use std::fmt::Debug;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::cache::CacheWriter;
use super::child_versions::stamped_content;
use super::key::ObjectKey;
use crate::telemetry::metrics;

const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what the reconcile never reads before an object is cached: managed fields and
/// the client-side-apply annotation are often larger than the spec itself.
pub fn trim<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
    if let Some(annotations) = &mut object.meta_mut().annotations {
        annotations.remove(LAST_APPLIED);
        if annotations.is_empty() {
            object.meta_mut().annotations = None;
        }
    }
}

/// How a watch asks the API server for this replica's slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceSelector {
    /// A label selector.
    Labels(String),
    /// A `shardSelector` expression (KEP-5866): ranges of the server's hash of a field.
    Shards(String),
}

/// A selector that can change; `None` selects nothing.
pub type Selector = tokio::sync::watch::Receiver<Option<SliceSelector>>;

/// Events, each with the selector of the watch that produced it.
pub type Tagged<K> = BoxStream<'static, (Arc<Option<SliceSelector>>, Result<watcher::Event<K>, watcher::Error>)>;

/// A watch of `api` that restarts whenever `selector` changes, each event tagged with the
/// selector it was listed or watched with (so "listed" always means listed *for that
/// selector*, whatever the selector is by the time the event is handled). `fixed_labels` are
/// always required in addition. Errors are retried with kube-runtime's default backoff.
pub fn retargetable<K>(api: Api<K>, fixed_labels: Option<String>, selector: Selector) -> Tagged<K>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + 'static,
{
    let open = move |selector: Option<SliceSelector>| -> Tagged<K> {
        let tag = Arc::new(selector.clone());
        let with_fixed = |labels: Option<&str>| match (fixed_labels.as_deref(), labels) {
            (Some(fixed), Some(labels)) => Some(format!("{fixed},{labels}")),
            (fixed, labels) => fixed.or(labels).map(str::to_string),
        };
        let (api, labels) = match &selector {
            Some(SliceSelector::Labels(labels)) => (api.clone(), with_fixed(Some(labels))),
            Some(SliceSelector::Shards(shards)) => (shard_selecting(&api, shards), with_fixed(None)),
            None => (api.clone(), None),
        };
        let events = match selector {
            Some(_) => {
                // A consistent list (not `any_semantic`): after a handoff, the new owner must not
                // start from an older state than the previous owner last wrote from.
                let config = labels.iter().fold(watcher::Config::default(), |c, l| c.labels(l));
                watcher(api, config).default_backoff().boxed()
            }
            // An empty list: the cache empties and the source counts as synced.
            None => futures::stream::iter([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)])
                .chain(futures::stream::pending())
                .boxed(),
        };
        events.map(move |event| (tag.clone(), event)).boxed()
    };
    // Nothing is watched until the first selector is published: before that, this replica
    // does not know its slice, and must not report its cache as synced.
    let state = (selector, None::<Tagged<K>>, open, false);
    futures::stream::unfold(state, |(mut selector, mut current, open, started)| async move {
        if !started && selector.changed().await.is_err() {
            return None;
        }
        loop {
            let inner = match &mut current {
                Some(inner) => inner,
                None => current.insert(open(selector.borrow_and_update().clone())),
            };
            let item = tokio::select! {
                // A changed selector first: nothing more of the outdated watch is passed on.
                biased;
                changed = selector.changed() => match changed {
                    Ok(()) => None,
                    Err(_) => return None,
                },
                item = inner.next() => Some(item?),
            };
            match item {
                Some(item) => return Some((item, (selector, current, open, true))),
                None => current = None, // retarget
            }
        }
    })
    .boxed()
}

/// `api` with every request asking for `shardSelector=shards` (kube's list and watch
/// parameters have no field for it yet).
fn shard_selecting<K>(api: &Api<K>, shards: &str) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope> + Clone,
{
    let client = crate::client::with_query(api.clone().into_client(), "shardSelector", shards);
    match api.namespace() {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    }
}

/// A primary watch event, once the cache has taken it.
pub struct Cached<K> {
    pub event: watcher::Event<K>,
    /// The cache's key for the event's object: whoever keeps a key shares the cache's.
    pub key: Option<ObjectKey>,
    /// Whether the object was labelled from the leader's backlog (see [`super::controller`]).
    pub backlog: bool,
}

/// Watch events of the primary resource, applied to `writer`'s cache as they pass, each
/// object passed through `trim` first (see [`trim`] for what any resource can lose). Each
/// event comes with what `is_backlog` said of its object before the trim (a hint the cache
/// need not keep; see [`super::controller`] for its use).
pub fn primary<K>(
    events: Tagged<K>,
    trim: fn(&mut K),
    is_backlog: fn(&K) -> bool,
    mut writer: CacheWriter<K>,
) -> impl Stream<Item = Cached<K>> + Send
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let kind = K::kind(&());
    events.filter_map(move |(_, event)| {
        let result = match event {
            Ok(event) => {
                let backlog = matches!(&event, watcher::Event::Apply(object) if is_backlog(object));
                let event = event.modify(trim);
                let key = writer.apply(&event);
                Some(Cached { event, key, backlog })
            }
            Err(error) => {
                metrics::count_watch_error(&kind);
                tracing::warn!(%kind, %error, "watch failed; retrying with backoff");
                None
            }
        };
        std::future::ready(result)
    })
}

/// What the child watch reports.
#[derive(Debug)]
pub enum ChildEvent {
    /// A child changed or vanished.
    Changed {
        kind: &'static str,
        /// The owner's key; children share it, as they carry their owner's name.
        owner: ObjectKey,
        /// `None` when the child was deleted.
        resource_version: Option<String>,
        /// What the child holds, if it is as our field manager last applied it.
        content: Option<u64>,
        /// Part of the initial list of a (re)started watch.
        initial: bool,
    },
    /// A (re)list has begun: what is known of this kind may be incomplete until it is done.
    Listing { kind: &'static str },
    /// A (re)list is complete; `selector` is the one it listed.
    Listed { kind: &'static str, selector: Option<SliceSelector> },
}

/// Metadata-only events of children whose controller is a `owner_kind`, selected by label
/// on the server. Nothing is cached: the owner's key, the version and the content stamp of
/// `field_manager` are all the runtime needs.
pub fn children<C>(
    events: Tagged<PartialObjectMeta<C>>,
    kind: &'static str,
    owner_kind: &'static str,
    field_manager: &'static str,
) -> impl Stream<Item = ChildEvent> + Send
where
    C: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    events.filter_map(move |(selector, event)| async move {
        let (child, deleted, initial) = match event {
            Ok(watcher::Event::Apply(child)) => (child, false, false),
            Ok(watcher::Event::InitApply(child)) => (child, false, true),
            Ok(watcher::Event::Delete(child)) => (child, true, false),
            Ok(watcher::Event::InitDone) => return Some(ChildEvent::Listed { kind, selector: (*selector).clone() }),
            Ok(watcher::Event::Init) => return Some(ChildEvent::Listing { kind }),
            Err(error) => {
                metrics::count_watch_error(kind);
                tracing::warn!(kind, %error, "child watch failed; retrying with backoff");
                return None;
            }
        };
        let owner = child.owner_references().iter().find(|o| o.controller == Some(true) && o.kind == owner_kind)?;
        Some(ChildEvent::Changed {
            kind,
            owner: ObjectKey::new(child.namespace().unwrap_or_default(), &owner.name),
            resource_version: if deleted { None } else { child.resource_version() },
            content: stamped_content(&child.metadata, field_manager),
            initial,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    use std::collections::BTreeMap;

    #[test]
    fn trim_drops_managed_fields_and_last_applied_but_keeps_other_annotations() {
        let mut cm = ConfigMap::default();
        cm.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        cm.metadata.annotations = Some(BTreeMap::from([
            (LAST_APPLIED.to_string(), "{...}".to_string()),
            ("keep".to_string(), "me".to_string()),
        ]));
        trim(&mut cm);
        assert!(cm.metadata.managed_fields.is_none());
        assert_eq!(cm.metadata.annotations.unwrap().keys().collect::<Vec<_>>(), ["keep"]);
    }
}
