//! The last known resourceVersion of each child, from our writes and from the child watch.
//!
//! It lets the child watch drop the echo of our own writes (and events already seen),
//! and lets the reconcile tell a repair (someone else changed or deleted the child) from
//! an update (the owner changed). Children share their owner's key, so an entry is
//! dropped with its owner.
//!
//! It also knows what each child holds (a hash of the content we wrote, stamped on the child
//! under the controller's [`ContentStamp`]) when the child is known to be as we wrote it, so
//! the reconcile can skip an apply that would change nothing: no write per child at resync,
//! restart or handoff.
//!
//! And it remembers the last generation of each owner whose outcome was reported, with the
//! owner's uid (an event, say), since the cache may not show yet the status written with it:
//! a second reconcile close behind the first must not report again.
//!
//! The echo of a write may arrive before the write's response. So while an owner is being
//! written ([`ChildVersions::begin_write`] … [`WriteGuard::finish`]), events for its
//! children are held, and compared with what we wrote once the writes are done.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::{NonZeroI64, NonZeroU64};
use std::sync::Mutex;

use kube::api::ObjectMeta;
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use super::key::ObjectKey;

/// How a controller marks a child with what it wrote: the annotation that holds the
/// [`content_hash`] in hex, written by applies of `field_manager`.
#[derive(Clone, Copy, Debug)]
pub struct ContentStamp {
    pub annotation: &'static str,
    pub field_manager: &'static str,
}

impl ContentStamp {
    /// Puts `content` on a child about to be written, in the form [`stamped_content`] reads.
    pub fn put(self, annotations: &mut BTreeMap<String, String>, content: u64) {
        annotations.insert(self.annotation.into(), format!("{content:x}"));
    }

    /// The content hash an annotation's value holds.
    pub fn parse(value: &str) -> Option<u64> {
        u64::from_str_radix(value, 16).ok()
    }
}

/// A hash of a child as we would write it (before the content and fencing annotations go on).
pub fn content_hash<C: Serialize>(child: &C) -> u64 {
    xxh3_64(&serde_json::to_vec(child).expect("a child serializes"))
}

/// The content hash stamped on a child, if the child is still as its last apply by the
/// stamp's field manager left it: no other manager has changed it since. managedFields times
/// have one-second resolution, so a change in the same second counts as someone else's.
pub fn stamped_content(meta: &ObjectMeta, stamp: ContentStamp) -> Option<u64> {
    let hash = meta.annotations.as_ref()?.get(stamp.annotation)?;
    let entries = meta.managed_fields.as_deref().unwrap_or_default();
    let ours = |e: &&k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry| {
        e.manager.as_deref() == Some(stamp.field_manager)
    };
    let last_apply = entries.iter().filter(ours).filter_map(|e| e.time.as_ref()).map(|t| t.0).max()?;
    let changed_since = entries.iter().filter(|e| !ours(e)).any(|e| e.time.as_ref().is_none_or(|t| t.0 >= last_apply));
    if changed_since { None } else { ContentStamp::parse(hash) }
}

/// What we know of one child (24 bytes: the hashes and the generation are never 0, so
/// their options cost nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Known {
    /// The [`version`] of its resourceVersion; `None` once the child was seen deleted.
    resource_version: Option<Hash>,
    /// The owner's generation at our last write.
    written_for_generation: Option<Generation>,
    /// The content hash of what the child holds, when known: from our write, or from an
    /// event whose change was our field manager's (see [`stamped_content`]).
    content: Option<Hash>,
}

impl Known {
    const UNKNOWN: Known = Known { resource_version: None, written_for_generation: None, content: None };
}

/// An owner's metadata.generation: the API server starts it at 1, so 0 (no generation) can
/// be `None` at no cost in memory.
type Generation = NonZeroI64;

fn nonzero_generation(value: Option<i64>) -> Option<Generation> {
    value.and_then(NonZeroI64::new)
}

/// A hash kept for comparison only; 0 is taken as 1, a collision of no consequence.
type Hash = NonZeroU64;

fn hash(value: u64) -> Hash {
    NonZeroU64::new(value).unwrap_or(NonZeroU64::MIN)
}

/// A resourceVersion, hashed: it is only ever compared for equality, and a hash is a tenth
/// of a string's memory (one per child of every owner).
fn version(resource_version: &str) -> Hash {
    hash(xxh3_64(resource_version.as_bytes()))
}

/// The most kinds of children an owner may have: room for each in every owner's entry.
/// (The controller checks its child watches against this at start, so one kind too many
/// fails there rather than on its first event.)
pub const CHILD_KINDS: usize = 2;

