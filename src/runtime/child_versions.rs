//! The last known resourceVersion of each child, from our writes and from the child watch.
//!
//! It lets the child watch drop the echo of our own writes (and events already seen),
//! and lets the reconcile tell a repair (someone else changed or deleted the child) from
//! an update (the policy changed). Children share their owner's key, so an entry is
//! dropped with its owner.
//!
//! It also knows what each child holds (a hash of the content we wrote, stamped on the child
//! as [`CONTENT_ANNOTATION`]) when the child is known to be as we wrote it, so the reconcile
//! can skip an apply that would change nothing: no write per child at resync, restart or
//! handoff.
//!
//! The echo of a write may arrive before the write's response. So while an owner is being
//! written ([`ChildVersions::begin_write`] … [`ChildVersions::end_write`]), events for its
//! children are held, and compared with what we wrote once the writes are done.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::Mutex;

use kube::api::ObjectMeta;
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use super::key::ObjectKey;

/// On every child we write: the [`content_hash`] of what we wrote, in hex.
pub const CONTENT_ANNOTATION: &str = "trafficpolicy.dev/content";

/// A hash of a child as we would write it (before the content and fencing annotations go on).
pub fn content_hash<C: Serialize>(child: &C) -> u64 {
    xxh3_64(&serde_json::to_vec(child).expect("a child serializes"))
}

/// The content hash stamped on a child, if the child is still as its last apply by
/// `field_manager` left it: no other manager has changed it since. managedFields times have
/// one-second resolution, so a change in the same second counts as someone else's.
pub fn stamped_content(meta: &ObjectMeta, field_manager: &str) -> Option<u64> {
    let stamp = meta.annotations.as_ref()?.get(CONTENT_ANNOTATION)?;
    let entries = meta.managed_fields.as_deref().unwrap_or_default();
    let ours = |e: &&k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry| {
        e.manager.as_deref() == Some(field_manager)
    };
    let last_apply = entries.iter().filter(ours).filter_map(|e| e.time.as_ref()).map(|t| t.0).max()?;
    let changed_since = entries.iter().filter(|e| !ours(e)).any(|e| e.time.as_ref().is_none_or(|t| t.0 >= last_apply));
    if changed_since { None } else { u64::from_str_radix(stamp, 16).ok() }
}

/// What we know of one child (32 bytes: the hashes are never 0, so their options cost
/// nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Known {
    /// The [`version`] of its resourceVersion; `None` once the child was seen deleted.
    resource_version: Option<Hash>,
    /// The owner's generation at our last write.
    written_for_generation: Option<i64>,
    /// The content hash of what the child holds, when known: from our write, or from an
    /// event whose change was our field manager's (see [`stamped_content`]).
    content: Option<Hash>,
}

impl Known {
    const UNKNOWN: Known = Known { resource_version: None, written_for_generation: None, content: None };
}

/// A hash kept for comparison only; 0 is taken as 1, a collision of no consequence.
type Hash = NonZeroU64;

fn hash(value: u64) -> Hash {
    NonZeroU64::new(value).unwrap_or(NonZeroU64::MIN)
}

/// A resourceVersion, hashed: it is only ever compared for equality, and a hash is a tenth
/// of a string's memory (one per child of every policy).
fn version(resource_version: &str) -> Hash {
    hash(xxh3_64(resource_version.as_bytes()))
}

/// The most kinds of children an owner may have: room for each in every owner's entry.
/// (The traffic-policy controller has two; the controller checks its child watches against
/// this at start, so a third kind fails there rather than on its first event.)
pub const CHILD_KINDS: usize = 2;

/// What we know of one owner's children, a slot per kind (see [`Inner::kinds`]): one map
/// entry per owner, so an owner's entry is dropped in one step.
#[derive(Debug, Default)]
struct Children([Known; CHILD_KINDS]);

impl Children {
    fn is_empty(&self) -> bool {
        self.0.iter().all(|known| *known == Known::UNKNOWN)
    }
}

