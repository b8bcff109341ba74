//! The generation predicate: which watch events are worth a reconcile.
//!
//! Passes the first sight of an object (including one that arrives through a relist or a
//! label change) and changes of `metadata.generation`; drops status-, label- and
//! annotation-only updates, which leave the generation alone. Deletions are handled by
//! the caller. Unlike kube-runtime's predicate, entries live exactly as long as the object
//! is in the watch: a relist drops those that vanished, so a returning object counts as new.

use std::collections::{HashMap, HashSet};

use super::key::ObjectKey;

#[derive(Default)]
pub struct GenerationPredicate {
    seen: HashMap<ObjectKey, Option<i64>>,
    relisted: Option<HashSet<ObjectKey>>,
}

impl GenerationPredicate {
    /// Records `generation` for `key`; true when it is new or changed.
    pub fn changed(&mut self, key: &ObjectKey, generation: Option<i64>) -> bool {
        if let Some(relisted) = &mut self.relisted {
            relisted.insert(key.clone());
        }
        match self.seen.get_mut(key) {
            Some(seen) if *seen == generation => false,
            Some(seen) => {
                *seen = generation;
                true
            }
            None => {
                self.seen.insert(key.clone(), generation);
                true
            }
        }
    }

    pub fn forget(&mut self, key: &ObjectKey) {
        self.seen.remove(key);
    }

    /// A relist starts: objects not seen again before [`Self::end_relist`] are gone.
    pub fn begin_relist(&mut self) {
        self.relisted = Some(HashSet::new());
    }

    /// Ends a relist and returns the keys that vanished during it.
    pub fn end_relist(&mut self) -> Vec<ObjectKey> {
        let relisted = self.relisted.take().unwrap_or_default();
        let gone: Vec<ObjectKey> = self.seen.keys().filter(|k| !relisted.contains(*k)).cloned().collect();
        for key in &gone {
            self.seen.remove(key);
        }
        gone
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
        assert!(p.changed(&k, Some(1)), "first sight");
        assert!(!p.changed(&k, Some(1)), "status, label or annotation update");
        assert!(p.changed(&k, Some(2)), "spec change");
        p.forget(&k);
        assert!(p.changed(&k, Some(2)), "seen again after a delete");
    }

    #[test]
    fn relist_drops_vanished_objects_so_they_count_as_new_on_return() {
        let mut p = GenerationPredicate::default();
        let (a, b) = (ObjectKey::new("ns", "a"), ObjectKey::new("ns", "b"));
        p.changed(&a, Some(1));
        p.changed(&b, Some(1));
        p.begin_relist();
        assert!(!p.changed(&a, Some(1)), "unchanged objects in a relist are not new");
        assert_eq!(p.end_relist(), vec![b.clone()]);
        assert!(p.changed(&b, Some(1)), "b came back, e.g. through a handoff");
    }
}
