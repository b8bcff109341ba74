//! The last known resourceVersion of each child, from our writes and from the child watch.
//!
//! It lets the child watch drop the echo of our own writes (and events already seen),
//! and lets the reconcile tell a repair (someone else changed or deleted the child) from
//! an update (the policy changed). Children share their owner's key, so an entry is
//! dropped with its owner.
//!
//! The echo of a write may arrive before the write's response. So while an owner is being
//! written ([`ChildVersions::begin_write`] … [`ChildVersions::end_write`]), events for its
//! children are held, and compared with what we wrote once the writes are done.

use std::collections::HashMap;
use std::sync::Mutex;

use super::key::ObjectKey;

/// What we know of one child.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Known {
    /// `None` once the child was seen deleted.
    resource_version: Option<String>,
    /// The owner's generation at our last write.
    written_for_generation: Option<i64>,
}

/// What an apply did to a child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyEffect {
    /// The server kept the object as it was.
    Unchanged,
    /// First write we know of (created, or changed after our restart).
    Applied,
    /// Changed because the owner's spec changed.
    Updated,
    /// Restored after someone else changed or deleted it.
    Repaired,
}

/// The writes to one owner's children are under way.
pub struct WriteGuard<'a> {
    versions: &'a ChildVersions,
    owner: Option<ObjectKey>,
}

impl WriteGuard<'_> {
    /// Ends the writes; true when a held event was not the echo of our own write, i.e.
    /// someone else changed a child meanwhile and the owner needs another look.
    pub fn finish(mut self) -> bool {
        let owner = self.owner.take().expect("finished once");
        self.versions.end_write(&owner)
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            self.versions.end_write(&owner);
        }
    }
}

#[derive(Default)]
pub struct ChildVersions {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    known: HashMap<(&'static str, ObjectKey), Known>,
    /// Owners being written, with the child events that arrived meanwhile.
    writing: HashMap<ObjectKey, Vec<(&'static str, Option<String>)>>,
}

impl ChildVersions {
    /// Records a version seen by the watch; true when it is news (not our own write's echo).
    pub fn observe(&self, kind: &'static str, key: &ObjectKey, resource_version: Option<&str>) -> bool {
        let mut inner = self.lock();
        if let Some(held) = inner.writing.get_mut(key) {
            held.push((kind, resource_version.map(str::to_string)));
            return false;
        }
        let entry = inner
            .known
            .entry((kind, key.clone()))
            .or_insert(Known { resource_version: None, written_for_generation: None });
        if entry.resource_version.as_deref() == resource_version && resource_version.is_some() {
            return false;
        }
        entry.resource_version = resource_version.map(str::to_string);
        true
    }

    /// Starts writing the children of `owner`: their events are held until the guard is
    /// finished or dropped (a cancelled reconcile must not leave events held).
    pub fn begin_write<'a>(&'a self, owner: &ObjectKey) -> WriteGuard<'a> {
        self.lock().writing.insert(owner.clone(), Vec::new());
        WriteGuard { versions: self, owner: Some(owner.clone()) }
    }

    fn end_write(&self, owner: &ObjectKey) -> bool {
        let mut inner = self.lock();
        let held = inner.writing.remove(owner).unwrap_or_default();
        let mut foreign = false;
        for (kind, resource_version) in held {
            let entry = inner
                .known
                .entry((kind, owner.clone()))
                .or_insert(Known { resource_version: None, written_for_generation: None });
            if entry.resource_version != resource_version {
                entry.resource_version = resource_version;
                foreign = true;
            }
        }
        foreign
    }

    /// Records our write and classifies it.
    pub fn written(
        &self,
        kind: &'static str,
        key: &ObjectKey,
        resource_version: &str,
        generation: Option<i64>,
    ) -> ApplyEffect {
        let mut inner = self.lock();
        let previous = inner.known.insert(
            (kind, key.clone()),
            Known { resource_version: Some(resource_version.to_string()), written_for_generation: generation },
        );
        match previous {
            Some(p) if p.resource_version.as_deref() == Some(resource_version) => ApplyEffect::Unchanged,
            Some(p) if p.written_for_generation.is_none() => ApplyEffect::Applied,
            Some(p) if p.written_for_generation == generation => ApplyEffect::Repaired,
            Some(_) => ApplyEffect::Updated,
            None => ApplyEffect::Applied,
        }
    }

    /// Drops what we know of the children of `owner`.
    pub fn forget_owner(&self, owner: &ObjectKey) {
        self.lock().known.retain(|(_, key), _| key != owner);
    }

    pub fn len(&self) -> usize {
        self.lock().known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_writes_and_filters_echoes() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        assert_eq!(v.written("NetworkPolicy", &k, "10", Some(1)), ApplyEffect::Applied);
        assert!(!v.observe("NetworkPolicy", &k, Some("10")), "echo of our own write");
        assert_eq!(v.written("NetworkPolicy", &k, "10", Some(1)), ApplyEffect::Unchanged);
        assert!(v.observe("NetworkPolicy", &k, Some("11")), "someone else edited it");
        assert_eq!(v.written("NetworkPolicy", &k, "12", Some(1)), ApplyEffect::Repaired);
        assert!(v.observe("NetworkPolicy", &k, None), "deleted");
        assert_eq!(v.written("NetworkPolicy", &k, "13", Some(1)), ApplyEffect::Repaired);
        assert_eq!(v.written("NetworkPolicy", &k, "14", Some(2)), ApplyEffect::Updated);
        v.forget_owner(&k);
        assert!(v.is_empty());
    }

    #[test]
    fn echoes_arriving_before_the_write_returns_are_recognised() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        let write = v.begin_write(&k);
        assert!(!v.observe("ConfigMap", &k, Some("5")), "held while writing");
        assert_eq!(v.written("ConfigMap", &k, "5", Some(1)), ApplyEffect::Applied);
        assert!(!write.finish(), "it was our own echo");
        assert!(!v.observe("ConfigMap", &k, Some("5")));

        let write = v.begin_write(&k);
        assert_eq!(v.written("ConfigMap", &k, "5", Some(1)), ApplyEffect::Unchanged);
        assert!(!v.observe("ConfigMap", &k, Some("6")), "held");
        assert!(write.finish(), "someone else wrote after us: look again");

        drop(v.begin_write(&k));
        assert!(v.observe("ConfigMap", &k, Some("7")), "a dropped write holds nothing back");
    }
}