/// What was known of one kind of children when a list of them began (see
/// [`ChildVersions::missing_from_list`]).
#[derive(Debug, Default)]
pub struct KnownBefore(HashMap<ObjectKey, Hash>);

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
    /// The kinds of children, in the order of their slots in every entry: each kind takes the
    /// next slot when first seen, so entries need not name their kinds.
    kinds: Vec<&'static str>,
    known: HashMap<ObjectKey, Children>,
    /// Owners being written.
    writing: HashMap<ObjectKey, Writing>,
}

/// An owner being written: the child events that arrived meanwhile, and the kinds (by slot)
/// forgotten meanwhile, because the owner left the cache or its children's watch. The
/// write must not bring those back: nothing would ever forget them again.
#[derive(Debug, Default)]
struct Writing {
    held: Vec<Observed>,
    forgotten: [bool; CHILD_KINDS],
}

impl Inner {
    fn slot(&mut self, kind: &'static str) -> usize {
        self.kinds.iter().position(|k| *k == kind).unwrap_or_else(|| {
            assert!(self.kinds.len() < CHILD_KINDS, "an owner has at most CHILD_KINDS kinds of children");
            self.kinds.push(kind);
            self.kinds.len() - 1
        })
    }

    /// What is known of `owner`'s child of `kind`, created unknown if need be.
    fn entry(&mut self, owner: &ObjectKey, kind: &'static str) -> &mut Known {
        let slot = self.slot(kind);
        &mut self.known.entry(owner.clone()).or_default().0[slot]
    }

    fn get(&self, owner: &ObjectKey, kind: &str) -> Option<&Known> {
        let slot = self.kinds.iter().position(|k| *k == kind)?;
        self.known.get(owner).map(|children| &children.0[slot])
    }
}

