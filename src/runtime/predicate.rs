//! The generation predicate: which watch events are worth a reconcile.
//!
//! Passes the first sight of an object (including one that arrives through a relist or a
//! label change), a new uid under a known name (deleted and created again while the watch
//! was down), and changes of `metadata.generation`; drops status-, label- and
//! annotation-only updates, which leave the generation alone. Deletions are handled by
//! the caller. Unlike kube-runtime's predicate, entries live exactly as long as the object
//! is in the cache: the controller forgets what the cache lets go of (deleted, gone from a
//! relist, or out of the slice), so a returning object counts as new.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64;

use super::key::ObjectKey;

/// What we last saw of an object: its uid (hashed: it is only compared, and a string would
/// take 72 bytes more per object) and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    uid: Option<u64>,
    generation: Option<i64>,
}

/// What an event shows about an object, against what was seen before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sight {
    /// Nothing worth a reconcile.
    Same,
    /// Not seen before (by name, or by uid under a known name).
    New,
    /// A new generation of a known object.
    Changed,
}

#[derive(Default)]
pub struct GenerationPredicate {
    seen: HashMap<ObjectKey, Seen>,
}

impl GenerationPredicate {
    /// Records `uid` and `generation` for `key`; true when the object is new (by name or
    /// by uid) or its generation changed.
    #[cfg(test)]
    fn changed(&mut self, key: &ObjectKey, uid: Option<&str>, generation: Option<i64>) -> bool {
        self.observe(key, uid, generation) != Sight::Same
    }

    /// Records `uid` and `generation` for `key`, and says how they differ from before.
    pub fn observe(&mut self, key: &ObjectKey, uid: Option<&str>, generation: Option<i64>) -> Sight {
        let now = Seen { uid: uid.map(|uid| xxh3_64(uid.as_bytes())), generation };
        match self.seen.get_mut(key) {
            Some(seen) if *seen == now => Sight::Same,
            Some(seen) => {
                let sight = if seen.uid == now.uid { Sight::Changed } else { Sight::New };
                *seen = now;
                sight
            }
            None => {
                self.seen.insert(key.clone(), now);
                Sight::New
            }
        }
    }

    pub fn forget(&mut self, key: &ObjectKey) {
        self.seen.remove(key);
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_first_sight_and_generation_changes_only() {
        let mut p = GenerationPredicate::default();
        let k = ObjectKey::new("ns", "a");
        assert!(p.changed(&k, Some("u1"), Some(1)), "first sight");
        assert!(!p.changed(&k, Some("u1"), Some(1)), "status, label or annotation update");
        assert!(p.changed(&k, Some("u1"), Some(2)), "spec change");
        p.forget(&k);
        assert!(p.changed(&k, Some("u1"), Some(2)), "seen again after a delete");
    }

    #[test]
    fn tells_a_new_object_from_a_new_generation() {
        let mut p = GenerationPredicate::default();
        let k = ObjectKey::new("ns", "a");
        assert_eq!(p.observe(&k, Some("u1"), Some(1)), Sight::New);
        assert_eq!(p.observe(&k, Some("u1"), Some(1)), Sight::Same);
        assert_eq!(p.observe(&k, Some("u1"), Some(2)), Sight::Changed);
        assert_eq!(p.observe(&k, Some("u2"), Some(1)), Sight::New, "deleted and created again");
    }

    #[test]
    fn a_new_uid_under_a_known_name_is_new() {
        let mut p = GenerationPredicate::default();
        let k = ObjectKey::new("ns", "a");
        assert!(p.changed(&k, Some("u1"), Some(1)));
        // Deleted and created again while the watch was down: the relist shows generation 1 again.
        assert!(p.changed(&k, Some("u2"), Some(1)), "same name and generation, another object");
        assert!(!p.changed(&k, Some("u2"), Some(1)));
    }
}
