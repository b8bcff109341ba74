//! The work-queue key: a namespaced object's namespace and name.
//!
//! The cache, the queue and the child versions each hold a key per object, so
//! a key is small: `namespace/name` in one shared allocation, whose clones cost a reference
//! count.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use kube::{Resource, ResourceExt};

/// `namespace/name` (16 bytes: a pointer and a length). Neither part can contain a `/`, so
/// the text alone tells the parts apart, and equal texts are equal keys.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey(Arc<str>);

impl ObjectKey {
    /// The key of object `name` in `namespace` (empty for a cluster-scoped object).
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self(format!("{}/{}", namespace.as_ref(), name.as_ref()).into())
    }

    /// The key of `object`.
    pub fn of<K: Resource>(object: &K) -> Self {
        Self::new(object.meta().namespace.as_deref().unwrap_or_default(), object.name_any())
    }

    fn parts(&self) -> (&str, &str) {
        self.0.split_once('/').expect("a key is namespace/name")
    }

    /// The object's namespace; empty for a cluster-scoped object.
    pub fn namespace(&self) -> &str {
        self.parts().0
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        self.parts().1
    }

    /// Whether `other` is a clone of this key, sharing its allocation.
    #[cfg(test)]
    pub fn shares(&self, other: &ObjectKey) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// By namespace, then name (not by the joined text, where `-` sorts before `/`).
impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_its_parts_and_orders_by_namespace_first() {
        let key = ObjectKey::new("team-a", "web");
        assert_eq!((key.namespace(), key.name()), ("team-a", "web"));
        assert_eq!(key.to_string(), "team-a/web");
        assert_eq!(ObjectKey::new("", "cluster-wide").namespace(), "");
        // Joined, "a-b/x" < "a/y"; by parts, namespace "a" comes first.
        assert!(ObjectKey::new("a", "y") < ObjectKey::new("a-b", "x"));
        assert_eq!(ObjectKey::new("a", "b-c"), ObjectKey::new("a", "b-c"));
        assert_ne!(ObjectKey::new("a-b", "c"), ObjectKey::new("a", "b-c"));
        assert_eq!(size_of::<ObjectKey>(), 16, "held once per object by four structures");
    }
}