/// A child event: its kind, [`version`] (`None`: deleted) and stamped content.
type Observed = (&'static str, Option<Hash>, Option<Hash>);

impl ChildVersions {
    /// Records a version seen by the watch, with the content it is known to hold; true when
    /// it is news (not our own write's echo).
    pub fn observe(
        &self,
        kind: &'static str,
        key: &ObjectKey,
        resource_version: Option<&str>,
        content: Option<u64>,
    ) -> bool {
        let resource_version = resource_version.map(version);
        let content = content.map(hash);
        let mut inner = self.lock();
        if let Some(writing) = inner.writing.get_mut(key) {
            writing.held.push((kind, resource_version, content));
            return false;
        }
        if resource_version.is_none() && !inner.known.contains_key(key) {
            // A child of an owner we know nothing of (or have forgotten: deleted, its
            // children collected after it) is gone: nothing to remember.
            return true;
        }
        let entry = inner.entry(key, kind);
        if entry.resource_version == resource_version && resource_version.is_some() {
            return false;
        }
        entry.resource_version = resource_version;
        entry.content = content.filter(|_| resource_version.is_some());
        true
    }

    /// True when the child is known to exist holding exactly `content`: applying it again
    /// would change nothing.
    pub fn holds(&self, kind: &'static str, key: &ObjectKey, content: u64) -> bool {
        let inner = self.lock();
        inner.get(key, kind).is_some_and(|k| k.resource_version.is_some() && k.content == Some(hash(content)))
    }

    /// Starts writing the children of `owner`: their events are held until the guard is
    /// finished or dropped (a cancelled reconcile must not leave events held).
    pub fn begin_write<'a>(&'a self, owner: &ObjectKey) -> WriteGuard<'a> {
        let mut inner = self.lock();
        // Keep the reconcile's key (the cache's, shared) rather than one a child event made.
        if let Some(children) = inner.known.remove(owner) {
            inner.known.insert(owner.clone(), children);
        }
        inner.writing.insert(owner.clone(), Writing::default());
        drop(inner);
        WriteGuard { versions: self, owner: Some(owner.clone()) }
    }

    fn end_write(&self, owner: &ObjectKey) -> bool {
        let mut inner = self.lock();
        let Writing { held, forgotten } = inner.writing.remove(owner).unwrap_or_default();
        let mut foreign = false;
        for (kind, resource_version, content) in held {
            if forgotten[inner.slot(kind)] {
                // Not recorded; looked at again, in case the owner came back meanwhile.
                foreign = true;
                continue;
            }
            let entry = inner.entry(owner, kind);
            if entry.resource_version != resource_version {
                entry.content = content.filter(|_| resource_version.is_some());
                entry.resource_version = resource_version;
                foreign = true;
            }
        }
        foreign
    }

    /// Records our write of `content` and classifies it.
    pub fn written(
        &self,
        kind: &'static str,
        key: &ObjectKey,
        resource_version: &str,
        generation: Option<i64>,
        content: u64,
    ) -> ApplyEffect {
        let resource_version = version(resource_version);
        let now = Known {
            resource_version: Some(resource_version),
            written_for_generation: generation,
            content: Some(hash(content)),
        };
        let mut inner = self.lock();
        let slot = inner.slot(kind);
        if inner.writing.get(key).is_some_and(|writing| writing.forgotten[slot]) {
            // Forgotten while being written: nothing is known of it before or after.
            return ApplyEffect::Applied;
        }
        let entry = inner.entry(key, kind);
        let previous = Some(std::mem::replace(entry, now)).filter(|p| *p != Known::UNKNOWN);
        match previous {
            Some(p) if p.resource_version == Some(resource_version) => ApplyEffect::Unchanged,
            Some(p) if p.written_for_generation.is_none() => ApplyEffect::Applied,
            Some(p) if p.written_for_generation == generation => ApplyEffect::Repaired,
            Some(_) => ApplyEffect::Updated,
            None => ApplyEffect::Applied,
        }
    }

    /// Drops what we know of the children of `owner`, and what a write under way would record.
    pub fn forget_owner(&self, owner: &ObjectKey) {
        let mut inner = self.lock();
        inner.known.remove(owner);
        if let Some(writing) = inner.writing.get_mut(owner) {
            writing.forgotten = [true; CHILD_KINDS];
        }
    }

    /// Drops what we know of children of `kind` whose owner `covers` says (their buckets
    /// left the slice), and the entries left with nothing.
    pub fn forget_kind_where(&self, kind: &str, covers: impl Fn(&ObjectKey) -> bool) {
        let mut inner = self.lock();
        let Some(slot) = inner.kinds.iter().position(|k| *k == kind) else { return };
        inner.known.retain(|owner, children| {
            if covers(owner) {
                children.0[slot] = Known::UNKNOWN;
            }
            !children.is_empty()
        });
        for (_, writing) in inner.writing.iter_mut().filter(|(owner, _)| covers(owner)) {
            writing.forgotten[slot] = true;
        }
    }

    /// What is known now of the `kind` children of the owners `covers` says: taken when a
    /// list of them begins.
    pub fn known_where(&self, kind: &str, covers: impl Fn(&ObjectKey) -> bool) -> KnownBefore {
        let inner = self.lock();
        let Some(slot) = inner.kinds.iter().position(|k| *k == kind) else { return KnownBefore::default() };
        let known = inner.known.iter().filter(|(owner, _)| covers(owner));
        KnownBefore(known.filter_map(|(owner, c)| Some((owner.clone(), c.0[slot].resource_version?))).collect())
    }

    /// A list sends no deletions. The owners whose `kind` child was known when the list
    /// began (`before`), is unchanged since, and was not `found` by it: their children were
    /// deleted before the list's snapshot. Marks each deleted, so the next reconcile applies it
    /// again, and returns the owners.
    pub fn missing_from_list(
        &self,
        kind: &'static str,
        before: KnownBefore,
        found: &HashSet<ObjectKey>,
    ) -> Vec<ObjectKey> {
        let mut inner = self.lock();
        let slot = inner.slot(kind);
        let Inner { known, writing, .. } = &mut *inner;
        let mut missing = Vec::new();
        for (owner, version) in before.0 {
            if found.contains(&owner) || writing.contains_key(&owner) {
                continue;
            }
            if let Some(child) = known.get_mut(&owner).map(|children| &mut children.0[slot])
                && child.resource_version == Some(version)
            {
                child.resource_version = None;
                child.content = None;
                missing.push(owner);
            }
        }
        missing
    }

    pub fn is_empty(&self) -> bool {
        self.lock().known.is_empty()
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
        assert_eq!(v.written("NetworkPolicy", &k, "10", Some(1), 1), ApplyEffect::Applied);
        assert!(!v.observe("NetworkPolicy", &k, Some("10"), None), "echo of our own write");
        assert_eq!(v.written("NetworkPolicy", &k, "10", Some(1), 1), ApplyEffect::Unchanged);
        assert!(v.observe("NetworkPolicy", &k, Some("11"), None), "someone else edited it");
        assert_eq!(v.written("NetworkPolicy", &k, "12", Some(1), 1), ApplyEffect::Repaired);
        assert!(v.observe("NetworkPolicy", &k, None, None), "deleted");
        assert_eq!(v.written("NetworkPolicy", &k, "13", Some(1), 1), ApplyEffect::Repaired);
        assert_eq!(v.written("NetworkPolicy", &k, "14", Some(2), 2), ApplyEffect::Updated);
        v.forget_owner(&k);
        assert!(v.is_empty());
    }

    #[test]
    fn an_apply_is_skipped_only_while_the_child_holds_what_we_would_write() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        assert!(!v.holds("ConfigMap", &k, 7), "nothing known yet");
        v.written("ConfigMap", &k, "10", Some(1), 7);
        assert!(v.holds("ConfigMap", &k, 7));
        assert!(!v.holds("ConfigMap", &k, 8), "the spec changed: different content");
        assert!(v.observe("ConfigMap", &k, Some("11"), None), "edited by someone else");
        assert!(!v.holds("ConfigMap", &k, 7), "edited: repair it");
        assert!(v.observe("ConfigMap", &k, Some("12"), Some(7)), "applied by another replica of ours");
        assert!(v.holds("ConfigMap", &k, 7));
        assert!(v.observe("ConfigMap", &k, None, Some(7)), "deleted");
        assert!(!v.holds("ConfigMap", &k, 7), "deleted: create it again");
    }

    fn meta(stamp: Option<&str>, entries: &[(&str, &str)]) -> ObjectMeta {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};
        let entry = |(manager, time): &(&str, &str)| ManagedFieldsEntry {
            manager: Some(manager.to_string()),
            time: Some(Time(time.parse().unwrap())),
            ..Default::default()
        };
        ObjectMeta {
            annotations: stamp.map(|s| [(CONTENT_ANNOTATION.to_string(), s.to_string())].into()),
            managed_fields: Some(entries.iter().map(entry).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn a_stamp_counts_only_when_no_other_manager_changed_the_child_since() {
        let (us, t1, t2) = ("operator", "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z");
        assert_eq!(stamped_content(&meta(Some("ff"), &[(us, t1)]), us), Some(255));
        assert_eq!(stamped_content(&meta(Some("ff"), &[("kubectl-label", t1), (us, t2)]), us), Some(255));
        assert_eq!(stamped_content(&meta(Some("ff"), &[(us, t1), ("kubectl-edit", t2)]), us), None, "edited after");
        assert_eq!(stamped_content(&meta(Some("ff"), &[(us, t1), ("kubectl-edit", t1)]), us), None, "same second");
        assert_eq!(stamped_content(&meta(None, &[(us, t1)]), us), None, "no stamp");
        assert_eq!(stamped_content(&meta(Some("ff"), &[("kubectl-create", t1)]), us), None, "never applied by us");
    }

    #[test]
    fn content_hashes_follow_the_content() {
        let cm = |value: &str| k8s_openapi::api::core::v1::ConfigMap {
            data: Some([("k".to_string(), value.to_string())].into()),
            ..Default::default()
        };
        assert_eq!(content_hash(&cm("a")), content_hash(&cm("a")));
        assert_ne!(content_hash(&cm("a")), content_hash(&cm("b")));
    }

    #[test]
    fn the_deletion_of_a_forgotten_owners_child_leaves_nothing_behind() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        v.written("ConfigMap", &k, "10", Some(1), 7);
        v.forget_owner(&k);
        assert!(v.observe("ConfigMap", &k, None, None), "news: the owner looks again, and finds itself gone");
        assert!(v.is_empty(), "collected children of a deleted owner must not stay known");
    }

    #[test]
    fn echoes_arriving_before_the_write_returns_are_recognised() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        let write = v.begin_write(&k);
        assert!(!v.observe("ConfigMap", &k, Some("5"), None), "held while writing");
        assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::Applied);
        assert!(!write.finish(), "it was our own echo");
        assert!(!v.observe("ConfigMap", &k, Some("5"), None));

        let write = v.begin_write(&k);
        assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::Unchanged);
        assert!(!v.observe("ConfigMap", &k, Some("6"), None), "held");
        assert!(write.finish(), "someone else wrote after us: look again");

        drop(v.begin_write(&k));
        assert!(v.observe("ConfigMap", &k, Some("7"), None), "a dropped write holds nothing back");
    }

    #[test]
    fn a_write_that_ends_after_its_owner_was_forgotten_brings_nothing_back() {
        let v = ChildVersions::default();
        let k = ObjectKey::new("ns", "a");
        // The policy is deleted, or leaves the slice, while its children are being written.
        let write = v.begin_write(&k);
        v.forget_owner(&k);
        assert!(!v.observe("ConfigMap", &k, Some("5"), Some(1)), "held while writing");
        assert_eq!(v.written("ConfigMap", &k, "5", Some(1), 1), ApplyEffect::Applied);
        assert!(write.finish(), "what the list of an owner that came back would bring: look again");
        assert!(v.is_empty(), "nothing would ever forget it again");

        // One kind's watch lets go of the owner's bucket while the owner is being written.
        let write = v.begin_write(&k);
        v.forget_kind_where("ConfigMap", |_| true);
        v.written("ConfigMap", &k, "6", Some(1), 1);
        v.written("NetworkPolicy", &k, "7", Some(1), 2);
        assert!(!write.finish());
        assert!(!v.holds("ConfigMap", &k, 1), "forgotten");
        assert!(v.holds("NetworkPolicy", &k, 2), "that kind's watch still covers the owner");
    }

    #[test]
    fn a_dropped_scope_forgets_its_kind_and_empty_entries() {
        let versions = ChildVersions::default();
        let (kept, dropped) = (ObjectKey::new("kept", "p"), ObjectKey::new("dropped", "p"));
        for owner in [&kept, &dropped] {
            versions.observe("NetworkPolicy", owner, Some("1"), Some(7));
            versions.observe("ConfigMap", owner, Some("1"), Some(8));
        }
        let in_dropped = |owner: &ObjectKey| owner.namespace() == "dropped";
        versions.forget_kind_where("NetworkPolicy", in_dropped);
        assert!(versions.holds("NetworkPolicy", &kept, 7));
        assert!(!versions.holds("NetworkPolicy", &dropped, 7));
        assert!(versions.holds("ConfigMap", &dropped, 8), "the other kind's watch has not dropped it yet");
        versions.forget_kind_where("ConfigMap", in_dropped);
        assert_eq!(versions.lock().known.len(), 1, "nothing is left of the dropped owner");
    }

    #[test]
    fn an_owner_entry_keeps_its_children_in_64_bytes() {
        assert_eq!(std::mem::size_of::<Children>(), 64, "two slots of 32 bytes, kinds named once");
    }

    #[test]
    fn a_child_a_list_does_not_find_is_known_deleted_unless_it_changed_since() {
        let versions = ChildVersions::default();
        let (gone, kept, rewritten) =
            (ObjectKey::new("n", "gone"), ObjectKey::new("n", "kept"), ObjectKey::new("n", "new"));
        for owner in [&gone, &kept, &rewritten] {
            versions.observe("ConfigMap", owner, Some("1"), Some(7));
        }
        let before = versions.known_where("ConfigMap", |_| true);
        // Written by us while the list ran, after its snapshot.
        versions.written("ConfigMap", &rewritten, "2", Some(1), 7);
        let found = HashSet::from([kept.clone()]);
        assert_eq!(versions.missing_from_list("ConfigMap", before, &found), std::slice::from_ref(&gone));
        assert!(!versions.holds("ConfigMap", &gone, 7), "applied again at the next reconcile");
        assert!(versions.holds("ConfigMap", &kept, 7) && versions.holds("ConfigMap", &rewritten, 7));
    }
}
