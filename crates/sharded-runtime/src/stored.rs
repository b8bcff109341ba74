//! The form an object takes in the cache: by default the object itself, trimmed of what no
//! reconcile reads; or a compact copy of what its reconcile reads.

use kube::Resource;

/// The form an object takes in the cache. It keeps what the runtime compares between
/// events: the uid, the generation (or whatever [`Stored::changed`] compares) and the
/// resourceVersion.
pub trait Stored: Send + Sync + Sized + 'static {
    /// The object watched.
    type Object: Resource + Clone;
    fn store(object: &Self::Object) -> Self;
    fn has_uid(&self, uid: Option<&str>) -> bool;
    fn generation(&self) -> Option<i64>;
    /// Whether `object`, a later sight of this one, is worth a reconcile: by default, a new
    /// generation (a change of its spec). A controller of labels, which leave the generation
    /// alone, compares what it keeps of them instead.
    fn changed(&self, object: &Self::Object) -> bool {
        self.generation() != object.meta().generation
    }
    /// Whether this is `resource_version` of the object (never when either has none).
    fn is_version(&self, resource_version: Option<&str>) -> bool;
    /// Whether `object` itself says that its latest change awaits the controller (as a
    /// status that observed an older generation does): met for the first time in a list,
    /// it is an edit, not backlog. By default nothing says so.
    fn shows_unobserved_change(_object: &Self::Object) -> bool {
        false
    }
}

/// By default, the object itself, trimmed as [`trim`] says. As kube's reflector
/// does, it is a clone: a clone also drops the spare room that decoded lists keep (a list of
/// one has room for four).
impl<K: Resource + Clone + Send + Sync + 'static> Stored for K {
    type Object = K;

    fn store(object: &K) -> K {
        let mut object = object.clone();
        trim(&mut object);
        object
    }

    fn has_uid(&self, uid: Option<&str>) -> bool {
        self.meta().uid.as_deref() == uid
    }

    fn generation(&self) -> Option<i64> {
        self.meta().generation
    }

    fn is_version(&self, resource_version: Option<&str>) -> bool {
        let cached = self.meta().resource_version.as_deref();
        cached.is_some() && cached == resource_version
    }
}

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
