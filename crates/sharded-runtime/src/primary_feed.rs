//! What the primary watch's events mean to the controller, as a state machine: each event,
//! already applied to the cache, returns what the controller must do. Nothing here waits or
//! sends, so the rules are tested as tables, without watches.
//!
//! The rules:
//! - the objects of a list wait until it completes (the cache publishes a list only then: a
//!   worker must find what it is handed), and then go to the queue if the predicate says
//!   so; the first list, and a part of a new slice (a handoff's gain), are backlog, low; a
//!   relist after a watch gap finds only real changes, high;
//! - an object the cache let go of (deleted, gone from a relist, out of the slice, or
//!   replaced by a new object under its name) is forgotten by the reconciler, then queued so
//!   that its key's state is cleared; only the watch can say so, since a worker that misses an
//!   object may be early;
//! - an object first seen by a watch event because it was labelled late, from a backlog
//!   nobody waits on (as after a preload), goes behind real changes.

use std::collections::{HashMap, HashSet};

use kube::Resource;
use kube::runtime::watcher;

use super::key::ObjectKey;
use super::parts::Buckets;
use super::predicate::{List, Sight};
use super::queue::Priority;
use super::watch::Cached;

/// What the controller does for one primary event, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrimaryCommand {
    /// The reconciler drops what it keeps of this object.
    Forget(ObjectKey),
    /// Queue this key in this lane.
    Enqueue(ObjectKey, Priority),
    /// The cache no longer holds a complete list of these buckets.
    Unlisted(Buckets),
    /// The cache holds a complete list of these buckets (and is synced once).
    Listed(Buckets),
}

/// An object found by a list under way, waiting for the list to complete.
struct Found {
    key: ObjectKey,
    sight: Sight,
    bucket: Option<u16>,
}

/// What primary watch events mean to the controller: the state machine behind [`PrimaryFeed::on`].
#[derive(Default)]
pub struct PrimaryFeed {
    /// What each part's list under way found.
    listing: HashMap<u64, Vec<Found>>,
    /// Parts that completed a list: a list of one of these again is of the same buckets.
    parts_listed: HashSet<u64>,
    /// Whether any list has completed since the start.
    listed_once: bool,
}

impl PrimaryFeed {
    /// Takes one event the cache has applied, and says what to do.
    pub fn on<K: Resource>(&mut self, cached: Cached<K>) -> Vec<PrimaryCommand> {
        use PrimaryCommand::*;
        let forget = |gone: Vec<ObjectKey>, lane: Priority| {
            gone.into_iter().flat_map(move |key| [Forget(key.clone()), Enqueue(key, lane)])
        };
        let (part, scope, event, key, sight, backlog, gone) = match cached {
            Cached::Event { part, scope, event, key, sight, backlog, gone } => {
                (part, scope, event, key, sight, backlog, gone)
            }
            Cached::Dropped { scope, gone } => {
                return [Unlisted(scope.buckets().clone())].into_iter().chain(forget(gone, Priority::Low)).collect();
            }
            Cached::Closed { part } => {
                self.listing.remove(&part);
                self.parts_listed.remove(&part);
                return Vec::new();
            }
        };
        // Each event comes with the cache's key for its object.
        let key = || key.clone().expect("an object's event has a key");
        match event {
            watcher::Event::Init => {
                self.listing.insert(part, Vec::new());
                // The cache's picture of the part is replaced when this list completes.
                vec![Unlisted(scope.buckets().clone())]
            }
            watcher::Event::InitApply(object) => {
                let bucket = scope.bucket_of(object.meta());
                self.listing.entry(part).or_default().push(Found { key: key(), sight, bucket });
                Vec::new()
            }
            watcher::Event::InitDone => {
                let list = match self.listed_once {
                    false => List::First,
                    true if self.parts_listed.contains(&part) => List::SameSlice,
                    true => List::NewSlice,
                };
                let mut commands = Vec::new();
                for Found { key, sight, bucket } in self.listing.remove(&part).unwrap_or_default() {
                    if sight == Sight::Replaced {
                        commands.push(Forget(key.clone()));
                    }
                    // Buckets the part lost during the list were forgotten meanwhile.
                    if sight != Sight::Same && bucket.is_some_and(|b| scope.buckets().contains(&b)) {
                        commands.push(Enqueue(key, list.priority_of(sight)));
                    }
                }
                commands.extend(forget(gone, Priority::Low));
                self.parts_listed.insert(part);
                self.listed_once = true;
                commands.push(Listed(scope.buckets().clone()));
                commands
            }
            watcher::Event::Apply(_) => match sight {
                Sight::Same => Vec::new(),
                Sight::New if backlog => vec![Enqueue(key(), Priority::Low)],
                Sight::Replaced => forget(vec![key()], Priority::High).collect(),
                _ => vec![Enqueue(key(), Priority::High)],
            },
            watcher::Event::Delete(_) => forget(vec![key()], Priority::High).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::PrimaryCommand::*;
    use super::*;
    use crate::parts::{Scope, Slicing};

    /// A scope of `buckets`, where namespace `ns-N` is in bucket N.
    fn scope(buckets: &[u16]) -> Scope {
        let bucket = |ns: &str| ns.trim_start_matches("ns-").parse().unwrap();
        Slicing::new(move |meta| meta.namespace.as_deref().map(bucket), bucket, |_| None)
            .scope(Arc::new(buckets.iter().copied().collect()))
    }

    fn object(namespace: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta { namespace: Some(namespace.into()), ..Default::default() },
            ..Default::default()
        }
    }

    fn event(part: u64, buckets: &[u16], event: watcher::Event<ConfigMap>, sight: Sight) -> Cached<ConfigMap> {
        let key = match &event {
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
                Some(ObjectKey::new(o.metadata.namespace.as_deref().unwrap(), "p"))
            }
            _ => None,
        };
        Cached::Event { part, scope: scope(buckets), event, key, sight, backlog: false, gone: Vec::new() }
    }

