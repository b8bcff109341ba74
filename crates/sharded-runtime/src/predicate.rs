//! The generation predicate: which watch events are worth a reconcile, and in which lane.
//!
//! Passes the first sight of an object (including one that arrives through a relist or a
//! handoff), a new uid under a known name (deleted and created again while the watch was
//! down), and changes of `metadata.generation`; drops status-, label- and annotation-only
//! updates, which leave the generation alone (unless the stored form says otherwise, see
//! [`Stored::changed`]). Deletions are handled by the caller.
//!
//! The cache is its memory: an event's object is compared with the one the cache held
//! before it (see [`super::cache`]), so nothing is kept per object beyond the cache, and an
//! object the cache let go of (deleted, gone from a relist, out of the slice) counts as new
//! when it returns. kube-runtime's predicates keep a hash per object in a map of their own.

use kube::Resource;

use super::queue::Priority;
use super::stored::Stored;

/// What an event shows about an object, against what was seen before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sight {
    /// Nothing worth a reconcile.
    Same,
    /// Not seen before.
    New,
    /// Not seen before, and the object says its latest change awaits the controller
    /// ([`Stored::shows_unobserved_change`]): edited during a handoff or a restart.
    Unobserved,
    /// A new uid under a known name: the object cached under that name was deleted and this
    /// one created while the watch was down. What was kept for the old one must go.
    Replaced,
    /// A new generation of a known object (or another change its stored form looks at).
    Changed,
}

/// What a first sight of `object` is: new, or showing a change that awaits the controller.
pub fn first_sight<S: Stored>(object: &S::Object) -> Sight {
    if S::shows_unobserved_change(object) { Sight::Unobserved } else { Sight::New }
}

/// How `object` differs from `cached`, what was last seen under its name.
pub fn sight<S: Stored>(cached: Option<&S>, object: &S::Object) -> Sight {
    let Some(cached) = cached else { return first_sight::<S>(object) };
    let now = object.meta();
    if !cached.has_uid(now.uid.as_deref()) {
        Sight::Replaced
    } else if cached.changed(object) {
        Sight::Changed
    } else {
        Sight::Same
    }
}

/// Which list an object came in, for its queue lane.
#[derive(Clone, Copy, Debug)]
pub enum List {
    /// The first list since the start.
    First,
    /// The first list of a part of the slice: buckets gained.
    NewSlice,
    /// A list of a part again, after a watch gap.
    SameSlice,
}

impl List {
    /// Backlog (the first list, and objects a new slice brings) goes low; a new generation,
    /// an object created during a watch gap, or one whose latest change awaits the
    /// controller, goes high.
    pub fn priority_of(self, sight: Sight) -> Priority {
        match (self, sight) {
            (_, Sight::Unobserved) => Priority::High,
            (List::First, _) | (List::NewSlice, Sight::New | Sight::Replaced) => Priority::Low,
            _ => Priority::High,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    fn object(uid: &str, generation: i64) -> ConfigMap {
        let metadata = ObjectMeta { uid: Some(uid.into()), generation: Some(generation), ..Default::default() };
        ConfigMap { metadata, ..Default::default() }
    }

    #[test]
    fn tells_a_new_object_from_a_new_generation() {
        let first = object("u1", 1);
        assert_eq!(sight::<ConfigMap>(None, &first), Sight::New, "first sight");
        assert_eq!(sight(Some(&first), &object("u1", 1)), Sight::Same, "status, label or annotation update");
        assert_eq!(sight(Some(&first), &object("u1", 2)), Sight::Changed, "spec change");
        // Deleted and created again while the watch was down: a relist shows generation 1 again.
        assert_eq!(sight(Some(&first), &object("u2", 1)), Sight::Replaced, "same name and generation, another object");
    }

    #[test]
    fn backlog_goes_low_and_changes_go_high() {
        use Priority::{High, Low};
        for (list, sight, lane) in [
            (List::First, Sight::New, Low),
            (List::First, Sight::Unobserved, High),
            (List::NewSlice, Sight::Unobserved, High),
            (List::First, Sight::Changed, Low),
            (List::NewSlice, Sight::New, Low),
            (List::NewSlice, Sight::Changed, High),
            (List::NewSlice, Sight::Replaced, Low),
            (List::SameSlice, Sight::New, High),
            (List::SameSlice, Sight::Replaced, High),
            (List::SameSlice, Sight::Changed, High),
        ] {
            assert_eq!(list.priority_of(sight), lane, "{list:?}, {sight:?}");
        }
    }
}
