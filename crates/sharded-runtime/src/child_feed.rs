//! What the child watches' events mean to the controller, as a state machine: each event
//! updates the [`ChildVersions`] and returns what the controller must do. Nothing here waits
//! or sends, so the rules are tested as tables, without watches.
//!
//! The rules:
//! - a list of a part that never completed one (a new slice, a handoff's gain) only teaches
//!   versions: the primary watch's list of the same part reconciles every owner anyway;
//! - after that, a child changed or deleted by someone else sends its owner back to the queue,
//!   before the backlog; the echo of our own write does not;
//! - a relist sends no deletions: a child known before it began, unchanged since, and not
//!   found was deleted while the watch was down, and its owner is looked at again;
//! - a kind's watch counts as having listed a bucket from the end of its list until its next
//!   list begins or the bucket leaves the slice; workers wait for that (see `controller`).

use std::collections::{HashMap, HashSet};

use super::child_versions::{ChildVersions, KnownBefore};
use super::key::ObjectKey;
use super::parts::Buckets;
use super::watch::ChildEvent;

/// What the controller does for one child event, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChildCommand {
    /// Reconcile this owner again, before the backlog.
    Requeue(ObjectKey),
    /// `kind`'s watch holds a complete list of `buckets` (and the kind is synced once).
    Listed { kind: &'static str, buckets: Buckets },
    /// `kind`'s watch no longer holds a complete list of `buckets`.
    Unlisted { kind: &'static str, buckets: Buckets },
}

/// What child watch events mean to the controller: the state machine behind [`ChildFeed::on`].
#[derive(Default)]
pub struct ChildFeed {
    /// Parts that completed a list.
    parts_listed: HashSet<u64>,
    /// Per part with a list under way: what was known of its children when the list began,
    /// and the owners whose children it has found so far.
    listing: HashMap<u64, (KnownBefore, HashSet<ObjectKey>)>,
}

impl ChildFeed {
    /// Takes one child event, records what it shows in `versions`, and says what to do.
    pub fn on(&mut self, event: ChildEvent, versions: &ChildVersions) -> Vec<ChildCommand> {
        match event {
            ChildEvent::Listing { kind, part, scope } => {
                let known = versions.known_where(kind, |owner| scope.covers_namespace(owner.namespace()));
                self.listing.insert(part, (known, HashSet::new()));
                vec![ChildCommand::Unlisted { kind, buckets: scope.buckets().clone() }]
            }
            ChildEvent::Listed { kind, part, scope } => {
                let mut commands = Vec::new();
                if let Some((known, found)) = self.listing.remove(&part) {
                    let missing = versions.missing_from_list(kind, known, &found);
                    if self.parts_listed.contains(&part) {
                        commands.extend(missing.into_iter().map(ChildCommand::Requeue));
                    }
                }
                self.parts_listed.insert(part);
                commands.push(ChildCommand::Listed { kind, buckets: scope.buckets().clone() });
                commands
            }
            ChildEvent::Dropped { kind, scope } => {
                versions.forget_kind_where(kind, |owner| scope.covers_namespace(owner.namespace()));
                vec![ChildCommand::Unlisted { kind, buckets: scope.buckets().clone() }]
            }
            ChildEvent::Closed { part } => {
                self.parts_listed.remove(&part);
                self.listing.remove(&part);
                Vec::new()
            }
            ChildEvent::Changed { kind, owner, resource_version, content, part, initial } => {
                if let Some((_, found)) = self.listing.get_mut(&part).filter(|_| initial) {
                    found.insert(owner.clone());
                }
                let news = versions.observe(kind, &owner, resource_version.as_deref(), content);
                if news && (self.parts_listed.contains(&part) || !initial) {
                    vec![ChildCommand::Requeue(owner)]
                } else {
                    Vec::new()
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::parts::{Scope, Slicing};

    const KIND: &str = "Secret";

    /// Part 0 covers bucket 1, where namespace `ns-1` is.
    fn scope() -> Scope {
        let bucket = |ns: &str| ns.trim_start_matches("ns-").parse().unwrap();
        Slicing::new(move |meta| meta.namespace.as_deref().map(bucket), bucket, |_| None).scope(Arc::new([1].into()))
    }

    fn owner(name: &str) -> ObjectKey {
        ObjectKey::new("ns-1", name)
    }

    fn changed(name: &str, version: Option<&str>, initial: bool) -> ChildEvent {
        let resource_version = version.map(String::from);
        ChildEvent::Changed { kind: KIND, owner: owner(name), resource_version, content: None, part: 0, initial }
    }

    fn listing() -> ChildEvent {
        ChildEvent::Listing { kind: KIND, part: 0, scope: scope() }
    }

    fn listed() -> ChildEvent {
        ChildEvent::Listed { kind: KIND, part: 0, scope: scope() }
    }

    fn buckets() -> Buckets {
        [1].into()
    }

    #[test]
    fn a_first_list_only_teaches_versions_and_then_marks_the_buckets_listed() {
        let (mut feed, versions) = (ChildFeed::default(), ChildVersions::default());
        assert_eq!(feed.on(listing(), &versions), [ChildCommand::Unlisted { kind: KIND, buckets: buckets() }]);
        assert_eq!(feed.on(changed("a", Some("1"), true), &versions), [], "the primary's list reconciles a");
        assert_eq!(feed.on(listed(), &versions), [ChildCommand::Listed { kind: KIND, buckets: buckets() }]);
    }

    #[test]
    fn a_change_by_someone_else_requeues_its_owner_and_our_own_echo_does_not() {
        let (mut feed, versions) = (ChildFeed::default(), ChildVersions::default());
        feed.on(listing(), &versions);
        feed.on(changed("a", Some("1"), true), &versions);
        feed.on(listed(), &versions);
        assert_eq!(feed.on(changed("a", Some("2"), false), &versions), [ChildCommand::Requeue(owner("a"))]);
        assert_eq!(feed.on(changed("a", None, false), &versions), [ChildCommand::Requeue(owner("a"))], "deleted");
        versions.written(KIND, &owner("a"), "3", Some(1), 9);
        assert_eq!(feed.on(changed("a", Some("3"), false), &versions), [], "the echo of our write");
    }

    #[test]
    fn a_relist_that_misses_a_known_child_requeues_its_owner() {
        let (mut feed, versions) = (ChildFeed::default(), ChildVersions::default());
        feed.on(listing(), &versions);
        feed.on(changed("a", Some("1"), true), &versions);
        feed.on(changed("b", Some("1"), true), &versions);
        feed.on(listed(), &versions);
        // The watch was down (410 Gone, say) while b's child was deleted: the relist finds a only.
        feed.on(listing(), &versions);
        assert_eq!(feed.on(changed("a", Some("1"), true), &versions), [], "a is unchanged");
        let commands = feed.on(listed(), &versions);
        assert_eq!(
            commands,
            [ChildCommand::Requeue(owner("b")), ChildCommand::Listed { kind: KIND, buckets: buckets() }],
            "b's child went while the watch was down"
        );
    }

    #[test]
    fn a_closed_part_lists_anew_like_a_first_list() {
        let (mut feed, versions) = (ChildFeed::default(), ChildVersions::default());
        feed.on(listing(), &versions);
        feed.on(changed("a", Some("1"), true), &versions);
        feed.on(listed(), &versions);
        assert_eq!(feed.on(ChildEvent::Closed { part: 0 }, &versions), []);
        feed.on(listing(), &versions);
        assert_eq!(feed.on(changed("a", Some("5"), true), &versions), [], "part 0 is new again");
        let dropped = ChildEvent::Dropped { kind: KIND, scope: scope() };
        assert_eq!(feed.on(dropped, &versions), [ChildCommand::Unlisted { kind: KIND, buckets: buckets() }]);
        assert!(!versions.holds(KIND, &owner("a"), 9), "the dropped buckets' children are forgotten");
    }
}
