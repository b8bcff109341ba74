//! The primary resource's cache: objects by [`ObjectKey`], filled from watch events.
//!
//! kube-runtime's reflector store does the same, but keys each object by an `ObjectRef`
//! that copies its name, namespace, resourceVersion and uid: about 170 bytes an object.
//! Here the key is the queue's, and it is handed on with each event, so the queue and the
//! child versions hold the cache's own allocation rather than copies.
//!
//! Objects are kept in the form their [`Stored`] type gives them: the object itself by
//! default, or a compact copy of what the reconcile reads. Each is kept with its bucket, as the API server's filter saw it
//! when it came.
//!
//! The cache is also the generation predicate's memory: each event's object is compared with
//! the one cached before it (see [`super::predicate`]).
//!
//! As in the reflector, a list is gathered aside and replaces what the cache holds of its
//! part of the slice when it completes: readers never see a half-listed part. Unlike it, a
//! list keeps the objects it finds unchanged as they are cached, so a relist does not hold
//! two copies of a slice.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::Resource;
use kube::runtime::watcher;

use super::key::ObjectKey;
use super::parts::Scope;
use super::predicate::{Sight, first_sight, sight};
use super::stored::Stored;

/// A cached object and its bucket (`None`: in no bucket, e.g. a malformed bucket label).
pub struct Entry<S> {
    pub object: Arc<S>,
    pub bucket: Option<u16>,
}

impl<S> Clone for Entry<S> {
    fn clone(&self) -> Self {
        Self { object: self.object.clone(), bucket: self.bucket }
    }
}

type Objects<S> = HashMap<ObjectKey, Entry<S>>;

/// Read access to the cache; clones share it.
pub struct Cache<S> {
    objects: Arc<RwLock<Objects<S>>>,
}

impl<S> Clone for Cache<S> {
    fn clone(&self) -> Self {
        Self { objects: self.objects.clone() }
    }
}

/// The cache's one writer, fed by the watch.
pub struct CacheWriter<S> {
    cache: Cache<S>,
    /// The lists under way, by part of the slice.
    listing: HashMap<u64, Objects<S>>,
}

/// An empty cache and its writer.
pub fn new<S>() -> (Cache<S>, CacheWriter<S>) {
    let cache = Cache { objects: Arc::new(RwLock::new(HashMap::new())) };
    (cache.clone(), CacheWriter { cache, listing: HashMap::new() })
}

impl<S> Cache<S> {
    /// The stored form of the object under `key`, if cached.
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<S>> {
        self.entry(key).map(|entry| entry.object)
    }

    /// The object of `key` with its bucket.
    pub fn entry(&self, key: &ObjectKey) -> Option<Entry<S>> {
        self.read().get(key).cloned()
    }

    /// Every object cached now, with its key.
    pub fn state(&self) -> Vec<(ObjectKey, Arc<S>)> {
        self.read().iter().map(|(key, entry)| (key.clone(), entry.object.clone())).collect()
    }

