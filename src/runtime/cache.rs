//! The primary resource's cache: objects by [`ObjectKey`], filled from watch events.
//!
//! kube-runtime's reflector store does the same, but keys each object by an `ObjectRef`
//! that copies its name, namespace, resourceVersion and uid: about 170 bytes a policy.
//! Here the key is the queue's, and it is handed on with each event, so the predicate, the
//! queue and the child versions hold the cache's own allocation rather than copies.
//!
//! As in the reflector, a list is gathered aside and replaces the cache whole when it
//! completes: readers never see a half-listed slice. Unlike it, a list keeps the objects it
//! finds unchanged as they are cached, so a relist does not hold two copies of a slice.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::Resource;
use kube::runtime::watcher;

use super::key::ObjectKey;

type Objects<K> = HashMap<ObjectKey, Arc<K>>;

/// Read access to the cache; clones share it.
pub struct Cache<K> {
    objects: Arc<RwLock<Objects<K>>>,
}

impl<K> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self { objects: self.objects.clone() }
    }
}

/// The cache's one writer, fed by the watch.
pub struct CacheWriter<K> {
    cache: Cache<K>,
    /// The list under way, if any.
    listing: Option<Objects<K>>,
}

/// An empty cache and its writer.
pub fn new<K>() -> (Cache<K>, CacheWriter<K>) {
    let cache = Cache { objects: Arc::new(RwLock::new(HashMap::new())) };
    (cache.clone(), CacheWriter { cache, listing: None })
}

impl<K> Cache<K> {
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<K>> {
        self.read().get(key).cloned()
    }

    /// Every object cached now.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> RwLockReadGuard<'_, Objects<K>> {
        self.objects.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Objects<K>> {
        self.objects.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<K: Resource + Clone> CacheWriter<K> {
    /// Applies a watch event; returns the cache's key for the event's object, if it has one.
    pub fn apply(&mut self, event: &watcher::Event<K>) -> Option<ObjectKey> {
        match event {
            watcher::Event::Init => {
                self.listing = Some(HashMap::new());
                None
            }
            watcher::Event::InitApply(object) => {
                // An object the relist finds unchanged is kept as cached: a relist of a slice
                // (after a handoff or a watch gap) then adds only what changed to memory.
                let key = ObjectKey::of(object);
                let (key, cached) = match self.cache.read().get_key_value(&key) {
                    Some((key, cached)) if same_version(cached.as_ref(), object) => (key.clone(), cached.clone()),
                    Some((key, _)) => (key.clone(), cached_copy(object)),
                    None => (key, cached_copy(object)),
                };
                self.listing.get_or_insert_default().insert(key.clone(), cached);
                Some(key)
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    // The old map is freed after the lock is released.
                    let replaced = std::mem::replace(&mut *self.cache.write(), listed);
                    drop(replaced);
                }
                None
            }
            watcher::Event::Apply(object) => {
                let mut objects = self.cache.write();
                let key = ObjectKey::of(object);
                let key = objects.get_key_value(&key).map_or(key, |(cached, _)| cached.clone());
                objects.insert(key.clone(), cached_copy(object));
                Some(key)
            }
            watcher::Event::Delete(object) => {
                let key = ObjectKey::of(object);
                Some(self.cache.write().remove_entry(&key).map_or(key, |(cached, _)| cached))
            }
        }
    }
}

/// Objects are cached as clones, as kube's reflector does: a clone also drops the spare
/// room that decoded lists keep (a list of one has room for four).
fn cached_copy<K: Clone>(object: &K) -> Arc<K> {
    Arc::new(object.clone())
}

fn same_version<K: Resource>(cached: &K, object: &K) -> bool {
    let cached = cached.meta().resource_version.as_deref();
    cached.is_some() && cached == object.meta().resource_version.as_deref()
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
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(cm("a", "1")));
        writer.apply(&watcher::Event::InitApply(cm("b", "1")));
        assert!(cache.is_empty(), "a list under way is not visible");
        writer.apply(&watcher::Event::InitDone);
        assert_eq!(cache.len(), 2);

        writer.apply(&watcher::Event::Apply(cm("a", "2")));
        assert_eq!(version(&cache, "a").as_deref(), Some("2"));
        writer.apply(&watcher::Event::Delete(cm("b", "2")));
        assert_eq!(version(&cache, "b"), None);

        // A relist that no longer finds `a`: the old state holds until the list completes.
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(cm("c", "3")));
        assert_eq!(version(&cache, "a").as_deref(), Some("2"));
        writer.apply(&watcher::Event::InitDone);
        assert_eq!((version(&cache, "a"), version(&cache, "c").as_deref()), (None, Some("3")));
    }

    #[test]
    fn an_interrupted_list_is_dropped_and_the_next_one_counts() {
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(&watcher::Event::Apply(cm("a", "1")));
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(cm("b", "2")));
        // The watch failed mid-list and lists again; "b" is gone by then.
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(cm("c", "3")));
        writer.apply(&watcher::Event::InitDone);
        let names: Vec<Option<String>> = ["a", "b", "c"].iter().map(|n| version(&cache, n)).collect();
        assert_eq!(names, [None, None, Some("3".into())]);
    }

    #[test]
    fn a_relist_keeps_unchanged_objects_as_cached() {
        let (cache, mut writer) = new::<ConfigMap>();
        writer.apply(&watcher::Event::Apply(cm("same", "1")));
        writer.apply(&watcher::Event::Apply(cm("edited", "1")));
        let before = |name: &str| cache.get(&ObjectKey::new("ns", name)).unwrap();
        let (same, edited) = (before("same"), before("edited"));
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(cm("same", "1")));
        writer.apply(&watcher::Event::InitApply(cm("edited", "2")));
        writer.apply(&watcher::Event::InitDone);
        assert!(Arc::ptr_eq(&same, &before("same")), "no second copy of an unchanged object");
        assert!(!Arc::ptr_eq(&edited, &before("edited")));
        assert_eq!(version(&cache, "edited").as_deref(), Some("2"));
    }

    #[test]
    fn keys_handed_out_share_the_cached_key() {
        let (cache, mut writer) = new::<ConfigMap>();
        let first = writer.apply(&watcher::Event::Apply(cm("a", "1"))).unwrap();
        let again = writer.apply(&watcher::Event::Apply(cm("a", "2"))).unwrap();
        let relisted = {
            writer.apply(&watcher::Event::Init);
            writer.apply(&watcher::Event::InitApply(cm("a", "3"))).unwrap()
        };
        writer.apply(&watcher::Event::InitDone);
        let deleted = writer.apply(&watcher::Event::Delete(cm("a", "4"))).unwrap();
        for key in [&again, &relisted, &deleted] {
            assert!(first.shares(key), "{key} is a copy");
        }
        assert!(cache.is_empty());
    }
}
