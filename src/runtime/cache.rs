//! The primary resource's cache: objects by [`ObjectKey`], filled from watch events.
//!
//! kube-runtime's reflector store does the same, but keys each object by an `ObjectRef`
//! that copies its name, namespace, resourceVersion and uid: about 170 bytes a policy.
//! Here the key is the queue's, and it is handed on with each event, so the predicate and
//! the queue hold the cache's own allocation rather than copies.
//!
//! As in the reflector, a list is gathered aside and replaces the cache whole when it
//! completes: readers never see a half-listed slice.

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
pub fn cache<K>() -> (Cache<K>, CacheWriter<K>) {
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

    /// `key`, or the equal key the cache already holds, so that its holders share one.
    fn shared(&self, key: ObjectKey) -> ObjectKey {
        self.read().get_key_value(&key).map_or(key, |(cached, _)| cached.clone())
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
        // Objects are cached as clones, as the reflector does: a clone also drops the spare
        // room that decoded lists keep (a list of one has room for four).
        match event {
            watcher::Event::Init => {
                self.listing = Some(HashMap::new());
                None
            }
            watcher::Event::InitApply(object) => {
                let key = self.cache.shared(ObjectKey::of(object));
                self.listing.get_or_insert_default().insert(key.clone(), Arc::new(object.clone()));
                Some(key)
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    *self.cache.write() = listed;
                }
                None
            }
            watcher::Event::Apply(object) => {
                let key = self.cache.shared(ObjectKey::of(object));
                self.cache.write().insert(key.clone(), Arc::new(object.clone()));
                Some(key)
            }
            watcher::Event::Delete(object) => {
                let key = ObjectKey::of(object);
                Some(self.cache.write().remove_entry(&key).map_or(key, |(cached, _)| cached))
            }
        }
    }
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
        let (cache, mut writer) = cache::<ConfigMap>();
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
    fn keys_handed_out_share_the_cached_key() {
        let (cache, mut writer) = cache::<ConfigMap>();
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