    /// How many objects the cache holds.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the cache holds no object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> RwLockReadGuard<'_, Objects<S>> {
        self.objects.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Objects<S>> {
        self.objects.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What the cache made of a watch event.
#[derive(Debug)]
pub struct CacheChange {
    /// The cache's key for the event's object, if it has one.
    pub key: Option<ObjectKey>,
    /// How the event's object differs from what the cache held under its name (the
    /// generation predicate; `Same` for events without an object, and for deletions).
    pub sight: Sight,
    /// What the cache let go of: at the end of a list, the objects of its scope it did not find.
    pub gone: Vec<ObjectKey>,
}

impl CacheChange {
    fn object(key: ObjectKey, sight: Sight) -> Self {
        Self { key: Some(key), sight, gone: Vec::new() }
    }

    fn nothing() -> Self {
        Self { key: None, sight: Sight::Same, gone: Vec::new() }
    }
}

impl<S: Stored> CacheWriter<S> {
    /// Applies an event of part `part` of the slice, which covers `scope`. A complete list
    /// replaces what the cache holds in `scope`.
    pub fn apply(&mut self, part: u64, scope: &Scope, event: &watcher::Event<S::Object>) -> CacheChange {
        let stored =
            |object: &S::Object| Entry { object: Arc::new(S::store(object)), bucket: scope.bucket_of(object.meta()) };
        match event {
            watcher::Event::Init => {
                self.listing.insert(part, HashMap::new());
                CacheChange::nothing()
            }
            watcher::Event::InitApply(object) => {
                // An object the relist finds unchanged is kept as cached: a relist of a slice
                // (after a handoff or a watch gap) then adds only what changed to memory.
                let key = ObjectKey::of(object);
                let (key, entry, sight) = match self.cache.read().get_key_value(&key) {
                    Some((key, cached)) if cached.object.is_version(object.meta().resource_version.as_deref()) => {
                        (key.clone(), cached.clone(), Sight::Same)
                    }
                    Some((key, cached)) => (key.clone(), stored(object), sight(Some(cached.object.as_ref()), object)),
                    None => (key, stored(object), first_sight::<S>(object)),
                };
                self.listing.entry(part).or_default().insert(key.clone(), entry);
                CacheChange::object(key, sight)
            }
            watcher::Event::InitDone => {
                let Some(mut listed) = self.listing.remove(&part) else { return CacheChange::nothing() };
                // Buckets the part lost during the list are no longer its to fill.
                listed.retain(|_, entry| scope.holds(entry.bucket));
                let removed = {
                    let mut objects = self.cache.write();
                    let gone =
                        take_where(&mut objects, |key, entry| scope.holds(entry.bucket) && !listed.contains_key(key));
                    objects.extend(listed);
                    gone
                };
                // What was let go of is freed after the lock is released.
                let gone = removed.into_iter().map(|(key, _)| key).collect();
                CacheChange { key: None, sight: Sight::Same, gone }
            }
            watcher::Event::Apply(object) => {
                let entry = stored(object);
                let mut objects = self.cache.write();
                let key = ObjectKey::of(object);
                let (key, sight) = match objects.get_key_value(&key) {
                    Some((cached_key, cached)) => (cached_key.clone(), sight(Some(cached.object.as_ref()), object)),
                    None => (key, first_sight::<S>(object)),
                };
                let replaced = objects.insert(key.clone(), entry);
                drop(objects);
                drop(replaced);
                CacheChange::object(key, sight)
            }
            watcher::Event::Delete(object) => {
                let key = ObjectKey::of(object);
                let mut objects = self.cache.write();
                // A part lets go only of what it holds: an object relabelled into another part's
                // bucket may come from that part's watch before this one says it left.
                let removed = match objects.get(&key) {
                    Some(entry) if scope.holds(entry.bucket) => objects.remove_entry(&key),
                    _ => None,
                };
                drop(objects);
                CacheChange::object(removed.map_or(key, |(cached, _)| cached), Sight::Same)
            }
        }
    }

    /// `scope` left the slice: lets go of its objects, and returns their keys.
    pub fn drop_scope(&mut self, scope: &Scope) -> Vec<ObjectKey> {
        let removed = take_where(&mut self.cache.write(), |_, entry| scope.holds(entry.bucket));
        removed.into_iter().map(|(key, _)| key).collect()
    }

    /// A part's watch is closed: a list it had under way will not complete.
    pub fn close(&mut self, part: u64) {
        self.listing.remove(&part);
    }
}

fn take_where<S>(objects: &mut Objects<S>, take: impl Fn(&ObjectKey, &Entry<S>) -> bool) -> Vec<(ObjectKey, Entry<S>)> {
    let keys: Vec<ObjectKey> =
        objects.iter().filter(|(key, entry)| take(key, entry)).map(|(key, _)| key.clone()).collect();
    keys.into_iter().filter_map(|key| objects.remove_entry(&key)).collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    fn cm(name: &str, version: &str) -> ConfigMap {
        let metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            resource_version: Some(version.into()),
            ..Default::default()
        };
        ConfigMap { metadata, ..Default::default() }
    }

    fn version(cache: &Cache<ConfigMap>, name: &str) -> Option<String> {
        cache.get(&ObjectKey::new("ns", name))?.metadata.resource_version.clone()
    }

    #[test]
    fn a_list_replaces_the_cache_only_when_complete() {
        let all = Scope::everything();
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(0, &all, &watcher::Event::Init);
        writer.apply(0, &all, &watcher::Event::InitApply(cm("a", "1")));
        writer.apply(0, &all, &watcher::Event::InitApply(cm("b", "1")));
        assert!(cache.is_empty(), "a list under way is not visible");
        writer.apply(0, &all, &watcher::Event::InitDone);
        assert_eq!(cache.len(), 2);

        writer.apply(0, &all, &watcher::Event::Apply(cm("a", "2")));
        assert_eq!(version(&cache, "a").as_deref(), Some("2"));
        writer.apply(0, &all, &watcher::Event::Delete(cm("b", "2")));
        assert_eq!(version(&cache, "b"), None);

        // A relist that no longer finds `a`: the old state holds until the list completes.
        writer.apply(0, &all, &watcher::Event::Init);
        writer.apply(0, &all, &watcher::Event::InitApply(cm("c", "3")));
        assert_eq!(version(&cache, "a").as_deref(), Some("2"));
        writer.apply(0, &all, &watcher::Event::InitDone);
        assert_eq!((version(&cache, "a"), version(&cache, "c").as_deref()), (None, Some("3")));
    }

    #[test]
    fn an_interrupted_list_is_dropped_and_the_next_one_counts() {
        let all = Scope::everything();
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(0, &all, &watcher::Event::Apply(cm("a", "1")));
        writer.apply(0, &all, &watcher::Event::Init);
        writer.apply(0, &all, &watcher::Event::InitApply(cm("b", "2")));
        // The watch failed mid-list and lists again; "b" is gone by then.
        writer.apply(0, &all, &watcher::Event::Init);
        writer.apply(0, &all, &watcher::Event::InitApply(cm("c", "3")));
        writer.apply(0, &all, &watcher::Event::InitDone);
        let names: Vec<Option<String>> = ["a", "b", "c"].iter().map(|n| version(&cache, n)).collect();
        assert_eq!(names, [None, None, Some("3".into())]);
    }

    #[test]
    fn a_relist_keeps_unchanged_objects_as_cached() {
        let all = Scope::everything();
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(0, &all, &watcher::Event::Apply(cm("same", "1")));
        writer.apply(0, &all, &watcher::Event::Apply(cm("edited", "1")));
        let before = |name: &str| cache.get(&ObjectKey::new("ns", name)).unwrap();
        let (same, edited) = (before("same"), before("edited"));
        writer.apply(0, &all, &watcher::Event::Init);
        writer.apply(0, &all, &watcher::Event::InitApply(cm("same", "1")));
        writer.apply(0, &all, &watcher::Event::InitApply(cm("edited", "2")));
        writer.apply(0, &all, &watcher::Event::InitDone);
        assert!(Arc::ptr_eq(&same, &before("same")), "no second copy of an unchanged object");
        assert!(!Arc::ptr_eq(&edited, &before("edited")));
        assert_eq!(version(&cache, "edited").as_deref(), Some("2"));
    }

    #[test]
    fn keys_handed_out_share_the_cached_key() {
        let all = Scope::everything();
        let (cache, mut writer) = new::<ConfigMap>();
        let first = writer.apply(0, &all, &watcher::Event::Apply(cm("a", "1"))).key.unwrap();
        let again = writer.apply(0, &all, &watcher::Event::Apply(cm("a", "2"))).key.unwrap();
        let relisted = {
            writer.apply(0, &all, &watcher::Event::Init);
            writer.apply(0, &all, &watcher::Event::InitApply(cm("a", "3"))).key.unwrap()
        };
        writer.apply(0, &all, &watcher::Event::InitDone);
        let deleted = writer.apply(0, &all, &watcher::Event::Delete(cm("a", "4"))).key.unwrap();
        for key in [&again, &relisted, &deleted] {
            assert!(first.shares(key), "{key} is a copy");
        }
        assert!(cache.is_empty());
    }

    #[test]
    fn a_part_replaces_only_its_scope_and_a_dropped_scope_is_let_go() {
        use std::collections::BTreeSet;
        let in_bucket = |ns: &str| if ns == "a" { 1 } else { 2 };
        let slicing =
            crate::parts::Slicing::new(move |meta| meta.namespace.as_deref().map(in_bucket), in_bucket, |_| None);
        let scope = |bucket: u16| slicing.scope(Arc::new(BTreeSet::from([bucket])));
        let (a, b) = (scope(1), scope(2));
        let in_ns = |ns: &str, name: &str| {
            let mut object = cm(name, "1");
            object.metadata.namespace = Some(ns.into());
            object
        };
        let (cache, mut writer) = new::<ConfigMap>();
        for (part, scope, ns, names) in [(0, &a, "a", ["x", "y"]), (1, &b, "b", ["x", "y"])] {
            writer.apply(part, scope, &watcher::Event::Init);
            for name in names {
                writer.apply(part, scope, &watcher::Event::InitApply(in_ns(ns, name)));
            }
            writer.apply(part, scope, &watcher::Event::InitDone);
        }
        assert_eq!(cache.len(), 4);
        // Part 1 relists and no longer finds b/y; part 0's objects are not its to drop.
        writer.apply(1, &b, &watcher::Event::Init);
        writer.apply(1, &b, &watcher::Event::InitApply(in_ns("b", "x")));
        let gone = writer.apply(1, &b, &watcher::Event::InitDone).gone;
        assert_eq!(gone, [ObjectKey::new("b", "y")]);
        assert_eq!(cache.len(), 3);
        // A deletion from part 1 of an object of part 0's bucket (an object relabelled into
        // it, whose old part's watch says it left after the new one brought it): it stays.
        writer.apply(0, &a, &watcher::Event::Apply(in_ns("a", "moved")));
        writer.apply(1, &b, &watcher::Event::Delete(in_ns("a", "moved")));
        assert!(cache.get(&ObjectKey::new("a", "moved")).is_some(), "not part 1's to let go of");
        writer.apply(0, &a, &watcher::Event::Delete(in_ns("a", "moved")));
        let mut dropped = writer.drop_scope(&a);
        dropped.sort();
        assert_eq!(dropped, [ObjectKey::new("a", "x"), ObjectKey::new("a", "y")]);
        assert_eq!(cache.state().len(), 1);
    }
}