/// What we know of one owner's children, a slot per kind (see [`Inner::kinds`]), and the
/// owner's last reported generation: one map entry per owner, so an owner's entry is dropped
/// in one step.
#[derive(Debug, Default)]
struct Children {
    slots: [Known; CHILD_KINDS],
    reported: Option<ReportedMark>,
}

/// A reported generation, with the uid of the object it belongs to: an object deleted and
/// created again under the same name must not find its predecessor's generation 1 reported,
/// whichever a worker reconciles first, the new object or the forgetting of the old one. The
/// uid's hash in the upper 32 bits and the generation in the lower, in the 8 bytes a
/// generation alone took.
type ReportedMark = NonZeroU64;

/// `None` for no generation, and for a generation above 2^32 (four billion edits of one
/// object), which is then never taken as reported: at worst one more report.
fn reported_mark(uid: &str, generation: Option<i64>) -> Option<ReportedMark> {
    let generation = u32::try_from(generation?).ok().filter(|g| *g > 0)?;
    let uid = xxh3_64(uid.as_bytes()) >> 32;
    NonZeroU64::new(uid << 32 | u64::from(generation))
}

impl Children {
    /// Nothing known of any child: the entry goes, its reported generation with it.
    fn is_empty(&self) -> bool {
        self.slots.iter().all(|known| *known == Known::UNKNOWN)
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
    /// The first write we know of (created, or changed after our restart).
    FirstWrite,
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

/// What is known of each owner's children: the versions and content hashes last written or seen,
/// and which owner generations were reported.
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
        &mut self.known.entry(owner.clone()).or_default().slots[slot]
    }

    fn get(&self, owner: &ObjectKey, kind: &str) -> Option<&Known> {
        let slot = self.kinds.iter().position(|k| *k == kind)?;
        self.known.get(owner).map(|children| &children.slots[slot])
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

    /// Whether the child is known to be as one of our writes left it, whatever it holds: it
    /// exists, and no one but our field manager has changed it since (so it is ours).
    pub fn as_written(&self, kind: &'static str, key: &ObjectKey) -> bool {
        let inner = self.lock();
        inner.get(key, kind).is_some_and(|k| k.resource_version.is_some() && k.content.is_some())
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
        let generation = nonzero_generation(generation);
        let now = Known {
            resource_version: Some(resource_version),
            written_for_generation: generation,
            content: Some(hash(content)),
        };
        let mut inner = self.lock();
        let slot = inner.slot(kind);
        if inner.writing.get(key).is_some_and(|writing| writing.forgotten[slot]) {
            // Forgotten while being written: nothing is known of it before or after.
            return ApplyEffect::FirstWrite;
        }
        let entry = inner.entry(key, kind);
        let previous = Some(std::mem::replace(entry, now)).filter(|p| *p != Known::UNKNOWN);
        match previous {
            Some(p) if p.resource_version == Some(resource_version) => ApplyEffect::Unchanged,
            Some(p) if p.written_for_generation.is_none() => ApplyEffect::FirstWrite,
            Some(p) if p.written_for_generation == generation => ApplyEffect::Repaired,
            Some(_) => ApplyEffect::Updated,
            None => ApplyEffect::FirstWrite,
        }
    }

    /// Whether `generation` of `owner`, the object with `uid`, was reported already (see
    /// [`Self::mark_reported`]).
    pub fn reported(&self, owner: &ObjectKey, uid: &str, generation: Option<i64>) -> bool {
        let mark = reported_mark(uid, generation);
        mark.is_some() && self.lock().known.get(owner).is_some_and(|children| children.reported == mark)
    }

    /// Records that `generation` of `owner`, the object with `uid`, was reported (`None`, no
    /// generation: forgets the last one). Only while its children are known: an owner
    /// forgotten meanwhile stays forgotten.
    pub fn mark_reported(&self, owner: &ObjectKey, uid: &str, generation: Option<i64>) {
        if let Some(children) = self.lock().known.get_mut(owner) {
            children.reported = reported_mark(uid, generation);
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
    pub fn forget_kind_where(&self, kind: &'static str, covers: impl Fn(&ObjectKey) -> bool) {
        let mut inner = self.lock();
        // Taken even for a kind not seen yet: a first write of it may be under way.
        let slot = inner.slot(kind);
        inner.known.retain(|owner, children| {
            if covers(owner) {
                children.slots[slot] = Known::UNKNOWN;
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
        KnownBefore(known.filter_map(|(owner, c)| Some((owner.clone(), c.slots[slot].resource_version?))).collect())
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
            if let Some(child) = known.get_mut(&owner).map(|children| &mut children.slots[slot])
                && child.resource_version == Some(version)
            {
                child.resource_version = None;
                child.content = None;
                missing.push(owner);
            }
        }
        missing
    }

    /// Whether nothing is known of any child.
    pub fn is_empty(&self) -> bool {
        self.lock().known.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests;
