//! Watch sources: the primary resource into the cache, and children as
//! metadata-only events that point at their owner.
//!
//! Both come from a watch of this replica's slice in parts (see [`super::parts`]): the API
//! server sends only the slice, and a handoff lists only what it moves.

use std::fmt::Debug;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::api::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::cache::{CacheChange, CacheWriter};
use super::child_versions::{ContentStamp, stamped_content};
use super::key::ObjectKey;
use super::parts::{Scope, SliceEvent};
use super::predicate::Sight;
use super::stored::Stored;

/// A primary watch event, once the cache has taken it.
pub enum Cached<K> {
    /// An event of part `part` of the slice, which covers `scope` now.
    Event {
        part: u64,
        scope: Scope,
        event: watcher::Event<K>,
        /// The cache's key for the event's object: whoever keeps a key shares the cache's.
        key: Option<ObjectKey>,
        /// How the object differs from what the cache held (the generation predicate).
        sight: Sight,
        /// Whether the object was labelled from the leader's backlog (see [`super::controller`]).
        backlog: bool,
        /// What the cache let go of: at the end of a list, the objects of `scope` it did not find.
        gone: Vec<ObjectKey>,
    },
    /// Buckets left the slice, and the cache let go of their objects, `gone`.
    Dropped { scope: Scope, gone: Vec<ObjectKey> },
    /// A part's watch is closed: a list it had under way will not complete.
    Closed { part: u64 },
}

/// Watch events of the primary resource, applied to `writer`'s cache as they pass, in the
/// form it stores. Each event comes with what `is_backlog` said of its object (a hint the
/// cache need not keep; see [`super::controller`] for its use).
pub fn primary<S>(
    events: BoxStream<'static, SliceEvent<S::Object>>,
    is_backlog: fn(&S::Object) -> bool,
    mut writer: CacheWriter<S>,
) -> impl Stream<Item = Cached<S::Object>> + Send
where
    S: Stored,
    S::Object: Resource<DynamicType = ()> + DeserializeOwned + Debug + Send + Sync + 'static,
{
    events.map(move |event| match event {
        SliceEvent::Part { part, scope, event } => {
            let backlog = matches!(&event, watcher::Event::Apply(object) if is_backlog(object));
            let CacheChange { key, sight, gone } = writer.apply(part, &scope, &event);
            Cached::Event { part, scope, event, key, sight, backlog, gone }
        }
        SliceEvent::Dropped(scope) => {
            let gone = writer.drop_scope(&scope);
            Cached::Dropped { scope, gone }
        }
        SliceEvent::Closed { part } => {
            writer.close(part);
            Cached::Closed { part }
        }
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
        /// The part of the slice whose watch saw it.
        part: u64,
        /// Part of a list.
        initial: bool,
    },
    /// A part's (re)list has begun: what is known of `scope` may be incomplete until it is done.
    Listing { kind: &'static str, part: u64, scope: Scope },
    /// A part's (re)list is complete.
    Listed { kind: &'static str, part: u64, scope: Scope },
    /// Buckets left the slice: forget what is known of their children.
    Dropped { kind: &'static str, scope: Scope },
    /// A part's watch is closed.
    Closed { part: u64 },
}

/// Metadata-only events of children whose controller is a `owner_kind`, selected by label
/// on the server. Nothing is cached: the owner's key, the version and the content hash under
/// `stamp` are all the runtime needs.
pub fn children<C>(
    events: BoxStream<'static, SliceEvent<PartialObjectMeta<C>>>,
    kind: &'static str,
    owner_kind: &'static str,
    stamp: ContentStamp,
) -> impl Stream<Item = ChildEvent> + Send
where
    C: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    events.filter_map(move |event| async move {
        let (part, child, deleted, initial) = match event {
            SliceEvent::Part { part, scope, event } => match event {
                watcher::Event::Apply(child) => (part, child, false, false),
                watcher::Event::InitApply(child) => (part, child, false, true),
                watcher::Event::Delete(child) => (part, child, true, false),
                watcher::Event::InitDone => return Some(ChildEvent::Listed { kind, part, scope }),
                watcher::Event::Init => return Some(ChildEvent::Listing { kind, part, scope }),
            },
            SliceEvent::Dropped(scope) => return Some(ChildEvent::Dropped { kind, scope }),
            SliceEvent::Closed { part } => return Some(ChildEvent::Closed { part }),
        };
        let owner = child.owner_references().iter().find(|o| o.controller == Some(true) && o.kind == owner_kind)?;
        Some(ChildEvent::Changed {
            kind,
            owner: ObjectKey::new(child.namespace().unwrap_or_default(), &owner.name),
            resource_version: if deleted { None } else { child.resource_version() },
            content: stamped_content(&child.metadata, stamp),
            part,
            initial,
        })
    })
}