    /// A whole list of `namespaces` by part `part`, each seen as `sight`.
    fn list(feed: &mut PrimaryFeed, part: u64, buckets: &[u16], found: &[(&str, Sight)]) -> Vec<PrimaryCommand> {
        let mut commands = feed.on(event(part, buckets, watcher::Event::Init, Sight::Same));
        for (namespace, sight) in found {
            commands.extend(feed.on(event(part, buckets, watcher::Event::InitApply(object(namespace)), *sight)));
        }
        commands.extend(feed.on(event(part, buckets, watcher::Event::InitDone, Sight::Same)));
        commands
    }

    fn key(namespace: &str) -> ObjectKey {
        ObjectKey::new(namespace, "p")
    }

    #[test]
    fn the_first_list_and_a_gained_part_are_backlog_and_a_relist_is_not() {
        let mut feed = PrimaryFeed::default();
        let first = list(&mut feed, 0, &[1], &[("ns-1", Sight::New)]);
        assert_eq!(first, [Unlisted([1].into()), Enqueue(key("ns-1"), Priority::Low), Listed([1].into())]);
        let gained = list(&mut feed, 1, &[2, 3], &[("ns-2", Sight::New), ("ns-3", Sight::Unobserved)]);
        assert_eq!(gained[1], Enqueue(key("ns-2"), Priority::Low), "a handoff's gain waits behind real changes");
        assert_eq!(gained[2], Enqueue(key("ns-3"), Priority::High), "unless it was edited meanwhile");
        let relist = list(&mut feed, 0, &[1], &[("ns-1", Sight::Changed)]);
        assert_eq!(relist[1], Enqueue(key("ns-1"), Priority::High), "an edit found after a watch gap");
        let relist = list(&mut feed, 1, &[2], &[("ns-2", Sight::New)]);
        assert_eq!(relist[1], Enqueue(key("ns-2"), Priority::High), "created during a watch gap: a real change");
    }

    #[test]
    fn a_list_hands_out_nothing_before_it_completes() {
        let mut feed = PrimaryFeed::default();
        assert_eq!(feed.on(event(0, &[1], watcher::Event::Init, Sight::Same)), [Unlisted([1].into())]);
        let found = feed.on(event(0, &[1], watcher::Event::InitApply(object("ns-1")), Sight::New));
        assert_eq!(found, [], "the cache does not show it yet");
    }

    #[test]
    fn what_the_cache_lets_go_of_is_forgotten_then_queued() {
        let mut feed = PrimaryFeed::default();
        list(&mut feed, 0, &[1], &[("ns-1", Sight::New)]);
        let deleted = feed.on(event(0, &[1], watcher::Event::Delete(object("ns-1")), Sight::Same));
        assert_eq!(deleted, [Forget(key("ns-1")), Enqueue(key("ns-1"), Priority::High)]);
        let replaced = feed.on(event(0, &[1], watcher::Event::Apply(object("ns-1")), Sight::Replaced));
        assert_eq!(replaced, [Forget(key("ns-1")), Enqueue(key("ns-1"), Priority::High)], "a new uid");
        let dropped = feed.on(Cached::<ConfigMap>::Dropped { scope: scope(&[1]), gone: vec![key("ns-1")] });
        assert_eq!(dropped, [Unlisted([1].into()), Forget(key("ns-1")), Enqueue(key("ns-1"), Priority::Low)]);
    }

    #[test]
    fn a_late_labelled_backlog_object_goes_low_and_an_unchanged_one_nowhere() {
        let mut feed = PrimaryFeed::default();
        list(&mut feed, 0, &[1], &[]);
        let mut labelled = event(0, &[1], watcher::Event::Apply(object("ns-1")), Sight::New);
        if let Cached::Event { backlog, .. } = &mut labelled {
            *backlog = true;
        }
        assert_eq!(feed.on(labelled), [Enqueue(key("ns-1"), Priority::Low)]);
        assert_eq!(feed.on(event(0, &[1], watcher::Event::Apply(object("ns-1")), Sight::Same)), [], "status only");
    }

    #[test]
    fn an_object_of_a_bucket_lost_during_the_list_is_not_handed_out() {
        let mut feed = PrimaryFeed::default();
        feed.on(event(0, &[1, 2], watcher::Event::Init, Sight::Same));
        feed.on(event(0, &[1, 2], watcher::Event::InitApply(object("ns-2")), Sight::New));
        // Bucket 2 left the part before the list completed.
        let done = feed.on(event(0, &[1], watcher::Event::InitDone, Sight::Same));
        assert_eq!(done, [Listed([1].into())]);
    }
}
